"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running: its programs are
scheduled as soon as every program of the previous kernel has signalled (`gdc_launch_dependents`), and they must wait
(`gdc_wait`, which returns once the previous kernel has finished and its writes are visible) before touching memory
that kernel writes or reads. What runs before the wait may only read memory no kernel of the step writes: the skinny
GEMM prefetches its weight slice into L2 there. Every kernel here signals first and waits before its first other
memory access, so a chain of them overlaps each kernel's start with the previous one's tail; a kernel launched
without PDL (torch's, cuBLAS) waits for the previous one as usual. Off unless `JETSERVE_PDL=1` (envs.pdl), and only
on CUDA devices of compute capability 9.0 or more; the interpreter never sees the instructions.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from jetserve import envs

try:  # Triton ≥ 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: PDL stays off (see `uses_pdl`)
    gdc_launch_dependents = gdc_wait = None

L2_LINE_BYTES = 128


def uses_pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL: JETSERVE_PDL=1, a CUDA device of capability ≥ 9.0, a Triton
    with grid-dependency control."""
    return envs.pdl() and x.is_cuda and gdc_wait is not None and _capability(x.device) >= (9, 0)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (both no-ops unless PDL)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs):
    """Fetch the 128-byte lines holding `ptrs` (any shape, valid addresses) into L2, fire and forget."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


def line_columns(block_k: int, element_size: int) -> int:
    """Columns of a weight row per 128-byte line prefetched, at most block_k."""
    return min(block_k, max(1, L2_LINE_BYTES // element_size))


def pdl_launch(x: torch.Tensor) -> dict:
    """The launch options of a kernel taking `PDL` on x's device: `PDL=True, launch_pdl=True` where `uses_pdl`, else
    nothing (the kernel's default, PDL off)."""
    return {"PDL": True, "launch_pdl": True} if uses_pdl(x) else {}
