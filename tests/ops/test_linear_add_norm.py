"""The linear op's `add_norm` epilogue: `rms_norm(y, norm_weight, eps, residual)` of the GEMM's output in the same
launch — the producing GEMM adds the residual and normalises for the next layer. The Triton kernel against the
reference composition (linear, then rms_norm) on the CPU interpreter at awkward sizes, through every path (one-row FMA
tiles, tensor-core tiles, K split into a second launch), and at the 2B shapes in bf16 on a GPU, also inside a CUDA
graph (its ticket counter is reused by every replay)."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops import backend
from jetserve.ops.linear import GEMV_MAX_ROWS, NARROW_MAX_ROWS
from jetserve.ops.linear import gated_norm_linear as dispatched_gated_norm_linear
from jetserve.ops.linear import linear as dispatched_linear
from jetserve.ops.linear import reference as ref
from jetserve.ops.linear import swiglu_linear as dispatched_swiglu_linear
from jetserve.ops.norm import reference as norm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-6


@pytest.fixture
def kernels(poisoned_empty):
    """The Triton module, with every new floating-point tensor (outputs, partials, sums of squares) NaN-filled."""
    if DEVICE == "cpu" and not envs.triton_interpret():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from jetserve.ops.linear import kernels as module

    return module


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def add_norm_args(num_rows: int, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A residual (row stride n + 3: a view, as the model's residual can be) and a norm weight."""
    residual = randn(num_rows, n + 3, dtype=dtype, seed=seed, scale=2.0)[:, 1 : n + 1]
    return residual, randn(n, dtype=dtype, seed=seed + 1), EPS


