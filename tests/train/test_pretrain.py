import copy
import json

import numpy as np
import pytest
import torch

from jetserve.model.loader import load_model
from jetserve.tokenizer import load_tokenizer
from jetserve.train.forward import forward_hidden
from jetserve.train.pretrain import (
    History,
    TokenStream,
    TrainConfig,
    build_model,
    build_optimizer,
    export_checkpoint,
    load_state,
    main,
    preset,
    save_state,
    train_step,
)

TEXT = (
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. "
    "To be, or not to be, that is the question. In the beginning was the word. "
)


@pytest.fixture(scope="module")
def token_files(tiny_train_checkpoint, tmp_path_factory):
    tok = load_tokenizer(tiny_train_checkpoint)
    ids = np.array(tok.encode(TEXT * 40), dtype=np.uint16)
    folder = tmp_path_factory.mktemp("tokens")
    np.save(folder / "train.npy", ids)
    np.save(folder / "heldout.npy", ids[:600])
    return folder


def _micro(vocab: int, seed: int = 0):
    cfg = TrainConfig(seq_len=48, batch_size=4, max_steps=40, lr=1e-2, warmup_steps=4, gdr_impl="reference", seed=seed)
    model = build_model(preset("micro", vocab), torch.device("cpu"), seed)
    return cfg, model, build_optimizer(model, cfg)


def test_a_few_steps_reduce_the_loss(token_files, tiny_train_checkpoint):
    vocab = load_tokenizer(tiny_train_checkpoint).vocab_size
    cfg, model, opt = _micro(vocab)
    stream = TokenStream(np.load(token_files / "train.npy"), cfg.seq_len, cfg.seed)
    losses = [train_step(model, opt, stream.next_batch(cfg.batch_size), step, cfg) for step in range(25)]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:3]), losses


def test_checkpoint_reloads_bit_identically_and_resume_continues_identically(
    token_files, tiny_train_checkpoint, tmp_path
):
    vocab = load_tokenizer(tiny_train_checkpoint).vocab_size
    tokens = np.load(token_files / "train.npy")
    cfg, model, opt = _micro(vocab)
    stream = TokenStream(tokens, cfg.seq_len, cfg.seed)
    for step in range(3):
        train_step(model, opt, stream.next_batch(cfg.batch_size), step, cfg)
    save_state(tmp_path / "state.pt", model, opt, 3, stream, History(), cfg, preset("micro", vocab))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())
    straight = [train_step(model, opt, stream.next_batch(cfg.batch_size), step, cfg) for step in range(3, 7)]

    cfg2, model2, opt2 = _micro(vocab, seed=1)  # different init: everything must come from the file
    stream2 = TokenStream(tokens, cfg.seq_len, cfg.seed)
    step, _ = load_state(tmp_path / "state.pt", model2, opt2, stream2)
    assert step == 3
    for name, tensor in model2.state_dict().items():
        assert torch.equal(tensor, saved_model[name]), name
    for pid, state in opt2.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, saved_opt["state"][pid][key]), (pid, key)
    resumed = [train_step(model2, opt2, stream2.next_batch(cfg.batch_size), s, cfg) for s in range(3, 7)]
    assert resumed == straight
    for name, tensor in model2.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_token_stream_position_resumes_the_same_rows():
    tokens = np.arange(1000, dtype=np.uint16)
    a = TokenStream(tokens, 16, seed=3)
    first = a.next_batch(50)  # crosses an epoch boundary (61 rows)
    b = TokenStream(tokens, 16, seed=3)
    b.next_batch(20)
    position = b.position()
    c = TokenStream(tokens, 16, seed=3)
    c.seek(**position)
    assert torch.equal(torch.cat([b.next_batch(45)]), c.next_batch(45))
    assert torch.equal(first[20:], TokenStream(tokens, 16, seed=3).next_batch(50)[20:])
    assert sorted(first[:61, 0].tolist()) == sorted(set(first[:61, 0].tolist()))  # no row twice in an epoch


def test_cli_pauses_resumes_exports_and_the_export_loads(token_files, tiny_train_checkpoint, tmp_path):
    args = [
        "--data", str(token_files / "train.npy"), "--data", f"{token_files / 'train.npy'}:2",
        "--heldout", str(token_files / "heldout.npy"), "--tokenizer", str(tiny_train_checkpoint),
        "--config", "micro", "--out", str(tmp_path / "run"), "--export", str(tmp_path / "export"),
        "--seq-len", "48", "--batch-size", "4", "--max-steps", "6", "--eval-every", "3", "--eval-batches", "2",
        "--warmup-steps", "2", "--lr", "0.01", "--gdr-impl", "reference",
    ]  # fmt: skip
    assert main(args + ["--max-minutes", "0"]) == 0  # the time budget is spent after one step: save and pause
    assert not (tmp_path / "run" / "done").exists()
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "done").read_text())
    assert summary["step"] == 6 and np.isfinite(summary["heldout_perplexity"])
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=False)
    assert [s for s, _ in state["history"]["train"]] == [1, 2, 3, 4, 5, 6]

    loaded = load_model(tmp_path / "export", dtype="float32")
    assert "lm_head.weight" not in json.dumps(sorted(loaded.state_dict()))
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == "jet_nemotron" and config["torch_dtype"] == "bfloat16"
    trained = build_model(preset("micro", loaded.config.vocab_size), torch.device("cpu"), 0)
    # The export rounds to bf16 everything but A_log and dt_bias.
    trained.load_state_dict({k: v if k.endswith(("A_log", "dt_bias")) else v.bfloat16().float()
                             for k, v in state["model"].items()})  # fmt: skip
    rows = torch.randint(0, 259, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, _ = forward_hidden(trained, rows, gdr_impl="reference")
        got, _ = forward_hidden(loaded, rows, gdr_impl="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_portable_resume_point_continues_the_run(token_files, tiny_train_checkpoint, tmp_path):
    args = [
        "--data", str(token_files / "train.npy"), "--tokenizer", str(tiny_train_checkpoint), "--config", "micro",
        "--portable", str(tmp_path / "portable"), "--seq-len", "48", "--batch-size", "4", "--max-steps", "5",
        "--warmup-steps", "2", "--lr", "0.01", "--gdr-impl", "reference",
    ]  # fmt: skip
    assert main(args + ["--out", str(tmp_path / "a"), "--max-minutes", "0"]) == 0
    assert json.loads((tmp_path / "portable" / "train_state.json").read_text())["step"] == 1
    assert main(args + ["--out", str(tmp_path / "b")]) == 0  # another machine: no state.pt, only the portable point
    state = torch.load(tmp_path / "b" / "state.pt", weights_only=False)
    assert state["step"] == 5 and [s for s, _ in state["history"]["train"]] == [1, 2, 3, 4, 5]
    assert state["data"] == {"epoch": 0, "index": 20}


def test_export_shards_load(tiny_train_checkpoint, tmp_path):
    model = build_model(preset("micro", 259), torch.device("cpu"), 0)
    export_checkpoint(model, preset("micro", 259), tiny_train_checkpoint, tmp_path, torch.float32, 40_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = load_model(tmp_path, dtype="float32")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
