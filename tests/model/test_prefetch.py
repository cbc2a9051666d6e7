"""The L2 prefetch plan: each decode GEMM is handed the first bytes of the weight the *next* GEMM reads, in the order
a forward runs them (checked by recording the calls), the lm_head after the last layer; a budget of 0 clears it."""

from __future__ import annotations

import pytest
import torch

from jetserve.model import fusion, layers
from jetserve.model.forward_batch import Phase
from jetserve.model.prefetch import gemm_sites, plan_l2_prefetch
from jetserve.model.static_cache import StaticCache
from jetserve.ops.linear import reference as ref


def record_gemms(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, prefetch) of every GEMM the model's layers run, in order."""
    calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def spy(name: str, fn):
        def wrapped(*args, prefetch=None, **kwargs):
            weight = args[4] if name == "gated_norm_linear" else args[1]
            calls.append((weight, prefetch))
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(fusion, "linear", spy("linear", ref.linear))
    monkeypatch.setattr(layers, "linear", spy("linear", ref.linear))
    monkeypatch.setattr(layers, "swiglu_linear", spy("swiglu_linear", ref.swiglu_linear))
    monkeypatch.setattr(layers, "gated_norm_linear", spy("gated_norm_linear", ref.gated_norm_linear))
    return calls


def test_each_gemm_prefetches_the_next_ones_weight(model, monkeypatch: pytest.MonkeyPatch) -> None:
    budget = 1000  # bytes: less than most weights (a prefix), more than some (the whole weight)
    total = plan_l2_prefetch(model, budget)
    calls = record_gemms(monkeypatch)
    cache = StaticCache(model, 1, 16)
    with torch.no_grad():
        model(cache.batch([0], [[3, 1, 4, 1, 5]]))
        fb = cache.batch([0], [[9]])
        assert fb.phase is Phase.DECODE
        calls.clear()
        model(fb)
    assert len(calls) == 4 * model.config.num_hidden_layers
    following = [w for w, _ in calls[1:]] + [model.lm_head_weight]
    assert sum(pf.numel() * pf.element_size() for _, pf in calls) == total
    for (_, pf), nxt in zip(calls, following, strict=True):
        assert pf is not None and pf.data_ptr() == nxt.data_ptr()  # starts where the next GEMM's weight starts
        assert pf.numel() == min(nxt.numel(), budget // nxt.element_size())
    assert plan_l2_prefetch(model, 0) == 0
    calls.clear()
    with torch.no_grad():
        model(cache.batch([0], [[2]]))
    assert len(calls) == 4 * model.config.num_hidden_layers and all(pf is None for _, pf in calls)


def test_sites_follow_the_layers_and_bad_budgets_are_refused(model) -> None:
    sites = gemm_sites(model)
    assert len(sites) == 4 * model.config.num_hidden_layers
    first = model.model.layers[0]
    assert sites[0][0] is first.self_attn and sites[0][1] is first.self_attn.fused_input.weight
    assert [s[0] for s in sites[1:4]] == [first.self_attn.o_proj, first.mlp, first.mlp.down_proj]
    with pytest.raises(ValueError, match="must be ≥ 0"):
        plan_l2_prefetch(model, -1)