def assert_pair(actual: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """(normed, h) within rounding of the reference's: h is one rounding of the same sum; normed differs by the
    order of its sum of squares."""
    for got, exp in zip(actual, want, strict=True):
        assert got.dtype == exp.dtype and got.shape == exp.shape and torch.isfinite(got).all()
        tol = TOLERANCE[exp.dtype]
        torch.testing.assert_close(got.float(), exp.float(), rtol=tol, atol=tol)


TILINGS = [
    None,  # the heuristic's pick
    (1, 8, 16, 1, False),  # one-row FMA tiles, no split: the last program to finish normalises
    (1, 8, 16, 3, False),  # FMA, K split: the sum's launch holds whole rows and normalises them
    (16, 16, 32, 1, True),  # tensor-core tile, no split
    (16, 16, 16, 2, True),  # tensor-core tile, split K
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("num_rows, n, k", [(1, 37, 50), (3, 40, 64)])
def test_linear_add_norm_matches_linear_then_rms_norm(kernels, dtype, tiling, num_rows, n, k) -> None:
    if tiling is not None and tiling[0] < num_rows:
        tiling = (16, *tiling[1:4], True)  # several rows: a tensor-core tile
    x = randn(num_rows, k, dtype=dtype, seed=1)
    weight = randn(n, k, dtype=dtype, seed=2, scale=k**-0.5)
    bias = randn(n, dtype=dtype, seed=3)
    add = add_norm_args(num_rows, n, dtype, seed=4)
    t = kernels.GemvTiling(*tiling) if tiling else None
    want = ref.linear(x, weight, bias, add_norm=add)
    for _ in range(2):  # again: the ticket counter is back to 0 after a launch
        assert_pair(kernels.linear(x, weight, bias, tiling=t, add_norm=add), want)
    assert int(kernels._ticket(x.device)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tiling", [None, (1, 8, 32, 1, False), (1, 8, 16, 2, False)])
def test_producer_modes_add_norm(kernels, dtype, tiling) -> None:
    """The model's producers: the SwiGLU down projection and the JetBlock's gated-norm o_proj."""
    n, k, heads, head = 29, 48, 3, 16
    t = kernels.GemvTiling(*tiling) if tiling else None
    gate_up = randn(1, 2 * k, dtype=dtype, seed=5)
    weight = randn(n, k, dtype=dtype, seed=6, scale=k**-0.5)
    add = add_norm_args(1, n, dtype, seed=7)
    assert_pair(kernels.swiglu_linear(gate_up, weight, tiling=t, add_norm=add), ref.swiglu_linear(gate_up, weight,
                add_norm=add))  # fmt: skip
    o, gate = randn(1, heads * head, dtype=dtype, seed=8, scale=3.0), randn(1, heads * head, dtype=dtype, seed=9)
    norm_weight = randn(head, dtype=dtype, seed=10)
    want = ref.gated_norm_linear(o, gate, norm_weight, 1e-5, weight, add_norm=add)
    got = kernels.gated_norm_linear(o, gate, norm_weight, 1e-5, weight, tiling=t, add_norm=add)
    assert_pair(got, want)


def test_reference_is_linear_then_rms_norm_and_checks() -> None:
    x, weight = randn(2, 9, dtype=torch.float32, seed=11), randn(5, 9, dtype=torch.float32, seed=12)
    residual, norm_weight = randn(2, 5, dtype=torch.float32, seed=13), randn(5, dtype=torch.float32, seed=14)
    normed, h = ref.linear(x, weight, add_norm=(residual, norm_weight, EPS))
    want = norm_ref.rms_norm(ref.linear(x, weight), norm_weight, EPS, residual)
    assert torch.equal(normed, want[0]) and torch.equal(h, want[1])
    with pytest.raises(ValueError, match="add_norm: residual"):
        ref.linear(x, weight, add_norm=(residual[:, :4], norm_weight, EPS))
    with pytest.raises(ValueError, match="add_norm: norm weight"):
        ref.linear(x, weight, add_norm=(residual, norm_weight[:4], EPS))


@pytest.mark.parametrize("flag", ["0", "1"])
def test_dispatch_passes_add_norm_to_either_variant(monkeypatch: pytest.MonkeyPatch, flag: str) -> None:
    """The public op: the pair on the reference backend, and (in the interpreter) on the Triton backend too, in the
    epilogue (JETSERVE_ADD_NORM_EPILOGUE=1) or as the norm op after the GEMM."""
    monkeypatch.setenv("JETSERVE_ADD_NORM_EPILOGUE", flag)
    x, weight = randn(1, 24, dtype=torch.float32, seed=15), randn(10, 24, dtype=torch.float32, seed=16)
    add = add_norm_args(1, 10, torch.float32, seed=17)
    want = ref.linear(x, weight, add_norm=add)
    names = ["reference"] + (["triton"] if envs.triton_interpret() else [])
    for name in names:
        backend.set_backend(name)
        try:
            assert_pair(dispatched_linear(x, weight, add_norm=add), want)
            o, gate = randn(1, 32, dtype=torch.float32, seed=18), randn(1, 32, dtype=torch.float32, seed=19)
            head_w, w2 = randn(16, dtype=torch.float32, seed=20), randn(10, 32, dtype=torch.float32, seed=21)
            got = dispatched_gated_norm_linear(o, gate, head_w, 1e-5, w2, add_norm=add)
            assert_pair(got, ref.gated_norm_linear(o, gate, head_w, 1e-5, w2, add_norm=add))
        finally:
            backend.set_backend(None)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 4, 16])
@pytest.mark.parametrize("mode", ["down", "o_proj"])
def test_add_norm_2b_shapes_bf16_and_in_a_graph(kernels, mode, num_rows) -> None:
    """The 2B's producers (SwiGLU down 1536 × 8960, gated-norm o_proj 1536 × 3072) at decode rows, bf16, eagerly and
    replayed from a CUDA graph three times (new inputs each time: the ticket counter must be back to 0)."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    dtype, n, k = torch.bfloat16, 1536, 8960 if mode == "down" else 3072
    weight = randn(n, k, dtype=dtype, seed=30, scale=k**-0.5)
    if mode == "down":
        x = randn(num_rows, 2 * k, dtype=dtype, seed=31)

        def run(add):
            return kernels.swiglu_linear(x, weight, add_norm=add)

        def reference(add):
            return ref.swiglu_linear(x, weight, add_norm=add)
    else:
        x = randn(num_rows, k, dtype=dtype, seed=32, scale=3.0)
        gate, head_w = randn(num_rows, k, dtype=dtype, seed=33), randn(256, dtype=dtype, seed=34)

        def run(add):
            return kernels.gated_norm_linear(x, gate, head_w, 1e-5, weight, add_norm=add)

        def reference(add):
            return ref.gated_norm_linear(x, gate, head_w, 1e-5, weight, add_norm=add)

    residual, norm_weight, _ = add_norm_args(num_rows, n, dtype, seed=35)
    add = (residual, norm_weight, EPS)
    assert_pair(run(add), reference(add))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(add)
    for seed in (36, 37, 38):
        residual.copy_(randn(num_rows, n, dtype=dtype, seed=seed, scale=2.0))
        graph.replay()
        assert_pair(captured, reference(add))


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [17, 32, 128, 200, 256])
@pytest.mark.parametrize("mode", ["down", "o_proj"])
def test_split_sum_norm_2b_shapes_bf16_and_in_a_graph(mode, num_rows) -> None:
    """Past GEMV_MAX_ROWS the public ops at the 2B's producers in bf16 hand the next RMSNorm to a K split's sum: the
    Triton GEMM's up to NARROW_MAX_ROWS rows (its tiling splits K), the batched split from BATCHED_MIN_ROWS (the
    rule's count, cuBLAS's fp32-out batched GEMM); eagerly and replayed from a CUDA graph with new residuals."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    from jetserve.ops.linear import kernels

    dtype, n, k = torch.bfloat16, 1536, 8960 if mode == "down" else 3072
    if num_rows <= NARROW_MAX_ROWS:
        assert kernels.choose_tiling(num_rows, n, k, kernels.sm_count(torch.device(DEVICE))).num_splits > 1
    else:
        assert kernels.batched_splits(num_rows, k) > 1
    weight = randn(n, k, dtype=dtype, seed=70, scale=k**-0.5)
    x = randn(num_rows, 2 * k if mode == "down" else k, dtype=dtype, seed=71)
    op, reference = (dispatched_swiglu_linear, ref.swiglu_linear) if mode == "down" else (dispatched_linear, ref.linear)
    residual, norm_weight, _ = add_norm_args(num_rows, n, dtype, seed=72)
    add = (residual, norm_weight, EPS)
    assert_pair(op(x, weight, add_norm=add), reference(x, weight, add_norm=add))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(x, weight, add_norm=add)
    for seed in (73, 74):
        residual.copy_(randn(num_rows, n, dtype=dtype, seed=seed, scale=2.0))
        graph.replay()
        assert_pair(captured, reference(x, weight, add_norm=add))


