"""The engine's own host work per decode step: the tiny model's engine with its decode forward replaced by a fixed
logits tensor, so a step is scheduling, slot tables, sampling, postprocessing and the RequestOutputs — the part of a
GPU step that no kernel speeds up. Per batch size and output length so far: milliseconds per step (mean of --steps).
`--graphs` takes the decode-graph path instead (a `GraphRunner` of buckets 1, 2, 4, 8, 16, 32, 64 whose graphs
replay nothing, overlap on: the host side of a GPU engine's plain step, `run_host` and `run_next` included; on the
CPU its tensor ops cost far less than the CUDA launches they stand for). There is no roofline: the figure is host
time, which a step's bytes do not bound. One JSON line per row with --json.
Usage: python bench/host_step.py [--batch-sizes 64,256] [--output-lens 10,1000] [--steps 100] [--graphs]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from jetserve.engine.bench_offline import random_model
from jetserve.engine.config import EngineConfig
from jetserve.engine.cuda_graph import GraphRunner
from jetserve.engine.engine import LLMEngine
from jetserve.sampling_params import SamplingParams

PROMPT_LEN = 64
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _NoReplay:
    """A captured graph's stand-in that runs nothing: the step's logits and argmax stay what they were."""

    def replay(self) -> None:
        pass


def host_ms(batch_size: int, output_len: int, steps: int, graphs: bool = False) -> float:
    model = random_model("tiny", "float32", torch.device("cpu"), seed=0)
    max_len = PROMPT_LEN + output_len + steps + 16
    pages = batch_size * (max_len // 16 + 2) + 1
    config = EngineConfig(device="cpu", max_num_seqs=batch_size, max_model_len=max_len, num_pages=pages,
                          num_slots=batch_size + 1, max_num_batched_tokens=8192)  # fmt: skip
    engine = LLMEngine(config, model=model, tokenizer=None)
    params = SamplingParams(temperature=0, max_tokens=output_len + steps + 8, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(str(i), [1 + (i + j) % 250 for j in range(PROMPT_LEN)], params)
    while any(not s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill with the real forward
    logits = torch.zeros(batch_size, model.config.vocab_size)  # [B, V]
    engine.runner.decode_logits = lambda input_ids, positions, state_indices, out=None: logits[: input_ids.shape[0]]
    if graphs:
        runner = GraphRunner(engine.runner, [b for b in GRAPH_BUCKETS if b < batch_size] + [batch_size])
        runner.graphs = {B: _NoReplay() for B in runner.batch_sizes}
        engine.runner.graph_runner = runner
    while engine.scheduler.running[0].num_output_tokens < output_len:
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return 1e3 * (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--output-lens", default="10,1000")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--graphs", action="store_true", help="the decode-graph path (graphs that replay nothing)")
    p.add_argument("--json", help="append one JSON line per row to this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'batch':>6} {'output tokens':>14} {'host ms/step':>13}")
    for batch_size in map(int, args.batch_sizes.split(",")):
        for output_len in map(int, args.output_lens.split(",")):
            ms = host_ms(batch_size, output_len, args.steps, args.graphs)
            print(f"{batch_size:>6} {output_len:>14} {ms:>13.3f}", flush=True)
            if args.json:
                row = {"batch_size": batch_size, "output_len": output_len, "graphs": args.graphs,
                       "host_ms_per_step": round(ms, 4)}  # fmt: skip
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
