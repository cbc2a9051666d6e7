"""A device tensor's copy to the host, started without waiting: what a step launched ahead is read through."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Pinned buffers and CUDA events a device's copies take in turn. A copy must be read before this many later copies
# start (the engine reads each step's before it launches the second step after it); one read later raises.
RING = 16


@dataclass
class _Entry:
    buffer: torch.Tensor  # pinned uint8, grown to the largest copy it has held
    event: torch.cuda.Event
    generation: int = 0  # copies this entry has taken


class _Ring:
    """The pinned buffers and events of one device's copies, made once: a fresh pinned tensor and event per copy cost
    the H200 host ~16 µs of a ~130 µs batch-1 decode step (session 51)."""

    def __init__(self) -> None:
        self.entries = [_Entry(torch.empty(0, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
                        for _ in range(RING)]  # fmt: skip
        self.next = 0

    def take(self, nbytes: int) -> _Entry:
        entry = self.entries[self.next]
        self.next = (self.next + 1) % RING
        entry.event.synchronize()  # its copy of RING copies ago: long done (a no-op wait)
        if entry.buffer.numel() < nbytes:
            entry.buffer = torch.empty(max(nbytes, 2 * entry.buffer.numel()), dtype=torch.uint8, pin_memory=True)
        entry.generation += 1
        return entry


_RINGS: dict[torch.device, _Ring] = {}


@dataclass
class HostCopy:
    """A tensor's copy on the host, queued behind the work in flight on its device. Reading it waits for its event
    only, so work queued after the copy (which may overwrite the device tensor) does not delay the read."""

    tensor: torch.Tensor  # the host copy (a view of a ring buffer on a GPU): valid once `wait` returned
    event: torch.cuda.Event | None  # None on the CPU: the copy was made at once
    entry: _Entry | None = None
    generation: int = 0

    def wait(self) -> torch.Tensor:
        """The host copy, once the device has made it."""
        if self.entry is not None:
            self.event.synchronize()
            if self.entry.generation != self.generation:
                raise RuntimeError(f"a host copy read after {RING} later copies reused its buffer")
        return self.tensor

    def read(self) -> list:
        """The copy as a (nested) list."""
        return self.wait().tolist()


def start_host_copy(tensor: torch.Tensor) -> HostCopy:
    """Queue `tensor`'s copy to pinned host memory behind the work in flight on its device, and an event after it.
    On the CPU the copy is made at once — a copy still, since `tensor` may be a static buffer that the next step
    overwrites before this one is read (the decode graph's argmax run eagerly in the CPU tests)."""
    if tensor.device.type != "cuda":
        return HostCopy(tensor.clone(), None)
    ring = _RINGS.get(tensor.device)
    if ring is None:
        ring = _RINGS[tensor.device] = _Ring()
    entry = ring.take(tensor.numel() * tensor.element_size())
    host = entry.buffer[: tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
    host.copy_(tensor, non_blocking=True)
    entry.event.record(torch.cuda.current_stream(tensor.device))  # the tensor's device, whichever is current
    return HostCopy(host, entry.event, entry, entry.generation)
