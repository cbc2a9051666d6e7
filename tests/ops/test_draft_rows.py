"""The draft catch-up's row metadata (`ops.draft_rows`): the Triton launch against the reference on awkward sizes
(rows with no, some and all tokens valid; strided inputs; int32 and int64), its outputs poisoned first; the reference
against what the rows mean; bad arguments refused; on a GPU at the 2B draft's shapes."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops.draft_rows import kernels, reference

needs_interpreter = pytest.mark.skipif(
    not envs.triton_interpret(), reason="Triton variants run here in the interpreter"
)
POISON = -7  # no output of the op can hold it: positions and context lengths are ≥ 0, slots ≥ 0 or -1


def rows(num_rows: int, width: int, page_size: int, seed: int, dtype=torch.int64, device="cpu"):
    """(start_positions, num_valid, block_tables) of `num_rows` rows: distinct random pages, starts anywhere that
    leaves room for the row, num_valid from 0 to width (both ends included when there are rows enough)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = 300 // page_size + 2
    tables = torch.randperm(num_rows * num_pages + 1, generator=gen)[1:].view(num_rows, num_pages).to(torch.int32)
    starts = torch.randint(0, 300 - width, (num_rows,), generator=gen)
    valid = torch.randint(0, width + 1, (num_rows,), generator=gen)
    valid[0] = width
    if num_rows > 1:
        valid[1] = 0
    return starts.to(dtype).to(device), valid.to(dtype).to(device), tables.to(device)


def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' output buffers start as POISON, so an element the launch does not write shows."""
    empty = torch.empty

    def fill(*shape, **kwargs):
        return empty(*shape, **kwargs).fill_(POISON)

    monkeypatch.setattr(kernels.torch, "empty", fill)


def test_reference_means_positions_and_slots() -> None:
    starts, valid, tables = rows(5, 6, 4, seed=0)
    positions, slots, last, context_lens = reference.draft_rows(starts, valid, tables, 6, 4)
    for n in range(5):
        s, v = int(starts[n]), int(valid[n])
        assert int(last[n]) == max(v - 1, 0) and int(context_lens[n]) == s + 6
        for c in range(6):
            p = s + min(c, max(v - 1, 0))
            assert int(positions[n, c]) == p
            expected = int(tables[n, p // 4]) * 4 + p % 4 if c < v else -1
            assert int(slots[n, c]) == expected
    assert context_lens.dtype == torch.int32 and positions.dtype == slots.dtype == last.dtype == torch.int64


SHAPES = [(1, 1, 4), (3, 4, 4), (5, 7, 16), (2, 13, 1), (4, 130, 8)]  # (rows, width, page size)


@needs_interpreter
@pytest.mark.parametrize(("num_rows", "width", "page_size"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_triton_launch_equals_the_reference(monkeypatch, num_rows: int, width: int, page_size: int, dtype) -> None:
    starts, valid, tables = rows(num_rows, width, page_size, seed=num_rows + width, dtype=dtype)
    # Strided views: start positions as a column of a tree's positions, num_valid every other element.
    tree_positions = torch.stack([starts, starts + 1, starts + 2], dim=1)  # [N, 3]
    spread = torch.stack([valid, torch.full_like(valid, 99)], dim=1).view(-1)[::2]  # [N], stride 2
    wide = torch.cat([tables, torch.zeros_like(tables)], dim=1)[:, : tables.shape[1]]  # rows strided by 2P
    poisoned_empty(monkeypatch)
    for args in ((starts, valid, tables), (tree_positions[:, 0], spread, wide)):
        want = reference.draft_rows(*args, width, page_size)
        got = kernels.draft_rows(*args, width, page_size)
        for w, g in zip(want, got, strict=True):
            assert w.dtype == g.dtype and torch.equal(w, g)


def test_bad_arguments_are_refused() -> None:
    starts, valid, tables = rows(3, 4, 4, seed=1)
    for module in (reference, kernels):
        with pytest.raises(ValueError, match="must be \\[N\\]"):
            module.draft_rows(starts, valid[:2], tables, 4, 4)
        with pytest.raises(ValueError, match="int32"):
            module.draft_rows(starts, valid, tables.long(), 4, 4)
        with pytest.raises(ValueError, match="must be ≥ 1"):
            module.draft_rows(starts, valid, tables, 0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("num_rows", "width"), [(1, 8), (64, 8), (8, 128)])
def test_on_gpu_at_the_draft_shapes(monkeypatch, num_rows: int, width: int) -> None:
    """A verify step's catch-up (8 tokens a row, up to 64 rows) and a ring's flush (128), pages of 16."""
    starts, valid, tables = rows(num_rows, width, 16, seed=width, device="cuda")
    poisoned_empty(monkeypatch)
    want = reference.draft_rows(starts, valid, tables, width, 16)
    got = kernels.draft_rows(starts, valid, tables, width, 16)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
