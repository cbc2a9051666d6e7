"""Tree acceptance with the verify step's result rows (`ops.tree_accept`): the reference against the composition it
replaces (`tree_accept_greedy`'s node walk, the padded rows' zero count, `VerifyOutput.emitted_tokens` and the result
row) on random trees and by hand, and the Triton launch against the reference on trees of awkward sizes with padded
rows, forced paths and sentinel-filled outputs."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops.sampling import tree_accept_greedy
from jetserve.ops.tree_accept import reference as ref
from jetserve.spec.tree import DraftTree, ancestor_mask
from jetserve.spec.verifier import VerifyOutput

SENTINEL = -12345  # what every new integer tensor holds in the kernel tests: an output left unwritten cannot pass


def trees(num_seqs: int, num_nodes: int, seed: int, vocab: int = 6) -> tuple[torch.Tensor, ...]:
    """(target, tokens, parents int32, depths int32 [N, T_d], mask [N, T_d, T_d], slots [N] int32): random trees
    whose nodes carry the target's token at their parent two times in three (the rest random from a small vocabulary,
    so that some match too), with equally deep matching paths and duplicate siblings; every third row padded."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)
    for j in range(1, num_nodes):
        parents[:, j] = torch.randint(0, j, (num_seqs,), generator=gen, dtype=torch.int32)
    depths = torch.zeros(num_seqs, num_nodes, dtype=torch.int32)
    for j in range(1, num_nodes):
        depths[:, j] = depths.gather(1, parents[:, j : j + 1].long()).squeeze(1) + 1
    target = torch.randint(0, vocab, (num_seqs, num_nodes), generator=gen)
    tokens = torch.randint(0, vocab, (num_seqs, num_nodes), generator=gen)
    planted = torch.rand(num_seqs, num_nodes, generator=gen) < 2 / 3
    at_parent = target.gather(1, parents.long().clamp(min=0))
    tokens = torch.where(planted, at_parent, tokens)
    slots = torch.arange(1, num_seqs + 1, dtype=torch.int32)
    slots[::3] = 0
    return target, tokens, parents, depths, ancestor_mask(parents, num_levels=num_nodes), slots


def composition(target, tokens, parents, depths, mask, slots) -> tuple[torch.Tensor, ...]:
    """What the tree verify step computed before the op: the node walk, padded rows' count 0, emitted tokens, the
    result row."""
    logits = torch.nn.functional.one_hot(target, int(target.max()) + 1).float()  # [N, T_d, V]: argmax = target
    accepted, num_accepted, bonus = tree_accept_greedy(logits, tokens, parents)
    num_accepted = torch.where(slots > 0, num_accepted, 0)
    positions = depths.long()
    tree = DraftTree(tokens, parents, depths, mask, positions, torch.zeros(tokens.shape))
    emitted = VerifyOutput(accepted, num_accepted, bonus, []).emitted_tokens(tree)
    depth = depths.max(dim=1, keepdim=True).values.long()
    return accepted, num_accepted, bonus, torch.cat([emitted, num_accepted.long()[:, None], depth], dim=1)


@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 1), (4, 2), (9, 8), (12, 13), (5, 33)])
def test_reference_is_the_composition_it_replaces(num_seqs: int, num_nodes: int) -> None:
    args = trees(num_seqs, num_nodes, seed=num_nodes)
    got = ref.tree_accept_emit(*args)
    for g, w in zip(got, composition(*args), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    if num_nodes >= 8:  # the random trees reach past the root on some rows, and stop at it on others
        counts = composition(*args[:5], torch.ones_like(args[5]))[1]
        assert counts.max() > 2 and counts.min() < counts.max()


def test_by_hand_the_deepest_path_then_the_lowest_index() -> None:
    # Root 0; children 1, 2 (both match); 3 under 1 (wrong), 4 under 2 (right), 5 under 2 (right, a later index);
    # 6 under 4 (wrong). The deepest matching nodes are 4 and 5 (depth 2): node 4 wins.
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 4]], dtype=torch.int32)
    depths = torch.tensor([[0, 1, 1, 2, 2, 2, 3]], dtype=torch.int32)
    target = torch.tensor([[7, 1, 8, 0, 3, 5, 2]])  # argmax at each node
    tokens = torch.tensor([[9, 7, 7, 2, 8, 8, 4]])
    mask = ancestor_mask(parents, num_levels=3)
    accepted, num_accepted, bonus, result = ref.tree_accept_emit(target, tokens, parents, depths, mask,
                                                                 torch.tensor([4]))  # fmt: skip
    assert accepted.tolist() == [[0, 2, 4, -1, -1, -1, -1]] and num_accepted.tolist() == [3]
    assert bonus.tolist() == [3]  # the target at node 4
    assert result.tolist() == [[7, 8, 3, -1, -1, -1, -1, 3, 3]]  # drafts of nodes 2, 4, then the bonus; count, depth


