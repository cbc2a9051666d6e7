"""Chain acceptance with the verify step's result rows (`ops.chain_accept`): the reference against the composition it
replaces (`tree_accept_greedy` on the chain, the padding rows' zero count, `VerifyOutput.emitted_tokens` and the result
row), and the Triton launch against the reference on chains of awkward lengths with padded rows, forced counts and
sentinel-filled outputs."""

from __future__ import annotations

import pytest
import torch

from jetserve.ops.chain_accept import reference as ref
from jetserve.ops.sampling import tree_accept_greedy
from jetserve.spec.tree import chain_tree
from jetserve.spec.verifier import VerifyOutput


def chains(
    num_seqs: int, num_nodes: int, seed: int, vocab: int = 50
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target [N, T_d], tokens [N, T_d], slots [N] int32): row i's drafts match the target's tokens for a random run
    (every length from none to the whole chain appears across rows), then differ; every third row padded (slot 0)."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, (num_seqs, num_nodes), generator=gen)
    tokens = torch.randint(0, vocab, (num_seqs, num_nodes), generator=gen)
    for i in range(num_seqs):
        run = i % num_nodes  # drafts 1 .. run match
        tokens[i, 1 : run + 1] = target[i, :run]
        if run + 1 < num_nodes:
            tokens[i, run + 1] = (target[i, run] + 1) % vocab
    slots = torch.arange(1, num_seqs + 1, dtype=torch.int32)
    slots[::3] = 0
    return target, tokens, slots


def composition(target: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the verify step computed before the op: acceptance, padded rows' count 0, emitted tokens, result row."""
    logits = torch.nn.functional.one_hot(target, 64).float()  # [N, T_d, V]: argmax = target
    tree = chain_tree(tokens, torch.zeros(tokens.shape[0], dtype=torch.long))
    accepted, num_accepted, bonus = tree_accept_greedy(logits, tokens, tree.parents)
    num_accepted = torch.where(slots > 0, num_accepted, 0)
    emitted = VerifyOutput(accepted, num_accepted, bonus, []).emitted_tokens(tree)
    depth = tree.depths.max(dim=1, keepdim=True).values.long()
    return accepted, num_accepted, bonus, torch.cat([emitted, num_accepted.long()[:, None], depth], dim=1)


@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 1), (4, 2), (7, 7), (9, 5)])
def test_reference_is_the_composition_it_replaces(num_seqs: int, num_nodes: int) -> None:
    target, tokens, slots = chains(num_seqs, num_nodes, seed=num_nodes)
    got = ref.chain_accept_emit(target, tokens, slots)
    for g, w in zip(got, composition(target, tokens, slots), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    accepted, num_accepted, bonus, result = got
    for i in range(num_seqs):  # the run built into row i, by hand
        run = i % num_nodes
        assert bonus[i] == target[i, run] and accepted[i].tolist() == [*range(run + 1), *[-1] * (num_nodes - run - 1)]
        count = run + 1 if slots[i] > 0 else 0
        want_row = [*tokens[i, 1:count].tolist(), *[int(bonus[i])] * (count > 0), *[-1] * (num_nodes - count)]
        assert num_accepted[i] == count and result[i].tolist() == [*want_row, count, num_nodes - 1]


def test_forced_counts_replace_the_acceptance() -> None:
    target, tokens, slots = chains(5, 6, seed=3)
    count = torch.tensor([1, 6, 3, 2, 4], dtype=torch.int32)
    forced_bonus = torch.tensor([11, 12, 13, 14, 15])
    accepted, num_accepted, bonus, result = ref.chain_accept_emit(target, tokens, slots, (count, forced_bonus))
    assert torch.equal(bonus, forced_bonus)
    assert accepted[1].tolist() == list(range(6)) and accepted[3].tolist() == [0, 1, -1, -1, -1, -1]
    assert num_accepted.tolist() == [0, 6, 3, 0, 4]  # rows 0 and 3 padded
    assert result[2].tolist() == [*tokens[2, 1:3].tolist(), 13, -1, -1, -1, 3, 5]
    assert result[0].tolist() == [-1] * 6 + [0, 5]


def test_bad_arguments_are_one_line_errors() -> None:
    target, tokens, slots = chains(3, 4, seed=1)
    with pytest.raises(ValueError, match="must match tokens"):
        ref.chain_accept_emit(target[:, :3], tokens, slots)
    with pytest.raises(ValueError, match="slots"):
        ref.chain_accept_emit(target, tokens, slots[:2])
    with pytest.raises(ValueError, match="integers"):
        ref.chain_accept_emit(target.float(), tokens, slots)
    with pytest.raises(ValueError, match="forced"):
        ref.chain_accept_emit(target, tokens, slots, (slots[:1], slots))
    with pytest.raises(ValueError, match="T_d ≥ 1"):
        ref.chain_accept_emit(target[:, :0], tokens[:, :0], slots)


KERNELS = "jetserve.ops.chain_accept.kernels"  # the module `op_kernels` (tests/ops/conftest.py) imports


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 1), (3, 2), (5, 7), (6, 9), (2, 14)])
def test_kernel_matches_reference(op_kernels, num_seqs: int, num_nodes: int, forced: bool) -> None:
    target, tokens, slots = chains(num_seqs, num_nodes, seed=10 + num_nodes)
    extra = None
    if forced:
        gen = torch.Generator().manual_seed(num_seqs)
        extra = (torch.randint(1, num_nodes + 1, (num_seqs,), generator=gen), torch.randint(0, 50, (num_seqs,)))
    want = ref.chain_accept_emit(target, tokens, slots, extra)
    moved = [t.to(DEVICE) for t in (target, tokens, slots)]
    got = op_kernels.chain_accept_emit(*moved, None if extra is None else tuple(t.to(DEVICE) for t in extra))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w)


def test_kernel_takes_strided_tokens(op_kernels) -> None:
    """tokens as a column slice (the forced modes build the chain with a cat; a caller may pass a view)."""
    target, tokens, slots = chains(4, 5, seed=2)
    wide = torch.cat([tokens, tokens], dim=1)[:, :5]
    got = op_kernels.chain_accept_emit(target.to(DEVICE), wide.to(DEVICE), slots.to(DEVICE))
    for g, w in zip(got, ref.chain_accept_emit(target, tokens, slots), strict=True):
        assert torch.equal(g.cpu(), w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 7), (16, 7), (64, 4), (256, 8)])
def test_gpu_kernel_matches_reference_at_verify_shapes(op_kernels, num_seqs: int, num_nodes: int) -> None:
    target, tokens, slots = chains(num_seqs, num_nodes, seed=num_seqs, vocab=151936)
    got = op_kernels.chain_accept_emit(target.cuda(), tokens.cuda(), slots.cuda())
    for g, w in zip(got, ref.chain_accept_emit(target, tokens, slots), strict=True):
        assert torch.equal(g.cpu(), w)