@pytest.mark.parametrize("shape", [(0, 8), (2, 0), (70, 8), (2, 3, 8)])
def test_add_norm_edges(kernels, shape) -> None:
    """No rows, no input features (no kernel: the composition), more rows than one launch holds (two launches share
    the ticket counter), leading dims, and a residual whose last dim is strided (copied)."""
    x = randn(*shape, dtype=torch.float32, seed=40)
    weight = randn(5, shape[-1], dtype=torch.float32, seed=41)
    residual = randn(5, *shape[:-1], dtype=torch.float32, seed=42).movedim(0, -1)  # [..., 5], last stride > 1
    add = (residual, randn(5, dtype=torch.float32, seed=43), EPS)
    assert_pair(kernels.linear(x, weight, add_norm=add), ref.linear(x, weight, add_norm=add))


def test_epilogue_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """JETSERVE_ADD_NORM_EPILOGUE: off by default, 1 on, anything else refused."""
    monkeypatch.delenv("JETSERVE_ADD_NORM_EPILOGUE", raising=False)
    assert not envs.add_norm_epilogue()
    monkeypatch.setenv("JETSERVE_ADD_NORM_EPILOGUE", "1")
    assert envs.add_norm_epilogue()
    monkeypatch.setenv("JETSERVE_ADD_NORM_EPILOGUE", "yes")
    with pytest.raises(ValueError, match="JETSERVE_ADD_NORM_EPILOGUE"):
        envs.add_norm_epilogue()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_rows, n, k, splits", [(17, 37, 60, 3), (40, 29, 64, 4), (5, 8, 48, 1), (70, 19, 30, 5)])
