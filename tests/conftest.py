"""Test-session setup: on a machine without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1), with two
small patches that let fla-core 0.6.0's kernels (`chunk_gated_delta_rule`) run there as they do on a GPU.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from jetserve import envs

# Must be set before any module defines a @triton.jit kernel: the decorator picks the interpreter at definition time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _autotune_without_gpu_benchmarker() -> None:
    """Patch (1): the autotuner times each config with the active GPU driver's benchmarker, and the interpreter has no
    driver. Give every config the same time without running it, so the autotuner keeps its first config."""
    from triton.runtime import autotuner

    def bench_nothing(self, *args, config, **meta) -> list[float]:
        return [0.0, 0.0, 0.0]

    autotuner.Autotuner._bench = bench_nothing


def _loop_indices_as_tensors() -> None:
    """Patch (2): compiled Triton gives `for i in range(n)` / `tl.range` loops a tensor induction variable (kernels call
    `i.to(tl.int64)` on it); the interpreter iterates plain Python ints. Make both yield interpreter scalar tensors.
    Builtin `range` is replaced only in the globals the rewritten kernel runs with (a copy of its module's globals), so
    host code in the same module is unaffected; `tl.static_range` still yields ints."""
    import triton.language as tl
    from triton.runtime import interpreter

    def as_int(x) -> int:
        x = x.value if isinstance(x, tl.constexpr) else x
        return int(x.handle.data.item()) if isinstance(x, tl.tensor) else int(x)

    def tensor_range(arg1, arg2=None, step=None, **kwargs):
        start, end = (0, arg1) if arg2 is None else (arg1, arg2)
        for i in range(as_int(start), as_int(end), 1 if step is None else as_int(step)):
            yield interpreter.interpreter_semantic.to_tensor(i, False)

    def compile_and_exec(self, transformed_ast):
        compiled_code = compile(transformed_ast, filename=self.filename, mode="exec")
        local_namespace = {**self.kwargs}
        fn_globals = {**vars(interpreter), **self.fn.__globals__, "range": tensor_range}
        exec(compiled_code, fn_globals, local_namespace)
        return local_namespace[self.fn.__name__]

    original_patch_lang_core = interpreter._patch_lang_core

    def patch_lang_core(lang, scope) -> None:
        original_patch_lang_core(lang, scope)
        scope.set_attr(lang, "range", tensor_range)

    interpreter.FunctionRewriter._compile_and_exec = compile_and_exec
    interpreter._patch_lang_core = patch_lang_core


if envs.triton_interpret():
    _autotune_without_gpu_benchmarker()
    _loop_indices_as_tensors()


@pytest.fixture(autouse=True)
def _release_cuda_memory_between_gpu_tests(request):
    """A `gpu` test's engine reserves most of the device for its caches. pytest keeps the last failure's traceback
    (sys.last_*), whose frames hold that engine: drop it and collect, so one failure does not fail every later test
    for want of memory."""
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        sys.last_type = sys.last_value = sys.last_traceback = None
        if hasattr(sys, "last_exc"):
            sys.last_exc = None
        gc.collect()
        torch.cuda.empty_cache()
    yield


@pytest.fixture
def decode_norm_calls(monkeypatch) -> list[bool]:
    """Per call of the Triton gated-delta-rule decode from here on, whether it ran the JetBlock's output norm."""
    from jetserve.ops.gated_delta_rule import decode

    calls: list[bool] = []
    original = decode.gated_delta_rule_decode

    def counted(*args, **kw):
        calls.append(kw.get("norm") is not None)
        return original(*args, **kw)

    monkeypatch.setattr(decode, "gated_delta_rule_decode", counted)
    return calls
