"""The next decode step's inputs (`ops.decode_inputs`): the reference against what it promises, the Triton launch
against the reference on awkward row counts (one program, a ragged second one), outputs poisoned beforehand."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops.decode_inputs import kernels, reference

needs_interpreter = pytest.mark.skipif(
    not envs.triton_interpret(), reason="Triton variants run here in the interpreter"
)
POISON = -7


def rows(num_rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(tokens, positions, state_indices int32, input_ids, used_positions) of a decode bucket of `num_rows`: random
    real rows, then padding (slot 0, position 0) for the last third; the outputs poisoned."""
    gen = torch.Generator().manual_seed(seed)
    num_real = num_rows - num_rows // 3
    tokens = torch.randint(0, 1000, (num_rows,), generator=gen)
    slots = torch.randint(1, 50, (num_rows,), generator=gen, dtype=torch.int32)
    positions = torch.randint(0, 5000, (num_rows,), generator=gen)
    slots[num_real:], positions[num_real:] = 0, 0
    poison = torch.full((num_rows,), POISON, dtype=torch.int64)
    return tokens, positions, slots, poison.clone(), poison.clone()


def test_reference_moves_real_rows_on_and_leaves_padding() -> None:
    tokens, positions, slots, input_ids, used = rows(7, 0)
    before = positions.clone()
    reference.advance_decode_inputs(tokens, positions, slots, input_ids, used)
    real = slots != 0
    assert real.sum() == 5
    assert torch.equal(used, before)
    assert torch.equal(positions[real], before[real] + 1) and torch.equal(positions[~real], before[~real])
    assert torch.equal(input_ids[real], tokens[real]) and not input_ids[~real].any()


@needs_interpreter
@pytest.mark.parametrize("num_rows", [1, 3, 130])
def test_triton_launch_equals_the_reference(num_rows: int) -> None:
    want, got = rows(num_rows, num_rows), rows(num_rows, num_rows)
    reference.advance_decode_inputs(*want)
    kernels.advance_decode_inputs(*got)
    for w, g in zip(want, got, strict=True):
        assert w.dtype == g.dtype and torch.equal(w, g)


@pytest.mark.parametrize("fn", [reference.advance_decode_inputs, kernels.advance_decode_inputs])
def test_bad_arguments_are_refused(fn) -> None:
    tokens, positions, slots, input_ids, used = rows(4, 1)
    with pytest.raises(ValueError, match="must all be"):
        fn(tokens[:3], positions, slots, input_ids, used)
    with pytest.raises(ValueError, match="int64"):
        fn(tokens.to(torch.int32), positions, slots, input_ids, used)
    with pytest.raises(ValueError, match="must not be"):
        fn(tokens, positions, slots, tokens, used)
    with pytest.raises(ValueError, match="must not be"):
        fn(tokens, positions, slots, input_ids, positions)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_rows", [1, 48, 256])  # decode buckets: the smallest, a middle, the largest
def test_gpu_launch_equals_the_reference(num_rows: int) -> None:
    want = [t.cuda() for t in rows(num_rows, num_rows)]
    got = [t.clone() for t in want]
    reference.advance_decode_inputs(*want)
    kernels.advance_decode_inputs(*got)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
