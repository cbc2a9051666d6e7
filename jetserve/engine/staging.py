"""Host rows to the device through one pinned buffer made once: what a step's uploads go through.

Before, each upload pinned a fresh host copy (`Tensor.pin_memory`, through torch's caching host allocator: 6.3 µs on
the H100 host, session 58) and its copy recorded an event there; a copy from pageable memory may wait for the device.
Here an upload is a numpy copy into the next free stretch of a pinned ring and one asynchronous copy out of it, which
also lets a graph's static inputs be loaded straight from the host (`copy_into`: 10.7 µs for a flush graph's block
against 19.4 µs for an upload and a device copy, session 58). The ring is cut into segments filled in turn; leaving
a segment records an event behind the copies queued out of it, and entering a segment again waits for the event it
recorded a lap before (in practice long done).
"""

from __future__ import annotations

import numpy as np
import torch

# 8 MiB of int64, in 8 segments of 128 Ki elements: a PREFILL step's rows (11 rows of its tokens) fit one segment up
# to ~11,900 tokens; a larger upload is pinned on its own (`UploadRing.num_unstaged`).
RING_ELEMENTS = 1 << 20
RING_SEGMENTS = 8


class UploadRing:
    """int64 host arrays to `device`, each through a stretch of one pinned ring (`upload`, `copy_into`). Every copy
    is queued on the device's current stream (the engine's one stream). On the CPU the ring is plain memory and every
    copy is made at once (the same path, without events), so a result never aliases the ring."""

    def __init__(self, device: torch.device, num_elements: int = RING_ELEMENTS, num_segments: int = RING_SEGMENTS):
        assert num_elements % (2 * num_segments) == 0, "segments of an even count keep every stretch 16-byte aligned"
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.buffer = torch.empty(num_elements, dtype=torch.int64, pin_memory=self.is_cuda)  # [num_elements]
        self._array = self.buffer.numpy()
        self.segment_size = num_elements // num_segments
        self._fences: list[torch.cuda.Event | None] = [None] * num_segments  # per segment: behind its last copy
        self._segment = 0
        self._used = 0  # elements of the current segment handed out
        self.num_unstaged = 0  # uploads larger than a segment, pinned on their own

    def upload(self, rows: np.ndarray) -> torch.Tensor:
        """A device copy of `rows` (any shape, int64), queued without waiting."""
        host = self._stage(rows)
        if not self.is_cuda:
            return host.clone()
        return host.to(self.device, non_blocking=True)

    def copy_into(self, dst: torch.Tensor, rows: np.ndarray) -> None:
        """Queue the copy of `rows` into the device tensor `dst` (of rows' shape), without waiting."""
        dst.copy_(self._stage(rows), non_blocking=True)

    def _stage(self, rows: np.ndarray) -> torch.Tensor:
        """`rows` copied into the ring's next free stretch (a host tensor of their shape), or pinned on their own
        where they exceed a segment. The caller queues its copy out of it before the next `_stage`."""
        n = rows.size
        if n > self.segment_size:
            self.num_unstaged += 1
            host = torch.from_numpy(np.ascontiguousarray(rows.astype(np.int64, casting="safe", copy=False)))
            return host.pin_memory() if self.is_cuda else host
        if self._used + n > self.segment_size:
            self._next_segment()
        start = self._segment * self.segment_size + self._used
        self._used += n + n % 2  # the next stretch starts 16-byte aligned
        stretch = self._array[start : start + n].reshape(rows.shape)
        np.copyto(stretch, rows, casting="safe")
        # A tensor over the numpy view, not a slice of `buffer`: slicing and viewing cost ~2 µs more on this
        # project's CPU, and a copy out of a slice of a pinned tensor records an event in torch's caching host
        # allocator (~6 µs on the H100 host, session 58), which the ring's own fences make needless. The copy is
        # asynchronous either way: the driver sees pinned memory.
        return torch.from_numpy(stretch)

    def _next_segment(self) -> None:
        """Fence the segment being left behind the copies queued out of it, then enter the next one, once the copies
        queued out of it a lap ago are made."""
        if self.is_cuda:
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(self.device))
            self._fences[self._segment] = fence
        self._segment = (self._segment + 1) % len(self._fences)
        self._used = 0
        fence = self._fences[self._segment]
        if fence is not None:
            fence.synchronize()
