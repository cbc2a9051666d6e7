"""The engine's own host work per VERIFY step: the default model and its draft (fp32, the CPU), every step verifying
the default chain, with the device work stubbed — the draft returns a fixed chain and the verify step a fixed result
(two drafts accepted and the bonus, tokens taken in turn from MT-bench's text so that detokenising is realistic) — so a
step is the scheduling, the slot tables, the uploads, the read-back, the acceptance bookkeeping, the policy, the
postprocessing and the RequestOutputs. Beside it, a plain decode step with its forward stubbed the same way. On a GPU
the stubs are graph replays; their own cost here is measured apart and taken off. With overlap scheduling (the
default, as here) the next verify step is launched on the device before this host work reads the one in flight
(`SpecDecoder.launch_verify_next`), so a verify step takes the longer of the host work and the GPU's draft and verify
graphs (session 44); one at a time it took the host work plus the verify graph (session 43). There is no roofline:
the figure is host time, which a step's bytes do not bound. One JSON line per batch size with --json.
Usage: python bench/spec_host_step.py [--batch-sizes 1,8] [--steps 400] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from jetserve.assets import DEFAULT_DRAFT, DEFAULT_MODEL
from jetserve.engine.bench_offline import bench_prompts
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine
from jetserve.evals.mtbench import load_questions
from jetserve.sampling_params import SamplingParams
from jetserve.spec.tree import DraftTree

ACCEPTED = 2  # drafts each stubbed verify step accepts (then the bonus token)


class TokenStream:
    """MT-bench's questions as one token stream, handed out in turn (the stubs' "generated" tokens)."""

    def __init__(self, engine: LLMEngine) -> None:
        text = " ".join(" ".join(q["turns"]) for q in load_questions())
        self.tokens = engine.tokenizer.encode(text)
        self.cursor = 0

    def take(self, count: int) -> list[int]:
        out = [self.tokens[(self.cursor + i) % len(self.tokens)] for i in range(count)]
        self.cursor += count
        return out


def stub_device_work(engine: LLMEngine, stream: TokenStream) -> tuple:
    """Replace the draft, the verify step and the plain decode forward by fixed results; returns the two spec stubs."""
    spec = engine.spec
    nodes = spec.shapes[0].num_draft_tokens

    def draft_tree(shape, roots, prefix, slots):
        n = roots.shape[0]
        return DraftTree(
            tokens=torch.full((n, nodes), 100), parents=torch.arange(-1, nodes - 1, dtype=torch.int32).expand(n, -1),
            depths=torch.arange(nodes, dtype=torch.int32).expand(n, -1),
            mask=torch.ones(n, nodes, nodes, dtype=torch.bool), positions=prefix[:, None] + torch.arange(nodes),
            scores=torch.zeros(n, nodes),
        )  # fmt: skip

    def verify(shape, tree, prefix, slots, sampling):
        n = prefix.shape[0]
        result = torch.full((n, nodes + 2), -1, dtype=torch.int64)  # [N, T_d + 2]: emitted, count, depth
        result[:, : ACCEPTED + 1] = torch.tensor(stream.take(ACCEPTED + 1))
        result[:, nodes], result[:, nodes + 1] = ACCEPTED + 1, nodes - 1
        return result

    def decode_logits(input_ids, positions, state_indices, out=None):
        logits = torch.zeros(input_ids.shape[0], engine.model_config.vocab_size)  # [N, V]
        logits[:, stream.take(1)[0]] = 1.0
        return logits

    spec.draft_tree, spec.verify = draft_tree, verify
    engine.runner.decode_logits = decode_logits
    return draft_tree, verify


def prefill(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, tag: str) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, params)
    while any(not s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def timed_steps(engine: LLMEngine, steps: int) -> float:
    for _ in range(10):  # warm
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1e3 * (time.perf_counter() - start) / steps


def host_ms(batch_size: int, steps: int) -> dict:
    config = EngineConfig(model=str(DEFAULT_MODEL), draft=str(DEFAULT_DRAFT), dtype="float32", device="cpu",
                          max_num_seqs=batch_size, spec_adaptive=False, num_pages=4096,
                          num_slots=batch_size + 2)  # fmt: skip
    engine = LLMEngine(config)
    prompts = bench_prompts(engine, "mtbench", batch_size, 1024, 0, batch_size)[:batch_size]
    room = engine.max_model_len - max(map(len, prompts)) - 1
    params = SamplingParams(temperature=0, max_tokens=min(room, (ACCEPTED + 1) * (steps + 16)), ignore_eos=True)
    prefill(engine, prompts, params, "spec")  # the real forwards: the draft caught up on the prompts
    stream = TokenStream(engine)
    draft_tree, verify = stub_device_work(engine, stream)
    verify_steps = engine.num_verify_steps
    verify_ms = timed_steps(engine, steps)
    assert engine.num_verify_steps - verify_steps == steps + 10, "every timed step must verify"
    roots = torch.zeros(batch_size, dtype=torch.int64)
    prefix, slots = torch.full((batch_size,), 100), torch.ones(batch_size, dtype=torch.int64)
    start = time.perf_counter()
    for _ in range(steps):
        verify(0, draft_tree(0, roots, prefix, slots), prefix, slots, None)
    stubs_ms = 1e3 * (time.perf_counter() - start) / steps
    for seq in list(engine.scheduler.running):
        engine.abort_request(seq.request_id)
    engine.set_speculation(False)
    prefill(engine, prompts, params, "plain")
    plain_ms = timed_steps(engine, steps)
    return {"batch_size": batch_size, "verify_host_ms": round(verify_ms - stubs_ms, 4), "stubs_ms": round(stubs_ms, 4),
            "plain_host_ms": round(plain_ms, 4), "accepted_drafts": ACCEPTED}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--json", help="append one JSON line per batch size to this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'batch':>6} {'verify host ms/step':>20} {'(stubs, taken off)':>19} {'plain host ms/step':>19}")
    for batch_size in map(int, args.batch_sizes.split(",")):
        row = host_ms(batch_size, args.steps)
        print(f"{batch_size:>6} {row['verify_host_ms']:>20.3f} {row['stubs_ms']:>19.3f} {row['plain_host_ms']:>19.3f}",
              flush=True)  # fmt: skip
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
