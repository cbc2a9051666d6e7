"""Every Triton kernel jetserve launches compiles for an H100/H200 (sm_90) here, on the CPU: the interpreter runs the
kernels in the CPU tests, but some mistakes pass there and fail only in the compiler — a kernel reading a plain
(non-constexpr) global (session 28's argmax: it ran in every interpreter test, then failed its first GPU call).

The benchmarks' tour of every op (`bench/common.all_cases`, the one `bench/memcheck_kernels.py` takes) runs on the
Triton backend with each launch recorded — kernel, argument types, constexpr values, warps and stages: at the tiny
test model's shapes in the interpreter, then at the 2B shapes with an H200's 132 SMs recorded without running (the
tiles a GPU launches: shared memory grows with them); each in fp16 (compiled as bf16, the GPU's dtype) and fp32 (the
dtype of the GPU's exactness tests). A subprocess without the interpreter then compiles each distinct launch down to
a cubin for sm_90 with Triton's own compiler (its wheel carries ptxas), every kernel with a `PDL` switch with it on
(as launched on a Hopper GPU), and checks that its shared memory fits a block: the fp32 gated-norm GEMM once asked
for 307 KB and did not launch (session 15) — with `fit_pipeline`'s budget raised back past the limit, this test fails
on that launch (314368 bytes).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jetserve import envs
from jetserve.ops import backend

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "maxnreg")
POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*bf16", torch.bfloat16: "*bf16", torch.float64: "*fp64",
                 torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8",
                 torch.bool: "*i1"}  # fmt: skip
H200_SMS = 132
SKIPPED_CASES = ("gated_delta_rule prefill T=",)  # fla-core's chunk kernels (autotuned, not ours); ours: prefill_inputs

COMPILE = r"""
import json, sys
from concurrent.futures import ProcessPoolExecutor

SMEM_LIMIT = 232448  # sm_90: 227 KiB of shared memory a block may opt in to

def compile_one(launch):
    import importlib
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    constexprs = {k: getattr(tl, v["tl"]) if isinstance(v, dict) else v for k, v in launch["constexprs"].items()}
    src = ASTSource(fn=fn, signature=launch["signature"], constexprs=constexprs)
    where = f"{launch['name']} {launch['signature']} {launch['constexprs']} {launch['options']}"
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as e:  # noqa: BLE001 - reported, one line per launch
        return f"{where}: {type(e).__name__}: {e}"[:3000]
    if compiled.metadata.shared > SMEM_LIMIT:  # the launch would fail: more shared memory than a block may have
        return f"{where}: needs {compiled.metadata.shared} bytes of shared memory, sm_90 has {SMEM_LIMIT}"
    return None

launches = json.load(open(sys.argv[1]))
with ProcessPoolExecutor(int(sys.argv[2])) as pool:
    failures = [f for f in pool.map(compile_one, launches) if f]
print(json.dumps({"compiled": len(launches), "failures": failures}))
"""


def _argument_type(value) -> tuple[str, object]:
    """(signature type, constexpr value or None) of a runtime argument as the JIT would type it."""
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype], None
    if value is None:
        return "constexpr", None
    if isinstance(value, bool):
        return "i1", None
    if isinstance(value, int):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), None
    if isinstance(value, float):
        return "fp32", None
    raise TypeError(f"unexpected kernel argument {value!r}")


def _constexpr_value(value):
    import triton.language as tl

    value = value.value if isinstance(value, tl.constexpr) else value
    if isinstance(value, tl.dtype):
        return {"tl": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"unexpected constexpr {value!r}")


def _record(fn, args, kwargs) -> dict | None:
    """One launch of a jetserve kernel as (module, name, signature, constexprs, options); None for another
    package's."""
    import triton.language as tl

    module = fn.fn.__module__
    if not module.startswith("jetserve."):
        return None
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
    options.pop("launch_pdl", None)
    fn_signature = inspect.signature(fn.fn)
    params = fn_signature.parameters
    bound = fn_signature.bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for name, value in bound.arguments.items():
        annotation = params[name].annotation
        if annotation is tl.constexpr or (isinstance(annotation, str) and "constexpr" in annotation):
            signature[name] = "constexpr"
            constexprs[name] = True if name == "PDL" else _constexpr_value(value)
        else:
            signature[name], _ = _argument_type(value)
            if signature[name] == "constexpr":
                constexprs[name] = None
    return {"module": module, "name": fn.fn.__name__, "signature": signature, "constexprs": constexprs,
            "options": options}  # fmt: skip


