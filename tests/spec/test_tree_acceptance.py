"""Tree acceptance (jetserve.ops.sampling.tree_acceptance): greedy on hand-made trees, batched == loop version, and
stochastic acceptance keeping the target distribution (chi-square at 1e-4) for chains and trees."""

import math

import pytest
import torch

from jetserve.ops.chain_accept import chain_accept_emit
from jetserve.ops.sampling import tree_accept, tree_accept_greedy, tree_accept_loop

VOCAB = 8


def _logits_with_argmax(argmax, seed=0):
    """logits [N, T_d, VOCAB] whose argmax at [i, j] is argmax[i][j], other entries random below it."""
    target = torch.tensor(argmax)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.rand(*target.shape, VOCAB, generator=gen)
    return logits.scatter(2, target[..., None], 3.0)


def _greedy_params(num_seqs):
    return dict(
        temperature=torch.zeros(num_seqs),
        top_k=torch.zeros(num_seqs, dtype=torch.int32),
        top_p=torch.ones(num_seqs),
        min_p=torch.zeros(num_seqs),
        seeds=torch.arange(num_seqs, dtype=torch.int64),
        counters=torch.zeros(num_seqs, dtype=torch.int64),
    )


def _all_greedy(logits, tokens, parents):
    """Greedy acceptance through every entry point, checked to agree; returns the lists."""
    out = tree_accept_greedy(logits, tokens, parents)
    params = _greedy_params(tokens.shape[0])
    for other in (tree_accept(logits, tokens, parents, **params), tree_accept_loop(logits, tokens, parents, **params)):
        for a, b in zip(out, other, strict=True):
            assert torch.equal(a, b)
    assert out[0].dtype == torch.int32 and out[1].dtype == torch.int32 and out[2].dtype == torch.int64
    return [x.tolist() for x in out]


@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 2), (5, 4), (7, 9)])
def test_chain_greedy_equals_tree_greedy(num_seqs, num_nodes):
    """`chain_accept_emit` (from the target's argmax, no padded rows) gives `tree_accept_greedy`'s three outputs on
    chains whose drafts follow the target's argmax for a random number of levels, then one wrong token, then random
    ones (which may match again)."""
    gen = torch.Generator().manual_seed(num_seqs * 100 + num_nodes)
    logits = torch.randn(num_seqs, num_nodes, VOCAB, generator=gen)
    target = logits.argmax(dim=-1)  # [N, T_d]
    tokens = torch.randint(0, VOCAB, (num_seqs, num_nodes), generator=gen)
    for i in range(num_seqs):
        # drafts 1..run right, run + 1 wrong; row 0 accepts every draft
        run = num_nodes - 1 if i == 0 else int(torch.randint(0, num_nodes, (1,), generator=gen))
        tokens[i, 1 : run + 1] = target[i, :run]
        if run + 1 < num_nodes:
            tokens[i, run + 1] = (target[i, run] + 1) % VOCAB
    parents = (torch.arange(num_nodes) - 1).to(torch.int32).expand(num_seqs, -1)
    slots = torch.arange(1, num_seqs + 1)
    chain, tree = chain_accept_emit(target, tokens, slots)[:3], tree_accept_greedy(logits, tokens, parents)
    for a, b in zip(chain, tree, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert int(chain[1][0]) == num_nodes


def test_greedy_chain_none_all_partial_mixed():
    # Chain of 4 nodes: node 0 the last committed token, drafts at 1..3. Target argmax per node per sequence.
    parents = torch.tensor([[-1, 0, 1, 2]] * 4, dtype=torch.int32)
    argmax = [[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [1, 2, 2, 7]]
    tokens = torch.tensor(
        [
            [9, 0, 4, 5],  # first draft wrong: nothing accepted, bonus = argmax at the root
            [9, 3, 4, 5],  # all three right: bonus = argmax at node 3
            [9, 3, 4, 0],  # two right
            [9, 1, 7, 2],  # first right, second wrong (a later match does not count)
        ]
    )
    accepted, num_accepted, bonus = _all_greedy(_logits_with_argmax(argmax), tokens, parents)
    assert num_accepted == [1, 4, 3, 2]
    assert accepted == [[0, -1, -1, -1], [0, 1, 2, 3], [0, 1, 2, -1], [0, 1, -1, -1]]
    assert bonus == [3, 6, 5, 2]


def test_greedy_tree_follows_the_matching_branch():
    # Root's children 1 (wrong) and 2 (right); 3 under 1; 4 (right) and 5 (wrong) under 2; 6 (right) under 4.
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 4], [-1, 0, 0, 1, 2, 2, 4]], dtype=torch.int32)
    argmax = [[5, 1, 2, 0, 3, 0, 4], [6, 1, 2, 0, 3, 0, 4]]
    tokens = torch.tensor([[0, 4, 5, 1, 2, 7, 3], [0, 4, 5, 1, 2, 7, 3]])
    accepted, num_accepted, bonus = _all_greedy(_logits_with_argmax(argmax, 1), tokens, parents)
    assert accepted[0] == [0, 2, 4, 6, -1, -1, -1] and num_accepted[0] == 4 and bonus[0] == 4
    # Sequence 1: the root's argmax (6) is no child: nothing accepted.
    assert accepted[1] == [0, -1, -1, -1, -1, -1, -1] and num_accepted[1] == 1 and bonus[1] == 6


