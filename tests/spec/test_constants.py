"""The shape constants of the draft's and the verify step's batches (`jetserve.spec.constants`): made once per
(name, shape, device), the values the per-call code made, not kept while a CUDA graph capture runs; the drafter and
the verifier serve them from their caches across steps."""

from __future__ import annotations

import pytest
import torch

from jetserve.spec import constants
from jetserve.spec.constants import ShapeConstants

CPU = torch.device("cpu")


def test_constants_have_the_per_call_values_and_are_made_once() -> None:
    c = ShapeConstants()
    assert torch.equal(c.arange(5, CPU), torch.arange(5))
    assert torch.equal(c.full((3, 2), -1, torch.long, CPU), torch.full((3, 2), -1, dtype=torch.long))
    assert c.full((3,), True, torch.bool, CPU).dtype == torch.bool
    offsets = c.offsets(3, 7, CPU)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 7, 14, 21]
    causal = c.causal(2, 4, CPU)
    assert causal.shape == (2, 4, 4) and causal.is_contiguous()
    assert torch.equal(causal[1], torch.ones(4, 4, dtype=torch.bool).tril())
    kept = len(c)
    assert c.arange(5, CPU) is c.arange(5, CPU) and c.causal(2, 4, CPU) is causal
    assert len(c) == kept == 5
    assert c.arange(6, CPU) is not c.arange(5, CPU)  # another shape, another tensor
    assert c.full((3,), 0, torch.int32, CPU) is not c.full((3,), 0, torch.int64, CPU)


def test_a_constant_made_during_a_capture_is_not_kept(monkeypatch) -> None:
    """Made while a capture runs, a tensor would live in that graph's pool (its fill in that graph alone): it serves
    the call and is made again on the next."""
    c = ShapeConstants()
    monkeypatch.setattr(constants, "_capturing", lambda device: True)
    first = c.arange(4, CPU)
    assert torch.equal(first, torch.arange(4)) and len(c) == 0 and c.arange(4, CPU) is not first
    monkeypatch.setattr(constants, "_capturing", lambda device: False)
    kept = c.arange(4, CPU)
    assert len(c) == 1 and c.arange(4, CPU) is kept


def test_what_is_kept_stays_under_its_bound(monkeypatch) -> None:
    """Past MAX_KEPT_BYTES a constant is made per call (still the right value), and nothing more is kept."""
    monkeypatch.setattr(constants, "MAX_KEPT_BYTES", 100)
    c = ShapeConstants()
    kept = c.arange(10, CPU)  # 80 bytes
    assert len(c) == 1 and c.kept_bytes == 80
    big = c.arange(5, CPU)  # 40 more would pass 100: not kept
    assert torch.equal(big, torch.arange(5)) and len(c) == 1 and c.arange(5, CPU) is not big
    assert c.full((4,), 1, torch.int32, CPU) is c.full((4,), 1, torch.int32, CPU)  # 16 bytes still fit
    assert c.kept_bytes == 96 and c.arange(10, CPU) is kept


def test_a_constant_made_in_inference_mode_serves_autograd_too() -> None:
    """Made under `torch.inference_mode` (as the engine runs), a constant is a normal tensor: a later forward with
    autograd on may save it for backward (an inference tensor there raises)."""
    c = ShapeConstants()
    with torch.inference_mode():
        mask = c.causal(1, 3, CPU)
    assert not mask.is_inference()
    x = torch.randn(1, 3, 3, requires_grad=True)
    torch.where(c.causal(1, 3, CPU), x, 0.0).sum().backward()
    assert torch.equal(x.grad, mask.float())


@pytest.mark.gpu
def test_gpu_capture_keeps_nothing_and_replays_a_constant_made_before() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    c = ShapeConstants()
    before = c.arange(8, device)  # made outside the capture: kept
    out = torch.empty(8, dtype=torch.long, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(c.arange(8, device) + c.arange(3, device).sum())  # the second is made inside: not kept
    assert len(c) == 1
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.arange(8) + 3) and c.arange(8, device) is before
