"""Tree acceptance with the verify step's result rows (`ops.tree_accept`): the reference against the composition it
replaces (`tree_accept_greedy`'s node walk, the padded rows' zero count, `VerifyOutput.emitted_tokens` and the result
row) on random trees and by hand, and the Triton launch against the reference on trees of awkward sizes with padded
rows, forced paths and sentinel-filled outputs."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from jetserve.ops.sampling import tree_accept_greedy
from jetserve.ops.tree_accept import reference as ref
from jetserve.spec.tree import DraftTree, ancestor_mask
from jetserve.spec.verifier import VerifyOutput


class Rows(NamedTuple):
    """A tree's fields as the op reads them (`ops.tree_accept.Tree`)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor

    def to(self, device: str) -> Rows:
        return Rows(*(t.to(device) for t in self))


def trees(num_seqs: int, num_nodes: int, seed: int, vocab: int = 6) -> tuple[torch.Tensor, Rows, torch.Tensor]:
    """(target [N, T_d], the tree's rows, slots [N] int32): random trees whose nodes carry the target's token at their
    parent two times in three (the rest random from a small vocabulary, so that some match too), with equally deep
    matching paths and duplicate siblings; every third row padded."""
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
    tokens = torch.where(planted, target.gather(1, parents.long().clamp(min=0)), tokens)
    slots = torch.arange(1, num_seqs + 1, dtype=torch.int32)
    slots[::3] = 0
    return target, Rows(tokens, parents, depths, ancestor_mask(parents, num_levels=num_nodes)), slots


