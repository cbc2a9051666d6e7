"""Linear op: the Triton skinny GEMM against the reference (`F.linear`) and float64, on the CPU interpreter at awkward
sizes and on the GPU at the 2B/4B decode shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jetserve import envs
from jetserve.ops import backend
from jetserve.ops.linear import GEMV_MAX_ROWS, NARROW_MAX_ROWS, logits_linear
from jetserve.ops.linear import linear as dispatched_linear
from jetserve.ops.linear import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER_DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # relative to the output's scale


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weightᵀ + bias in float64."""
    y = x.double() @ weight.double().T
    return y + bias.double() if bias is not None else y


def assert_matches(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Finite, in x.dtype, and within rounding of the float64 product: errors are measured against the output's scale
    (the root-mean-square of the exact result), since single outputs of a random product can be near zero."""
    exact = expected(x, weight, bias)
    assert actual.dtype == x.dtype and actual.shape == exact.shape
    assert torch.isfinite(actual).all()
    scale = max(exact.pow(2).mean().sqrt().item(), 1e-6) if exact.numel() else 1.0
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(actual.double() / scale, exact / scale, rtol=tol, atol=tol)


@pytest.fixture
def kernels(poisoned_empty):
    """The Triton module, with every new floating-point tensor (the output, the split-K partials) NaN-filled."""
    if DEVICE == "cpu" and not envs.triton_interpret():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from jetserve.ops.linear import kernels as module

    return module


def test_reference_is_f_linear() -> None:
    x, weight, bias = randn(3, 17, seed=1), randn(5, 17, seed=2), randn(5, seed=3)
    assert torch.equal(ref.linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    assert ref.linear(x.view(3, 1, 17), weight).shape == (3, 1, 5)
    assert_matches(ref.linear(x, weight, bias), x, weight, bias)


def test_rejects_bad_arguments() -> None:
    x = randn(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        ref.linear(x, randn(4, 7))
    with pytest.raises(ValueError, match="dtype"):
        ref.linear(x, randn(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias"):
        ref.linear(x, randn(4, 8), randn(3))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 16])
@pytest.mark.parametrize("n", [1, 12, 37, 300])
@pytest.mark.parametrize("k", [1, 17, 64, 200])
def test_linear_kernel_awkward_sizes(kernels, dtype: torch.dtype, num_rows: int, n: int, k: int) -> None:
    x = randn(num_rows, k, dtype=dtype, seed=10)
    weight = randn(n, k, dtype=dtype, seed=11, scale=k**-0.5)
    bias = randn(n, dtype=dtype, seed=12) if (n + k) % 2 else None  # half the cases with a bias
    x, weight = x.to(DEVICE), weight.to(DEVICE)
    bias = bias.to(DEVICE) if bias is not None else None
    assert_matches(kernels.linear(x, weight, bias), x, weight, bias)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize(
    "num_rows, n, k, block_m, block_n, block_k, num_splits, use_dot",
    [
        (1, 37, 200, 1, 16, 32, 3, False),  # FMA, split K with a ragged last split and a ragged last tile
        (3, 300, 64, 4, 8, 16, 4, False),  # FMA, split K, K a multiple of the tile
        (5, 37, 200, 16, 16, 32, 1, True),  # tensor-core tile (rows padded to 16), one split
        (16, 300, 200, 16, 32, 16, 5, True),  # tensor-core tile, split K
    ],
)
def test_linear_kernel_every_path(
    kernels,
    dtype: torch.dtype,
    has_bias: bool,
    num_rows: int,
    n: int,
    k: int,
    block_m: int,
    block_n: int,
    block_k: int,
    num_splits: int,
    use_dot: bool,
) -> None:
    """The tiling heuristic picks a path from the shape; force each one (FMA / tl.dot, with and without split K)."""
    tiling = kernels.GemvTiling(block_m, block_n, block_k, num_splits, use_dot)
    x = randn(num_rows, k, dtype=dtype, seed=20).to(DEVICE)
    weight = randn(n, k, dtype=dtype, seed=21, scale=k**-0.5).to(DEVICE)
    bias = randn(n, dtype=dtype, seed=22).to(DEVICE) if has_bias else None
    assert_matches(kernels.linear(x, weight, bias, tiling=tiling), x, weight, bias)


def with_silu(y: torch.Tensor, silu_cols: int) -> torch.Tensor:
    """y [M, N] (float64) with SiLU on columns [0, silu_cols)."""
    y = y.clone()
    y[:, :silu_cols] = torch.nn.functional.silu(y[:, :silu_cols])
    return y


def test_reference_silu_cols() -> None:
    x, weight, bias = randn(3, 17, seed=1), randn(5, 17, seed=2), randn(5, seed=3)
    y = ref.linear(x, weight, bias, silu_cols=2)
    plain = ref.linear(x, weight, bias)
    torch.testing.assert_close(y[:, :2], torch.nn.functional.silu(plain[:, :2]))
    assert torch.equal(y[:, 2:], plain[:, 2:])
    with pytest.raises(ValueError, match="silu_cols"):
        ref.linear(x, weight, silu_cols=6)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize(
    "num_rows, n, k, silu_cols, tiling",
    [
        (1, 37, 200, 20, None),
        (3, 300, 64, 300, None),  # every column
        (1, 37, 200, 5, (1, 16, 32, 3, False)),  # FMA, split K: the SiLU runs in the split sum
        (16, 300, 200, 129, (16, 32, 16, 5, True)),  # tensor cores, split K
        (5, 37, 200, 17, (16, 16, 32, 1, True)),  # tensor cores, one split: the SiLU in the GEMM's epilogue
    ],
)
def test_linear_kernel_silu_cols(kernels, dtype, num_rows, n, k, silu_cols, tiling) -> None:
    """SiLU on the first `silu_cols` output columns (after the bias), the rest untouched."""
    x = randn(num_rows, k, dtype=dtype, seed=60).to(DEVICE)
    weight = randn(n, k, dtype=dtype, seed=61, scale=k**-0.5).to(DEVICE)
    bias = randn(n, dtype=dtype, seed=62).to(DEVICE)
    t = kernels.GemvTiling(*tiling) if tiling else None
    actual = kernels.linear(x, weight, bias, silu_cols=silu_cols, tiling=t)
    exact = with_silu(expected(x, weight, bias), silu_cols)
    assert actual.dtype == dtype and torch.isfinite(actual).all()
    scale = exact.pow(2).mean().sqrt().item()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double() / scale, exact / scale, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("num_rows, n, cols", [(1, 5, 3), (3, 1500, 1100), (70, 40, 40), (2, 2100, 2049)])
def test_silu_columns_matches_torch_silu_in_place(kernels, dtype, num_rows, n, cols) -> None:
    """The in-place SiLU of the leading columns (rows strided: a column slice of a wider output), against torch's
    in-place SiLU; the other columns and the rows' padding untouched."""
    wide = randn(num_rows, n + 7, dtype=dtype, seed=n, scale=4.0).to(DEVICE)  # [M, N + 7]: the row stride
    y = wide[:, :n]
    want = wide.clone()
    torch.nn.functional.silu(want[:, :cols], inplace=True)
    assert kernels.silu_columns_(y, cols) is y
    tol = {torch.float32: 1e-6, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(wide, want, rtol=tol, atol=tol)
    assert torch.equal(wide[:, cols:], want[:, cols:])
    y3 = randn(2, 3, n, dtype=dtype, seed=1).to(DEVICE)  # leading dims
    want3 = y3.clone()
    torch.nn.functional.silu(want3[..., :cols], inplace=True)
    torch.testing.assert_close(kernels.silu_columns_(y3, cols), want3, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="silu_columns_"):
        kernels.silu_columns_(y, n + 1)


def test_dispatched_silu_cols_past_the_triton_rows(kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the Triton GEMM's rows the public op runs the reference GEMM, then the SiLU launch: the reference's
    result, with the launch taken on the Triton backend and not on the reference backend."""
    num_rows = NARROW_MAX_ROWS + 3
    x = randn(num_rows, 40, seed=70).to(DEVICE)
    weight = randn(300, 40, seed=71, scale=40**-0.5).to(DEVICE)
    want = ref.linear(x, weight, silu_cols=130)
    calls = []
    original = kernels.silu_columns_

    def counted(y, cols):
        calls.append(cols)
        return original(y, cols)

    monkeypatch.setattr(kernels, "silu_columns_", counted)
    try:
        backend.set_backend("triton")
        torch.testing.assert_close(dispatched_linear(x, weight, silu_cols=130), want, rtol=1e-6, atol=1e-6)
        assert calls == [130]
        backend.set_backend("reference")
        assert torch.equal(dispatched_linear(x, weight, silu_cols=130), want)
        assert calls == [130]
    finally:
        backend.set_backend(None)


def gated_norm_input(o: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What the gated-norm mode multiplies: `gated_rms_norm` over heads of norm_weight's size, in o.dtype."""
    from jetserve.ops.norm.reference import gated_rms_norm

    m, width = o.shape
    shape = (m, width // norm_weight.shape[0], norm_weight.shape[0])
    return gated_rms_norm(o.reshape(shape), norm_weight, gate.reshape(shape), eps).reshape(m, width)


def test_gated_norm_reference_and_checks() -> None:
    o, gate, norm_weight, weight = randn(3, 64, seed=70), randn(3, 64, seed=71), randn(16, seed=72), randn(5, 64)
    want = ref.linear(gated_norm_input(o, gate, norm_weight, 1e-5), weight)
    assert torch.equal(ref.gated_norm_linear(o, gate, norm_weight, 1e-5, weight), want)
    with pytest.raises(ValueError, match="power of two"):
        ref.gated_norm_linear(o, gate, randn(24), 1e-5, weight)
    with pytest.raises(ValueError, match="alike"):
        ref.gated_norm_linear(o, gate[:, :32], norm_weight, 1e-5, weight)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize(
    "num_rows, n, heads, head, tiling",
    [
        (1, 37, 3, 32, None),  # the heuristic's pick; K = 96 is not a power of two (a tile past K is masked)
        (3, 12, 4, 16, None),
        (1, 37, 6, 32, (1, 16, 32, 3, False)),  # FMA, split K: each split normalises its own heads
        (5, 300, 2, 64, (16, 32, 16, 1, True)),  # tensor cores with a tile narrower than a head: widened to one head
        (16, 40, 4, 32, (16, 16, 64, 2, True)),  # tensor cores, split K, two heads per tile
    ],
)
def test_gated_norm_kernel_matches_reference(kernels, dtype, num_rows, n, heads, head, tiling) -> None:
    """The o_proj prologue: per-head RMSNorm of o, times the norm weight and silu(gate) (gate a strided view),
    rounded to o's dtype as gated_rms_norm rounds it, times the weight."""
    k = heads * head
    o = randn(num_rows, k, dtype=dtype, seed=73, scale=3.0).to(DEVICE)
    wide = randn(num_rows, k + 5, dtype=dtype, seed=74).to(DEVICE)
    gate = wide[:, 2 : 2 + k]  # row stride k + 5
    norm_weight = randn(head, dtype=dtype, seed=75).to(DEVICE)
    weight = randn(n, k, dtype=dtype, seed=76, scale=k**-0.5).to(DEVICE)
    t = kernels.GemvTiling(*tiling) if tiling else None
    actual = kernels.gated_norm_linear(o, gate, norm_weight, 1e-5, weight, tiling=t)
    assert_matches(actual, gated_norm_input(o, gate, norm_weight, 1e-5), weight, None)


def swiglu_input(gate_up: torch.Tensor) -> torch.Tensor:
    """The GEMM input the SwiGLU mode forms: silu(gate) * up in fp32, rounded to gate_up's dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def test_swiglu_reference_is_silu_and_mul_then_linear() -> None:
    from jetserve.ops.norm.reference import silu_and_mul

    gate_up, weight = randn(3, 2 * 17, seed=50), randn(5, 17, seed=51)
    assert torch.equal(ref.swiglu_linear(gate_up, weight), ref.linear(silu_and_mul(gate_up), weight))
    with pytest.raises(ValueError, match="weight must be"):
        ref.swiglu_linear(gate_up, randn(5, 16))
    with pytest.raises(ValueError, match="even"):
        ref.swiglu_linear(randn(3, 33), randn(5, 16))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize(
    "num_rows, n, k, tiling",
    [
        (1, 37, 200, None),  # the heuristic's pick
        (3, 12, 17, None),
        (1, 37, 200, (1, 16, 32, 3, False)),  # FMA, split K, ragged K
        (5, 37, 200, (16, 16, 32, 1, True)),  # tensor-core tile, one split, ragged K
        (16, 300, 64, (16, 32, 16, 2, True)),  # tensor-core tile, split K, K a multiple of the tile
        (7, 150, 2100, None),  # the heuristic's SwiGLU tiles (`swiglu_tiling`): 128 wide, split K, ragged N and K
    ],
)
def test_swiglu_kernel_matches_silu_and_mul_then_linear(kernels, dtype, num_rows, n, k, tiling) -> None:
    """The SwiGLU mode reads [gate | up] (here a column slice of a wider tensor) and multiplies silu(gate) * up,
    rounded as silu_and_mul rounds it, by the weight."""
    wide = randn(num_rows, 2 * k + 3, dtype=dtype, seed=52).to(DEVICE)
    gate_up = wide[:, 1 : 2 * k + 1]  # [M, 2K], row stride 2K + 3
    weight = randn(n, k, dtype=dtype, seed=53, scale=k**-0.5).to(DEVICE)
    t = kernels.GemvTiling(*tiling) if tiling else None
    assert_matches(kernels.swiglu_linear(gate_up, weight, tiling=t), swiglu_input(gate_up), weight, None)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
def test_linear_kernel_strided_rows(kernels, dtype: torch.dtype) -> None:
    """x a column slice of a wider tensor (row stride > K, unit stride along K), e.g. one part of a fused output."""
    wide = randn(4, 3 + 70 + 5, dtype=dtype, seed=30).to(DEVICE)
    x = wide[:, 3:73]  # [4, 70], stride (78, 1)
    assert x.stride() == (78, 1)
    weight = randn(45, 70, dtype=dtype, seed=31, scale=70**-0.5).to(DEVICE)
    bias = randn(45, dtype=dtype, seed=32).to(DEVICE)
    assert_matches(kernels.linear(x, weight, bias), x, weight, bias)
    xt = randn(70, 4, dtype=dtype, seed=33).to(DEVICE).T  # unit stride along M: copied
    assert_matches(kernels.linear(xt, weight), xt, weight, None)


def test_linear_kernel_leading_dims_and_empty(kernels) -> None:
    x = randn(2, 3, 24, seed=40).to(DEVICE)
    weight = randn(10, 24, seed=41).to(DEVICE)
    y = kernels.linear(x, weight)
    assert y.shape == (2, 3, 10)
    assert_matches(y.view(6, 10), x.view(6, 24), weight, None)
    assert kernels.linear(x[:0], weight).shape == (0, 3, 10)
    bias = randn(10, seed=42).to(DEVICE)
    assert torch.equal(kernels.linear(x[..., :0], weight[:, :0], bias), bias.expand(2, 3, 10))


def test_linear_kernel_more_rows_than_one_launch(kernels) -> None:
    """Rows past MAX_BLOCK_M run as further launches over row blocks."""
    num_rows = kernels.MAX_BLOCK_M + 3
    x = randn(num_rows, 20, seed=50).to(DEVICE)
    weight = randn(7, 20, seed=51).to(DEVICE)
    assert_matches(kernels.linear(x, weight), x, weight, None)


def test_widened_tiling_splits_head_wide_tiles() -> None:
    """The gated-norm mode's tiles hold whole heads; the K split is chosen again for them (session 28's sweep): the 2B
    o_proj (1536 x 3072, heads of 256) at 2-16 rows on 132 SMs runs 4 splits of 3 tiles, never more programs than
    SMs; one-row FMA tiles (1024 wide) and tilings already holding whole heads are kept."""
    from jetserve.ops.linear.kernels import NORM_MIN_TILES_PER_SPLIT, choose_tiling, widened_tiling

    for num_rows in (2, 7, 16):
        t = widened_tiling(choose_tiling(num_rows, 1536, 3072, num_sms=132), 256, 1536, 3072, num_sms=132)
        assert (t.block_k, t.num_splits) == (256, 4)
    for n, k, head in [(1536, 3072, 256), (2048, 4096, 256), (1536, 512, 256), (300, 96, 32)]:
        for num_rows in (2, 9, 16):
            t = widened_tiling(choose_tiling(num_rows, n, k, num_sms=132), head, n, k, num_sms=132)
            tiles = -(-k // t.block_k)
            assert t.block_k % head == 0 and -(-n // t.block_n) * t.num_splits <= 132
            assert t.num_splits == 1 or tiles // t.num_splits >= NORM_MIN_TILES_PER_SPLIT - 1
            assert -(-tiles // -(-tiles // t.num_splits)) == t.num_splits  # no split without a tile
    fma = choose_tiling(1, 1536, 3072, num_sms=132)
    assert widened_tiling(fma, 256, 1536, 3072, num_sms=132) == fma
    wide = choose_tiling(7, 1536, 3072, num_sms=132)
    assert widened_tiling(wide, 64, 1536, 3072, num_sms=132) == wide


def test_swiglu_tiling_widens_tensor_core_tiles() -> None:
    """The SwiGLU mode's tensor-core tiles are SWIGLU_BLOCK_N wide with SWIGLU_WARPS warps, K split again (session
    35's sweep): the 2B down (1536 x 8960) at 2-16 rows on 132 SMs runs 8 splits of 9 tiles (96 programs), the 4B's
    (2048 x 11008) 8 of 11 (128); never more programs than SMs, no split without a tile; one-row FMA tiles, an N no
    wider than the tile and tiles already that wide are kept."""
    from jetserve.ops.linear.kernels import SWIGLU_BLOCK_N, SWIGLU_WARPS, choose_tiling, swiglu_tiling

    for n, k in [(1536, 8960), (2048, 11008)]:
        for num_rows in (2, 7, 16):
            t = swiglu_tiling(choose_tiling(num_rows, n, k, num_sms=132), n, k, num_sms=132)
            assert (t.block_m, t.block_n, t.block_k, t.num_warps, t.num_splits) == (16, 128, 128, 8, 8)
    for n, k in [(1536, 8960), (300, 2100), (129, 64), (4096, 1536)]:
        for num_rows in (2, 9, 16, 64):
            t = swiglu_tiling(choose_tiling(num_rows, n, k, num_sms=132), n, k, num_sms=132)
            tiles = -(-k // t.block_k)
            assert (t.block_n, t.num_warps) == (SWIGLU_BLOCK_N, SWIGLU_WARPS)
            assert -(-n // t.block_n) * t.num_splits <= max(132, -(-n // t.block_n))
            assert -(-tiles // -(-tiles // t.num_splits)) == t.num_splits  # no split without a tile
    fma = choose_tiling(1, 1536, 8960, num_sms=132)
    assert swiglu_tiling(fma, 1536, 8960, num_sms=132) == fma
    narrow = choose_tiling(7, 48, 8960, num_sms=132)
    assert swiglu_tiling(narrow, 48, 8960, num_sms=132) == narrow


def test_choose_tiling_at_decode_shapes() -> None:
    """At the 2B/4B decode shapes on an H200 (132 SMs): the tile holds every row; more than one row takes tensor-core
    tiles; K is split only into runs of at least MIN_TILES_PER_SPLIT tiles and never past one program per SM."""
    from jetserve.ops.linear.kernels import FMA_PROGRAMS_PER_SM, MIN_TILES_PER_SPLIT, choose_tiling

    for num_rows in (1, 2, 3, 8, 16, 32, 64):
        for n, k in [(1536, 8960), (8960, 1536), (1536, 3072), (8856, 1536), (151936, 1536), (2048, 11008), (12, 1536)]:
            t = choose_tiling(num_rows, n, k, num_sms=132)
            assert t.block_m >= num_rows and (t.use_dot or num_rows == 1)
            if t.num_splits > 1:
                assert -(-k // t.block_k) // t.num_splits >= MIN_TILES_PER_SPLIT - 1, (num_rows, n, k, t)
                programs_per_sm = 1 if t.use_dot else FMA_PROGRAMS_PER_SM
                assert -(-n // t.block_n) * t.num_splits <= programs_per_sm * 132, (num_rows, n, k, t)
    assert choose_tiling(2, 1536, 8960, num_sms=132).num_splits > 1  # the MLP down projection: too few tiles on N
    assert not choose_tiling(1, 1536, 8960, num_sms=132).use_dot  # one row, narrow N: FMA tiles
    assert choose_tiling(1, 8960, 1536, num_sms=132).use_dot  # one row, N fills the SMs with tensor-core tiles
    # One row, FMA tiles (session 17's sweep): the long-K down projection takes 2 rows per program, the o_proj 8 warps
    down, o_proj = choose_tiling(1, 1536, 8960, num_sms=132), choose_tiling(1, 1536, 3072, num_sms=132)
    assert (down.block_n, down.block_k, down.num_warps) == (2, 1024, 4)
    assert (o_proj.block_n, o_proj.block_k, o_proj.num_warps) == (4, 1024, 8)
    # 33-64 rows (wide weights, session 20's sweep): 64-wide K steps at 4 stages
    for n in (8856, 17920):
        t = choose_tiling(64, n, 1536, num_sms=132)
        assert (t.block_m, t.block_n, t.block_k, t.num_stages, t.num_splits) == (64, 64, 64, 4, 1)


def test_fit_pipeline_keeps_the_stages_in_shared_memory() -> None:
    """fp32 tiles of the gated-norm prologue (a head of 256 per K tile) at 3-4 stages needed 307 KB of shared memory
    on an H200 (limit 227 KB, measured): the stages shrink to fit; the bf16 decode tilings keep theirs."""
    from jetserve.ops.linear.kernels import PIPELINE_SMEM_BYTES, choose_tiling, fit_pipeline

    norm = (None, None, 1e-6, 256)
    for num_rows in (1, 2, 16):
        for n, k in [(1536, 3072), (2048, 4096), (8960, 1536), (151936, 1536)]:
            base = choose_tiling(num_rows, n, k, num_sms=132)
            wide = dataclasses.replace(base, block_k=max(base.block_k, 256))
            for size, gated, prologue in [(2, False, None), (2, True, None), (4, False, norm), (4, True, None)]:
                t = fit_pipeline(wide, size, gated, prologue)
                assert t.num_stages >= 1 and (t.block_m, t.block_n, t.block_k) == (wide.block_m, wide.block_n,
                                                                                   wide.block_k)  # fmt: skip
                if t.use_dot:
                    x_tiles = 1 + (gated or prologue is not None)
                    stage = (t.block_n + x_tiles * t.block_m) * t.block_k * size
                    assert t.num_stages * stage <= PIPELINE_SMEM_BYTES or t.num_stages == 1
            if wide.use_dot:  # bf16 with the norm prologue: unchanged (it compiled at 4 stages)
                assert fit_pipeline(wide, 2, False, norm) == wide
                assert fit_pipeline(wide, 4, False, norm).num_stages < wide.num_stages


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton for 1..NARROW_MAX_ROWS rows of a narrow weight in the plain mode when the backend allows it, F.linear
    otherwise."""
    from jetserve.ops.linear import kernels as module

    calls = []
    monkeypatch.setattr(module, "linear", lambda x, w, b=None, **kw: calls.append(x.shape) or ref.linear(x, w, b, **kw))
    monkeypatch.setattr(backend, "_forced", None)
    weight = randn(6, 8, seed=60)
    backend.set_backend("triton")
    try:
        interpreted = envs.triton_interpret()
        dispatched_linear(randn(1, 8), weight)
        dispatched_linear(randn(NARROW_MAX_ROWS, 8), weight)
        dispatched_linear(randn(NARROW_MAX_ROWS + 1, 8), weight)  # too many rows: F.linear
        dispatched_linear(randn(2, 8, dtype=torch.float64), weight.double())  # no Triton variant for float64
        assert calls == ([(1, 8), (NARROW_MAX_ROWS, 8)] if interpreted or DEVICE == "cuda" else [])
        calls.clear()
        trainable = weight.clone().requires_grad_(True)
        dispatched_linear(randn(1, 8), trainable).sum().backward()  # autograd needs the product: F.linear
        assert calls == [] and trainable.grad is not None
        with torch.no_grad():
            dispatched_linear(randn(1, 8), trainable)
        assert calls == ([(1, 8)] if interpreted or DEVICE == "cuda" else [])
        calls.clear()
        backend.set_backend("reference")
        dispatched_linear(randn(1, 8), weight)
        assert calls == []
    finally:
        backend.set_backend(None)


def test_dispatch_of_wide_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights of WIDE_MIN_N rows or more take the Triton kernel up to WIDE_MAX_ROWS rows; narrower ones up to
    NARROW_MAX_ROWS in the plain mode, up to GEMV_MAX_ROWS with JETSERVE_NARROW_GEMM=0."""
    from jetserve.ops import linear as ops_linear
    from jetserve.ops.linear import kernels as module

    calls = []
    monkeypatch.setattr(module, "linear", lambda x, w, b=None, **kw: calls.append(x.shape) or ref.linear(x, w, b, **kw))
    monkeypatch.setattr(backend, "_forced", None)
    wide, narrow = randn(ops_linear.WIDE_MIN_N, 8, seed=61), randn(ops_linear.WIDE_MIN_N - 1, 8, seed=62)
    backend.set_backend("triton")
    try:
        dispatched_linear(randn(ops_linear.WIDE_MAX_ROWS, 8), wide)
        dispatched_linear(randn(ops_linear.WIDE_MAX_ROWS + 1, 8), wide)  # too many rows even for a wide weight
        dispatched_linear(randn(NARROW_MAX_ROWS + 1, 8), narrow)
        dispatched_linear(randn(NARROW_MAX_ROWS, 8), narrow)
        monkeypatch.setenv("JETSERVE_NARROW_GEMM", "0")
        dispatched_linear(randn(GEMV_MAX_ROWS + 1, 8), narrow)  # off: cuBLAS past GEMV_MAX_ROWS
        dispatched_linear(randn(GEMV_MAX_ROWS, 8), narrow)
        triton_runs = envs.triton_interpret() or DEVICE == "cuda"
        want = [(ops_linear.WIDE_MAX_ROWS, 8), (NARROW_MAX_ROWS, 8), (GEMV_MAX_ROWS, 8)]
        assert calls == (want if triton_runs else [])
    finally:
        backend.set_backend(None)


@pytest.mark.skipif(not envs.triton_interpret(), reason="the Triton backend runs here in the interpreter")
def test_fused_modes_past_gemv_rows_run_their_prologue_then_the_plain_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past GEMV_MAX_ROWS a narrow weight's SwiGLU and gated-norm products run their activation / norm op, then the
    plain Triton GEMM (up to NARROW_MAX_ROWS rows), never the fused kernels; the reference's results either way."""
    from jetserve.ops.linear import gated_norm_linear, kernels, swiglu_linear

    plain, fused = [], []
    real = kernels.linear
    monkeypatch.setattr(kernels, "linear", lambda x, w, b=None, **kw: plain.append(x.shape[0]) or real(x, w, b, **kw))
    monkeypatch.setattr(kernels, "swiglu_linear", lambda *a, **kw: fused.append("swiglu"))
    monkeypatch.setattr(kernels, "gated_norm_linear", lambda *a, **kw: fused.append("gated norm"))
    num_rows, n, k = GEMV_MAX_ROWS + 5, 24, 64
    weight = randn(n, k, seed=63, scale=k**-0.5)
    gate_up = randn(num_rows, 2 * k, seed=64)
    o, gate, head_w = randn(num_rows, k, seed=65), randn(num_rows, k, seed=66), randn(16, seed=67)
    backend.set_backend("triton")
    try:
        want_swiglu = ref.swiglu_linear(gate_up, weight)
        want_norm = ref.gated_norm_linear(o, gate, head_w, 1e-5, weight)
        torch.testing.assert_close(swiglu_linear(gate_up, weight), want_swiglu, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gated_norm_linear(o, gate, head_w, 1e-5, weight), want_norm, rtol=1e-5, atol=1e-5)
    finally:
        backend.set_backend(None)
    assert plain == [num_rows, num_rows] and fused == []


def test_model_projections_go_through_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's GEMMs run `ops.linear`: the fused input projections, o_proj (`layers.Linear`), and down_proj
    with the SwiGLU activation fused in."""
    from jetserve.model import fusion, layers

    seen = []
    monkeypatch.setattr(
        layers, "linear", lambda x, w, b=None, **kw: seen.append(("layer", w.shape)) or ref.linear(x, w, b, **kw)
    )
    monkeypatch.setattr(
        layers, "swiglu_linear", lambda x, w, **kw: seen.append(("swiglu", w.shape)) or ref.swiglu_linear(x, w, **kw)
    )
    monkeypatch.setattr(
        fusion, "linear", lambda x, w, b=None, **kw: seen.append(("fused", w.shape)) or ref.linear(x, w, b, **kw)
    )
    mlp = layers.MLP(8, 12)
    fusion.fuse_projections(mlp)
    with torch.no_grad():
        mlp(randn(3, 8))
    assert seen == [("fused", (32, 8)), ("swiglu", (8, 12))]  # gate|up's 24 rows padded to OUTPUT_ROW_ALIGN
    with torch.no_grad():
        layers.Linear(8, 4, bias=True)(randn(2, 8))  # o_proj's class
    assert seen[-1] == ("layer", (4, 8))


# --- GPU: the real decode shapes in bf16 (tests/ops/test_*_gpu.py style) ---

# (N, K) of decode projections, separate and fused. 2B: hidden 1536, MLP 8960, JetBlock D_k 1152, D_v 3072, D_g 384,
# 12 heads. 4B: hidden 2048, MLP 11008, D_k 2048, D_v 4096, D_g 512, 16 heads. Attention: 12/16 heads, 2 KV heads, 128.
GPU_SHAPES = {
    "2b jet q|k|v|a|b|g|w1": (1152 + 1152 + 3072 + 12 + 12 + 3072 + 384, 1536),
    "2b jet a": (12, 1536),
    "2b jet o": (1536, 3072),
    "2b attn q|k|v": (1536 + 256 + 256, 1536),
    "2b mlp gate|up": (2 * 8960, 1536),
    "2b mlp down": (1536, 8960),
    "2b lm_head": (151936, 1536),
    "4b jet q|k|v|a|b|g|w1": (2048 + 2048 + 4096 + 16 + 16 + 4096 + 512, 2048),
    "4b jet o": (2048, 4096),
    "4b mlp gate|up": (2 * 11008, 2048),
    "4b mlp down": (2048, 11008),
    "4b lm_head": (151936, 2048),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(GPU_SHAPES))
@pytest.mark.parametrize("num_rows", [1, 2, 5, 16, 32])
def test_linear_kernel_real_shapes_bf16(kernels, name: str, num_rows: int) -> None:
    n, k = GPU_SHAPES[name]
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(num_rows)
    x = torch.randn(num_rows, k, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype) if "attn" in name else None
    actual = kernels.linear(x, weight, bias)
    assert_matches(actual, x, weight, bias)
    torch.testing.assert_close(actual, ref.linear(x, weight, bias), rtol=1.6e-2, atol=2e-2)  # cuBLAS, to bf16 rounding


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["2b jet q|k|v|a|b|g|w1", "2b jet o", "2b mlp down"])
@pytest.mark.parametrize("num_rows", [1, 7, 64])
def test_linear_kernel_fp32_is_fp32_accurate(kernels, name: str, num_rows: int) -> None:
    """fp32 operands on the tensor-core tiles (`FP32_DOT_PRECISION`): within 1e-6 of the fp64 product, relative to
    the largest output, which plain TF32's 10-bit mantissa would not meet; `ieee` measured 0.8-1.8e-6 where these
    shapes take a dot (session 40). One row of o_proj and down takes the FMA tiles (1e-7)."""
    n, k = GPU_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(num_rows)
    x = torch.randn(num_rows, k, device="cuda", generator=gen)
    weight = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
    exact = x.double() @ weight.double().T
    error = (kernels.linear(x, weight).double() - exact).abs().max() / exact.abs().max()
    assert error < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_linear_kernel_in_cuda_graph(kernels) -> None:
    """The launch captures (no host sync; the split-K partials come from the caching allocator) and replays."""
    n, k = GPU_SHAPES["2b mlp down"]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    expected_y = kernels.linear(x, weight)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernels.linear(x, weight)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernels.linear(x, weight)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(y, expected_y)
    assert torch.equal(y, kernels.linear(x, weight))  # deterministic: split K sums in a fixed order


def test_logits_linear_is_fp32_product() -> None:
    """On the CPU: the product in x.dtype, widened to fp32 (the reference)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 24, generator=gen).to(torch.bfloat16)
    weight = torch.randn(50, 24, generator=gen).to(torch.bfloat16)
    logits = logits_linear(x, weight)
    assert logits.dtype == torch.float32 and logits.shape == (3, 50)
    assert torch.equal(logits, torch.nn.functional.linear(x, weight).float())
    with pytest.raises(ValueError, match="weight must be"):
        logits_linear(x, weight[:, :8])


def test_logits_linear_into_a_buffer() -> None:
    """`out`: the logits land in the given fp32 buffer (a decode graph's static rows), which is returned; a buffer of
    another dtype, shape or layout is refused."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 24, generator=gen).to(torch.bfloat16)
    weight = torch.randn(50, 24, generator=gen).to(torch.bfloat16)
    static = torch.full((4, 50), float("nan"))
    logits = logits_linear(x, weight, static[:3])
    assert logits.data_ptr() == static.data_ptr()
    assert torch.equal(static[:3], logits_linear(x, weight)) and static[3].isnan().all()
    for bad in (torch.empty(3, 50, dtype=torch.bfloat16), torch.empty(3, 49), torch.empty(50, 3).t()):
        with pytest.raises(ValueError, match="out must be"):
            logits_linear(x, weight, bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logits_linear_on_cuda_keeps_the_fp32_accumulator() -> None:
    """bf16 operands at the 2B lm_head shape: the logits equal the fp32 product of the same bf16 values to fp32
    rounding, not to bf16 rounding (which ties many top logits of a flat distribution)."""
    n, k = GPU_SHAPES["2b lm_head"]
    gen = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(5, k, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    logits = logits_linear(x, weight)
    exact = x.double() @ weight.double().T
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), exact, rtol=1e-4, atol=1e-4)
    rounded = torch.nn.functional.linear(x, weight).float()
    assert (logits - exact.float()).abs().max() < (rounded - exact.float()).abs().max() / 4
    static = torch.full((8, n), float("nan"), device="cuda")  # into a buffer: the same GEMM, no copy
    assert logits_linear(x, weight, static[:5]).data_ptr() == static.data_ptr()
    assert torch.equal(static[:5], logits) and static[5:].isnan().all()
    # a torch whose fp32-out GEMM cannot write into a buffer: the same logits, copied in
    import jetserve.ops.linear as linear_ops

    real = linear_ops._has_fp32_out_gemm
    linear_ops._has_fp32_out_gemm = lambda device, into=False: not into and real(device)
    try:
        static.fill_(float("nan"))
        assert logits_linear(x, weight, static[:5]).data_ptr() == static.data_ptr()
        assert torch.equal(static[:5], logits) and static[5:].isnan().all()
    finally:
        linear_ops._has_fp32_out_gemm = real


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["2b mlp down", "4b mlp down"])
@pytest.mark.parametrize("num_rows", [1, 2, 5, 16])
def test_swiglu_kernel_real_shapes_bf16(kernels, name: str, num_rows: int) -> None:
    n, k = GPU_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(num_rows)
    gate_up = torch.randn(num_rows, 2 * k, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    actual = kernels.swiglu_linear(gate_up, weight)
    assert_matches(actual, swiglu_input(gate_up), weight, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["2b jet o", "4b jet o"])
@pytest.mark.parametrize("num_rows", [1, 2, 5, 16])
def test_gated_norm_kernel_real_shapes_bf16(kernels, name: str, num_rows: int) -> None:
    n, k = GPU_SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(num_rows)
    o, gate = (torch.randn(num_rows, k, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    norm_weight = torch.randn(256, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    actual = kernels.gated_norm_linear(o, gate, norm_weight, 1e-5, weight)
    assert_matches(actual, gated_norm_input(o, gate, norm_weight, 1e-5), weight, None)
