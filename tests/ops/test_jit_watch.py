"""`ops.jit_watch`: the hook counts what Triton reports, chains a hook already installed, and is removed after."""

from __future__ import annotations

from types import SimpleNamespace

from triton import knobs

from jetserve.ops.jit_watch import watch_specializations


def test_counts_by_kernel_chains_and_restores() -> None:
    calls = []

    def outer(**kwargs):
        calls.append(kwargs["fn"].name)
        return False  # let Triton compile

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = outer
    try:
        with watch_specializations() as seen:
            hook = knobs.runtime.jit_cache_hook
            assert hook is not outer
            for name in ("_rope_kernel", "_linear_kernel", "_linear_kernel"):
                assert hook(key=None, repr="", fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
                            already_compiled=False) is False  # fmt: skip
        assert seen == {"_linear_kernel": 2, "_rope_kernel": 1}
        assert calls == ["_rope_kernel", "_linear_kernel", "_linear_kernel"]
        assert knobs.runtime.jit_cache_hook is outer
        with watch_specializations() as nothing:
            pass
        assert not nothing and knobs.runtime.jit_cache_hook is outer
    finally:
        knobs.runtime.jit_cache_hook = previous
