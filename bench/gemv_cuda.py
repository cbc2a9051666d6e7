"""One-row GEMV written outside Triton, against the Triton op and cuBLAS, at the 2B decode shapes (plain mode).

A CUDA C++ kernel compiled with NVRTC through CuPy (the GPU image has it; jetserve does not depend on it): one warp per
R weight rows, each lane loading U 16-byte vectors of the weight (and of x) before multiplying, fp32 accumulation, a
warp-shuffle sum and one rounding to bf16. Swept: R in 1/2/4, U in 2..12, `__ldg` or streaming `__ldcs` loads, 4 or 8
warps a block. Weights rotate through copies larger than 4x the L2, so they come from HBM as in a decode step. Per
variant: µs per call (median of CUDA-graph replays), GB/s and the fraction of the copy bandwidth measured in the same
run, the error against an fp32 product. One JSON line per row with --json FILE. Session 21's result is in
docs/kernels.md (the op stayed in Triton).
Usage: python bench/gemv_cuda.py [--json FILE]   (a CUDA GPU with CuPy)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from linear import ceilings  # noqa: E402
from tile_sweep import weight_copies  # noqa: E402
from timing import time_ms, warm_clocks  # noqa: E402

SHAPES = {"fused input": (8856, 1536), "o_proj": (1536, 3072), "gate|up": (17920, 1536), "down": (1536, 8960),
          "attention q|k|v": (2048, 1536), "attention o": (1536, 1536)}  # fmt: skip

SOURCE = r"""
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {  // 8 bf16 pairs: a bf16 is the high half of an fp32
  unsigned int av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    s += __uint_as_float(av[i] << 16) * __uint_as_float(bv[i] << 16);
    s += __uint_as_float(av[i] & 0xffff0000u) * __uint_as_float(bv[i] & 0xffff0000u);
  }
  return s;
}
__device__ __forceinline__ unsigned short to_bf16(float f) {  // round to nearest even
  unsigned int u = __float_as_uint(f);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
extern "C" __global__ void gemv(const uint4* __restrict__ x, const uint4* __restrict__ w,
                                unsigned short* __restrict__ y, int n, int vectors_per_row) {
  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * ROWS;
  if (row0 >= n) return;
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
  for (int base = 0; base < vectors_per_row; base += 32 * UNROLL) {
    uint4 xv[UNROLL], wv[ROWS][UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {  // every load of the step issued before any multiply
      const int v = base + u * 32 + lane;
      const bool ok = v < vectors_per_row;
      xv[u] = ok ? __ldg(x + v) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        wv[r][u] = ok ? LOAD(w + (size_t)min(row0 + r, n - 1) * vectors_per_row + v) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r] += dot8(xv[u], wv[r][u]);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], offset);
  if (lane == 0)
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      if (row0 + r < n) y[row0 + r] = to_bf16(acc[r]);
}
"""


def compile_variants() -> list[tuple[str, int, int, object]]:
    """(label, rows per warp, warps per block, kernel) for each variant swept."""
    import cupy

    variants = []
    for rows, unroll, load in itertools.product((1, 2, 4), (2, 4, 6, 8, 12), ("__ldg", "__ldcs")):
        if rows * unroll > 24:  # the weight vectors held in registers
            continue
        options = ("-std=c++17", f"-DROWS={rows}", f"-DUNROLL={unroll}", f"-DLOAD={load}")
        kernel = cupy.RawModule(code=SOURCE, options=options).get_function("gemv")
        for warps in (4, 8):
            label = f"CUDA rows/warp={rows} loads/lane={unroll} {load} warps/block={warps}"
            variants.append((label, rows, warps, kernel))
    return variants


def measure(n: int, k: int, variants: list, gen: torch.Generator) -> list[tuple[float, str, float]]:
    """(seconds per call, kernel, max error relative to the largest output) for cuBLAS, today's Triton op and each
    CUDA variant on an [n, k] bf16 weight and one row of x, fastest first."""
    import cupy

    from jetserve.ops.linear import kernels

    device, dtype = "cuda", torch.bfloat16
    weights = [(torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(dtype)
               for _ in range(weight_copies(n * k * dtype.itemsize, device))]  # fmt: skip
    x = torch.randn(1, k, device=device, generator=gen).to(dtype)
    y = torch.empty(1, n, device=device, dtype=dtype)
    want = F.linear(x.float(), weights[0].float())
    x16, y16 = cupy.asarray(x.view(torch.int16)), cupy.asarray(y.view(torch.int16))
    w16 = [cupy.asarray(w.view(torch.int16)) for w in weights]

    def launcher(kernel, rows: int, warps: int):
        row_groups = -(-n // rows)  # one warp each
        blocks = -(-row_groups // warps)

        def launch(i: int) -> torch.Tensor:
            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):  # captured with torch's stream
                kernel((blocks,), (32 * warps,), (x16, w16[i], y16, cupy.int32(n), cupy.int32(k // 8)))
            return y

        return launch

    runs = [("cuBLAS", lambda i: F.linear(x, weights[i])), ("Triton (today)", lambda i: kernels.linear(x, weights[i]))]
    runs += [(label, launcher(kernel, rows, warps)) for label, rows, warps, kernel in variants]
    results = []
    for label, run in runs:
        got = run(0)
        torch.cuda.synchronize()
        err = float((got.float() - want).abs().max() / want.abs().max())
        ms = time_ms(lambda run=run: [run(i) for i in range(len(weights))], device)
        results.append((ms / 1e3 / len(weights), label, err))
    return sorted(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemv_cuda: needs a CUDA GPU (and CuPy)")
    copy_bw, _ = ceilings("cuda")
    name = torch.cuda.get_device_name()
    print(f"{name}: copy {copy_bw / 1e9:.0f} GB/s (read + written); %copy = bandwidth / copy bandwidth")
    variants = compile_variants()
    warm_clocks("cuda", lambda: torch.empty(1 << 28, device="cuda", dtype=torch.uint8).zero_())
    out = open(args.json, "a") if args.json else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape, (n, k) in SHAPES.items():
        case, nbytes = f"2b {shape} {n}x{k} M=1", (n * k + k + n) * 2
        results = measure(n, k, variants, gen)
        torch.cuda.empty_cache()
        print(f"\n{case}: {nbytes / 1e6:.1f} MB, {nbytes / copy_bw * 1e6:.2f} µs at copy bandwidth")
        print(f"{'µs':>8} {'GB/s':>6} {'%copy':>6} {'max err':>9}  kernel")
        for seconds, label, err in results:
            gbps = nbytes / seconds / 1e9
            print(f"{seconds * 1e6:8.2f} {gbps:6.0f} {gbps * 1e9 / copy_bw:6.1%} {err:9.2e}  {label}")
            if out:
                row = {"case": case, "kernel": label, "us": seconds * 1e6, "gb_per_s": gbps, "bytes": nbytes,
                       "copy_fraction": gbps * 1e9 / copy_bw, "max_err": err, "device": name,
                       "copy_gb_per_s": copy_bw / 1e9}  # fmt: skip
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