def test_forced_paths_replace_the_acceptance() -> None:
    target, tokens, parents, depths, mask, slots = trees(4, 9, seed=3)
    deepest = depths.argmax(dim=1)  # [N]
    path = [[int(a) for a in torch.nonzero(mask[i, deepest[i]]).flatten()] for i in range(4)]  # ancestors in order
    accepted = torch.full((4, 9), -1, dtype=torch.int32)
    for i, nodes in enumerate(path):
        accepted[i, : len(nodes)] = torch.tensor(nodes, dtype=torch.int32)
    count = torch.tensor([len(p) for p in path], dtype=torch.int32)
    forced_bonus = torch.tensor([11, 12, 13, 14])
    got = ref.tree_accept_emit(target, tokens, parents, depths, mask, slots, (accepted, count, forced_bonus))
    assert torch.equal(got[0], accepted) and torch.equal(got[2], forced_bonus)
    assert got[1].tolist() == [0 if slots[i] == 0 else len(path[i]) for i in range(4)]
    for i in range(1, 3):  # rows 1 and 2 are not padded
        drafts = [int(tokens[i, a]) for a in path[i][1:]]
        assert got[3][i].tolist() == [*drafts, 11 + i, *[-1] * (9 - len(path[i])), len(path[i]), len(path[i]) - 1]


def test_bad_arguments_are_one_line_errors() -> None:
    target, tokens, parents, depths, mask, slots = trees(3, 4, seed=1)
    with pytest.raises(ValueError, match="must match tokens"):
        ref.tree_accept_emit(target[:, :3], tokens, parents, depths, mask, slots)
    with pytest.raises(ValueError, match="mask"):
        ref.tree_accept_emit(target, tokens, parents, depths, mask.int(), slots)
    with pytest.raises(ValueError, match="slots"):
        ref.tree_accept_emit(target, tokens, parents, depths, mask, slots[:2])
    with pytest.raises(ValueError, match="integers"):
        ref.tree_accept_emit(target, tokens, parents, depths.float(), mask, slots)
    with pytest.raises(ValueError, match="forced"):
        ref.tree_accept_emit(target, tokens, parents, depths, mask, slots, (tokens, slots[:1], slots))
    with pytest.raises(ValueError, match="T_d ≥ 1"):
        ref.tree_accept_emit(target[:, :0], tokens[:, :0], parents[:, :0], depths[:, :0], mask[:, :0, :0], slots)


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch):
    """The Triton module, with every new integer tensor (its outputs) filled with SENTINEL."""
    if not torch.cuda.is_available() and not envs.triton_interpret():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from jetserve.ops.tree_accept import kernels as module

    empty = torch.empty

    def sentinel_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t if t.is_floating_point() or t.dtype == torch.bool else t.fill_(SENTINEL)

    monkeypatch.setattr(torch, "empty", sentinel_empty)
    return module


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _forced(args: tuple[torch.Tensor, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forced path per row: the ancestors of a random node, root first, and a random bonus."""
    mask = args[4]
    num_seqs, num_nodes = args[1].shape
    gen = torch.Generator().manual_seed(seed)
    last = torch.randint(0, num_nodes, (num_seqs,), generator=gen)
    accepted = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)
    count = torch.zeros(num_seqs, dtype=torch.int32)
    for i in range(num_seqs):
        nodes = torch.nonzero(mask[i, last[i]]).flatten()
        accepted[i, : len(nodes)], count[i] = nodes.int(), len(nodes)
    return accepted, count, torch.randint(0, 50, (num_seqs,), generator=gen)


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 1), (3, 2), (5, 7), (7, 8), (2, 14), (2, 31)])
def test_kernel_matches_reference(kernels, num_seqs: int, num_nodes: int, forced: bool) -> None:
    args = trees(num_seqs, num_nodes, seed=10 + num_nodes)
    extra = _forced(args, num_seqs) if forced else None
    want = ref.tree_accept_emit(*args, extra)
    got = kernels.tree_accept_emit(*(t.to(DEVICE) for t in args), None if extra is None else
                                   tuple(t.to(DEVICE) for t in extra))  # fmt: skip
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w)


def test_kernel_takes_strided_and_expanded_inputs(kernels) -> None:
    """tokens as a column slice (the forced modes build the tree's tokens with a cat) and an expanded mask."""
    target, tokens, parents, depths, mask, slots = trees(1, 6, seed=2)
    wide = torch.cat([tokens, tokens], dim=1)[:, :6].repeat(3, 1)
    args = (target.repeat(3, 1), wide, parents.repeat(3, 1), depths.repeat(3, 1), mask.expand(3, -1, -1),
            slots.repeat(3))  # fmt: skip
    got = kernels.tree_accept_emit(*(t.to(DEVICE) for t in args))
    want = ref.tree_accept_emit(*(t.contiguous() for t in args))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 8), (16, 8), (64, 16), (256, 8), (4, 64)])
def test_gpu_kernel_matches_reference_at_verify_shapes(kernels, num_seqs: int, num_nodes: int) -> None:
    args = trees(num_seqs, num_nodes, seed=num_seqs, vocab=151936)
    got = kernels.tree_accept_emit(*(t.cuda() for t in args))
    for g, w in zip(got, ref.tree_accept_emit(*args), strict=True):
        assert torch.equal(g.cpu(), w)
