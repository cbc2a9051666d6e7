"""The one backend switch: `reference` (pure PyTorch, any device) or `triton` (CUDA, or the CPU interpreter)."""

from __future__ import annotations

import functools

import torch

from jetserve import envs

BACKENDS = ("reference", "triton")
INTERPRETER_SMS = 4  # the launch heuristics' SM count off the GPU: keeps interpreter grids small
_forced: str | None = None


def set_backend(name: str | None) -> None:
    """Force a backend for every op; None returns to the default (env var, else by device)."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"backend: {name!r} is not one of {', '.join(BACKENDS)}")
    _forced = name


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on tensor `x` should run its Triton variant."""
    name = _forced or envs.backend()
    if name == "reference":
        return False
    if name == "triton":
        return x.is_cuda or envs.triton_interpret()
    return x.is_cuda


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (INTERPRETER_SMS elsewhere), queried once per device."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
