"""bench/verify_glue.py's draft-step count (CPU, the default pair): one draft step of a chain launches none of the
shape-only kernels that `spec.constants` serves (its aranges, fills of -1 and 0, the causal triangle), and the
script's JSON lines carry the counts (before the constants, a chain-6 step had 11 aranges, 21 fills and 5 triangles);
a greedy chain's verify step makes its emitted tokens and result row in the acceptance op, a greedy tree's in the tree
acceptance op, and a tree's draft step selects its nodes in the tree selection op."""

import json


def _rows(run_bench, tmp_path, *flags: str) -> list[dict]:
    out = tmp_path / "glue.jsonl"
    run = run_bench("bench/verify_glue.py", "--batch-sizes", "1", *flags, "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_chain_draft_step_makes_no_shape_constants(tmp_path, run_bench):
    rows = _rows(run_bench, tmp_path, "--draft-shapes", "1x6x7")
    (draft,) = [r for r in rows if r.get("draft_shape") == "1x6x7"]
    ops = draft["by_op"]
    assert draft["ops"] > 0 and "tril" not in ops and "arange" not in ops, ops  # the chain tree's shape: constants
    assert ops.get("fill_", 0) <= 6, ops  # the reference top-1's, one a level (a Triton kernel on a GPU)
    assert ops.get("add", 0) <= 15, ops  # 6 norms' eps, 6 top-1 shifts, and 3 a step: the levels' positions made once
    verify = {r["part"]: r["ops"] for r in rows if r.get("batch_size") == 1}
    assert verify["batch"] > 0 and "arange" not in next(r for r in rows if r.get("part") == "batch")["by_op"]
    # a greedy chain's acceptance, emitted tokens and result row: `ops.chain_accept` (one launch on a GPU), nothing
    # after it
    assert verify["chain acceptance op"] > 0 and "emitted tokens" not in verify and "acceptance" not in verify, verify


def test_a_tree_step_accepts_in_one_op_and_selects_in_one_op(tmp_path, run_bench):
    """Before `ops.tree_accept`, a tree-8 verify step's node walk, emitted tokens and result row were ~150 launches;
    before `ops.tree_select`, its draft step's selection and ancestor mask ~85 (162 ops in all, 85 after)."""
    rows = _rows(run_bench, tmp_path, "--verify-shape", "2x3x8", "--draft-shapes", "2x3x8")
    (draft,) = [r for r in rows if r.get("draft_shape") == "2x3x8"]
    ops = draft["by_op"]
    assert ops["tree selection op"] == 1 and "scatter_" not in ops and draft["ops"] < 100, ops  # scatter_: 4 before
    verify = {r["part"]: r["ops"] for r in rows if r.get("batch_size") == 1}
    assert all(r["verify_shape"] == "2x3x8" for r in rows if "batch_size" in r)
    assert verify["tree acceptance op"] > 0 and "chain acceptance op" not in verify, verify
    assert "emitted tokens" not in verify and verify["verify (rest)"] <= 4, verify  # argmax, the hidden-state store
