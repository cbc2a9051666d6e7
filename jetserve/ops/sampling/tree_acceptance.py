"""EAGLE-3 tree acceptance on the device: greedy (longest path matching the target argmax) and stochastic (tree
rejection sampling that keeps the target distribution exactly), each with its bonus token; plus a per-sequence
Python loop version of the same rules that the tests check the batched one against.
"""

from __future__ import annotations

import torch

from jetserve.ops.sampling.greedy import argmax
from jetserve.ops.sampling.reference import filtered_distribution, uniform_noise

# The acceptance draws of a verify step at counter c come from the hash stream of counter c | 2^62, which no
# plain draw (counter < 2^62) ever uses; the bonus token uses counter c itself, like `sample`.
ACCEPT_STREAM = 1 << 62


def _check_tree_inputs(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> tuple[int, int, int]:
    if logits.dim() != 3:
        raise ValueError(f"tree acceptance: logits must be [N, T_d, V], got shape {tuple(logits.shape)}")
    num_seqs, num_nodes, vocab_size = logits.shape
    if tokens.shape != (num_seqs, num_nodes) or parents.shape != (num_seqs, num_nodes):
        raise ValueError(
            f"tree acceptance: tokens and parents must be [N, T_d] = [{num_seqs}, {num_nodes}], got "
            f"{tuple(tokens.shape)}, {tuple(parents.shape)}"
        )
    return num_seqs, num_nodes, vocab_size


def _check_sampling_rows(num_seqs: int, **rows: torch.Tensor) -> None:
    for name, row in rows.items():
        if row.shape != (num_seqs,):
            raise ValueError(f"tree acceptance: {name} must be [N] = [{num_seqs}], got shape {tuple(row.shape)}")


def _path_to(node: torch.Tensor, depth: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """accepted_nodes [N, T_d] int32: the path root → `node` [N] (at `depth` [N]), root first, padded with -1."""
    num_seqs, num_nodes = parents.shape
    device = parents.device
    path = torch.full((num_seqs, num_nodes + 1), -1, dtype=torch.long, device=device)  # last column: a sink
    current, level = node.long(), depth.long()
    for _ in range(num_nodes):
        live = level >= 0  # [N]
        path.scatter_(1, torch.where(live, level, num_nodes)[:, None], torch.where(live, current, -1)[:, None])
        current = torch.where(live, parents.long().gather(1, current.clamp(min=0)[:, None]).squeeze(1), -1)
        level = level - 1
    return path[:, :num_nodes].to(torch.int32)


def tree_accept_greedy(
    logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance: the longest root-to-node path whose every draft token equals the target argmax at its parent.

    logits [N, T_d, V] (the target's logits at every node), tokens [N, T_d] (node 0 the last committed token),
    parents [N, T_d] int (-1 at node 0, `parents[:, j] < j` otherwise). Among equally long paths the one ending at
    the lowest node index wins. Returns accepted_nodes [N, T_d] int32 (root first, padded with -1), num_accepted [N]
    int32 (root included, so ≥ 1) and the bonus token [N] int64: the target argmax at the last accepted node.
    """
    num_seqs, num_nodes, _ = _check_tree_inputs(logits, tokens, parents)
    device = logits.device
    target = argmax(logits)  # [N, T_d]
    parent = parents.long().clamp(min=0)  # [N, T_d]
    is_match = tokens.long() == target.gather(1, parent)  # [N, T_d]: node j's token is the argmax at its parent
    on_path = torch.ones(num_seqs, num_nodes, dtype=torch.bool, device=device)
    depth = torch.zeros(num_seqs, num_nodes, dtype=torch.long, device=device)
    for j in range(1, num_nodes):  # parents precede children, so one pass in node order settles every node
        on_path[:, j] = is_match[:, j] & on_path.gather(1, parent[:, j : j + 1]).squeeze(1)
        depth[:, j] = depth.gather(1, parent[:, j : j + 1]).squeeze(1) + 1
    reach = torch.where(on_path, depth, -1)  # [N, T_d]
    best_depth = reach.max(dim=1).values  # [N]
    best = (reach == best_depth[:, None]).int().argmax(dim=1)  # [N]: the lowest index at that depth
    accepted = _path_to(best, best_depth, parents)
    bonus = target.gather(1, best[:, None]).squeeze(1)
    return accepted, (best_depth + 1).to(torch.int32), bonus


def target_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """The distribution `sample` draws from, normalised: softmax(logits / T) filtered by top-k/top-p/min-p (as
    `filtered_distribution`) and renormalised. logits [N, T_d, V], the rest [N]; rows with temperature 0 use T = 1
    (their acceptance is greedy). Returns [N, T_d, V] fp32."""
    num_seqs, num_nodes, vocab_size = logits.shape
    per_node = [x.repeat_interleave(num_nodes) for x in (temperature, top_k, top_p, min_p)]  # [N*T_d] each
    probs, threshold, _ = filtered_distribution(logits.reshape(num_seqs * num_nodes, vocab_size), *per_node)
    kept = torch.where(probs >= threshold, probs, 0.0)  # [N*T_d, V]
    return (kept / kept.sum(dim=-1, keepdim=True)).view(num_seqs, num_nodes, vocab_size)


def _normalise(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p / sum, sum > 0) per row of p [N, V] (rows summing to 0 are returned unchanged)."""
    total = p.sum(dim=-1, keepdim=True)  # [N, 1]
    ok = total > 0
    return torch.where(ok, p / torch.where(ok, total, 1.0), p), ok.squeeze(-1)


def _reject(p: torch.Tensor, q: torch.Tensor | None, child: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """After rejecting `child` [N]: p ← norm(max(p - q, 0)) and q ← norm(q without the child). With no q (each
    child a deterministic proposal, q = its point mass), p ← norm(p without the child)."""
    drop = child.long()[:, None]
    without = p.scatter(1, drop, 0.0)  # [N, V]
    fallback, _ = _normalise(without)
    if q is None:
        return fallback, None
    residual, ok = _normalise((p - q).clamp(min=0.0))
    # A zero residual means p == q up to rounding, where rejection has probability 0; fall back to dropping the child.
    new_p = torch.where(ok[:, None], residual, fallback)
    new_q, _ = _normalise(q.scatter(1, drop, 0.0))
    return new_p, new_q


def _draw(p: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """A draw from p [N, V] by the exponential race of `sample`: argmax(p / race) over p > 0."""
    return torch.where(p > 0, p / race, -1.0).argmax(dim=-1)


def tree_accept(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tree acceptance per sequence: greedy where temperature == 0, else tree rejection sampling.

    logits [N, T_d, V], tokens [N, T_d], parents [N, T_d] as in `tree_accept_greedy`; sampling parameters [N] as in
    `sample`; counters [N] the request's draw index (each verify step needs a fresh one, e.g. the number of tokens
    generated so far). Rejection sampling walks down from the root; at the current node with target distribution p it
    tries the children in node order: child c is accepted with probability min(1, p(c) / q(c)); on rejection
    p ← norm(max(p - q, 0)) and c is removed from q (renormalised). The first accepted child becomes the current
    node (with fresh p and q); when none is, the bonus token is drawn from p. `draft_probs` [N, T_d, V] is q at each
    node: the distribution its children were drawn from without replacement. None means the children are
    deterministic proposals (EAGLE's top-k), each its own point mass: c is accepted with probability p(c) and dropped
    from p on rejection. Both keep the target distribution exactly. Returns (accepted_nodes [N, T_d] int32 root
    first padded with -1, num_accepted [N] int32 root included, bonus [N] int64). No host synchronisation.
    """
    num_seqs, num_nodes, vocab_size = _check_tree_inputs(logits, tokens, parents)
    _check_sampling_rows(
        num_seqs, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds, counters=counters
    )
    if draft_probs is not None and draft_probs.shape != logits.shape:
        raise ValueError(
            f"tree_accept: draft_probs must be [N, T_d, V] = {tuple(logits.shape)}, got {draft_probs.shape}"
        )
    device = logits.device
    greedy = tree_accept_greedy(logits, tokens, parents)
    probs = target_probs(logits, temperature, top_k, top_p, min_p)  # [N, T_d, V]
    q_all = None if draft_probs is None else draft_probs.float()
    u = uniform_noise(seeds, counters | ACCEPT_STREAM, num_nodes)  # [N, T_d]: node j's acceptance draw
    race = -torch.log(uniform_noise(seeds, counters, vocab_size))  # [N, V]

    rows = torch.arange(num_seqs, device=device)
    current = torch.zeros(num_seqs, dtype=torch.long, device=device)  # [N]
    count = torch.ones(num_seqs, dtype=torch.long, device=device)  # [N]
    accepted = torch.full((num_seqs, num_nodes + 1), -1, dtype=torch.long, device=device)  # last column: a sink
    accepted[:, 0] = 0
    p = probs[:, 0]  # [N, V]
    q = None if q_all is None else q_all[:, 0]
    for j in range(1, num_nodes):  # parents precede children: one pass in node order follows the accepted path
        is_child = parents[:, j].long() == current  # [N]
        child = tokens[:, j].long()  # [N]
        p_child = p.gather(1, child[:, None]).squeeze(1)  # [N]
        q_child = 1.0 if q is None else q.gather(1, child[:, None]).squeeze(1)
        accept = is_child & (u[:, j] * q_child < p_child)  # u < p/q, written so q = 0 or p = 0 need no division
        reject = is_child & ~accept
        p_rej, q_rej = _reject(p, q, child)
        p = torch.where(accept[:, None], probs[:, j], torch.where(reject[:, None], p_rej, p))
        if q is not None:
            q = torch.where(accept[:, None], q_all[:, j], torch.where(reject[:, None], q_rej, q))
        accepted[rows, torch.where(accept, count, num_nodes)] = torch.where(accept, j, -1)
        count = count + accept.long()
        current = torch.where(accept, j, current)
    bonus = _draw(p, race)

    is_greedy = temperature <= 0  # [N]
    accepted = torch.where(is_greedy[:, None], greedy[0], accepted[:, :num_nodes].to(torch.int32))
    num_accepted = torch.where(is_greedy, greedy[1], count.to(torch.int32))
    return accepted, num_accepted, torch.where(is_greedy, greedy[2], bonus)


def tree_accept_loop(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tree_accept` written as a plain loop over sequences and tree levels (host syncs everywhere): the rules stated
    once more, directly, with the same random draws, for tests."""
    num_seqs, num_nodes, vocab_size = _check_tree_inputs(logits, tokens, parents)
    probs = target_probs(logits, temperature, top_k, top_p, min_p)
    u = uniform_noise(seeds, counters | ACCEPT_STREAM, num_nodes)
    race = -torch.log(uniform_noise(seeds, counters, vocab_size))
    parent_list, token_list = parents.tolist(), tokens.tolist()
    accepted = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)
    num_accepted = torch.zeros(num_seqs, dtype=torch.int32)
    bonus = torch.zeros(num_seqs, dtype=torch.int64)
    for i in range(num_seqs):
        if float(temperature[i]) <= 0:
            # Every node whose whole path matches the target argmax; the deepest (lowest index on ties) wins.
            argmax = logits[i].argmax(dim=-1).tolist()
            best_path = [0]
            for j in range(1, num_nodes):
                path = [j]
                while path[-1] != 0:
                    path.append(parent_list[i][path[-1]])
                path.reverse()
                is_match = all(token_list[i][c] == argmax[parent_list[i][c]] for c in path[1:])
                if is_match and len(path) > len(best_path):
                    best_path = path
            accepted[i, : len(best_path)] = torch.tensor(best_path, dtype=torch.int32)
            num_accepted[i] = len(best_path)
            bonus[i] = argmax[best_path[-1]]
            continue
        path = [0]
        while True:
            node = path[-1]
            children = [j for j in range(num_nodes) if parent_list[i][j] == node]
            p = probs[i, node].clone()
            q = None if draft_probs is None else draft_probs[i, node].float().clone()
            chosen = None
            for c in children:
                token = token_list[i][c]
                q_c = 1.0 if q is None else float(q[token])
                if float(u[i, c]) * q_c < float(p[token]):
                    chosen = c
                    break
                if q is None:
                    p[token] = 0.0
                    p = p / p.sum() if p.sum() > 0 else p
                else:
                    residual = (p - q).clamp(min=0.0)
                    if residual.sum() > 0:
                        p = residual / residual.sum()
                    else:
                        p[token] = 0.0
                        p = p / p.sum() if p.sum() > 0 else p
                    q[token] = 0.0
                    q = q / q.sum() if q.sum() > 0 else q
            if chosen is None:
                bonus[i] = int(torch.where(p > 0, p / race[i], -1.0).argmax())
                break
            path.append(chosen)
        accepted[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
        num_accepted[i] = len(path)
    return accepted, num_accepted, bonus
