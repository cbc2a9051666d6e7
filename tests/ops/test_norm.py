"""Norm ops: the references against direct formulas (float64, one token or one head at a time)."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops.norm import reference as ref


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale + 0.1).to(dtype)


def direct_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DESIGN.md §1 in float64, one token at a time: weight * x / sqrt(mean(x²) + eps)."""
    rows = [weight.double() * row.double() / torch.sqrt((row.double() ** 2).mean() + eps) for row in x]
    return torch.stack(rows)


@pytest.mark.parametrize("shape", [(1, 7), (5, 96), (13, 1536)])
def test_rms_norm_matches_direct_formula_fp32(shape: tuple[int, int]) -> None:
    x = randn(*shape, seed=1, scale=3.0)
    weight = randn(shape[1], seed=2)
    y = ref.rms_norm(x, weight, 1e-6)
    assert y.dtype == torch.float32 and y.shape == x.shape
    torch.testing.assert_close(y.double(), direct_rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_rounds_once_in_low_precision(dtype: torch.dtype) -> None:
    x = randn(9, 200, dtype=dtype, seed=3, scale=2.0)
    weight = randn(200, dtype=dtype, seed=4)
    y = ref.rms_norm(x, weight, 1e-6)
    assert y.dtype == dtype
    expected = direct_rms_norm(x, weight, 1e-6)
    # The weight is applied in fp32 before the single cast back: within half an ulp of the exact value
    # (plus fp32 noise), i.e. equal to the rounded float64 result in nearly every element.
    assert (y == expected.to(dtype)).float().mean() > 0.99
    torch.testing.assert_close(y.double(), expected, rtol=torch.finfo(dtype).eps, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual(dtype: torch.dtype) -> None:
    x = randn(11, 130, dtype=dtype, seed=5)
    residual = randn(11, 130, dtype=dtype, seed=6, scale=4.0)
    weight = randn(130, dtype=dtype, seed=7)
    y, h = ref.rms_norm(x, weight, 1e-5, residual=residual)
    assert h.dtype == dtype and torch.equal(h, x + residual)
    assert torch.equal(y, ref.rms_norm(x + residual, weight, 1e-5))
    torch.testing.assert_close(y.double(), direct_rms_norm(h, weight, 1e-5), rtol=2**-7, atol=1e-2)


def test_rms_norm_rejects_bad_shapes() -> None:
    x = randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        ref.rms_norm(x, randn(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ref.rms_norm(x, randn(8), 1e-6, residual=randn(3, 8, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_per_head_loop(dtype: torch.dtype) -> None:
    num_tokens, num_heads, head_dim, eps = 7, 3, 20, 1e-5
    o = randn(num_tokens, num_heads, head_dim, dtype=dtype, seed=8, scale=2.0)
    gate = randn(num_tokens, num_heads, head_dim, dtype=dtype, seed=9, scale=2.0)
    weight = randn(head_dim, dtype=dtype, seed=10)
    y = ref.gated_rms_norm(o, weight, gate, eps)
    assert y.dtype == dtype and y.shape == o.shape
    expected = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float64)
    for t in range(num_tokens):
        for h in range(num_heads):
            v = o[t, h].double()
            g = gate[t, h].double()
            expected[t, h] = v / torch.sqrt((v**2).mean() + eps) * weight.double() * g * torch.sigmoid(g)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)


def test_gated_rms_norm_rejects_bad_shapes() -> None:
    o = randn(2, 3, 4)
    with pytest.raises(ValueError, match="gate"):
        ref.gated_rms_norm(o, randn(4), randn(2, 3, 5), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        ref.gated_rms_norm(o, randn(3), randn(2, 3, 4), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = randn(6, 2 * 37, dtype=dtype, seed=11, scale=3.0)
    y = ref.silu_and_mul(x)
    assert y.shape == (6, 37) and y.dtype == dtype
    gate, up = x[:, :37].double(), x[:, 37:].double()
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(y.double(), gate * torch.sigmoid(gate) * up, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="even"):
        ref.silu_and_mul(randn(2, 5))


def test_embed_norm_pair_is_both_norms_side_by_side() -> None:
    """The draft-layer input: row t is [norm(table[ids[t]]); norm(hidden[t])], each the direct formula."""
    table, hidden = randn(11, 24, seed=40, scale=2.0), randn(4, 24, seed=41, scale=3.0)
    ids = torch.tensor([3, 0, 10, 3])
    w_e, w_h = randn(24, seed=42), randn(24, seed=43)
    y = ref.embed_norm_pair(ids, table, hidden, (w_e, w_h), 1e-6)
    assert y.shape == (4, 48) and y.dtype == torch.float32
    torch.testing.assert_close(y[:, :24].double(), direct_rms_norm(table[ids], w_e, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y[:, 24:].double(), direct_rms_norm(hidden, w_h, 1e-6), rtol=1e-6, atol=1e-6)


def test_embed_norm_pair_rejects_bad_arguments() -> None:
    table, hidden, w = randn(11, 8), randn(3, 8), randn(8)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="ids must be"):
        ref.embed_norm_pair(ids.float(), table, hidden, (w, w), 1e-6)
    with pytest.raises(ValueError, match="hidden must be"):
        ref.embed_norm_pair(ids[:2], table, hidden, (w, w), 1e-6)
    with pytest.raises(ValueError, match="hidden must be"):
        ref.embed_norm_pair(ids, table, hidden.double(), (w, w), 1e-6)
    with pytest.raises(ValueError, match="the hidden norm's must be"):
        ref.embed_norm_pair(ids, table, hidden, (w, w[:7]), 1e-6)
    with pytest.raises(ValueError, match="a pair"):
        ref.embed_norm_pair(ids, table, hidden, (w,), 1e-6)


# --- Triton kernels against the reference (the interpreter on the CPU: fp32/fp16 only, tiny grids) ---

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETER_DTYPES = [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def kernels(poisoned_empty):
    """The Triton module, with every new floating-point tensor NaN-filled while a test runs."""
    if DEVICE == "cpu" and not envs.triton_interpret():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from jetserve.ops.norm import kernels as module

    return module


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all()
    tol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", [(1, 1), (3, 7), (17, 100), (5, 1000)])
@pytest.mark.parametrize("has_residual", [False, True])
def test_rms_norm_kernel(kernels, dtype: torch.dtype, num_tokens: int, hidden: int, has_residual: bool) -> None:
    x = randn(num_tokens, hidden + 3, dtype=dtype, seed=20, scale=2.0).to(DEVICE)[:, 2:-1]  # strided rows
    weight = randn(hidden, dtype=dtype, seed=21).to(DEVICE)
    residual = randn(num_tokens, hidden, dtype=dtype, seed=22, scale=3.0).to(DEVICE) if has_residual else None
    actual = kernels.rms_norm(x, weight, 1e-6, residual)
    expected = ref.rms_norm(x, weight, 1e-6, residual)
    if has_residual:
        assert torch.equal(actual[1], expected[1])  # the residual stream is bit-exact
        actual, expected = actual[0], expected[0]
    assert_matches(actual, expected)


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(1, 1, 3), (5, 3, 20), (9, 4, 100), (2, 3, 256)])
def test_gated_rms_norm_kernel(kernels, dtype: torch.dtype, num_tokens: int, num_heads: int, head_dim: int) -> None:
    o = randn(num_tokens, num_heads, head_dim, dtype=dtype, seed=23, scale=2.0).to(DEVICE)
    fused = randn(num_tokens, 2 * num_heads * head_dim + 5, dtype=dtype, seed=24, scale=2.0).to(DEVICE)
    gate = fused[:, 5 : 5 + num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # a view of a fused output
    weight = randn(head_dim, dtype=dtype, seed=25).to(DEVICE)
    assert_matches(kernels.gated_rms_norm(o, weight, gate, 1e-5), ref.gated_rms_norm(o, weight, gate, 1e-5))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("num_tokens, inner", [(1, 1), (4, 37), (3, 1500)])
def test_silu_and_mul_kernel(kernels, dtype: torch.dtype, num_tokens: int, inner: int) -> None:
    x = randn(num_tokens, 2 * inner + 4, dtype=dtype, seed=26, scale=3.0).to(DEVICE)[:, 4:]  # strided rows
    assert_matches(kernels.silu_and_mul(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("dtype", INTERPRETER_DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", [(1, 1), (3, 7), (6, 100), (2, 384)])
def test_embed_norm_pair_kernel(kernels, dtype: torch.dtype, num_tokens: int, hidden: int) -> None:
    """Widths that leave the block's tail masked, a strided hidden (a view of a wider tensor) and repeated ids, given
    contiguous and as a strided column (a chain's tokens at one level)."""
    table = randn(13, hidden, dtype=dtype, seed=44, scale=2.0).to(DEVICE)
    hidden_rows = randn(num_tokens, hidden + 5, dtype=dtype, seed=45, scale=3.0).to(DEVICE)[:, 5:]
    ids = torch.tensor([12, 0, 5, 5, 7, 1][:num_tokens], device=DEVICE)
    w_e, w_h = randn(hidden, dtype=dtype, seed=46).to(DEVICE), randn(hidden, dtype=dtype, seed=47).to(DEVICE)
    expected = ref.embed_norm_pair(ids, table, hidden_rows, (w_e, w_h), 1e-6)
    assert_matches(kernels.embed_norm_pair(ids, table, hidden_rows, (w_e, w_h), 1e-6), expected)
    column = torch.stack([ids.flip(0), ids, ids + 1], dim=1)[:, 1]  # [T] of stride 3
    assert_matches(kernels.embed_norm_pair(column, table, hidden_rows, (w_e, w_h), 1e-6), expected)


def test_kernels_accept_zero_tokens(kernels) -> None:
    weight = randn(8).to(DEVICE)
    empty = torch.zeros(0, 8, device=DEVICE)
    assert kernels.rms_norm(empty, weight, 1e-6).shape == (0, 8)
    y, h = kernels.rms_norm(empty, weight, 1e-6, empty)
    assert y.shape == h.shape == (0, 8)
    assert kernels.gated_rms_norm(empty.view(0, 1, 8), weight, empty.view(0, 1, 8), 1e-6).shape == (0, 1, 8)
    assert kernels.silu_and_mul(empty).shape == (0, 4)
    no_ids = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert kernels.embed_norm_pair(no_ids, randn(3, 8).to(DEVICE), empty, (weight, weight), 1e-6).shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 7, 300, 4099])
@pytest.mark.parametrize(
    "hidden, num_heads, head_v_dim, intermediate",
    [(1536, 12, 256, 8960), (2048, 16, 256, 11008)],  # 2B, 4B
)
def test_kernels_at_real_shapes_bf16(
    kernels, num_tokens: int, hidden: int, num_heads: int, head_v_dim: int, intermediate: int
) -> None:
    dtype = torch.bfloat16
    x = randn(num_tokens, hidden, dtype=dtype, seed=30).cuda()
    residual = randn(num_tokens, hidden, dtype=dtype, seed=31, scale=8.0).cuda()
    weight = randn(hidden, dtype=dtype, seed=32).cuda()
    assert_matches(kernels.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    (y, h), (y_ref, h_ref) = kernels.rms_norm(x, weight, 1e-6, residual), ref.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(h, h_ref)
    assert_matches(y, y_ref)

    o = randn(num_tokens, num_heads, head_v_dim, dtype=dtype, seed=33).cuda()
    gate = randn(num_tokens, num_heads, head_v_dim, dtype=dtype, seed=34, scale=2.0).cuda()
    o_weight = randn(head_v_dim, dtype=dtype, seed=35).cuda()
    assert_matches(kernels.gated_rms_norm(o, o_weight, gate, 1e-5), ref.gated_rms_norm(o, o_weight, gate, 1e-5))

    gate_up = randn(num_tokens, 2 * intermediate, dtype=dtype, seed=36, scale=2.0).cuda()
    assert_matches(kernels.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("vocab, hidden", [(8192, 384), (151936, 1536), (151936, 2048)])  # default, 2B, 4B drafts
def test_embed_norm_pair_at_real_shapes_bf16(kernels, num_tokens: int, vocab: int, hidden: int) -> None:
    dtype = torch.bfloat16
    table = randn(vocab, hidden, dtype=dtype, seed=50).cuda()
    hidden_rows = randn(num_tokens, hidden, dtype=dtype, seed=51, scale=4.0).cuda()
    ids = torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(52)).cuda()
    w_e, w_h = randn(hidden, dtype=dtype, seed=53).cuda(), randn(hidden, dtype=dtype, seed=54).cuda()
    actual = kernels.embed_norm_pair(ids, table, hidden_rows, (w_e, w_h), 1e-6)
    assert_matches(actual, ref.embed_norm_pair(ids, table, hidden_rows, (w_e, w_h), 1e-6))
