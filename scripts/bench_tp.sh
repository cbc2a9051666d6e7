#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (run on nvidia-h200-x2): `jetserve bench offline` at TP=1 and TP=2 on the 2B and 4B
# configs (random weights) in one run, then the collectives of a TP=2 decode step against NCCL's bus bandwidth
# measured here. Prints JSON rows (one per batch size) under a header per run; results go to $OUT (default bench_tp/).
# Carry ".whl" (fla-core) in the call, as for gpu_check.sh. Env: CONFIGS (default "2b 4b"), BATCH_SIZES, INPUT_LEN,
# OUTPUT_LEN.
set -euo pipefail
OUT=$(realpath -m "${OUT:-bench_tp}")
cd "$(dirname "$0")/.."
source scripts/carried_wheels.sh
install_carried_wheels
BATCH_SIZES=${BATCH_SIZES:-1,8,64,256}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-128}
CONFIGS=${CONFIGS:-2b 4b}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.csv"
nvidia-smi topo -m | tee "$OUT/topology.txt"
for config in $CONFIGS; do
  for tp in 1 2; do
    echo "== bench offline --config $config --tensor-parallel-size $tp"
    python3 -m jetserve.cli bench offline --config "$config" --dtype bfloat16 --tensor-parallel-size "$tp" \
      --batch-sizes "$BATCH_SIZES" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --json \
      | tee "$OUT/offline_${config}_tp${tp}.jsonl"
  done
  echo "== collectives of a TP=2 decode step, $config"
  python3 -m jetserve.distributed.bench_collectives --config "$config" --tensor-parallel-size 2 \
    --batch-sizes "$BATCH_SIZES" | tee "$OUT/collectives_${config}_tp2.jsonl"
done
# The TP=2 speed-up per batch size, and the share of a TP=2 decode step its collectives take.
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def rows(name):
    return {r["batch_size"]: r for r in map(json.loads, (out / name).read_text().splitlines()) if r}
print(f"{'config':>6} {'batch':>6} {'TPOT tp1 ms':>12} {'TPOT tp2 ms':>12} {'speed-up':>9} {'comm us':>9} "
      f"{'comm share':>11} {'comm bw-bound us':>17} {'busbw GB/s':>11}")
for config in ("2b", "4b"):
    if not (out / f"collectives_{config}_tp2.jsonl").exists():
        continue
    one, two = rows(f"offline_{config}_tp1.jsonl"), rows(f"offline_{config}_tp2.jsonl")
    comm = rows(f"collectives_{config}_tp2.jsonl")
    for b in sorted(one):
        c = comm.get(b, {})
        t1, t2 = one[b]["tpot_ms"], two[b]["tpot_ms"]
        us = c.get("step_collectives_us", float("nan"))
        print(f"{config:>6} {b:>6} {t1:>12.3f} {t2:>12.3f} {t1 / t2:>8.2f}x {us:>9.1f} {us / 1e3 / t2:>10.1%} "
              f"{c.get('bandwidth_bound_us', float('nan')):>17.1f} {c.get('bus_bandwidth_gb_s', float('nan')):>11.1f}")
PY