def test_greedy_prefers_the_longer_of_two_matching_paths():
    # Duplicate sibling tokens (both match); only the second one's child matches too.
    parents = torch.tensor([[-1, 0, 0, 1, 2]], dtype=torch.int32)
    argmax = [[5, 1, 2, 0, 0]]
    tokens = torch.tensor([[0, 5, 5, 7, 2]])
    accepted, num_accepted, bonus = _all_greedy(_logits_with_argmax(argmax, 2), tokens, parents)
    assert accepted == [[0, 2, 4, -1, -1]] and num_accepted == [3] and bonus == [0]


def _random_tree(num_seqs, num_nodes, gen):
    parents = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)
    for j in range(1, num_nodes):
        parents[:, j] = torch.randint(0, j, (num_seqs,), generator=gen, dtype=torch.int32)
    return parents


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_batched_equals_loop_version(with_draft_probs):
    gen = torch.Generator().manual_seed(5)
    num_seqs, num_nodes, vocab = 24, 9, 12
    parents = _random_tree(num_seqs, num_nodes, gen)
    logits = torch.randn(num_seqs, num_nodes, vocab, generator=gen) * 1.5
    # Draft tokens from a distribution close to the target, so that paths get accepted at all depths.
    # (drawn with the test's generator: from the global one, the draw moved with the tests run before it, and one in
    # ~60 global seeds accepted no sequence's drafts short of depth 2)
    parent_logits = logits.gather(1, parents.clamp(min=0).long()[..., None].expand(-1, -1, vocab))
    probs = torch.softmax(parent_logits, dim=-1).reshape(-1, vocab)
    tokens = torch.multinomial(probs, 1, generator=gen).view(num_seqs, num_nodes)
    draft_probs = torch.softmax(logits + torch.randn(logits.shape, generator=gen), dim=-1) if with_draft_probs else None
    params = dict(
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.3] * 6),
        top_k=torch.tensor([0, 0, 5, 3, 0, 8] * 4, dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 1.0] * 8),
        min_p=torch.tensor([0.0] * 20 + [0.1] * 4),
        seeds=torch.arange(num_seqs, dtype=torch.int64) * 7919,
        counters=torch.full((num_seqs,), 3, dtype=torch.int64),
    )
    num_accepted_seen = set()
    for step in range(6):
        params["counters"] = params["counters"] + step
        batched = tree_accept(logits, tokens, parents, **params, draft_probs=draft_probs)
        looped = tree_accept_loop(logits, tokens, parents, **params, draft_probs=draft_probs)
        for a, b in zip(batched, looped, strict=True):
            assert torch.equal(a, b)
        num_accepted_seen |= set(batched[1].tolist())
    assert {1, 2, 3} <= num_accepted_seen


