import collections
import gzip
import json

import pytest
import torch

from jetserve.model.forward_batch import ForwardBatch, KVMetadata, Phase
from jetserve.model.loader import load_model
from jetserve.spec.eagle3 import load_draft_model
from jetserve.train.eagle3 import (
    build_draft_vocab,
    draft_config,
    draft_step,
    expected_chain_length,
    export_draft,
    main,
    new_draft_model,
    read_prompt_records,
    regenerate_answers,
    regenerate_answers_engine,
    select_prompts,
    target_outputs,
    target_to_draft,
    ttt_loss,
)


def test_draft_vocab_maps_round_trip():
    counts = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(0))
    counts[17] = 1000
    d2t, t2d = build_draft_vocab(counts, 64)
    kept = torch.arange(64) + d2t  # draft id → target id
    assert bool((kept[1:] > kept[:-1]).all()), "sorted, no repeats"
    assert int(t2d.sum()) == 64 and bool(t2d[kept].all()) and bool(t2d[17])
    assert torch.equal(target_to_draft(t2d)[kept], torch.arange(64))  # target → draft → target
    assert bool((target_to_draft(t2d)[~t2d] == -1).all())
    threshold = counts[kept].min()
    assert bool((counts[~t2d] <= threshold).all()), "the most frequent tokens are kept"


def _setup(checkpoint, draft_vocab=96, seed=0):
    target = load_model(checkpoint, dtype="float32")
    counts = torch.randint(0, 100, (target.config.vocab_size,), generator=torch.Generator().manual_seed(seed))
    d2t, t2d = build_draft_vocab(counts, draft_vocab)
    config = draft_config(target, draft_vocab, intermediate_size=96)
    return target, config, new_draft_model(target, config, d2t, t2d, seed)


def _prefill(draft, ids, hidden, start, num_cached, slots):
    T = ids.shape[0]
    positions = torch.arange(start, start + T)
    fb = ForwardBatch(
        phase=Phase.PREFILL, input_ids=ids, positions=positions,
        cu_seqlens=torch.tensor([0, T], dtype=torch.int32), context_lens=torch.tensor([start + T], dtype=torch.int32),
        state_indices=torch.zeros(1, dtype=torch.int32), has_initial_state=torch.ones(1, dtype=torch.bool),
        max_seqlen_q=T, kv=KVMetadata(slot_mapping=slots, block_tables=torch.arange(1, 9, dtype=torch.int32)[None]),
    )  # fmt: skip
    return draft(ids, hidden, fb)


def test_training_time_test_steps_equal_the_drafter_at_each_depth(tiny_train_checkpoint):
    """Step k of the training-time test at row n-1 is the draft at depth k of the inference drafter: a chain at
    positions n .. n+k-1 over the draft cache of positions [0, n)."""
    target, _, draft = _setup(tiny_train_checkpoint)
    torch.manual_seed(0)
    T, n = 30, 26
    ids = torch.randint(0, target.config.vocab_size, (1, T))
    with torch.no_grad():
        aux, _ = target_outputs(target, draft, ids, gdr_impl="reference")
        hidden = draft.project_features(aux)  # [1, T, H]
        keys, values, outs = [], [], []
        h = hidden
        for step in range(3):
            h = draft_step(draft, torch.nn.functional.pad(ids[:, 1 + step :], (0, 1 + step)), h, step, keys, values)
            outs.append(h)
        attn = draft.midlayer.self_attn
        cache = torch.full((9, 16, attn.num_kv_heads, attn.head_dim), float("nan"))
        draft.bind_cache(cache, cache.clone())
        slots = 16 + torch.arange(n)  # pages 1.. of the block table
        cached = _prefill(draft, ids[0, 1 : n + 1], hidden[0, :n], 0, 0, slots)
        torch.testing.assert_close(cached, outs[0][0, :n], rtol=1e-5, atol=1e-5)
        chain_hidden = [cached[n - 1]]
        for depth in (1, 2):
            chain_ids = ids[0, n + 1 : n + 1 + depth]
            got = _prefill(draft, chain_ids, torch.stack(chain_hidden), n, n, torch.full((depth,), -1))
            torch.testing.assert_close(got[-1], outs[depth][0, n - 1], rtol=1e-5, atol=1e-5)
            chain_hidden.append(got[-1])


def test_a_few_draft_training_steps_reduce_the_loss(tiny_train_checkpoint):
    target, _, draft = _setup(tiny_train_checkpoint, draft_vocab=320)
    with torch.no_grad():
        target.model.norm.weight.mul_(20.0)  # a confident target: its next-token distributions are near one-hot
    torch.manual_seed(0)
    ids = torch.randint(0, 320, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.bool)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss, accs = ttt_loss(target, draft, ids, mask, num_steps=3, gdr_impl="reference")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert len(accs) == 3 and all(0.0 <= a <= 1.0 for a in accs)
    assert target.model.embed_tokens.weight.grad is None, "the target's embedding stays frozen"


