"""The glue of a VERIFY step: the kernel-launching torch ops outside the target and draft forwards and the commit,
counted on the CPU with the default model and its draft (fp32, reference backend, the graph-free path; the default
chain shape, or --verify-shape's tree) and grouped by part: the batch, K/V metadata, logits, the acceptance op (chain
or tree: acceptance, emitted tokens and the result row), the draft's catch-up and its feature projection. Each is one
small kernel in the verify CUDA graph (the K/V metadata, acceptance and draft-rows ops one launch each), so the count
is what the glue's launches cost in kernels. With --draft-shapes, a draft step's too (one `draft_tree` call at batch
1, outside the draft's forward). There is no roofline: a count, not a time. One JSON line per (batch size, part) and
per draft shape with --json.
Usage: python bench/verify_glue.py [--batch-sizes 1,8] [--verify-shape 2x3x8] [--draft-shapes 1x6x7,2x3x8] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from jetserve.assets import resolve_checkpoint
from jetserve.llm import LLM
from jetserve.ops.chain_accept import reference as chain_accept_reference
from jetserve.ops.draft_rows import reference as draft_rows_reference
from jetserve.ops.kv_metadata import reference as kv_metadata_reference
from jetserve.ops.tree_accept import reference as tree_accept_reference
from jetserve.ops.tree_select import reference as tree_select_reference
from jetserve.sampling_params import SamplingParams
from jetserve.spec.verifier import VerifyOutput

# aten ops that launch no kernel of their own (views, metadata, dtype no-ops) or only dispatch to others
NON_KERNELS = {
    "aten::" + name
    for name in (
        "view as_strided empty empty_strided detach alias lift_fresh unsqueeze squeeze expand slice select t "
        "transpose permute reshape _reshape_alias resolve_conj resolve_neg result_type unbind split chunk "
        "narrow split_with_sizes _unsafe_view contiguous flatten unflatten view_as empty_like resize_ "
        "_local_scalar_dense item expand_as broadcast_tensors is_nonzero new_empty new_empty_strided to "
        "_to_copy zeros_like scalar_tensor lift is_same_size size stride numel dim as_strided_ unsqueeze_ squeeze_"
    ).split()
}
LEFT_OUT = ("target forward", "draft forward", "commit")
# parts counted here in their reference's ops that are one launch each on the GPU: `ops.kv_metadata`,
# `ops.chain_accept`, `ops.tree_accept`, `ops.draft_rows`
ONE_LAUNCH = ("K/V metadata op", "chain acceptance op", "tree acceptance op", "draft rows op")
TREE_SELECTION = "tree selection op"  # a draft step's `ops.tree_select`, counted as its one launch


def _labelled(obj: object, name: str, label: str) -> None:
    """Run `obj.name` inside a profiler range called `label`."""
    method = getattr(obj, name)

    def wrapped(*args, **kwargs):
        with record_function(label):
            return method(*args, **kwargs)

    setattr(obj, name, wrapped)


def _part(event, labels: set[str]) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in labels:
            return parent.name
        parent = parent.cpu_parent
    return None


def _speculating(batch_size: int, **spec_shape) -> tuple[object, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The default pair's engine (CPU, fp32) a few verify steps into `batch_size` greedy sequences, always verifying
    with shape 0 (`spec_shape`: spec_topk / spec_steps / spec_num_draft_tokens, else the default's), and the running
    sequences' (roots, prefix lengths, slots) for the next step."""
    llm = LLM(model=resolve_checkpoint("default", "model"), draft=resolve_checkpoint("default", "draft"), device="cpu",
              dtype="float32", max_num_seqs=max(batch_size, 2), max_model_len=1024, **spec_shape)  # fmt: skip
    engine, spec = llm.engine, llm.engine.spec
    spec.policy.forced_option = 0  # always verify with shape 0
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"r{i}", list(range(1 + i, 30 + i)), params)
    for _ in range(4):
        engine.step()
    seqs = list(engine.scheduler.running)
    host = np.array([[s.token_ids[-1] for s in seqs], [s.num_computed_tokens for s in seqs], [s.slot for s in seqs]])
    roots, prefix, slots = torch.from_numpy(host)
    return spec, (roots, prefix, slots)


def _leaf_ops(prof, labels: set[str], rest: str = "verify (rest)") -> dict[str, collections.Counter]:
    """{part (the innermost range of `labels` around it, else `rest`): Counter of aten op → launches} over the
    profile's kernel-launching ops, each counted at its leaves."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name in NON_KERNELS:
            continue
        if any(c.name.startswith("aten::") and c.name not in NON_KERNELS for c in event.cpu_children):
            continue  # counted at its leaves
        counts[_part(event, labels) or rest][event.name[len("aten::") :]] += 1
    return counts


def count_draft_glue(topk: int, steps: int, nodes: int) -> collections.Counter:
    """Counter of aten op → launches of one `draft_tree` call (batch 1, the tree shape given) outside the draft's
    forward: the levels' batches and candidates, and the tree selection op as its one launch (with the reference ops of
    the draft's norm and top-1, which are Triton kernels on a GPU)."""
    spec, (roots, prefix, slots) = _speculating(1, spec_topk=topk, spec_steps=steps, spec_num_draft_tokens=nodes)
    _labelled(spec.draft, "forward", "draft forward")
    _labelled(spec.draft, "forward_normed", "draft forward")  # a chain's levels: the forward and its final norm
    _labelled(tree_select_reference, "select_tree", TREE_SELECTION)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        spec.draft_tree(0, roots, prefix, slots)
    counts = _leaf_ops(prof, {"draft forward", TREE_SELECTION}, rest="draft glue")
    glue = counts["draft glue"]
    if TREE_SELECTION in counts:  # one launch on the GPU
        glue[TREE_SELECTION] = 1
    return glue


