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

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.device = device
        self._host = {
            "temperature": np.zeros(num_slots, np.float32),
            "top_k": np.zeros(num_slots, np.int32),
            "top_p": np.ones(num_slots, np.float32),
            "min_p": np.zeros(num_slots, np.float32),
            "seeds": np.zeros(num_slots, np.int64),
        }
        self.params = {name: torch.from_numpy(a.copy()).to(device) for name, a in self._host.items()}  # [S] each
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
        """Copy changed parameters to the device (before the step that uses them)."""
        if self._is_dirty:
            for name, array in self._host.items():
                self.params[name].copy_(torch.from_numpy(array), non_blocking=False)
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
    ) -> torch.Tensor:
        """logits [N, V] fp32, state_indices [N], counters [N] int64 → tokens [N] int64. `slots` [N] are the state
        indices on the host: their parameters choose the least work that draws the same tokens — an argmax when
        every row is greedy, no top-k/top-p/min-p threshold when no sampled row filters (`sample`'s promises); None
        takes the full path (the memory profile of the largest step)."""
        return self._draw(logits, state_indices, lambda: counters, slots)

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
    ) -> torch.Tensor:
        if slots is None:
            is_filtered = has_greedy = True
        else:
            host = self._host
            is_random = host["temperature"][slots] > 0  # [N]
            if not is_random.any():  # all greedy: the argmax alone (the filters are not looked at)
                return argmax(logits)
            filters = (host["top_k"][slots] > 0) | (host["top_p"][slots] < 1) | (host["min_p"][slots] > 0)  # [N]
            is_filtered = bool((is_random & filters).any())
            has_greedy = not bool(is_random.all())
        rows = self.rows(state_indices, counters())
        return sample(
            logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.seeds, rows.counters,
            is_filtered=is_filtered, has_greedy=has_greedy,
        )  # fmt: skip

    def rows(self, state_indices: torch.Tensor, counters: torch.Tensor) -> SamplingRows:
        """The parameters of the sequences in slots `state_indices` [N], gathered on the device, with their
        counters [N]."""
        slots = state_indices.long()
        p = self.params
        return SamplingRows(
            temperature=p["temperature"][slots], top_k=p["top_k"][slots], top_p=p["top_p"][slots],
            min_p=p["min_p"][slots], seeds=p["seeds"][slots], counters=counters.long(),
        )  # fmt: skip
