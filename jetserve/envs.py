"""Every environment variable jetserve reads, in one place."""

from __future__ import annotations

import os


def _switch(name: str, default: str) -> bool:
    """An on/off variable: "1" or "0" (unset: `default`); anything else is an error naming it."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name}: {value!r} is not 0 or 1")
    return value == "1"


def backend() -> str | None:
    """JETSERVE_BACKEND: `reference` or `triton`; unset means triton on CUDA tensors, reference elsewhere."""
    return os.environ.get("JETSERVE_BACKEND") or None


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels on the CPU (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tp_all_reduce() -> str:
    """JETSERVE_TP_ALL_REDUCE: how tensor-parallel ranks sum small (decode-sized) tensors on GPUs: `nccl` (default) or
    `one-shot` (PyTorch symmetric memory over NVLink: every rank reads its peers' buffers in one kernel; messages
    past `group.ONE_SHOT_MAX_BYTES` still go through NCCL)."""
    value = os.environ.get("JETSERVE_TP_ALL_REDUCE", "nccl") or "nccl"
    if value not in ("nccl", "one-shot"):
        raise ValueError(f"JETSERVE_TP_ALL_REDUCE: {value!r} is not one of nccl, one-shot")
    return value


def pdl() -> bool:
    """The decode step's Triton kernels launch with programmatic dependent launch where the GPU has it (Hopper and
    later: a kernel's programs start while the kernel before it finishes; `jetserve.ops.pdl`); JETSERVE_PDL=0 turns it
    off."""
    return _switch("JETSERVE_PDL", "1")


def add_norm_epilogue() -> bool:
    """JETSERVE_ADD_NORM_EPILOGUE=1: the Triton skinny GEMM that produces a layer's output (o_proj, down) also adds the
    residual and runs the next RMSNorm in its epilogue (`ops.linear`'s `add_norm`). Off by default: on an H200 it was
    no faster (session 23, docs/kernels.md); off, the norm runs as its own launch after the GEMM."""
    return _switch("JETSERVE_ADD_NORM_EPILOGUE", "0")


def fused_mixer() -> bool:
    """A JetBlock's decode conv and gated delta rule as one Triton launch at batch 1 (`jetserve.ops.jet_mixer`): on by
    default (the 2B's batch-1 step 1.62 → 1.55 ms on an H200, session 22); JETSERVE_FUSED_MIXER=0 turns it off."""
    return _switch("JETSERVE_FUSED_MIXER", "1")


def split_norm() -> bool:
    """Past the Triton GEMM's rows, a narrow projection followed by the next RMSNorm (o_proj, down at decode batches)
    runs as a batched GEMM of K-split partials and one Triton launch that sums them, adds the residual and normalises
    (`ops.linear.kernels.batched_split_linear`): on by default; JETSERVE_SPLIT_NORM=0 runs cuBLAS then the norm op."""
    return _switch("JETSERVE_SPLIT_NORM", "1")


def narrow_gemm() -> bool:
    """A narrow projection (N < `ops.linear.WIDE_MIN_N`: o_proj, down) in the plain mode takes the Triton skinny GEMM
    up to `ops.linear.NARROW_MAX_ROWS` rows, its next RMSNorm in the K split's sum launch, where cuBLAS then the norm
    op ran past `GEMV_MAX_ROWS` (session 31): on by default; JETSERVE_NARROW_GEMM=0 turns it off."""
    return _switch("JETSERVE_NARROW_GEMM", "1")


def one_capture() -> bool:
    """The decode buckets' CUDA graphs come from one stream capture, and the speculative graphs from a second, each
    split per graph through the driver API (`engine.graph_split`): on by default where the driver allows;
    JETSERVE_ONE_CAPTURE=0 captures each graph on its own (a process's fourth capture slows every graph of it by 3-4%
    on an H200, session 33)."""
    return _switch("JETSERVE_ONE_CAPTURE", "1")