def count_glue(batch_size: int, shape: tuple[int, int, int] | None = None) -> dict[str, collections.Counter]:
    """{part: Counter of aten op → launches} for one verify step of `batch_size` greedy sequences: the default
    (chain) shape, or `shape` = (topk, steps, nodes)."""
    names = ("spec_topk", "spec_steps", "spec_num_draft_tokens")
    spec_shape = {} if shape is None else dict(zip(names, shape, strict=True))
    spec, (roots, prefix, slots) = _speculating(batch_size, **spec_shape)
    parts = {
        (spec.verifier.model, "forward"): "target forward",
        (spec.draft, "forward"): "draft forward",
        (spec.draft, "forward_normed"): "draft forward",
        (spec.verifier.model, "commit_verified"): "commit",
        (spec.verifier, "forward_batch"): "batch",
        (spec.runner, "verify_kv_metadata"): "K/V metadata",
        (spec.verifier.model, "compute_logits"): "logits",
        (spec.drafters[0], "extend_after_verify"): "draft catch-up",
        (spec.draft, "project_features"): "feature projection",
        (VerifyOutput, "emitted_tokens"): "emitted tokens",
    }
    for (obj, name), label in parts.items():
        _labelled(obj, name, label)
    _labelled(kv_metadata_reference, "kv_metadata", ONE_LAUNCH[0])
    _labelled(chain_accept_reference, "chain_accept_emit", ONE_LAUNCH[1])
    _labelled(tree_accept_reference, "tree_accept_emit", ONE_LAUNCH[2])
    _labelled(draft_rows_reference, "draft_rows", ONE_LAUNCH[3])
    labels = set(parts.values()) | set(ONE_LAUNCH)
    with torch.inference_mode():
        tree = spec.draft_tree(0, roots, prefix, slots)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            spec.verify(0, tree, prefix, slots, None)
    return _leaf_ops(prof, labels)


def _shapes(p: argparse.ArgumentParser, flag: str, text: str) -> list[tuple[int, int, int]]:
    """TOPKxSTEPSxNODES, comma-separated → [(topk, steps, nodes)], or the parser's one-line error."""
    try:
        shapes = [tuple(map(int, shape.split("x"))) for shape in filter(None, text.split(","))]
    except ValueError:
        shapes = [()]
    if any(len(shape) != 3 for shape in shapes):
        p.error(f"{flag} {text!r}: want TOPKxSTEPSxNODES, comma-separated (e.g. 1x6x7,2x3x8)")
    return shapes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1")
    p.add_argument("--verify-shape", default="", help="the verify step's tree, TOPKxSTEPSxNODES (default: the chain)")
    p.add_argument("--draft-shapes", default="", help="also a draft step's glue at batch 1: TOPKxSTEPSxNODES, ...")
    p.add_argument("--json")
    args = p.parse_args()
    draft_shapes = _shapes(p, "--draft-shapes", args.draft_shapes)
    verify_shape = (_shapes(p, "--verify-shape", args.verify_shape) or [None])[0]
    torch.set_num_threads(1)
    out = open(args.json, "a") if args.json else None
    for batch_size in map(int, args.batch_sizes.split(",")):
        try:
            counts = count_glue(batch_size, verify_shape)
        except ValueError as e:  # a tree shape the engine refuses
            p.error(f"--verify-shape {args.verify_shape}: {e}")
        glue = {part: c for part, c in counts.items() if part not in LEFT_OUT}
        total = sum(sum(c.values()) for c in glue.values())
        launches = total - sum(sum(glue.get(part, {}).values()) - (part in glue) for part in ONE_LAUNCH)
        print(f"\nbatch {batch_size}: {total} kernel-launching ops of glue, {launches} launches on the GPU where "
              f"each of {', '.join(map(repr, ONE_LAUNCH))} is one (left out: " +
              ", ".join(f"{part} {sum(counts[part].values())}" for part in LEFT_OUT) + ")")  # fmt: skip
        print(f"{'part':20s} {'ops':>4s}  most frequent")
        for part, c in sorted(glue.items(), key=lambda kv: -sum(kv[1].values())):
            print(f"{part:20s} {sum(c.values()):4d}  " + ", ".join(f"{op}×{n}" for op, n in c.most_common(8)))
            if out:
                row = {"batch_size": batch_size, "part": part, "ops": sum(c.values()), "by_op": dict(c),
                       "verify_shape": args.verify_shape or "default"}  # fmt: skip
                out.write(json.dumps(row) + "\n")
    for topk, steps, nodes in draft_shapes:
        shape = f"{topk}x{steps}x{nodes}"
        try:
            c = count_draft_glue(topk, steps, nodes)
        except ValueError as e:  # a tree shape the engine refuses
            p.error(f"--draft-shapes {shape}: {e}")
        print(f"\ndraft step {shape} (topk x steps x nodes), batch 1: {sum(c.values())} kernel-launching ops outside "
              f"the draft's forward: " + ", ".join(f"{op}×{n}" for op, n in c.most_common(12)))  # fmt: skip
        if out:
            out.write(json.dumps({"draft_shape": shape, "part": "draft glue", "ops": sum(c.values()),
                                  "by_op": dict(c)}) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
