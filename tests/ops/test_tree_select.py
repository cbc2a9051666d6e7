"""Draft-tree selection (`ops.tree_select`): the reference against a per-row loop of the same rules (cap, rank, keep,
renumber, ancestry) on random candidates with tied and -inf scores, and the Triton launch against the reference on
awkward shapes with sentinel-filled outputs."""

from __future__ import annotations

import math

import pytest
import torch

from jetserve.ops.tree_select import reference as ref
from jetserve.ops.tree_select.reference import Candidates


def candidates(num_seqs: int, topk: int, steps: int, seed: int) -> Candidates:
    """Candidates (root_tokens [N], tokens, scores, parents [N, M], root_positions [N]) for `steps` levels of `topk`
    candidates then topk² per level, each child of a random candidate of the level before; scores are cumulative
    log-probs rounded to a coarse grid (so that ties occur), one in seven -inf below its parent."""
    gen = torch.Generator().manual_seed(seed)
    widths = [topk] + [topk * topk] * (steps - 1)
    parents, own = [], []
    offset = 0
    for d, width in enumerate(widths):
        if d == 0:
            parents.append(torch.full((num_seqs, width), -1, dtype=torch.long))
        else:
            previous = widths[d - 1]
            parents.append(offset - previous + torch.randint(0, previous, (num_seqs, width), generator=gen))
        own.append(-(torch.rand(num_seqs, width, generator=gen) * 4).round() / 2)
        offset += width
    parents, own = torch.cat(parents, dim=1), torch.cat(own, dim=1)
    own[torch.rand(own.shape, generator=gen) < 1 / 7] = -math.inf
    scores = own.clone()
    for c in range(scores.shape[1]):  # cumulative: the parent's plus its own (parents precede children)
        has = parents[:, c] >= 0
        scores[has, c] += scores[has, parents[has, c]]
    tokens = torch.randint(0, 1000, own.shape, generator=gen)
    root = torch.randint(0, 1000, (num_seqs,), generator=gen)
    return Candidates(root, tokens, scores, parents, torch.arange(num_seqs) * 7)


def loop_select(candidates: Candidates, num_draft_tokens: int) -> list[dict]:
    """The rules one row at a time in Python: per row {token, parent, depth, ancestors, position, score} by node."""
    root_tokens, tokens, scores, parents, root_positions = candidates
    rows = []
    for i in range(tokens.shape[0]):
        num = tokens.shape[1]
        chain = []  # each candidate's ancestors-or-self, itself first
        for c in range(num):
            up, path = c, []
            while up >= 0:
                path.append(up)
                up = int(parents[i, up])
            chain.append(path)
        capped = [min(float(scores[i, a]) for a in chain[c]) for c in range(num)]
        order = sorted(range(num), key=lambda c: (-capped[c], c))
        kept = sorted(order[: num_draft_tokens - 1])
        node = {c: n + 1 for n, c in enumerate(kept)}
        row = {"token": [int(root_tokens[i])], "parent": [-1], "depth": [0], "ancestors": [{0}],
               "position": [int(root_positions[i])], "score": [0.0]}  # fmt: skip
        for c in kept:
            row["token"].append(int(tokens[i, c]))
            row["parent"].append(node.get(int(parents[i, c]), 0))
            row["depth"].append(len(chain[c]))
            row["ancestors"].append({0, *(node[a] for a in chain[c])})
            row["position"].append(int(root_positions[i]) + len(chain[c]))
            row["score"].append(capped[c])
        rows.append(row)
    return rows


