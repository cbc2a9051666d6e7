"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

from jetserve import envs


@pytest.fixture
def poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every new floating-point tensor from `torch.empty` / `torch.empty_like` starts as NaN while a test runs, so an
    output a kernel fails to write cannot pass."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))


SENTINEL = -12345  # what `poisoned_outputs` fills new integer tensors with


@pytest.fixture
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Every new tensor from `torch.empty` starts poisoned while a test runs: floating point NaN, integers SENTINEL,
    bools the fixture's param (True, or False through `indirect` parametrization: a mask needs both, so that an
    entry left unwritten fails whichever value it should hold)."""
    empty = torch.empty
    mask_fill = getattr(request, "param", True)

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(mask_fill if t.dtype == torch.bool else float("nan") if t.is_floating_point() else SENTINEL)

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))


@pytest.fixture
def op_kernels(request: pytest.FixtureRequest, poisoned_outputs: None) -> ModuleType:
    """The Triton module the test module names in `KERNELS`, its outputs poisoned (`poisoned_outputs`); a skip where
    neither CUDA nor the interpreter can run it."""
    if not torch.cuda.is_available() and not envs.triton_interpret():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    return importlib.import_module(request.module.KERNELS)