def composition(target: torch.Tensor, tree: Rows, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the tree verify step computed before the op: the node walk, padded rows' count 0, emitted tokens, the
    result row."""
    logits = torch.nn.functional.one_hot(target, int(target.max()) + 1).float()  # [N, T_d, V]: argmax = target
    accepted, num_accepted, bonus = tree_accept_greedy(logits, tree.tokens, tree.parents)
    num_accepted = torch.where(slots > 0, num_accepted, 0)
    draft = DraftTree(*tree, positions=tree.depths.long(), scores=torch.zeros(tree.tokens.shape))
    emitted = VerifyOutput(accepted, num_accepted, bonus, []).emitted_tokens(draft)
    depth = tree.depths.max(dim=1, keepdim=True).values.long()
    return accepted, num_accepted, bonus, torch.cat([emitted, num_accepted.long()[:, None], depth], dim=1)


@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 1), (4, 2), (9, 8), (12, 13), (5, 33)])
def test_reference_is_the_composition_it_replaces(num_seqs: int, num_nodes: int) -> None:
    target, tree, slots = trees(num_seqs, num_nodes, seed=num_nodes)
    got = ref.tree_accept_emit(target, tree, slots)
    for g, w in zip(got, composition(target, tree, slots), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    if num_nodes >= 8:  # the random trees reach past the root on some rows, and stop at it on others
        counts = composition(target, tree, torch.ones_like(slots))[1]
        assert counts.max() > 2 and counts.min() < counts.max()


def test_a_draft_tree_is_taken_as_it_is() -> None:
    """The verifier hands the op its `DraftTree`: the same result as its four fields."""
    target, tree, slots = trees(4, 8, seed=5)
    draft = DraftTree(*tree, positions=tree.depths.long(), scores=torch.zeros(tree.tokens.shape))
    for a, b in zip(ref.tree_accept_emit(target, draft, slots), ref.tree_accept_emit(target, tree, slots), strict=True):
        assert torch.equal(a, b)


def test_by_hand_the_deepest_path_then_the_lowest_index() -> None:
    # Root 0; children 1, 2 (both match); 3 under 1 (wrong), 4 under 2 (right), 5 under 2 (right, a later index);
    # 6 under 4 (wrong). The deepest matching nodes are 4 and 5 (depth 2): node 4 wins.
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, 4]], dtype=torch.int32)
    depths = torch.tensor([[0, 1, 1, 2, 2, 2, 3]], dtype=torch.int32)
    target = torch.tensor([[7, 1, 8, 0, 3, 5, 2]])  # argmax at each node
    tokens = torch.tensor([[9, 7, 7, 2, 8, 8, 4]])
    tree = Rows(tokens, parents, depths, ancestor_mask(parents, num_levels=3))
    accepted, num_accepted, bonus, result = ref.tree_accept_emit(target, tree, torch.tensor([4]))
    assert accepted.tolist() == [[0, 2, 4, -1, -1, -1, -1]] and num_accepted.tolist() == [3]
    assert bonus.tolist() == [3]  # the target at node 4
    assert result.tolist() == [[7, 8, 3, -1, -1, -1, -1, 3, 3]]  # drafts of nodes 2, 4, then the bonus; count, depth


def _forced(tree: Rows, last: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forced acceptance of the path to node last[i] of each row (its ancestors, root first) with `bonus`."""
    num_seqs, num_nodes = tree.tokens.shape
    accepted = torch.full((num_seqs, num_nodes), -1, dtype=torch.int32)
    count = torch.zeros(num_seqs, dtype=torch.int32)
    for i in range(num_seqs):
        nodes = torch.nonzero(tree.mask[i, last[i]]).flatten()  # ancestors in node order, which is depth order
        accepted[i, : len(nodes)], count[i] = nodes.int(), len(nodes)
    return accepted, count, bonus


def test_forced_paths_replace_the_acceptance() -> None:
    target, tree, slots = trees(4, 9, seed=3)
    forced = _forced(tree, tree.depths.argmax(dim=1), torch.tensor([11, 12, 13, 14]))
    accepted, num_accepted, bonus, result = ref.tree_accept_emit(target, tree, slots, forced)
    assert torch.equal(accepted, forced[0]) and torch.equal(bonus, forced[2])
    assert torch.equal(num_accepted, torch.where(slots > 0, forced[1], 0))
    for i in range(1, 3):  # rows 1 and 2 are not padded
        count = int(forced[1][i])
        drafts = [int(tree.tokens[i, a]) for a in forced[0][i, 1:count]]
        assert result[i].tolist() == [*drafts, 11 + i, *[-1] * (9 - count), count, count - 1]


def test_bad_arguments_are_one_line_errors() -> None:
    target, tree, slots = trees(3, 4, seed=1)
    with pytest.raises(ValueError, match="must match tokens"):
        ref.tree_accept_emit(target[:, :3], tree, slots)
    with pytest.raises(ValueError, match="mask"):
        ref.tree_accept_emit(target, tree._replace(mask=tree.mask.int()), slots)
    with pytest.raises(ValueError, match="slots"):
        ref.tree_accept_emit(target, tree, slots[:2])
    with pytest.raises(ValueError, match="integers"):
        ref.tree_accept_emit(target, tree._replace(depths=tree.depths.float()), slots)
    with pytest.raises(ValueError, match="forced"):
        ref.tree_accept_emit(target, tree, slots, (tree.tokens, slots[:1], slots))
    empty = Rows(tree.tokens[:, :0], tree.parents[:, :0], tree.depths[:, :0], tree.mask[:, :0, :0])
    with pytest.raises(ValueError, match="T_d ≥ 1"):
        ref.tree_accept_emit(target[:, :0], empty, slots)


KERNELS = "jetserve.ops.tree_accept.kernels"  # the module `op_kernels` (tests/ops/conftest.py) imports


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("forced", [False, True])
@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 1), (3, 2), (5, 7), (7, 8), (2, 14), (2, 31)])
def test_kernel_matches_reference(op_kernels, num_seqs: int, num_nodes: int, forced: bool) -> None:
    target, tree, slots = trees(num_seqs, num_nodes, seed=10 + num_nodes)
    extra = None
    if forced:  # the path to a random node of each row, and a random bonus
        gen = torch.Generator().manual_seed(num_seqs)
        last = torch.randint(0, num_nodes, (num_seqs,), generator=gen)
        extra = _forced(tree, last, torch.randint(0, 50, (num_seqs,), generator=gen))
    want = ref.tree_accept_emit(target, tree, slots, extra)
    got = op_kernels.tree_accept_emit(target.to(DEVICE), tree.to(DEVICE), slots.to(DEVICE),
                                   None if extra is None else tuple(t.to(DEVICE) for t in extra))  # fmt: skip
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w)


def test_kernel_takes_strided_and_expanded_inputs(op_kernels) -> None:
    """tokens as a column slice (the forced modes build the tree's tokens with a cat) and an expanded mask."""
    target, tree, slots = trees(1, 6, seed=2)
    wide = torch.cat([tree.tokens, tree.tokens], dim=1)[:, :6].repeat(3, 1)
    rows = Rows(wide, tree.parents.repeat(3, 1), tree.depths.repeat(3, 1), tree.mask.expand(3, -1, -1))
    got = op_kernels.tree_accept_emit(target.repeat(3, 1).to(DEVICE), rows.to(DEVICE), slots.repeat(3).to(DEVICE))
    want = ref.tree_accept_emit(target.repeat(3, 1), Rows(*(t.contiguous() for t in rows)), slots.repeat(3))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_seqs, num_nodes", [(1, 8), (16, 8), (64, 16), (256, 8), (4, 64)])
def test_gpu_kernel_matches_reference_at_verify_shapes(op_kernels, num_seqs: int, num_nodes: int) -> None:
    target, tree, slots = trees(num_seqs, num_nodes, seed=num_seqs, vocab=151936)
    got = op_kernels.tree_accept_emit(target.cuda(), tree.to("cuda"), slots.cuda())
    for g, w in zip(got, ref.tree_accept_emit(target, tree, slots), strict=True):
        assert torch.equal(g.cpu(), w)
