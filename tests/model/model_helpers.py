"""Helpers shared by the model tests."""

import torch


def jet_states(model, seq):
    """Every per-sequence JetBlock state of StaticCache sequence `seq` (slot seq + 1): conv windows and recurrent
    states, cloned."""
    out = []
    for layer in model.model.layers:
        if layer.kind == "jet":
            out += [layer.self_attn.conv_state[seq + 1].clone(), layer.self_attn.recurrent_state[seq + 1].clone()]
    return out


def random_tokens(n, seed):
    """`n` token ids of the tiny vocabulary, reproducible by `seed`."""
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
