"""Greedy acceptance of draft chains and the verify step's result rows, as torch ops (the contract the Triton launch
in `kernels.py` keeps)."""

from __future__ import annotations

import torch

Forced = tuple[torch.Tensor, torch.Tensor] | None  # (num_accepted [N], bonus [N]) replacing the acceptance
Accepted = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # (accepted, num_accepted, bonus, result)


def check_chain_args(target: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, forced: Forced) -> None:
    if tokens.dim() != 2 or tokens.shape[1] < 1:
        raise ValueError(f"chain_accept_emit: tokens must be [N, T_d] with T_d ≥ 1, got {tuple(tokens.shape)}")
    num_seqs = tokens.shape[0]
    if target.shape != tokens.shape:
        raise ValueError(f"chain_accept_emit: target {tuple(target.shape)} must match tokens {tuple(tokens.shape)}")
    if slots.shape != (num_seqs,):
        raise ValueError(f"chain_accept_emit: slots {tuple(slots.shape)} must be [{num_seqs}]")
    if forced is not None and any(t.shape != (num_seqs,) for t in forced):
        raise ValueError(f"chain_accept_emit: forced (num_accepted, bonus) must be [{num_seqs}] each")
    for name, t in (("target", target), ("tokens", tokens), ("slots", slots), *(("forced", t) for t in forced or ())):
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"chain_accept_emit: {name} must hold integers, got {t.dtype}")


def chain_accept_emit(
    target: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, forced: Forced = None
) -> Accepted:
    """Greedy acceptance of one chain per row and what the step emits, from the target's greedy tokens.

    target [N, T_d] int64: the target's argmax at each node; tokens [N, T_d]: the chain (node 0 the root, the last
    committed token; node j's parent j - 1); slots [N]: each row's state slot, 0 for a padded row (which commits
    nothing). The accepted drafts are the leading run of drafts j + 1 equal to the target's token at node j; the bonus
    is the target's token after the run. `forced` = (num_accepted [N], bonus [N]) replaces that acceptance (the
    benchmarks' forced "all": a count of at least 1 and at most T_d).

    Returns accepted [N, T_d] int32 (nodes 0 .. count - 1, then -1), num_accepted [N] int32 (the count, root
    included; 0 on padded rows), bonus [N] int64, and result [N, T_d + 2] int64: the emitted tokens (the accepted
    drafts, then the bonus, -1 after num_accepted), num_accepted, and the chain's depth T_d - 1 — the row a verify
    step reads back in one transfer. `tree_accept_greedy`'s result for a chain, with `VerifyOutput.emitted_tokens`'s.
    """
    check_chain_args(target, tokens, slots, forced)
    num_seqs, num_nodes = tokens.shape
    device = tokens.device
    target, tokens = target.long(), tokens.long()
    nodes = torch.arange(num_nodes, device=device)  # [T_d]
    if forced is None:
        is_match = tokens[:, 1:] == target[:, :-1]  # [N, T_d - 1]: draft j + 1 is the target's token at node j
        drafts = is_match.long().cumprod(dim=1).sum(dim=1)  # [N]: the leading run
        count = drafts + 1
        bonus = target.gather(1, drafts[:, None]).squeeze(1)  # [N]
    else:
        count, bonus = forced[0].long(), forced[1].long()
    accepted = torch.where(nodes[None, :] < count[:, None], nodes[None, :], -1).to(torch.int32)  # [N, T_d]
    count = torch.where(slots > 0, count, 0)  # [N]
    after = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # [N, T_d]: draft j + 1 at j (the last column unused)
    emitted = torch.where(nodes[None, :] == count[:, None] - 1, bonus[:, None], after)
    emitted = torch.where(nodes[None, :] < count[:, None], emitted, -1)  # [N, T_d]
    depth = torch.full((num_seqs, 1), num_nodes - 1, dtype=torch.long, device=device)
    result = torch.cat([emitted, count[:, None], depth], dim=1)  # [N, T_d + 2]
    return accepted, count.to(torch.int32), bonus, result
