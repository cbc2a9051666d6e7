"""StatePool: JetBlock state slots (conv window and recurrent state of every `jet` layer), one per running sequence."""

from __future__ import annotations

import torch

from jetserve.config import ModelConfig


class StatePool:
    """`conv_states` `[L_jet, S, W-1, D_v]` (model dtype) and `recurrent_states` `[L_jet, S, H, K, V]` (fp32).

    Slot 0 is reserved as the target of padded rows and never handed out. A slot's contents are meaningful only
    while its sequence has computed tokens: the kernels read it only where `has_initial_state`, so a new sequence
    needs no zeroing. Speculative decoding needs no copy of it: a VERIFY step reads the committed state and leaves
    it untouched, each JetBlock keeps that step's per-node inputs, and `JetBlock.commit` replays the accepted path
    into the slot in place (ops `dynamic_conv_commit`, `gated_delta_rule_commit`).
    """

    def __init__(
        self,
        num_slots: int,
        jet_layer_ids: tuple[int, ...],
        conv_shape: tuple[int, int],  # (W-1, D_v)
        recurrent_shape: tuple[int, int, int],  # (H, K, V)
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        assert num_slots >= 2, "slot 0 is reserved, so a pool needs at least two slots"
        self.num_slots = num_slots
        self.jet_layer_ids = jet_layer_ids
        L = len(jet_layer_ids)
        self.conv_states = torch.zeros(L, num_slots, *conv_shape, dtype=dtype, device=device)  # [L, S, W-1, D]
        self.recurrent_states = torch.zeros(
            L, num_slots, *recurrent_shape, dtype=torch.float32, device=device
        )  # [L, S, H, K, V]
        self._free: list[int] = list(range(num_slots - 1, 0, -1))

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> StatePool:
        conv_shape, recurrent_shape = state_shapes(config)
        return cls(num_slots, config.jet_layer_ids, conv_shape, recurrent_shape, dtype, device)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_usable_slots(self) -> int:
        return self.num_slots - 1

    def allocate(self) -> int:
        """A free slot (the caller checked `num_free_slots`)."""
        assert self._free, "no free state slot"
        return self._free.pop()

    def free(self, slot: int) -> None:
        assert 0 < slot < self.num_slots and slot not in self._free, f"slot {slot} is not allocated"
        self._free.append(slot)

    def layer_states(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Per-layer views for `model.bind_caches`: conv `{layer: [S, W-1, D]}`, recurrent `{layer: [S, H, K, V]}`."""
        conv = {layer: self.conv_states[i] for i, layer in enumerate(self.jet_layer_ids)}
        recurrent = {layer: self.recurrent_states[i] for i, layer in enumerate(self.jet_layer_ids)}
        return conv, recurrent


def state_shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """((W-1, D_v), (H, K, V)) of one JetBlock layer's per-sequence state; zeros for a model without `jet` layers."""
    jet = config.jet
    if jet is None:
        return (0, 0), (0, 0, 0)
    return (jet.conv_size - 1, jet.value_dim), (jet.num_heads, jet.head_dim, jet.head_v_dim)
