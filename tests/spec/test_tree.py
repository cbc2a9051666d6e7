"""DraftTree construction from fabricated draft log-probs: chains, trees, best-N selection, ancestry invariants."""

import pytest
import torch

from jetserve.spec.tree import DraftLevel, build_draft_tree, chain_buffers, chain_tree, expand_frontier, first_level


def _draft_levels(num_seqs, vocab, topk, num_steps, seed):
    """Run the EAGLE level loop on random draft distributions; also return every candidate for a brute-force check:
    per sequence a list of (token, parent candidate or -1, own log-prob)."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(num_seqs, vocab, generator=gen) * 2, dim=-1)
    top_lp, top_tok = logprobs.topk(topk, dim=-1)
    level, frontier_index, frontier_scores = first_level(top_lp, top_tok)
    levels = [level]
    flat = [[(int(top_tok[i, c]), -1, float(top_lp[i, c])) for c in range(topk)] for i in range(num_seqs)]
    offset = 0
    for _ in range(1, num_steps):
        child_lp = torch.log_softmax(torch.randn(num_seqs, topk, vocab, generator=gen) * 2, dim=-1)
        lp, tok = child_lp.topk(topk, dim=-1)  # [N, k, k]
        level, next_index, next_scores = expand_frontier(frontier_scores, frontier_index, lp, tok)
        width_prev = levels[-1].tokens.shape[1]
        for i in range(num_seqs):
            for f in range(topk):
                for c in range(topk):
                    parent = offset + int(frontier_index[i, f])
                    flat[i].append((int(tok[i, f, c]), parent, float(lp[i, f, c])))
        offset += width_prev
        levels.append(level)
        frontier_index, frontier_scores = next_index, next_scores
    return levels, flat


def _brute_force(flat, num_draft_tokens):
    """Cumulative scores of every candidate, and the chosen set: best num_draft_tokens - 1, ties to lower index."""
    scores = []
    for _token, parent, lp in flat:
        scores.append(lp + (scores[parent] if parent >= 0 else 0.0))
    order = sorted(range(len(flat)), key=lambda c: (-scores[c], c))
    return scores, sorted(order[: num_draft_tokens - 1])


def _check_structure(tree):
    num_seqs, num_nodes = tree.tokens.shape
    assert tree.parents[:, 0].eq(-1).all() and tree.depths[:, 0].eq(0).all()
    for i in range(num_seqs):
        for j in range(1, num_nodes):
            parent = int(tree.parents[i, j])
            assert 0 <= parent < j, "parents precede children"
            assert int(tree.depths[i, j]) == int(tree.depths[i, parent]) + 1
            expected = torch.zeros(num_nodes, dtype=torch.bool)
            node = j
            while node >= 0:
                expected[node] = True
                node = int(tree.parents[i, node])
            assert torch.equal(tree.mask[i, j], expected)
        assert torch.equal(tree.mask[i, 0], torch.nn.functional.one_hot(torch.tensor(0), num_nodes).bool())


@pytest.mark.parametrize("topk, num_steps, num_draft_tokens", [(2, 3, 6), (3, 4, 12), (2, 2, 7), (4, 1, 3)])
def test_tree_keeps_best_nodes_by_cumulative_logprob(topk, num_steps, num_draft_tokens):
    num_seqs = 4
    levels, flat = _draft_levels(num_seqs, vocab=50, topk=topk, num_steps=num_steps, seed=topk * 10 + num_steps)
    root = torch.tensor([7, 8, 9, 10])
    root_positions = torch.tensor([0, 5, 17, 3])
    tree = build_draft_tree(root, levels, num_draft_tokens, root_positions)
    assert tree.tokens.shape == (num_seqs, num_draft_tokens)
    _check_structure(tree)
    assert torch.equal(tree.positions, root_positions[:, None] + tree.depths.long())
    assert torch.equal(tree.tokens[:, 0], root)
    for i in range(num_seqs):
        scores, chosen = _brute_force(flat[i], num_draft_tokens)
        # Node j (j >= 1) is the (j-1)-th chosen candidate; its parent node is its parent candidate's node.
        node_of = {c: n + 1 for n, c in enumerate(chosen)}
        for n, c in enumerate(chosen, start=1):
            token, parent, _ = flat[i][c]
            assert int(tree.tokens[i, n]) == token
            assert int(tree.parents[i, n]) == (0 if parent < 0 else node_of[parent])
            assert float(tree.scores[i, n]) == pytest.approx(scores[c], abs=1e-5)


def test_topk_one_is_a_chain():
    num_seqs, num_steps = 3, 5
    levels, _ = _draft_levels(num_seqs, vocab=30, topk=1, num_steps=num_steps, seed=3)
    root = torch.tensor([1, 2, 3])
    positions = torch.tensor([4, 0, 9])
    tree = build_draft_tree(root, levels, num_steps + 1, positions)
    chain = chain_tree(tree.tokens, positions)
    for name in ("tokens", "parents", "depths", "mask", "positions"):
        assert torch.equal(getattr(tree, name), getattr(chain, name)), name
    assert torch.equal(tree.parents[0], torch.arange(-1, num_steps, dtype=torch.int32))
    assert torch.equal(tree.mask[0], torch.tril(torch.ones(num_steps + 1, num_steps + 1, dtype=torch.bool)))


def test_ancestors_kept_when_scores_tie_or_rise():
    """A child whose log-prob is 0 ties its parent, and scores handed in may even exceed the parent's: the parent is
    still kept whenever the child is."""
    root = torch.tensor([0])
    level0 = DraftLevel(tokens=torch.tensor([[5, 6]]), scores=torch.tensor([[-1.0, -3.0]]), parents=torch.zeros(1, 2))
    # Children of candidate 1 (score -3) claim -0.5 (above every other), children of 0 tie it at -1.
    level1 = DraftLevel(
        tokens=torch.tensor([[7, 8, 9]]),
        scores=torch.tensor([[-1.0, -0.5, -0.5]]),
        parents=torch.tensor([[0, 1, 1]]),
    )
    tree = build_draft_tree(root, [level0, level1], 3, torch.tensor([10]))
    _check_structure(tree)
    # Best two after capping: candidate 0 (-1), its child 7 (-1, tie → after its parent); 6's children cap at -3.
    assert tree.tokens.tolist() == [[0, 5, 7]]
    assert tree.parents.tolist() == [[-1, 0, 1]]


def test_bad_sizes_are_errors():
    levels, _ = _draft_levels(2, vocab=10, topk=2, num_steps=2, seed=0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build_draft_tree(torch.tensor([1, 2]), levels, 8, torch.tensor([0, 0]))  # only 6 candidates
    with pytest.raises(ValueError, match="root_positions"):
        build_draft_tree(torch.tensor([1, 2]), levels, 3, torch.tensor([0]))


def test_chain_tree_fills_chain_buffers():
    """`chain_buffers` holds a chain's parents, depths and mask and zeros; `chain_tree` fills its tokens, positions
    (root + depth) and scores, and equals the general builder's chain."""
    tokens = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    empty = chain_buffers(2, 4, tokens.device)
    assert torch.equal(empty.parents, torch.tensor([[-1, 0, 1, 2]] * 2, dtype=torch.int32))
    assert torch.equal(empty.depths, torch.tensor([[0, 1, 2, 3]] * 2, dtype=torch.int32))
    assert torch.equal(empty.mask, torch.ones(4, 4, dtype=torch.bool).tril().expand(2, -1, -1))
    assert not empty.tokens.any() and not empty.positions.any() and not empty.scores.any()
    scores = torch.tensor([[0.0, -1.0, -2.0, -4.0], [0.0, -0.5, -0.7, -0.9]])
    tree = chain_tree(tokens, torch.tensor([3, 9]), scores)
    assert torch.equal(tree.tokens, tokens) and torch.equal(tree.scores, scores)
    assert torch.equal(tree.positions, torch.tensor([[3, 4, 5, 6], [9, 10, 11, 12]]))
    assert tree.positions.dtype == torch.int64 and tree.tokens.dtype == torch.int64
