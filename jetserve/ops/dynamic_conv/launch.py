"""Launch helpers for the dynamic_conv Triton kernels: JIT chosen at launch time, and tile sizes per device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton


class LazyKernel:
    """A Triton kernel JIT-wrapped on first launch, separately for compiled and interpreted runs.

    `triton.jit` picks the interpreter from TRITON_INTERPRET when it decorates, so decorating at import would fix the
    choice for the whole process; wrapping at launch lets tests turn the interpreter on after jetserve was imported.
    The kernel body must not call other `@triton.jit` functions for the same reason.
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.variants: dict[bool, object] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable:
        interpret = bool(triton.knobs.runtime.interpret)
        if interpret not in self.variants:
            self.variants[interpret] = triton.jit(self.fn)
        return self.variants[interpret][grid]


@dataclass(frozen=True)
class Tiles:
    block_tokens: int  # BT: token rows per program (tl.dot M, so >= 16)
    block_channels: int  # BD: output channels per program
    block_g: int  # BG: kernel-generator width per tl.dot step (>= 16)
    num_warps: int = 4


def tiles_for(x: torch.Tensor, num_rows: int) -> Tiles:
    """Tile sizes for `num_rows` token rows on x's device; small in the interpreter so tests cross tile edges."""
    if not x.is_cuda:
        return Tiles(block_tokens=16, block_channels=16, block_g=16, num_warps=1)
    block_tokens = 16 if num_rows <= 16 else 32 if num_rows <= 64 else 64
    return Tiles(block_tokens=block_tokens, block_channels=64, block_g=64, num_warps=4)


def dot_precision(x: torch.Tensor) -> str:
    """`ieee` for fp32 inputs (TF32 would lose the fp32 contract); 16-bit inputs ignore it."""
    return "ieee" if x.dtype == torch.float32 else "tf32"
