"""K/V metadata (`ops.kv_metadata`): the Triton launch against the reference for decode-, verify- and prefill-shaped
steps with padding rows, SWA rings a chunk overruns, and only some block-table columns; the reference against what the
slot mapping means."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops.kv_metadata import kernels, reference

PAGE, RING, SLOTS, PAGES_PER_SEQ = 4, 8, 6, 9

needs_interpreter = pytest.mark.skipif(
    not envs.triton_interpret(), reason="Triton variants run here in the interpreter"
)


def block_table(seed: int) -> torch.Tensor:
    """[S, P] int32 with distinct random pages per row; row 0 (the padding slot) all page 0."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(SLOTS * PAGES_PER_SEQ, generator=gen)[: SLOTS * PAGES_PER_SEQ].view(SLOTS, PAGES_PER_SEQ)
    table[0] = 0
    return table.to(torch.int32) + 1


def step(kind: str) -> tuple[torch.Tensor, ...]:
    """(positions, rows, seq_ends, state_indices) of a step: decode (one token each, a padding row), verify (rows
    of 3 tokens) or prefill (chunks of 1, 11 and 2 tokens: 11 overruns the ring of 8)."""
    if kind == "decode":
        slots = torch.tensor([3, 0, 5, 1])
        positions = torch.tensor([17, 0, 4, 33])
        return positions, slots, positions + 1, slots
    if kind == "verify":
        slots, prefix, width = torch.tensor([2, 4, 0]), torch.tensor([9, 0, 0]), 3
        positions = (prefix[:, None] + torch.arange(width)).view(-1)
        return positions, slots.repeat_interleave(width), (prefix + width).repeat_interleave(width), slots
    slots, starts, lens = torch.tensor([1, 3, 5]), torch.tensor([6, 0, 30]), torch.tensor([1, 11, 2])
    owner = torch.repeat_interleave(torch.arange(3), lens)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    positions = torch.arange(int(lens.sum())) - cu[owner] + starts[owner]
    return positions, slots[owner], (starts + lens)[owner], slots


def test_reference_slot_mapping_means_page_and_row() -> None:
    table = block_table(0)
    positions, rows, ends, slots = step("prefill")
    kv, swa = reference.kv_metadata(positions, rows, ends, slots, table, 7, PAGE, RING, True, True)
    for t, (p, r) in enumerate(zip(positions.tolist(), rows.tolist(), strict=True)):
        assert kv[0][t] == int(table[r, p // PAGE]) * PAGE + p % PAGE
        kept = p >= int(ends[t]) - RING
        assert swa[0][t] == (r * RING + p % RING if kept else -1)
    assert (swa[0] == -1).sum() == 3  # the 11-token chunk's first 3 tokens are overwritten within the step
    assert torch.equal(kv[1], table[slots, :7]) and swa[1].tolist()[1] == [3 * 2, 3 * 2 + 1]


@needs_interpreter
@pytest.mark.parametrize("kind", ["decode", "verify", "prefill"])
@pytest.mark.parametrize(("attn", "swa"), [(True, True), (True, False), (False, True)])
def test_triton_launch_equals_the_reference(kind: str, attn: bool, swa: bool) -> None:
    table = block_table(1)
    positions, rows, ends, slots = step(kind)
    args = (positions, rows.to(torch.int32), ends, slots.to(torch.int32), table, 7, PAGE, RING, attn, swa)
    want, got = reference.kv_metadata(*args), kernels.kv_metadata(*args)
    for w, g in zip(want, got, strict=True):
        assert (w is None) == (g is None)
        if w is not None:
            for a, b in zip(w, g, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)


def test_block_cols_takes_two_values() -> None:
    """A prefill's column count changes with every prompt's length; the launch's BLOCK_COLS constexpr must not (each
    value is a compile in the first step that meets it)."""
    assert {kernels.block_cols(n) for n in range(1, 5000)} == {kernels.SHORT_COLS, kernels.BLOCK_COLS}


@needs_interpreter
@pytest.mark.parametrize("num_cols", [300, 1100])  # one block of 1024 (300 past SHORT_COLS), then two blocks
def test_wide_tables_copy_every_column(num_cols: int) -> None:
    gen = torch.Generator().manual_seed(2)
    table = torch.randint(1, 50_000, (SLOTS, 1100), generator=gen, dtype=torch.int32)
    positions, rows, ends, slots = step("decode")
    args = (positions, rows.to(torch.int32), ends, slots.to(torch.int32), table, num_cols, PAGE, RING, True, False)
    want, got = reference.kv_metadata(*args)[0], kernels.kv_metadata(*args)[0]
    assert torch.equal(want[1], got[1]) and torch.equal(want[0], got[0])


def test_bad_arguments_are_refused() -> None:
    positions, rows, ends, slots = step("decode")
    with pytest.raises(ValueError, match="must be \\[T\\]"):
        reference.kv_metadata(positions, rows[:2], ends, slots, block_table(0), 7, PAGE, RING, True, True)
    with pytest.raises(ValueError, match="num_cols 10"):
        reference.kv_metadata(positions, rows, ends, slots, block_table(0), 10, PAGE, RING, True, True)
