"""Every kernel launch of the default pair's speculative graphs, in order, on the CPU: the bodies that the draft graph
and the verify graph capture (`SpecGraphRunner._draft` / `_verify`, greedy) run once on the Triton backend in the
interpreter, each Triton kernel counted as one launch and each torch op outside them that launches a kernel on a GPU
(views and no-op casts left out) as one, with the line of `jetserve` that issued it. The engine is set up on the
reference backend (prefill, then decode steps); one draft and verify step runs first, as the warm-up before a
capture does (it makes the shape constants the graphs then read), and the next is listed.

A count, not a time: there is no roofline. On an H200 a launch in these graphs costs ~1.1 µs (session 46: 9 launches
fewer in the chain-3 draft graph took it 10.3 µs faster), so the count predicts what a change to the glue moves.
`--list` prints every launch; the summary counts them by kind and name. One JSON line per graph with --json.
Usage: python bench/step_launches.py [--batch-size 1] [--shape 1] [--list] [--json FILE]
"""

from __future__ import annotations

import os

# Before any kernel is defined: the @triton.jit decorator picks the interpreter at definition time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from verify_glue import NON_KERNELS  # noqa: E402  (bench/, the script's folder)

from jetserve.assets import resolve_checkpoint  # noqa: E402
from jetserve.engine.cuda_graph import GraphRunner, SpecGraphRunner  # noqa: E402
from jetserve.llm import LLM  # noqa: E402
from jetserve.ops.backend import set_backend  # noqa: E402
from jetserve.sampling_params import SamplingParams  # noqa: E402

# aten ops that launch no kernel: verify_glue's list, less the casts and copies it cannot tell from no-ops (here a cast
# or `contiguous` that returns its input is left out as it happens) and the ops that do launch one (a fill, a read)
NO_KERNEL = {name.removeprefix("aten::") for name in NON_KERNELS} - {
    "to", "_to_copy", "contiguous", "zeros_like", "item", "_local_scalar_dense"
}  # fmt: skip


class LaunchLog(TorchDispatchMode):
    """Records (kind, name, where) for each Triton launch and each kernel-launching torch op outside them."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[tuple[str, str, str]] = []
        self._inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        is_no_op_cast = name in ("to", "contiguous") and args and out is args[0]
        if not self._inside_triton and name not in NO_KERNEL and not is_no_op_cast:
            self.launches.append(("torch", name, _caller()))
        return out

    def triton_run(self, original):
        def run(kernel, *args, **kwargs):
            self.launches.append(("triton", getattr(getattr(kernel, "fn", None), "__name__", str(kernel)), _caller()))
            self._inside_triton += 1
            try:
                return original(kernel, *args, **kwargs)
            finally:
                self._inside_triton -= 1

        return run


def _caller() -> str:
    """The innermost frame in the `jetserve` package: file:line function."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/jetserve/" in frame.filename:
            return f"{frame.filename.split('/jetserve/')[-1]}:{frame.lineno} {frame.name}"
    return "?"


def speculating_graphs(batch_size: int, steps: int = 4) -> tuple[SpecGraphRunner, int]:
    """The default pair's engine (CPU, fp32, reference backend) `steps` steps into `batch_size` greedy sequences, and
    a SpecGraphRunner over it with the running rows' inputs loaded (its graphs are never captured: the bodies are
    called directly); returns it and the rows' bucket."""
    set_backend("reference")
    try:
        llm = LLM(model=resolve_checkpoint("default", "model"), draft=resolve_checkpoint("default", "draft"),
                  device="cpu", dtype="float32", max_num_seqs=max(batch_size, 2), max_model_len=1024)  # fmt: skip
        engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        for i in range(batch_size):
            engine.add_request(f"r{i}", list(range(1 + i, 30 + i)), params)
        for _ in range(steps):
            engine.step()
    finally:
        set_backend(None)
    engine.runner.graph_runner = GraphRunner(engine.runner, [batch_size])  # the pool SpecGraphRunner asks for
    graphs = SpecGraphRunner(engine.spec, [batch_size])
    seqs = list(engine.scheduler.running)
    inputs = [[s.token_ids[-1] for s in seqs], [s.num_computed_tokens for s in seqs], [s.slot for s in seqs]]
    return graphs, graphs._load(torch.tensor(inputs, dtype=torch.int64))


def count_launches(batch_size: int, shape: int) -> dict[str, list[tuple[str, str, str]]]:
    """{"draft": launches, "verify": launches} of one draft graph body and one greedy verify graph body."""
    graphs, bucket = speculating_graphs(batch_size)
    if not 0 <= shape < len(graphs.spec.shapes):
        raise ValueError(f"--shape {shape}: the engine has shapes 0..{len(graphs.spec.shapes) - 1}")
    log = LaunchLog()
    original = interpreter.InterpretedFunction.run
    interpreter.InterpretedFunction.run = log.triton_run(original)
    set_backend("triton")
    bodies = {"draft": lambda: graphs._draft(bucket, shape), "verify": lambda: graphs._verify(bucket, shape, True)}
    out = {}
    try:
        with torch.inference_mode():
            for body in bodies.values():  # a warm-up step, as before a capture: it makes the shape's constants
                body()
            for name, body in bodies.items():  # the next step, as the graphs replay it
                log.launches = []
                with log:
                    body()
                out[name] = log.launches
    finally:
        interpreter.InterpretedFunction.run = original
        set_backend(None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--shape", type=int, default=1, help="the engine's draft shape (0: chain 7, 1: chain 3)")
    p.add_argument("--list", action="store_true", help="print every launch in order")
    p.add_argument("--json")
    args = p.parse_args()
    if args.batch_size < 1:
        p.error(f"--batch-size {args.batch_size}: must be ≥ 1")
    torch.set_num_threads(1)
    try:
        launches = count_launches(args.batch_size, args.shape)
    except ValueError as e:
        p.error(str(e))
    for graph, rows in launches.items():
        kinds = collections.Counter(kind for kind, _, _ in rows)
        print(f"\n{graph} graph, batch {args.batch_size}, shape {args.shape}: {len(rows)} launches "
              f"({kinds['triton']} Triton, {kinds['torch']} torch)")  # fmt: skip
        if args.list:
            for kind, name, where in rows:
                print(f"  {kind:6s} {name:34s} {where}")
        by_name = collections.Counter(f"{kind}:{name}" for kind, name, _ in rows)
        print("  " + ", ".join(f"{name}×{n}" for name, n in by_name.most_common()))
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"graph": graph, "batch_size": args.batch_size, "shape": args.shape,
                                    "launches": len(rows), "triton": kinds["triton"], "torch": kinds["torch"],
                                    "by_name": dict(by_name)}) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