def _tour(cases: dict) -> list[str]:
    """Run every case of `bench/common.all_cases` but fla's; their names."""
    names = []
    for name, build in cases.items():
        if any(skip in name for skip in SKIPPED_CASES):
            continue
        fn, _, _ = build()
        fn()
        names.append(name)
    return names


def _split_k_launches() -> None:
    """The skinny GEMM's split-K sum, with the bias, the SiLU columns and the add-norm epilogue (tilings forced)."""
    from jetserve.ops.linear import kernels

    x, weight, bias = torch.randn(3, 64).half(), torch.randn(40, 64).half(), torch.randn(40).half()
    split = kernels.GemvTiling(16, 16, 16, 4, True)
    kernels.linear(x, weight, bias, silu_cols=7, tiling=split)
    kernels.linear(x, weight, add_norm=(torch.randn(3, 40).half(), torch.randn(40).half(), 1e-6), tiling=split)
    kernels.linear(x[:1], weight, tiling=kernels.GemvTiling(1, 4, 16, 4, False, 4, 1))


def _compiler_available() -> bool:
    """Whether this Triton has the CUDA backend's compiler (a wheel without ptxas cannot build a cubin here)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return Path(get_ptxas(90).path).is_file()
    except Exception:  # noqa: BLE001 - any failure (another Triton's API included): no compiler
        return False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the kernels themselves (the gpu tests)")
@pytest.mark.skipif(not envs.triton_interpret(), reason="the tour runs the kernels in the Triton interpreter")
@pytest.mark.skipif(not _compiler_available(), reason="this Triton cannot compile for CUDA here (no ptxas)")
def test_every_launched_kernel_compiles_for_sm90(tmp_path, monkeypatch) -> None:
    from triton.runtime import interpreter

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from common import SHAPES, all_cases
    finally:
        sys.path.remove(str(ROOT / "bench"))
    launches: dict[str, dict] = {}
    original_run = interpreter.InterpretedFunction.run
    record_only = False

    def recording_run(self, *args, grid, warmup, **kwargs):
        launch = _record(self, args, kwargs)
        if launch is not None:
            launches.setdefault(json.dumps(launch, sort_keys=True), launch)
            if record_only:
                return None
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    backend.set_backend("triton")
    names = []
    try:
        for dtype in (torch.float16, torch.float32):  # fp16 compiled as bf16; fp32 as the fp32 tests run it
            names += _tour(all_cases(SHAPES["smoke"], dtype, "cpu", small=True))
        _split_k_launches()  # the tour's tiny GEMMs never split K
        # The 2B shapes with an H200's 132 SMs: the tiles a GPU launches (shared memory grows with them), recorded
        # without running them in the interpreter.
        record_only = True
        for module in list(sys.modules.values()):
            if module and module.__name__.startswith("jetserve.ops") and getattr(module, "sm_count", None):
                monkeypatch.setattr(module, "sm_count", lambda device: H200_SMS)
        for dtype in (torch.float16, torch.float32):
            names += _tour(all_cases(SHAPES["2b"], dtype, "cpu", small=True))
    finally:
        backend.set_backend(None)
    kernels = {launch["name"] for launch in launches.values()}
    assert len(names) > 200 and len(kernels) > 20 and "_split_sum_kernel" in kernels, (len(names), sorted(kernels))
    spec = tmp_path / "launches.json"
    spec.write_text(json.dumps(list(launches.values())))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    run = subprocess.run([sys.executable, "-c", COMPILE, str(spec), str(min(2, os.cpu_count() or 1))], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=1200)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["compiled"] == len(launches)
    assert not result["failures"], "\n".join(result["failures"])
