"""bench/step_launches.py (CPU, the default pair, the graphs' bodies on the Triton backend in the interpreter): the
chain-3 draft graph at batch 1 launches 38 kernels, 11 of them torch's — the three lm_heads and 8 of glue, with no
shape constant made, no stack of the levels' tokens and no copy of the tree into the graph's (session 46: 19 torch
launches before) — and its verify graph 18 torch launches, none a `repeat_interleave` or the read-back of the next
inputs (`gather`, `where`); a bad shape is a one-line error."""

import json


def test_chain_graphs_launch_no_avoidable_glue(tmp_path, run_bench):
    out = tmp_path / "launches.jsonl"
    run = run_bench("bench/step_launches.py", "--batch-size", "1", "--shape", "1", "--list", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {r["graph"]: r for r in map(json.loads, out.read_text().splitlines())}
    draft, verify = rows["draft"], rows["verify"]
    torch_ops = {name.split(":", 1)[1]: n for name, n in draft["by_name"].items() if name.startswith("torch:")}
    assert draft["torch"] == sum(torch_ops.values()) == 11, torch_ops
    assert torch_ops["linear"] == 3 and torch_ops.get("copy_", 0) == 1, torch_ops  # the lm_heads; the root's copy
    assert not {"arange", "full", "ones", "tril", "stack", "zeros"} & set(torch_ops), torch_ops
    assert draft["triton"] == 27 and draft["by_name"]["triton:_top_logprob_merge_kernel"] == 3
    verify_ops = {name.split(":", 1)[1] for name in verify["by_name"] if name.startswith("torch:")}
    assert verify["torch"] <= 18 and not {"repeat_interleave", "gather", "where", "arange"} & verify_ops, verify
    assert verify["by_name"]["triton:_chain_accept_emit_kernel"] == 1
    assert "spec/drafter.py" in run.stdout  # --list names the line that launched each


def test_a_shape_the_engine_lacks_is_an_error(run_bench):
    run = run_bench("bench/step_launches.py", "--shape", "7")
    assert run.returncode == 2 and "--shape 7" in run.stderr.strip().splitlines()[-1]
