"""Device tensors that depend on a batch's shape alone — the aranges, masks and fills of the draft's and the verify
step's batches — made once per (name, shape, device) and kept, instead of one small kernel each in every step.

In a CUDA graph each of these is a kernel of ~1 µs replayed every step (H200, session 34's profile of a chain-6
verify step at batch 1: aranges, fills, a triangle and copies among its ~60 small torch kernels). A tensor first made
during a stream capture would live in that graph's pool with its fill captured in that graph alone, so during a
capture a missing tensor is made for the call and not kept: the engine runs every step once before capturing it,
which fills the cache. What is kept is bounded (MAX_KEPT_BYTES, outside the memory plan): past it, tensors are made
per call, as without the cache (an eager catch-up of rows of any width up to the ring's would otherwise keep a
tensor per width and row count). Callers must not write into what they get.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

MAX_KEPT_BYTES = 16 << 20  # what one cache keeps at most (the graphs' shapes need a few hundred KiB)


class ShapeConstants:
    def __init__(self) -> None:
        self._tensors: dict[tuple, torch.Tensor] = {}
        self.kept_bytes = 0

    def get(self, key: Hashable, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor kept under (key, device), else `make()` (kept unless a CUDA graph capture is running or it
        would pass MAX_KEPT_BYTES). Made as a normal tensor even under `torch.inference_mode`, so that a later call
        outside it may use it."""
        full_key = (key, str(device))
        tensor = self._tensors.get(full_key)
        if tensor is None:
            with torch.inference_mode(False):
                tensor = make()
            nbytes = tensor.numel() * tensor.element_size()
            if not _capturing(tensor.device) and self.kept_bytes + nbytes <= MAX_KEPT_BYTES:
                self._tensors[full_key] = tensor
                self.kept_bytes += nbytes
        return tensor

    def arange(self, n: int, device: torch.device) -> torch.Tensor:
        """[n] int64: 0 .. n - 1."""
        return self.get(("arange", n), device, lambda: torch.arange(n, device=device))

    def full(
        self, shape: tuple[int, ...], value: bool | int | float, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """`torch.full(shape, value, dtype=dtype)`."""
        return self.get(("full", shape, value, dtype), device, lambda: torch.full(shape, value, dtype=dtype,
                                                                                   device=device))  # fmt: skip

    def offsets(self, num_rows: int, width: int, device: torch.device) -> torch.Tensor:
        """[num_rows + 1] int32: 0, width, 2·width, ... — the cu_seqlens of rows of equal width."""
        return self.get(("offsets", num_rows, width), device,
                        lambda: (torch.arange(num_rows + 1, device=device) * width).to(torch.int32))  # fmt: skip

    def causal(self, num_rows: int, width: int, device: torch.device) -> torch.Tensor:
        """[num_rows, width, width] bool: each row's lower triangle (token a ≤ j is j's ancestor in a chain)."""

        def make() -> torch.Tensor:
            mask = torch.ones(width, width, dtype=torch.bool, device=device).tril()  # [C, C]
            return mask.expand(num_rows, width, width).contiguous()

        return self.get(("causal", num_rows, width), device, make)

    def __len__(self) -> int:
        return len(self._tensors)


def _capturing(device: torch.device) -> bool:
    """A CUDA graph capture is running on `device`'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
