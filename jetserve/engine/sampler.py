"""Sampler: each state slot's sampling parameters kept on the device, and the draw of one step's tokens."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from jetserve.ops.sampling import argmax, sample
from jetserve.sampling_params import SamplingParams
from jetserve.spec.verifier import SamplingRows


class Sampler:
    """Per-slot parameter tensors `[S]`, written on the host when a sequence takes a slot and copied to the device
    once per step when they changed, so a step gathers its rows by state index with no host loop.

    A request's draw depends only on (its seed, its counter, its logits): the counter is the sequence's length when
    it samples (prompt + output so far), so a request samples the same tokens in any batch and after a preemption.
    """

    # Each parameter's dtype and initial value, laid out in one block (`_PARAMS` order, each segment 16-byte aligned).
    _PARAMS = {
        "seeds": (torch.int64, 0),
        "temperature": (torch.float32, 0.0),
        "top_k": (torch.int32, 0),
        "top_p": (torch.float32, 1.0),
        "min_p": (torch.float32, 0.0),
    }

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.device = device
        offsets, size = {}, 0
        for name, (dtype, _) in self._PARAMS.items():
            offsets[name] = size
            size += -(-num_slots * dtype.itemsize // 16) * 16
        # The host's copy, and a staging copy of it that one copy moves to the device block: five synchronous copies
        # from pageable memory took ~200 µs of a new request's first step on the H200 host (session 51).
        self._block = np.zeros(size, np.uint8)
        self._host = {
            name: self._block[offsets[name] : offsets[name] + num_slots * dtype.itemsize].view(
                str(dtype).removeprefix("torch.")
            )
            for name, (dtype, _) in self._PARAMS.items()
        }  # [S] each: views of the host block
        for name, (_, initial) in self._PARAMS.items():
            self._host[name][:] = initial
        self._staging = torch.from_numpy(self._block.copy())
        if device.type == "cuda":
            self._staging = self._staging.pin_memory()
        self._copied: torch.cuda.Event | None = None  # the last sync's copy out of the staging block
        self._device_block = self._staging.to(device, copy=True)
        self.params = {
            name: self._device_block[offsets[name] : offsets[name] + num_slots * dtype.itemsize].view(dtype)
            for name, (dtype, _) in self._PARAMS.items()
        }  # [S] each: views of the device block, which the graphs read in place
        self._is_dirty = False

    def set_slot(self, slot: int, params: SamplingParams, seed: int) -> None:
        host = self._host
        host["temperature"][slot] = params.temperature
        host["top_k"][slot] = params.top_k
        host["top_p"][slot] = params.top_p
        host["min_p"][slot] = params.min_p
        host["seeds"][slot] = seed
        self._is_dirty = True

    def sync(self) -> None:
        """Copy changed parameters to the device (before the step that uses them), queued behind the work in flight
        and not waited for: the staging block is rewritten only once its last copy has left it."""
        if self._is_dirty:
            if self._copied is not None:
                self._copied.synchronize()  # long done: the last sync's copy was queued at least a step ago
            self._staging.numpy()[:] = self._block
            self._device_block.copy_(self._staging, non_blocking=True)
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
            self._is_dirty = False

    def is_all_greedy(self, slots: np.ndarray) -> bool:
        """Whether every one of these slots samples greedily (then a step needs only an argmax)."""
        return bool((self._host["temperature"][slots] == 0).all())

    def __call__(
        self,
        logits: torch.Tensor,
        state_indices: torch.Tensor,
        counters: torch.Tensor,
        slots: np.ndarray | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [N, V] fp32, state_indices [N], counters [N] int64 → tokens [N] int64. `slots` [N] are the state
        indices on the host: their parameters choose the least work that draws the same tokens — an argmax when
        every row is greedy, no top-k/top-p/min-p threshold when no sampled row filters (`sample`'s promises); None
        takes the full path (the memory profile of the largest step). Into `out` [N] int64 (contiguous) when given,
        which is returned: an all-greedy draw's argmax writes it directly, a sampled draw is copied in."""
        return self._draw(logits, state_indices, lambda: counters, slots, out)

    def after(
        self, logits: torch.Tensor, state_indices: torch.Tensor, positions: torch.Tensor, slots: np.ndarray | None
    ) -> torch.Tensor:
        """A decode step's draw: as `__call__` with counters `positions + 1` [N] (the length each sequence reaches),
        formed only when a row samples — an all-greedy step launches its argmax alone."""
        return self._draw(logits, state_indices, lambda: positions + 1, slots)

    def _draw(
        self,
        logits: torch.Tensor,
        state_indices: torch.Tensor,
        counters: Callable[[], torch.Tensor],
        slots: np.ndarray | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The tokens [N], into `out` when given: an all-greedy draw's argmax writes it, a sampled draw is copied in."""
        if slots is None:
            is_filtered = has_greedy = True
        else:
            host = self._host
            is_random = host["temperature"][slots] > 0  # [N]
            if not is_random.any():  # all greedy: the argmax alone (the filters are not looked at)
                return argmax(logits, out=out)
            filters = (host["top_k"][slots] > 0) | (host["top_p"][slots] < 1) | (host["min_p"][slots] > 0)  # [N]
            is_filtered = bool((is_random & filters).any())
            has_greedy = not bool(is_random.all())
        rows = self.rows(state_indices, counters())
        tokens = sample(
            logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.seeds, rows.counters,
            is_filtered=is_filtered, has_greedy=has_greedy,
        )  # fmt: skip
        return tokens if out is None else out.copy_(tokens)

    def rows(self, state_indices: torch.Tensor, counters: torch.Tensor) -> SamplingRows:
        """The parameters of the sequences in slots `state_indices` [N], gathered on the device, with their
        counters [N]."""
        slots = state_indices.long()
        p = self.params
        return SamplingRows(
            temperature=p["temperature"][slots], top_k=p["top_k"][slots], top_p=p["top_p"][slots],
            min_p=p["min_p"][slots], seeds=p["seeds"][slots], counters=counters.long(),
        )  # fmt: skip
