"""A device tensor's copy to the host, started without waiting: what a step launched ahead is read through."""

from __future__ import annotations

import torch


def start_host_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue `tensor`'s copy to pinned host memory behind the work in flight on its device, and an event after it;
    returns (host copy, event). Reading the copy waits for the event only, so work queued after it (which may
    overwrite `tensor`) does not delay the read. On the CPU the copy is made at once: (copy, None) — a copy still, since
    `tensor` may be a static buffer that the next step overwrites before this one is read (the decode graph's argmax
    run eagerly in the CPU tests)."""
    if tensor.device.type != "cuda":
        return tensor.clone(), None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device))  # the tensor's device, whichever is current
    return host, copied
