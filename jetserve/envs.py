"""Every environment variable jetserve reads, in one place."""

from __future__ import annotations

import os


def backend() -> str | None:
    """JETSERVE_BACKEND: `reference` or `triton`; unset means triton on CUDA tensors, reference elsewhere."""
    return os.environ.get("JETSERVE_BACKEND") or None


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels on the CPU (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
