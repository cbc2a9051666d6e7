"""Norm ops: the references against direct formulas (float64, one token or one head at a time)."""

from __future__ import annotations

import pytest
import torch

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
