"""Registers, spills and shared memory of the decode step's Triton kernels at the 2B shapes, compiled for an H100/H200
(sm_90) on any machine: Triton compiles for a named target without a GPU, and its bundled `ptxas -v` reports what one
thread of each kernel holds. No GPU, no timing: it answers "does this tiling spill, and how many programs fit on an
SM" before device time is spent. Arguments are assumed aligned as Triton specializes them at launch (`divisibility`);
the GPU machine's Triton (3.6) may differ from this one's. One JSON line per kernel with --json FILE.
Usage: python bench/registers.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
# compile afresh: this reads the PTX, which a cache packed by scripts/triton_cache.sh (binaries only) does not hold
os.environ["TRITON_ALWAYS_COMPILE"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from jetserve.ops.dynamic_conv.decode import _decode_kernel as conv_decode  # noqa: E402
from jetserve.ops.feature_ring.store import _store_kernel as feature_ring  # noqa: E402
from jetserve.ops.gated_delta_rule.decode import gated_delta_rule_decode_kernel as gdr_decode  # noqa: E402
from jetserve.ops.jet_mixer.decode import _jet_mixer_decode_kernel as jet_mixer  # noqa: E402
from jetserve.ops.kv_metadata.kernels import _kv_metadata_kernel as kv_metadata  # noqa: E402
from jetserve.ops.linear.kernels import _linear_kernel as linear  # noqa: E402
from jetserve.ops.norm.kernels import _rms_norm_kernel as rms_norm  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM = 65536
SHARED_BYTES_PER_SM = 228 * 1024  # H100/H200 (a block may use 227 KB of it)
WARPS_PER_SM = 64


def argument_types(fn, constexprs: dict, pointers: dict[str, str], floats: tuple[str, ...] = ()) -> dict[str, str]:
    """Each argument's type: constexpr, the pointer type given, fp32 for `floats`, else i32 (sizes and strides)."""
    return {
        name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in floats else "i32")
        for name in fn.arg_names
    }


