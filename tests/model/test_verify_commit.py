"""VERIFY then commit through the whole model (all three layer kinds) == plain prefill/decode of the accepted path."""

import dataclasses

import pytest
import torch
from model_helpers import jet_states, random_tokens

from jetserve.model.static_cache import StaticCache


def _path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("parents", [[-1, 0, 1, 2, 3], [-1, 0, 0, 1, 2, 1, 5]], ids=["chain", "tree"])
def test_verify_logits_equal_decoding_each_ancestry_path(model, parents):
    prompt = random_tokens(23, 0)  # longer than the SWA window (16)
    tree = random_tokens(len(parents), 1)
    cache = StaticCache(model, 1, 64)
    model(cache.batch([0], [prompt]))
    fb = cache.verify_batch([0], torch.tensor([tree]), torch.tensor([parents]))
    verify_logits = model.compute_logits(model(fb))  # [T_d, vocab]
    for node in range(len(parents)):
        path = [tree[j] for j in _path(parents, node)]
        plain = StaticCache(model, 1, 64)
        hidden = model(plain.batch([0], [prompt + path]))
        torch.testing.assert_close(verify_logits[node], model.compute_logits(hidden[-1:])[0], rtol=1e-4, atol=1e-4)


def test_rounds_of_verify_and_commit_equal_prefill_of_acceptedrandom_tokens(model):
    """Several rounds with different acceptance (including 1 after ≥ 2, and a tree branch), two sequences."""
    prompts = [random_tokens(20, 2), random_tokens(5, 3)]
    cache = StaticCache(model, 2, 96)
    model(cache.batch([0, 1], prompts))
    history = [list(p) for p in prompts]
    parents = torch.tensor([[-1, 0, 1, 1, 3, 2]] * 2, dtype=torch.int32)
    rounds = [([0, 1, 3, 4], [0, 1, 2, 5]), ([0], [0, 1, 2]), ([0, 1, 2], [0, 1, 3, 4]), ([0, 1], [0])]
    for r, paths in enumerate(rounds):
        tokens = torch.tensor([random_tokens(6, 10 + 2 * r), random_tokens(6, 11 + 2 * r)])
        fb = cache.verify_batch([0, 1], tokens, parents)
        model(fb)
        accepted = torch.full((2, 6), -1, dtype=torch.int32)
        for i, path in enumerate(paths):
            accepted[i, : len(path)] = torch.tensor(path, dtype=torch.int32)
            history[i] += [int(tokens[i, j]) for j in path]
        num = torch.tensor([len(p) for p in paths], dtype=torch.int32)
        model.commit_verified(fb, accepted, num)
        cache.commit([0, 1], num.tolist())
    # The next decode after the rounds == decode after prefilling the accepted history.
    after = model.compute_logits(model(cache.batch([0, 1], [[7], [9]])))
    committed = [jet_states(model, i) for i in range(2)]
    for i, (h, nxt) in enumerate(zip(history, (7, 9), strict=True)):
        plain = StaticCache(model, 1, 96)
        model(plain.batch([0], [h]))
        expected = model.compute_logits(model(plain.batch([0], [[nxt]])))
        torch.testing.assert_close(after[i], expected[0], rtol=1e-4, atol=1e-4)
        for a, b in zip(committed[i], jet_states(model, 0), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_chain_rounds_move_no_kv_and_equal_prefill_of_accepted(model, monkeypatch):
    """A chain's accepted nodes already sit at their final K/V positions: `commit_verified` on a chain batch launches
    no K/V move, and rounds of chain verify and commit (acceptance 1 to all, the SWA window passed) still equal
    prefilling the accepted tokens."""
    import jetserve.model.attention as attention

    moves = []
    monkeypatch.setattr(attention, "kv_cache_commit", lambda *args, **kwargs: moves.append(args))
    prompts = [random_tokens(14, 4), random_tokens(3, 5)]
    cache = StaticCache(model, 2, 96)
    model(cache.batch([0, 1], prompts))
    history = [list(p) for p in prompts]
    parents = torch.tensor([[-1, 0, 1, 2, 3]] * 2, dtype=torch.int32)
    for r, counts in enumerate([(5, 1), (1, 3), (2, 5), (4, 2)]):
        tokens = torch.tensor([random_tokens(5, 20 + 2 * r), random_tokens(5, 21 + 2 * r)])
        fb = dataclasses.replace(cache.verify_batch([0, 1], tokens, parents), tree_is_chain=True)
        model(fb)
        accepted = torch.arange(5, dtype=torch.int32).expand(2, 5).clone()
        for i, n in enumerate(counts):
            history[i] += tokens[i, :n].tolist()
        num = torch.tensor(counts, dtype=torch.int32)
        model.commit_verified(fb, accepted, num)
        cache.commit([0, 1], list(counts))
    assert moves == []
    after = model.compute_logits(model(cache.batch([0, 1], [[7], [9]])))
    for i, (h, nxt) in enumerate(zip(history, (7, 9), strict=True)):
        plain = StaticCache(model, 1, 96)
        model(plain.batch([0], [h]))
        expected = model.compute_logits(model(plain.batch([0], [[nxt]])))
        torch.testing.assert_close(after[i], expected[0], rtol=1e-4, atol=1e-4)