def test_batched_split_linear_matches_linear_then_rms_norm(kernels, dtype, num_rows, n, k, splits) -> None:
    """Past the Triton GEMM's rows: the K split's partials as one batched GEMM, then the split sum with the bias, the
    residual add and the norm, against the reference composition, at awkward sizes; x a strided column slice."""
    x = randn(num_rows, k + 5, dtype=dtype, seed=50)[:, 2 : k + 2]
    weight = randn(n, k, dtype=dtype, seed=51, scale=k**-0.5)
    bias = randn(n, dtype=dtype, seed=52)
    add = add_norm_args(num_rows, n, dtype, seed=53)
    assert_pair(kernels.batched_split_linear(x, weight, bias, add, splits), ref.linear(x, weight, bias, add_norm=add))
    assert_pair(kernels.batched_split_linear(x, weight, None, add, splits), ref.linear(x, weight, add_norm=add))
    with pytest.raises(ValueError, match="must divide K"):
        kernels.batched_split_linear(x, weight, bias, add, k + 1)


def test_batched_splits_rule() -> None:
    """At most BATCHED_MAX_SPLITS divisors of K in runs of at least BATCHED_MIN_CHUNK, for decode batches from
    BATCHED_MIN_ROWS rows; none when one split would do or for a prefill's rows."""
    from jetserve.ops.linear import kernels as module

    assert module.batched_splits(256, 8960) == 4  # the 2B's down
    assert module.batched_splits(128, 3072) == 2  # the 2B's o_proj
    assert module.batched_splits(256, 1536) == 0  # the attention's o: one split
    assert module.batched_splits(64, 8960) == 0  # few rows: cuBLAS
    assert module.batched_splits(4096, 8960) == 0  # a prefill
    assert module.batched_splits(512, 7 * 1537) == 0  # runs of 1537 would need 7 splits
    assert module.batched_splits(512, 3 * 1600) == 3


