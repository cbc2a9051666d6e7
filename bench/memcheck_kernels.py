"""Run every kernel jetserve ships once per case at the 2B and 4B shapes, for `compute-sanitizer --tool memcheck`.

Before the kernels run, a large buffer is allocated and freed so that the caching allocator hands the kernels reused
memory (fla-core 0.6.0's fused recurrent kernel crashed only then). Sizes are the benchmark's, shrunk (`small`) except
for decode (batch 1, 64 and 256) and the JetBlock ops' verify and commit (batch 1, 16 and 64), whose tile rules pick
other tiles as the batch grows; attention at 4K context stays out (slow under the checker). Arguments, if any, keep
only the cases whose name holds one of them (e.g. `python bench/memcheck_kernels.py linear`).
"""

from __future__ import annotations

import sys

import torch
from common import SHAPES, all_cases


def main(argv: list[str]) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cuda":
        big = torch.empty(8 << 30, dtype=torch.uint8, device=device)
        big.fill_(7)
        del big  # stays in the allocator's cache, to be reused by the kernels' tensors
    models = ("2b", "4b", "smoke") if device == "cuda" else ("smoke",)  # smoke: the tiny test model's head sizes
    count = 0
    for model in models:
        cases = all_cases(SHAPES[model], dtype, device, small=True)
        decode = all_cases(SHAPES[model], dtype, device, small=False)
        full = ("decode", "verify", "commit", "batched split")  # full size: the rules pick other tiles past a few rows
        cases |= {n: build for n, build in decode.items() if any(k in n for k in full) and "ctx=4096" not in n}
        for name, build in cases.items():
            if argv and not any(part in name for part in argv):
                continue
            fn, _, _ = build()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            count += 1
            print(f"ok {model} {name}", flush=True)
    print(f"{count} kernel cases ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