def divisibility(fn, types: dict[str, str], unaligned: tuple[str, ...] = ()) -> dict:
    """Triton's launch-time specialization, assumed: every pointer 16-byte aligned and every integer argument (sizes,
    strides) a multiple of 16, except those named. Without it the compiler assumes 2-byte loads and pipelines
    nothing (no cp.async), so registers and shared memory would not be the GPU's."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if types[name] not in ("constexpr", "fp32") and name not in unaligned
    }


def ptxas_info(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """{registers, spill_bytes, shared_bytes, programs_per_sm} of `fn` compiled for sm_90 with these constexprs; the
    programs an SM holds at once, as its registers, warps and shared memory allow."""
    source = ASTSource(fn, types, constexprs=constexprs, attrs=divisibility(fn, types))
    compiled = triton.compile(source, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                                text=True, check=True).stderr  # fmt: skip
    finally:
        os.unlink(f.name)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    shared = compiled.metadata.shared
    programs = min(REGISTERS_PER_SM // max(1, registers * 32 * num_warps), WARPS_PER_SM // num_warps,
                   SHARED_BYTES_PER_SM // max(1, shared))  # fmt: skip
    return {"registers": registers, "spill_bytes": spills, "shared_bytes": shared, "programs_per_sm": programs}


def cases() -> list[tuple[str, object, dict, dict, int, int]]:
    """(name, kernel, argument types, constexprs, warps, stages) at the 2B decode shapes, with the tiles the
    wrappers pick on an H200."""
    bf16 = "*bf16"
    out = []
    ptrs = {n: bf16 for n in ("x", "w", "bias", "y", "gate", "norm_w", "residual", "h", "out_w")}
    ptrs |= {"partial": "*fp32", "sumsq": "*fp32", "ticket": "*i32"}
    no_add = dict(ADD_NORM=False, BLOCK_ROW=1, BLOCK_P=1)
    for label, block_n, block_k, warps, norm_head, gated, add, stages in [
        ("linear one-row FMA, o_proj gated norm (1536 x 3072)", 4, 1024, 8, 256, False, no_add, 1),
        ("linear one-row FMA, down SwiGLU (1536 x 8960)", 2, 1024, 4, 0, True, no_add, 1),
        ("... o_proj, + residual add and RMSNorm", 4, 1024, 8, 256, False, dict(ADD_NORM=True, BLOCK_ROW=2048,
                                                                                 BLOCK_P=512), 1),
        ("... down, + residual add and RMSNorm", 2, 1024, 4, 0, True, dict(ADD_NORM=True, BLOCK_ROW=2048,
                                                                          BLOCK_P=1024), 1),
        ("... o_proj gated norm, a 3-stage loop", 4, 1024, 8, 256, False, no_add, 3),
        ("... down SwiGLU, a 3-stage loop", 2, 1024, 4, 0, True, no_add, 3),
    ]:  # fmt: skip
        consts = dict(HAS_BIAS=False, HAS_SILU=False, GATED=gated, NORM_HEAD=norm_head, IS_SPLIT=False, USE_DOT=False,
                      EVEN_M=True, EVEN_K=False, INPUT_PRECISION="tf32", BLOCK_M=1, BLOCK_N=block_n,
                      BLOCK_K=block_k, NUM_STAGES=stages, PDL=True, **add)  # fmt: skip
        out.append((label, linear, argument_types(linear, consts, ptrs, ("eps", "out_eps")), consts, warps, stages))
    consts = dict(HAS_BIAS=False, HAS_SILU=True, GATED=False, NORM_HEAD=0, IS_SPLIT=False, USE_DOT=True, EVEN_M=False,
                  EVEN_K=True, INPUT_PRECISION="tf32", BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, NUM_STAGES=4, PDL=True,
                  **no_add)  # fmt: skip
    out.append(("linear tensor-core, fused input (8856 x 1536)", linear,
                argument_types(linear, consts, ptrs, ("eps", "out_eps")), consts, 4, 4))  # fmt: skip
    consts = dict(HAS_RESIDUAL=True, BLOCK_R=2, BLOCK_D=2048, PDL=True)
    ptrs = {n: bf16 for n in ("x", "r", "w", "y", "h")}
    out.append(
        ("rms_norm with residual, 1 row", rms_norm, argument_types(rms_norm, consts, ptrs, ("eps",)), consts, 4, 3)
    )
    ptrs = {n: bf16 for n in ("u", "h", "w2_weight", "w2_bias", "conv_state", "out")} | {"state_indices": "*i32"}
    for label, (bn, bd, bg, warps, early) in {"up to 16 rows": (16, 8, 128, 2, True),
                                              "past 32 rows": (64, 16, 64, 4, False)}.items():  # fmt: skip
        consts = dict(W=4, WT=4, BN=bn, BD=bd, BG=bg, DOT_PRECISION="tf32", EARLY_LOADS=early, PDL=True)
        out.append((f"dynamic_conv decode, {label}", conv_decode, argument_types(conv_decode, consts, ptrs), consts,
                    warps, 3))  # fmt: skip
    ptrs = {n: bf16 for n in ("q", "k", "v", "a", "b", "o", "gate", "norm_weight", "y")}
    ptrs |= {"A_log": "*fp32", "dt_bias": "*fp32", "state": "*fp32", "state_indices": "*i32"}
    for label, bv, chunks, norm in [("BV 32", 32, 1, False), ("two 64-wide tiles", 64, 2, False),
                                    ("a whole head, with the output norm", 64, 4, True)]:  # fmt: skip
        consts = dict(H=12, K=96, V=256, BK=128, BV=bv, CHUNKS=chunks, EPS=1e-6, NORM=norm, BLOCK_VN=256, PDL=True)
        out.append((f"gated_delta_rule decode, {label}", gdr_decode,
                    argument_types(gdr_decode, consts, ptrs, ("scale", "norm_eps")), consts, 4, 3))  # fmt: skip
    consts = dict(H=12, K=96, V=256, W=4, WT=4, WP=4, BK=128, BV=8, BG=128, EPS=1e-6, PDL=True)
    ptrs = {n: bf16 for n in ("u", "h", "w2_weight", "w2_bias", "conv_state", "q", "k", "a", "b", "o")}
    ptrs |= {"A_log": "*fp32", "dt_bias": "*fp32", "state": "*fp32", "state_indices": "*i32"}
    out.append(("jet_mixer decode (fused), 1 row", jet_mixer, argument_types(jet_mixer, consts, ptrs, ("scale",)),
                consts, 4, 3))  # fmt: skip
    consts = dict(ATTN=True, SWA=True, BLOCK_COLS=256, BLOCK_RING=128)
    ptrs = {"positions": "*i64", "rows": "*i32", "seq_ends": "*i64", "state_indices": "*i32", "block_table": "*i32",
            "slot_mapping": "*i64", "tables": "*i32", "swa_slot_mapping": "*i64", "swa_tables": "*i32"}  # fmt: skip
    out.append(("kv_metadata, attn and swa", kv_metadata, argument_types(kv_metadata, consts, ptrs), consts, 4, 1))
    consts = dict(NUM=3, BLOCK=1024)
    ptrs = {n: bf16 for n in ("ring", "f0", "f1", "f2", "f3")} | {"slots": "*i32", "positions": "*i64"}
    out.append(("feature_ring store, 3 layers", feature_ring, argument_types(feature_ring, consts, ptrs), consts, 4, 1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    out = open(args.json, "a") if args.json else None
    print(f"{'kernel':56} {'warps':>5} {'regs':>5} {'spill B':>8} {'smem B':>7} {'progs/SM':>8}")
    for name, fn, types, consts, warps, stages in cases():
        info = ptxas_info(fn, types, consts, warps, stages)
        print(f"{name:56} {warps:5d} {info['registers']:5d} {info['spill_bytes']:8d} {info['shared_bytes']:7d} "
              f"{info['programs_per_sm']:8d}")  # fmt: skip
        if out:
            out.write(json.dumps({"kernel": name, "target": "sm_90", "num_warps": warps, **info}) + "\n")


if __name__ == "__main__":
    main()
