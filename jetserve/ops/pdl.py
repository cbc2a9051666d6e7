"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running: its programs are
scheduled once every program of the previous kernel has signalled (`gdc_launch_dependents`, here when a program's main
work is done), and they wait (`gdc_wait`, which returns once the previous kernel has finished and its writes are
visible) before their first memory access. So a chain of these kernels overlaps each one's launch and start with the
previous one's tail; a kernel launched without PDL (torch's, cuBLAS) waits for the previous one as usual. The skinny
GEMM, RMSNorm (with and without the residual), the conv decode, the gated-delta-rule decode and the fused mixer
decode (`jetserve.ops.jet_mixer`) take part.

Measured on an H200 (2B, 4K context, session 21): batch-1 TPOT 1.796 → 1.736 ms, batch 64 3.628 → 3.550 ms, batch 256
7.98 → 8.04 ms (the same call, one GPU each). Session 20's versions also prefetched each GEMM's weight slice into L2
before the wait, and lost (1.727 → 2.081 ms a batch-1 step): the prefetches of the next weights thrashed L2; prefetching
only each program's first weight tile still cost (1.671 → 1.694 ms), so nothing is prefetched. Session 39's decode
kernels with their state loads before the wait, and session 53's GEMMs with their first weight tile loaded (not
prefetched) before it, RMSNorms signalling before their wait and GEMMs right after theirs, all measured slower
(docs/kernels.md): each kernel waits before its first load and signals once its main work is done.

On unless `JETSERVE_PDL=0` (envs.pdl), and only on CUDA devices of compute capability 9.0 or more with a Triton that
has grid-dependency control; the interpreter never sees the instructions.
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


def uses_pdl(x: torch.Tensor) -> bool:
    """Whether kernels on x's device launch with PDL: not turned off (JETSERVE_PDL=0), a CUDA device of capability
    ≥ 9.0, a Triton with grid-dependency control."""
    return envs.pdl() and x.is_cuda and gdc_wait is not None and _capability(x.device) >= (9, 0)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel (a no-op unless PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_exit(PDL: tl.constexpr):
    """Let the next kernel launch (a no-op unless PDL): called once a program's main work is done, so that one kernel
    at most waits ahead (signalled at the start, a whole layer's kernels were launched at once)."""
    if PDL:
        gdc_launch_dependents()


def pdl_launch(x: torch.Tensor) -> dict:
    """The launch options of a kernel taking `PDL` on x's device: `PDL=True, launch_pdl=True` where `uses_pdl`, else
    nothing (the kernel's default, PDL off)."""
    return {"PDL": True, "launch_pdl": True} if uses_pdl(x) else {}