@pytest.mark.parametrize("topk, steps, num_draft_tokens", [(2, 3, 8), (1, 4, 5), (3, 2, 12), (4, 3, 9), (2, 1, 2)])
def test_reference_keeps_the_rules_by_row(topk: int, steps: int, num_draft_tokens: int) -> None:
    args = candidates(5, topk, steps, seed=topk * 10 + steps)
    tokens, parents, depths, mask, positions, scores = ref.select_tree(args, num_draft_tokens, steps)
    assert (tokens.dtype, parents.dtype, depths.dtype, mask.dtype, positions.dtype, scores.dtype) == (
        torch.int64, torch.int32, torch.int32, torch.bool, torch.int64, torch.float32)  # fmt: skip
    for i, want in enumerate(loop_select(args, num_draft_tokens)):
        assert tokens[i].tolist() == want["token"] and parents[i].tolist() == want["parent"]
        assert depths[i].tolist() == want["depth"] and positions[i].tolist() == want["position"]
        assert scores[i].tolist() == want["score"]
        assert [set(torch.nonzero(r).flatten().tolist()) for r in mask[i]] == want["ancestors"]


def test_bad_arguments_are_one_line_errors() -> None:
    args = candidates(3, 2, 2, seed=1)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        ref.select_tree(args, args.tokens.shape[1] + 2, 2)
    with pytest.raises(ValueError, match="must match tokens"):
        ref.select_tree(args._replace(scores=args.scores[:, :3]), 4, 2)
    with pytest.raises(ValueError, match="root_positions"):
        ref.select_tree(args._replace(root_positions=args.root_positions[:2]), 4, 2)
    with pytest.raises(ValueError, match="floating"):
        ref.select_tree(args._replace(scores=args.scores.long()), 4, 2)
    with pytest.raises(ValueError, match="max_depth"):
        ref.select_tree(args, 4, 0)


KERNELS = "jetserve.ops.tree_select.kernels"  # the module `op_kernels` (tests/ops/conftest.py) imports


# The masks are poisoned with True, then with False, so that an entry left unwritten fails whichever it should hold
# (with True alone, a dropped store of the root column passed).
both_mask_fills = pytest.mark.parametrize("poisoned_outputs", [True, False], ids=["masks-true", "masks-false"],
                                          indirect=True)  # fmt: skip


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@both_mask_fills
@pytest.mark.parametrize(
    "num_seqs, topk, steps, num_draft_tokens", [(1, 1, 1, 2), (3, 2, 3, 8), (2, 3, 3, 17), (4, 4, 2, 6), (2, 2, 5, 11)]
)
def test_kernel_matches_reference(op_kernels, num_seqs: int, topk: int, steps: int, num_draft_tokens: int) -> None:
    args = candidates(num_seqs, topk, steps, seed=num_seqs + 100 * topk + steps)
    want = ref.select_tree(args, num_draft_tokens, steps)
    got = op_kernels.select_tree(Candidates(*(t.to(DEVICE) for t in args)), num_draft_tokens, steps)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w)


@both_mask_fills
def test_kernel_takes_strided_inputs(op_kernels) -> None:
    """Scores and parents as column slices, int32 parents and root positions as an expanded vector."""
    args = candidates(3, 2, 3, seed=4)
    width = args.tokens.shape[1]
    strided = args._replace(
        scores=torch.cat([args.scores, args.scores], dim=1)[:, :width],
        parents=torch.cat([args.parents, args.parents], dim=1)[:, :width].int(),
        root_positions=torch.tensor([5]).expand(3),
    )
    want = ref.select_tree(args._replace(root_positions=torch.full((3,), 5)), 8, 3)
    got = op_kernels.select_tree(Candidates(*(t.to(DEVICE) for t in strided)), 8, 3)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@both_mask_fills
@pytest.mark.parametrize("num_seqs, topk, steps, num_draft_tokens", [(1, 2, 3, 8), (64, 2, 3, 8), (256, 4, 4, 16),
                                                                    (16, 8, 3, 64)])  # fmt: skip
def test_gpu_kernel_matches_reference_at_draft_shapes(op_kernels, num_seqs, topk, steps, num_draft_tokens) -> None:
    args = candidates(num_seqs, topk, steps, seed=num_seqs)
    got = op_kernels.select_tree(Candidates(*(t.cuda() for t in args)), num_draft_tokens, steps)
    for g, w in zip(got, ref.select_tree(args, num_draft_tokens, steps), strict=True):
        assert torch.equal(g.cpu(), w)
