"""The fused kernel-generator tile κ = h @ w2ᵀ + bias shared by the dynamic_conv Triton kernels; their tile sizes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def kernel_tile(
    h,  # [T, G]
    w2_weight,  # [D*W, G]
    w2_bias,  # [D*W]
    rows,  # [BT] int64: token rows of h
    m_rows,  # [BT] bool
    c0,  # first channel of the tile
    num_channels,
    num_g,
    g_end,  # num_g, or 0 to skip the GEMM for a tile without tokens
    stride_h,
    W: tl.constexpr,
    WP: tl.constexpr,  # next power of two >= W
    BT: tl.constexpr,
    BD: tl.constexpr,
    BG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """κ for BT tokens × BD channels × all taps as one GEMM tile [BT, BD*WP] (w2 rows c*W + j are contiguous for a
    channel block when W = WP), returned in fp32 as [BT, BD, WP]; padded taps j >= W are 0."""
    o_n = tl.arange(0, BD * WP)
    o_c = c0 + o_n // WP
    o_j = o_n % WP
    m_n = (o_c < num_channels) & (o_j < W)
    w_rows = (o_c * W + o_j).to(tl.int64)
    acc = tl.zeros((BT, BD * WP), dtype=tl.float32)
    for g0 in range(0, g_end, BG):
        o_g = g0 + tl.arange(0, BG)
        m_g = o_g < num_g
        b_h = tl.load(h + rows[:, None] * stride_h + o_g[None, :], mask=m_rows[:, None] & m_g[None, :], other=0.0)
        b_w = tl.load(w2_weight + w_rows[None, :] * num_g + o_g[:, None], mask=m_g[:, None] & m_n[None, :], other=0.0)
        acc += tl.dot(b_h, b_w, input_precision=DOT_PRECISION)
    acc += tl.load(w2_bias + w_rows, mask=m_n, other=0.0).to(tl.float32)[None, :]
    return tl.reshape(acc, (BT, BD, WP))


@dataclass(frozen=True)
class Tiles:
    block_tokens: int  # BT: token rows per program (tl.dot M, so >= 16)
    block_channels: int  # BD: output channels per program; the GEMM tile is BD*WP wide
    block_g: int  # BG: kernel-generator width per tl.dot step (>= 16)
    num_warps: int = 4
    num_stages: int = 3


def tiles_for(x: torch.Tensor, num_rows: int) -> Tiles:
    """Tile sizes for `num_rows` token rows on x's device; small in the interpreter so tests cross tile edges."""
    if not x.is_cuda:
        return Tiles(block_tokens=16, block_channels=16, block_g=16, num_warps=1)
    block_tokens = 16 if num_rows <= 16 else 32 if num_rows <= 64 else 64
    return Tiles(block_tokens=block_tokens, block_channels=32, block_g=64, num_warps=4)


def decode_tiles_for(x: torch.Tensor, num_rows: int) -> Tiles:
    """The decode kernel's tiles: up to 16 rows its w2 tile is streamed once per step, so narrower channel blocks (8:
    384 programs at the 2B's 3072 channels instead of 96), longer K steps and 2 warps keep more bytes in flight
    (a sweep on an H200, 2B shape, w2 from HBM: 6.9 → 5.9 µs at N = 1, 7.1 → 6.3 µs at N = 16); past 32 rows,
    64-row token tiles of 16 channels, 64-wide K steps (session 23's sweep of the decode kernel in a CUDA graph
    behind the input projection, 2B: 64 rows 9.66 → 7.63 µs, 256 rows 19.31 → 15.04 µs, with its taps loaded after
    the GEMM); 17-32 rows, `tiles_for`."""
    if x.is_cuda and num_rows > 32:
        return Tiles(block_tokens=64, block_channels=16, block_g=64, num_warps=4, num_stages=3)
    if not x.is_cuda or num_rows > 16:
        return tiles_for(x, num_rows)
    return Tiles(block_tokens=16, block_channels=8, block_g=128, num_warps=2, num_stages=3)


VERIFY_NARROW_MAX_ROWS = 128  # up to this many draft rows the verify kernel takes 16-channel blocks (more programs)


def verify_tiles_for(x: torch.Tensor, num_rows: int) -> Tiles:
    """The tree verify kernel's tiles (session 27's sweep on an H200, 2B shape, w2 from HBM, µs a call against
    `tiles_for`): up to 16 rows, the decode's 16 x 8 tiles with one warp (a chain of 6 at batch 1, 7 rows: 7.21 →
    5.73); up to VERIFY_NARROW_MAX_ROWS, 64-row tiles of 16 channels (16 chains, 112 rows: 8.79 → 7.76); past it
    `tiles_for`'s 64 x 32 (168, 256 and 448 rows: 10.04, 10.02 and 18.22 µs against 12.12, 13.03 and 20.48 with 16
    channels)."""
    if not x.is_cuda:
        return tiles_for(x, num_rows)
    if num_rows <= 16:
        return Tiles(block_tokens=16, block_channels=8, block_g=128, num_warps=1, num_stages=3)
    if num_rows <= VERIFY_NARROW_MAX_ROWS:
        return Tiles(block_tokens=64, block_channels=16, block_g=64, num_warps=4, num_stages=3)
    return tiles_for(x, num_rows)


def dot_precision(x: torch.Tensor) -> str:
    """`ieee` for fp32 inputs (TF32 would lose the fp32 contract); 16-bit inputs ignore it."""
    return "ieee" if x.dtype == torch.float32 else "tf32"