def _chi2_critical(df, z=3.719):
    """Wilson–Hilferty approximation of the chi-square quantile at one-sided level 1e-4 (z = 3.719)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(observed, expected):
    """Statistic and degrees of freedom over the cells with expected >= 5; a cell of probability 0 must stay empty."""
    assert observed[expected == 0].sum() == 0, "a token of target probability 0 was emitted"
    keep = expected >= 5
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


V = 6
TEMPERATURE, TOP_K = 0.9, 5


def _filtered(logits):
    """softmax(logits / T) over the TOP_K largest, renormalised (the target's distribution)."""
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    kth = probs.topk(TOP_K, dim=-1).values[..., -1:]
    probs = torch.where(probs >= kth, probs, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _children(q, k, num_trials, sampled, gen):
    """k distinct children per row of q [N, V]: drawn without replacement from q, or q's top-k (deterministic)."""
    if sampled:
        return torch.multinomial(q, k, replacement=False, generator=gen)
    return q.topk(k, dim=-1).indices


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("sampled_drafts", [True, False])
def test_stochastic_acceptance_keeps_target_distribution(topk, sampled_drafts):
    """Two draft levels; target p(. | context) from fixed tables. The first emitted token must follow p0, and the
    second, given a first token a that was accepted from the tree, must follow p1[a]: one chi-square over both."""
    gen = torch.Generator().manual_seed(11 + topk)
    num_trials = 40000
    target0 = torch.randn(V, generator=gen)  # logits at the root
    target1 = torch.randn(V, V, generator=gen)  # at a depth-1 node of token a
    target2 = torch.randn(V, V, V, generator=gen)  # at a depth-2 node of path (a, b)
    # Drafts that roughly know the target (as a trained draft does) but are clearly not it.
    q0 = torch.softmax(target0 + torch.randn(V, generator=gen), dim=-1)
    q1 = torch.softmax(target1 + torch.randn(V, V, generator=gen), dim=-1)

    # Node layout, level by level: root; its k children; each child's k children.
    first = _children(q0.expand(num_trials, V), topk, num_trials, sampled_drafts, gen)  # [N, k]
    second = torch.stack(
        [_children(q1[first[:, c]], topk, num_trials, sampled_drafts, gen) for c in range(topk)], dim=1
    )  # [N, k, k]
    tokens = torch.cat([torch.zeros(num_trials, 1, dtype=torch.long), first, second.reshape(num_trials, -1)], dim=1)
    parents = torch.tensor([-1] + [0] * topk + [1 + c for c in range(topk) for _ in range(topk)], dtype=torch.int32)
    parents = parents.expand(num_trials, -1).contiguous()
    first_of = first[:, torch.arange(topk).repeat_interleave(topk)]  # [N, k*k]: the depth-1 token above each leaf
    logits = torch.cat(
        [target0.expand(num_trials, 1, V), target1[first], target2[first_of, second.reshape(num_trials, -1)]], dim=1
    )
    uniform = torch.full((num_trials, topk * topk, V), 1.0 / V)
    draft_probs = torch.cat([q0.expand(num_trials, 1, V), q1[first], uniform], dim=1) if sampled_drafts else None
    params = dict(
        temperature=torch.full((num_trials,), TEMPERATURE),
        top_k=torch.full((num_trials,), TOP_K, dtype=torch.int32),
        top_p=torch.ones(num_trials),
        min_p=torch.zeros(num_trials),
        seeds=torch.arange(num_trials, dtype=torch.int64) * 1000003 + 17,
        counters=torch.full((num_trials,), 5, dtype=torch.int64),
    )
    accepted, num_accepted, bonus = tree_accept(logits, tokens, parents, **params, draft_probs=draft_probs)

    node_tokens = lambda d: tokens.gather(1, accepted[:, d : d + 1].long().clamp(min=0)).squeeze(1)  # noqa: E731
    emitted1 = torch.where(num_accepted >= 2, node_tokens(1), bonus)  # [N]
    has_second = num_accepted >= 2
    emitted2 = torch.where(num_accepted >= 3, node_tokens(2), bonus)  # valid where has_second

    p0, p1 = _filtered(target0), _filtered(target1)
    observed = [torch.bincount(emitted1, minlength=V).float()]
    expected = [num_trials * p0]
    for a in range(V):
        rows = has_second & (emitted1 == a)
        observed.append(torch.bincount(emitted2[rows], minlength=V).float())
        expected.append(rows.sum() * p1[a])
    stat, df = _chi2(torch.cat(observed), torch.cat(expected))
    # Cells: TOP_K first tokens, and TOP_K second tokens after each of at least `topk` accepted first tokens.
    assert df >= TOP_K * (1 + topk) - 3 and has_second.float().mean() > 0.2
    assert stat < _chi2_critical(df), f"chi-square {stat:.1f} over {df} degrees of freedom"
    # The test has power: the same counts are far from the draft's distribution.
    assert _chi2(observed[0], num_trials * q0)[0] > 10 * _chi2_critical(V - 1)


def test_input_shapes_are_checked():
    logits = torch.randn(2, 3, VOCAB)
    with pytest.raises(ValueError, match="tokens and parents"):
        tree_accept_greedy(logits, torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.int32))
    params = _greedy_params(2)
    params["seeds"] = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="seeds"):
        tree_accept(logits, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.int32), **params)


def test_next_tree_inputs_take_the_bonus_and_the_accepted_count():
    """A verify step launched ahead takes its roots and prefix moves from the step before's result rows on the device
    (`next_tree_inputs`): the last emitted token (the bonus) and the accepted node count; a padded row (count 0) gets
    root 0 and stays where it is."""
    from jetserve.spec.verifier import next_tree_inputs

    num_nodes = 4
    rows = torch.tensor(
        [
            [11, 12, 13, 14, 4, 3],  # every draft accepted: the bonus is the 4th token
            [21, -1, -1, -1, 1, 3],  # nothing accepted: the bonus alone
            [31, 32, -1, -1, 2, 2],
            [0, 0, 0, 0, 0, 0],  # a padded row
        ]
    )
    roots, count = next_tree_inputs(rows, num_nodes)
    assert roots.tolist() == [14, 21, 32, 0] and count.tolist() == [4, 1, 2, 0]