@pytest.mark.skipif(not envs.triton_interpret(), reason="the Triton backend runs here in the interpreter")
@pytest.mark.parametrize("flag", ["0", "1"])
def test_dispatch_takes_the_batched_split_past_the_triton_rows(
    kernels, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    """On the Triton backend, rows past the Triton GEMM's with add_norm take `batched_split_linear` (JETSERVE_SPLIT_NORM
    on, the default) with the rule's splits, or cuBLAS then the norm op (off); the pair is the reference's either
    way, for the plain, SwiGLU and gated-norm producers."""
    monkeypatch.setenv("JETSERVE_SPLIT_NORM", flag)
    monkeypatch.setattr(kernels, "BATCHED_MIN_ROWS", 16)  # small shapes still split
    monkeypatch.setattr(kernels, "BATCHED_MIN_CHUNK", 16)
    calls = []
    real = kernels.batched_split_linear
    monkeypatch.setattr(kernels, "batched_split_linear", lambda *a: calls.append(a[-1]) or real(*a))
    num_rows, n, k = NARROW_MAX_ROWS + 4, 16, 64  # past every Triton row count of a narrow weight
    x = randn(num_rows, k, dtype=torch.float32, seed=60)
    weight = randn(n, k, dtype=torch.float32, seed=61, scale=k**-0.5)
    add = add_norm_args(num_rows, n, torch.float32, seed=62)
    gate_up = randn(num_rows, 2 * k, dtype=torch.float32, seed=63)
    o, gate = randn(num_rows, k, dtype=torch.float32, seed=64), randn(num_rows, k, dtype=torch.float32, seed=65)
    head_w = randn(16, dtype=torch.float32, seed=66)
    backend.set_backend("triton")
    try:
        assert_pair(dispatched_linear(x, weight, add_norm=add), ref.linear(x, weight, add_norm=add))
        assert_pair(dispatched_swiglu_linear(gate_up, weight, add_norm=add),
                    ref.swiglu_linear(gate_up, weight, add_norm=add))  # fmt: skip
        assert_pair(dispatched_gated_norm_linear(o, gate, head_w, 1e-5, weight, add_norm=add),
                    ref.gated_norm_linear(o, gate, head_w, 1e-5, weight, add_norm=add))  # fmt: skip
        dispatched_linear(x, weight)  # no norm after it: cuBLAS alone
    finally:
        backend.set_backend(None)
    assert calls == ([] if flag == "0" else [kernels.batched_splits(num_rows, k)] * 3)
    assert flag == "0" or calls[0] > 1


@pytest.mark.skipif(not envs.triton_interpret(), reason="the Triton backend runs here in the interpreter")
@pytest.mark.parametrize("k", [64, 2048])
def test_narrow_rows_past_gemv_take_the_norm_in_the_split_sum(kernels, monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    """A narrow weight from GEMV_MAX_ROWS + 1 to NARROW_MAX_ROWS rows takes the plain Triton GEMM; where its tiling
    splits K (K = 2048 here) the add-norm goes into the launch (its sum normalises: no norm op), otherwise the norm
    op runs after it; the pair is the reference's either way (NaN-poisoned outputs and partials)."""
    import jetserve.ops.linear as public

    num_rows, n = GEMV_MAX_ROWS + 4, 16
    handed, norms = [], []
    real_linear, real_norm = kernels.linear, public.rms_norm
    monkeypatch.setattr(kernels, "linear", lambda *a, add_norm=None, **kw: handed.append(add_norm is not None)
                        or real_linear(*a, add_norm=add_norm, **kw))  # fmt: skip
    monkeypatch.setattr(public, "rms_norm", lambda *a, **kw: norms.append(1) or real_norm(*a, **kw))
    x = randn(num_rows, k, dtype=torch.float32, seed=70)
    weight = randn(n, k, dtype=torch.float32, seed=71, scale=k**-0.5)
    add = add_norm_args(num_rows, n, torch.float32, seed=72)
    splits = kernels.choose_tiling(num_rows, n, k, kernels.sm_count(x.device)).num_splits
    assert (splits > 1) == (k == 2048)
    backend.set_backend("triton")
    try:
        assert_pair(dispatched_linear(x, weight, add_norm=add), ref.linear(x, weight, add_norm=add))
    finally:
        backend.set_backend(None)
    assert handed == [splits > 1] and norms == ([] if splits > 1 else [1])


@pytest.mark.parametrize(("name", "read"), [("JETSERVE_SPLIT_NORM", envs.split_norm),
                                            ("JETSERVE_NARROW_GEMM", envs.narrow_gemm)])  # fmt: skip
def test_linear_flags_on_by_default(monkeypatch: pytest.MonkeyPatch, name: str, read) -> None:
    """JETSERVE_SPLIT_NORM and JETSERVE_NARROW_GEMM: on by default, 0 off, anything else refused."""
    monkeypatch.delenv(name, raising=False)
    assert read()
    monkeypatch.setenv(name, "0")
    assert not read()
    monkeypatch.setenv(name, "no")
    with pytest.raises(ValueError, match=name):
        read()