def test_draft_training_step_runs_under_bf16_autocast(tiny_train_checkpoint):
    """The GPU trainer's step (bf16 autocast over fp32 parameters) on the CPU's autocast: the loss is finite and
    every draft parameter that the training-time test reaches gets a gradient (fc and o_proj are the model's
    `Linear` layers, which failed under autocast until session 39)."""
    target, _, draft = _setup(tiny_train_checkpoint, draft_vocab=320)
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 16, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, accs = ttt_loss(target, draft, ids, mask, num_steps=2, gdr_impl="reference")
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    for name in ("fc.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        grad = dict(draft.named_parameters())[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_expected_chain_length():
    assert expected_chain_length([1.0, 1.0]) == 3.0
    assert expected_chain_length([0.5, 0.5]) == pytest.approx(1.75)


def test_regenerate_answers_is_greedy_and_stops(tiny_train_checkpoint):
    from jetserve.generate import generate_tokens

    target = load_model(tiny_train_checkpoint, dtype="float32")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    stop = (300,)
    got = regenerate_answers(target, prompts, max_new_tokens=6, stop_ids=stop, batch_size=2, gdr_impl="reference")
    for prompt, answer in zip(prompts, got, strict=True):
        want = generate_tokens(target, prompt, 6, stop_token_ids=stop).token_ids
        assert answer == want


def test_engine_regeneration_equals_the_forward_one(tiny_train_checkpoint):
    """`--regenerate-with engine` gives the per-token re-forward's greedy answers (fp32 on the CPU), stop token kept."""
    target = load_model(tiny_train_checkpoint, dtype="float32")
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40] * 9]
    want = regenerate_answers(target, prompts, max_new_tokens=7, stop_ids=(300,), batch_size=2, gdr_impl="reference")
    stop = want[0][2]  # a token the first answer reaches: that answer must end on it
    want = regenerate_answers(target, prompts, max_new_tokens=7, stop_ids=(stop,), batch_size=2, gdr_impl="reference")
    got = regenerate_answers_engine(tiny_train_checkpoint, prompts, 7, (stop,), torch.device("cpu"), max_num_seqs=2)
    assert got == want
    assert got[0][-1] == stop and len(got[0]) == 3


def test_export_loads_through_the_eagle3_loader(tiny_train_checkpoint, tmp_path):
    target, config, draft = _setup(tiny_train_checkpoint)
    export_draft(draft, config, tmp_path, dtype=torch.float32)
    loaded = load_draft_model(tmp_path, target)
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name].to(tensor.dtype), tensor), name
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 96


def _records(group, n, split="train"):
    source = group.split(":")[1]
    return [{"prompt": f"{group} {i}", "source": source, "group": group, "split": split} for i in range(n)]


def test_prompts_are_drawn_evenly_across_groups_leaving_out_excluded_sources():
    records = _records("p:a", 20) + _records("p:b", 3) + _records("c:a", 10) + _records("p:m", 6)
    records += _records("p:a", 5, split="heldout") + records[:4]  # another split, and repeated prompts
    picked = select_prompts(records, "train", 12, seed=0, exclude_sources=("m",))
    assert len({r["prompt"] for r in picked}) == 12 and all(r["split"] == "train" for r in picked)
    # rounds of one from each group, in the groups' order: p:b runs out after three, the last three go to the others
    assert collections.Counter(r["group"] for r in picked) == {"c:a": 5, "p:a": 4, "p:b": 3}
    assert picked == select_prompts(records, "train", 12, seed=0, exclude_sources=("m",)), "seeded"
    other = select_prompts(records, "train", 12, seed=1, exclude_sources=("m",))
    assert [r["prompt"] for r in other] != [r["prompt"] for r in picked]
    assert {r["group"] for r in select_prompts(records, "train", 100, 0, ("c:a",))} == {"p:a", "p:b", "p:m"}
    assert len(select_prompts(records, "train", 100, 0)) == 39  # every distinct prompt once
    assert len(select_prompts(records, "heldout", 100, 0)) == 5


def test_prompt_files_may_hold_conversations_and_be_gzipped(tmp_path):
    chat = tmp_path / "chat.jsonl.gz"
    rows = [{"source": "gsm8k", "split": "heldout", "messages": [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
             {"role": "user", "content": "and 3+3?"}]},
            {"messages": [{"role": "user", "content": "Hi."}]}]  # fmt: skip
    chat.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    assert read_prompt_records(chat) == [
        {"prompt": "2+2?", "source": "gsm8k", "group": "chat:gsm8k", "split": "heldout"},
        {"prompt": "Hi.", "source": "chat", "group": "chat:chat", "split": "train"},
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"messages": []}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: a record needs a 'prompt'"):
        read_prompt_records(bad)


def test_cli_trains_pauses_resumes_and_exports(tiny_train_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"Tell me about thing {i}.", "split": "heldout" if i < 2 else "train"} for i in range(8)]
    lines += [{"prompt": f"Question {i}?", "source": "mt-bench"} for i in range(3)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    chat = tmp_path / "chat.jsonl.gz"
    talks = [{"source": "gsm8k", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(3)]
    chat.write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in talks).encode()))
    base = ["--target", str(tiny_train_checkpoint), "--prompts", str(prompts), "--prompts", str(chat)]
    assert main(base + ["--out", str(tmp_path / "bad"), "--exclude-sources", "mtbench"]) == 2
    assert "--exclude-sources: no record has source or group mtbench" in capsys.readouterr().err
    args = base + ["--exclude-sources", "mt-bench", "--out", str(tmp_path / "run"),
            "--draft-vocab-size", "64", "--intermediate-size", "64", "--max-new-tokens", "8", "--max-steps", "4",
            "--batch-size", "2", "--num-ttt-steps", "3", "--warmup-steps", "1", "--gdr-impl", "reference"]  # fmt: skip
    assert main(args + ["--max-minutes", "0"]) == 0
    assert not (tmp_path / "run" / "done").exists()
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 4 and len(summary["heldout_step_accuracy"]) == 3
    assert summary["prompts_by_source"] == {"train": {"chat:gsm8k": 3, "prompts:prompts": 6},
                                            "heldout": {"prompts:prompts": 2}}  # fmt: skip
    load_draft_model(tmp_path / "run" / "draft", load_model(tiny_train_checkpoint, dtype="float32"))
