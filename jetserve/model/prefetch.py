"""Which weight each decode-time GEMM prefetches into L2 (`ops.linear`'s `prefetch` hint).

A decode step at small batch streams every weight once, GEMM after GEMM, with small kernels between them (norms, the
JetBlock's conv and gated delta rule, attention) during which HBM idles. Each GEMM that takes the Triton skinny path
can bring the first bytes of the *next* GEMM's weight into L2 behind its own tail, so the next one starts from L2.
The order per decoder layer: the mixer's fused input projections, its o_proj, the MLP's gate|up, its down_proj; the
last layer's down_proj prefetches the lm_head. A budget of 0 plans nothing (and drops an earlier plan)."""

from __future__ import annotations

import torch
from torch import nn


def gemm_sites(model: nn.Module) -> list[tuple[nn.Module, torch.Tensor]]:
    """(module whose GEMM runs, its weight) in a decode step's order. An unfused input group's weight is None's
    stand-in: its first projection's weight (what the concatenated GEMM reads first)."""
    sites: list[tuple[nn.Module, torch.Tensor]] = []
    for layer in model.model.layers:
        for group, out in ((layer.self_attn, layer.self_attn.o_proj), (layer.mlp, layer.mlp.down_proj)):
            fused = group.fused_input
            sites.append((group, fused.weight if fused is not None else group.input_projections()[0].weight))
            sites.append((out, out.weight))
    return sites


def plan_l2_prefetch(model: nn.Module, budget_bytes: int) -> int:
    """Set each GEMM site's `prefetch_next` to the first `budget_bytes` of the next site's weight (the lm_head after
    the last layer); 0 clears them. Returns the bytes a decode step prefetches. Plan again after anything that
    replaces parameters (the plan holds views of the weights it names)."""
    if budget_bytes < 0:
        raise ValueError(f"l2 prefetch budget: must be ≥ 0 bytes, got {budget_bytes}")
    sites = gemm_sites(model)
    targets = [weight for _, weight in sites[1:]] + [model.lm_head_weight]
    total = 0
    for (module, _), target in zip(sites, targets, strict=True):
        if budget_bytes == 0 or target.is_meta or not target.is_contiguous():
            module.prefetch_next = None
            continue
        flat = target.detach().reshape(-1)
        count = min(flat.numel(), budget_bytes // flat.element_size())
        module.prefetch_next = flat[:count]  # [count] elements: the target's first budget bytes
        total += count * flat.element_size()
    return total
