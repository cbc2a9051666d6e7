"""The engine's Sampler: per-slot parameters on the device, and the least work that draws the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jetserve.engine import sampler as sampler_module
from jetserve.engine.sampler import Sampler
from jetserve.sampling_params import SamplingParams

VOCAB = 300


def make_sampler(params: dict[int, SamplingParams]) -> Sampler:
    sampler = Sampler(num_slots=8, device=torch.device("cpu"))
    for slot, p in params.items():
        sampler.set_slot(slot, p, seed=1000 + slot)
    sampler.sync()
    return sampler


def spy_on_sample(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Record the promises each `sample` call is made with."""
    calls: list[dict] = []
    sample = sampler_module.sample

    def spied(*args, **kwargs):
        calls.append(kwargs)
        return sample(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "sample", spied)
    return calls


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({1: SamplingParams(temperature=0), 2: SamplingParams(temperature=0)}, None),  # argmax only
        ({1: SamplingParams(temperature=0.8), 2: SamplingParams(temperature=1.2)}, (False, False)),
        ({1: SamplingParams(temperature=0), 2: SamplingParams(temperature=1.0)}, (False, True)),
        ({1: SamplingParams(temperature=0.8, top_p=0.9), 2: SamplingParams(temperature=1.0)}, (True, False)),
        ({1: SamplingParams(temperature=0.8, top_k=5), 2: SamplingParams(temperature=0)}, (True, True)),
        ({1: SamplingParams(temperature=0.8, min_p=0.1), 2: SamplingParams(temperature=1.0)}, (True, False)),
        # A greedy row's filters do not count: it takes the argmax.
        ({1: SamplingParams(temperature=0, top_k=5), 2: SamplingParams(temperature=1.0)}, (False, True)),
    ],
)
def test_sampler_takes_the_least_work_that_draws_the_same_tokens(monkeypatch, params, expected) -> None:
    sampler = make_sampler(params)
    calls = spy_on_sample(monkeypatch)
    slots = np.array(sorted(params), dtype=np.int64)  # [N]
    state_indices = torch.from_numpy(slots).int()
    counters = torch.tensor([5, 9], dtype=torch.int64)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3)) * 3  # [N, V]
    tokens = sampler(logits, state_indices, counters, slots)
    if expected is None:
        assert calls == []
    else:
        assert calls == [dict(is_filtered=expected[0], has_greedy=expected[1])]
    # The full path (no promises) draws the same tokens.
    assert torch.equal(tokens, sampler(logits, state_indices, counters, None))
    assert calls[-1] == dict(is_filtered=True, has_greedy=True)


@pytest.mark.parametrize("temperatures", [(0.0, 0.0), (0.0, 0.9), (0.7, 1.1)])
def test_a_draw_into_a_given_buffer_is_the_draw(temperatures) -> None:
    """`out` (a prefill graph's token buffer, which the draft's catch-up reads): the draw lands there, and the call
    returns that very tensor, with the tokens a draw without `out` gives; the rows past N are left alone."""
    sampler = make_sampler({slot: SamplingParams(temperature=t) for slot, t in zip((1, 2), temperatures, strict=True)})
    slots = np.array([1, 2], dtype=np.int64)
    state_indices = torch.from_numpy(slots).int()
    counters = torch.tensor([3, 7], dtype=torch.int64)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(11)) * 3  # [N, V]
    buffer = torch.full((4,), -1, dtype=torch.int64)
    tokens = sampler(logits, state_indices, counters, slots, out=buffer[:2])
    assert tokens.data_ptr() == buffer.data_ptr() and tokens.shape == (2,)
    assert torch.equal(tokens, sampler(logits, state_indices, counters, slots))
    assert buffer[2:].tolist() == [-1, -1]


def test_a_greedy_draw_into_a_given_buffer_copies_nothing_more(monkeypatch) -> None:
    """The Triton argmax returns a view of `out`, not `out` itself: the draw must not copy that view onto `out`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func.overloadpacket.__name__ == "copy_"
            return func(*args, **(kwargs or {}))

    def argmax_as_triton(logits, out=None):  # writes `out` without a copy_, returns a view of it
        torch.argmax(logits, dim=-1, out=out)
        return out.view(-1)

    monkeypatch.setattr(sampler_module, "argmax", argmax_as_triton)
    sampler = make_sampler({1: SamplingParams(temperature=0), 2: SamplingParams(temperature=0)})
    slots = np.array([1, 2], dtype=np.int64)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(13))  # [N, V]
    out = torch.full((2,), -1, dtype=torch.int64)
    with Copies():
        tokens = sampler(logits, torch.from_numpy(slots).int(), torch.tensor([1, 1]), slots, out=out)
    assert Copies.count == 0 and tokens.data_ptr() == out.data_ptr()
    assert out.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decode_draw_forms_counters_only_when_a_row_samples(temperature) -> None:
    """`Sampler.after` (a decode step's draw from the positions it cached) equals the draw with counters = positions
    + 1, and an all-greedy step launches no add for them: only its argmax."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpNames(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    sampler = make_sampler({1: SamplingParams(temperature=temperature), 2: SamplingParams(temperature=temperature)})
    slots = np.array([1, 2], dtype=np.int64)
    state_indices = torch.from_numpy(slots).int()
    positions = torch.tensor([4, 8], dtype=torch.int64)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)) * 3  # [N, V]
    with OpNames() as ops:
        tokens = sampler.after(logits, state_indices, positions, slots)
    assert torch.equal(tokens, sampler(logits, state_indices, positions + 1, slots))
    assert ("add" in ops.names) == (temperature > 0)
    if temperature == 0:
        assert ops.names == ["argmax"]


@pytest.mark.parametrize("num_slots", [1, 5, 8])
def test_parameters_reach_the_device_at_sync_only(num_slots):
    """The five per-slot parameters share one device block (one copy a sync), each a [S] view of its dtype starting
    16-byte aligned, with their defaults; a slot's values arrive at `sync`, and host writes after it do not leak."""
    sampler = Sampler(num_slots=num_slots, device=torch.device("cpu"))
    p = sampler.params
    assert {name: t.dtype for name, t in p.items()} == {"seeds": torch.int64, "temperature": torch.float32,
                                                        "top_k": torch.int32, "top_p": torch.float32,
                                                        "min_p": torch.float32}  # fmt: skip
    assert all(t.shape == (num_slots,) and t.data_ptr() % 16 == 0 for t in p.values())
    assert p["top_p"].eq(1).all() and not any(p[n].any() for n in ("seeds", "temperature", "top_k", "min_p"))
    slot = num_slots - 1
    sampler.set_slot(slot, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1), seed=1234)
    assert p["temperature"][slot] == 0  # not before the sync
    sampler.sync()
    got = [p[n][slot].item() for n in ("seeds", "temperature", "top_k", "top_p", "min_p")]
    assert got == [1234, pytest.approx(0.7), 5, pytest.approx(0.9), pytest.approx(0.1)]
    sampler.set_slot(slot, SamplingParams(temperature=0.2), seed=7)
    assert p["seeds"][slot] == 1234 and p["temperature"][slot] == pytest.approx(0.7)
    sampler.sync()
    assert p["seeds"][slot] == 7 and p["top_k"][slot] == 0 and p["top_p"][slot] == 1
