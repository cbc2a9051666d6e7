"""Which second CUDA graph slows the 2B's batch-1 decode graph (docs/performance.md, sessions 30-31): an engine that
captures bucket 1 alone decodes a 1K-token prompt; its graph A is replayed back to back (5 x 50 replays), then the
variant's graph is captured in the same process and A is replayed again. A variant per process (its state is the
process's): run the script once per variant. Beside the times, the step's roofline (its bytes over the copy bandwidth
measured here).

Variants: none; torch-add (one torch kernel captured through the engine's own `_capture`: two warm-ups on a new side
stream, then the capture); torch-add-plain (the same kernel run once on the current stream, then captured);
torch-add-relaxed (one warm-up on a side stream, captured with capture_error_mode="relaxed"); norm-pdl / norm-no-pdl
(one Triton RMSNorm launched with / without PDL, through `_capture`); cublas (one GEMM through `_capture`);
decode-1 (the batch-1 step captured a second time through `_capture`).
Session 31 (H200): torch-add, norm-no-pdl, cublas and decode-1 took A from 1.521-1.527 to 1.578-1.584 ms; none,
norm-pdl, torch-add-plain and torch-add-relaxed left it. An engine capturing every bucket relaxed, or warming up on
the current stream or on one shared side stream, kept the slow figure (1.576-1.583 ms). (Those figures came from
`.dev` probes this script was written from after the session's GPU time was spent: not yet run in this form.)
Usage: python bench/graph_trigger.py VARIANT
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from profile_decode import graph_replay_ms  # noqa: E402

from jetserve.engine.bench_offline import decode_step_bytes, measure_copy_bandwidth, random_model  # noqa: E402
from jetserve.engine.config import EngineConfig  # noqa: E402
from jetserve.engine.cuda_graph import _capture  # noqa: E402
from jetserve.engine.engine import LLMEngine  # noqa: E402
from jetserve.sampling_params import SamplingParams  # noqa: E402

VARIANTS = ("none", "torch-add", "torch-add-plain", "torch-add-relaxed", "norm-pdl", "norm-no-pdl", "cublas",
            "decode-1")  # fmt: skip
PROMPT = 1024


def second_graph(variant: str, engine: LLMEngine, device: torch.device) -> dict:
    """Capture the variant's graph; returns the graphs (kept alive while A is timed again)."""
    from jetserve.ops.norm import kernels as norm_kernels
    from jetserve.ops.norm import rms_norm

    graphs: dict = {}
    t = torch.zeros(1024, device=device)
    if variant == "torch-add":
        _capture("x", graphs, None, lambda: t.add_(1.0))
    elif variant in ("torch-add-plain", "torch-add-relaxed"):
        stream = torch.cuda.Stream() if variant == "torch-add-relaxed" else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            t.add_(1.0)
        torch.cuda.current_stream().wait_stream(stream)
        graphs["x"] = torch.cuda.CUDAGraph()
        mode = "relaxed" if variant == "torch-add-relaxed" else "global"
        with torch.cuda.graph(graphs["x"], capture_error_mode=mode):
            t.add_(1.0)
    elif variant in ("norm-pdl", "norm-no-pdl"):
        x = torch.randn(1, 1536, device=device, dtype=torch.bfloat16)
        w = torch.randn(1536, device=device, dtype=torch.bfloat16)
        saved = norm_kernels.pdl_launch
        if variant == "norm-no-pdl":
            norm_kernels.pdl_launch = lambda x: {}
        try:
            _capture("x", graphs, None, lambda: rms_norm(x, w, 1e-6))
        finally:
            norm_kernels.pdl_launch = saved
    elif variant == "cublas":
        x = torch.randn(64, 1536, device=device, dtype=torch.bfloat16)
        w = torch.randn(1536, 1536, device=device, dtype=torch.bfloat16)
        _capture("x", graphs, None, lambda: F.linear(x, w))
    elif variant == "decode-1":
        runner = engine.runner.graph_runner
        _capture("x", graphs, None, lambda: runner._step(1))
    torch.cuda.synchronize()
    return graphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", choices=VARIANTS)
    args = p.parse_args()
    device = torch.device("cuda")
    model = random_model("2b", "bfloat16", device, seed=0)
    config = EngineConfig(device="cuda", max_num_seqs=16, max_model_len=PROMPT + 600, cuda_graph_max_batch_size=1)
    engine = LLMEngine(config, model=model, tokenizer=None)
    prompt = torch.randint(0, 1000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("p0", prompt, SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    for _ in range(40):  # prefill, then decode steps: A's static buffers hold a real step at ~1K context
        engine.step()
    torch.cuda.synchronize()
    bandwidth = measure_copy_bandwidth(device)
    roofline_ms = decode_step_bytes(engine, 1, PROMPT + 40) / bandwidth * 1e3

    def times() -> str:
        return " ".join(f"{graph_replay_ms(engine, 1, 50):.4f}" for _ in range(5))

    before = times()
    with torch.inference_mode():
        graphs = second_graph(args.variant, engine, device)
    for _ in range(10):  # the engine's own steps again (A replays with the real inputs)
        engine.step()
    torch.cuda.synchronize()
    print(f"{args.variant}: A {before} ms before, {times()} ms after ({len(graphs)} graph(s) captured); roofline "
          f"{roofline_ms:.3f} ms ({bandwidth / 1e9:.0f} GB/s copy bandwidth measured here)")  # fmt: skip


if __name__ == "__main__":
    main()
