#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs (run on nvidia-h200-x2): `jetserve bench offline` at TP=1 and TP=2 on the 2B and 4B
# configs (random weights) in one run — TP=2 twice, with NCCL's all-reduce and with the one-shot all-reduce over
# symmetric memory (JETSERVE_TP_ALL_REDUCE) — then the collectives of a TP=2 decode step, both kinds, against NCCL's
# bus bandwidth measured here. Prints JSON rows (one per batch size) under a header per run; results go to $OUT (default bench_tp/).
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
  echo "== collectives of a TP=2 decode step, $config"
  python3 -m jetserve.distributed.bench_collectives --config "$config" --tensor-parallel-size 2 \
    --batch-sizes "$BATCH_SIZES" --all-reduce nccl,one-shot | tee "$OUT/collectives_${config}_tp2.jsonl"
  for run in tp1:1:nccl tp2:2:nccl tp2_oneshot:2:one-shot; do
    IFS=: read -r name tp kind <<<"$run"
    echo "== bench offline --config $config --tensor-parallel-size $tp (all-reduce: $kind)"
    JETSERVE_TP_ALL_REDUCE=$kind python3 -m jetserve.cli bench offline --config "$config" --dtype bfloat16 \
      --tensor-parallel-size "$tp" --batch-sizes "$BATCH_SIZES" --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
      --json | tee "$OUT/offline_${config}_${name}.jsonl"
  done
done
# The TP=2 speed-up per batch size (NCCL and one-shot all-reduce), and what a TP=2 decode step's collectives take.
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def rows(name, kind=None):
    found = [json.loads(line) for line in (out / name).read_text().splitlines() if line.startswith("{")]
    return {r["batch_size"]: r for r in found if kind is None or r.get("all_reduce") == kind}
nan = float("nan")
print(f"{'config':>6} {'batch':>6} {'TPOT tp1':>9} {'tp2 nccl':>9} {'tp2 1shot':>9} {'speed-up':>15} "
      f"{'comm us nccl/1shot':>19} {'bw-bound us':>12} {'busbw GB/s':>11}")
for config in ("2b", "4b"):
    if not (out / f"collectives_{config}_tp2.jsonl").exists():
        continue
    one, two, shot = (rows(f"offline_{config}_{n}.jsonl") if (out / f"offline_{config}_{n}.jsonl").exists() else {}
                      for n in ("tp1", "tp2", "tp2_oneshot"))
    nccl, oneshot = (rows(f"collectives_{config}_tp2.jsonl", k) for k in ("nccl", "one-shot"))
    for b in sorted(nccl):
        t1 = one.get(b, {}).get("tpot_ms", nan)
        t2, t3 = (r.get(b, {}).get("tpot_ms", nan) for r in (two, shot))
        c1, c2 = (r.get(b, {}).get("step_collectives_us", nan) for r in (nccl, oneshot))
        bound = nccl.get(b, {}).get("bandwidth_bound_us", nan)
        busbw = nccl.get(b, {}).get("bus_bandwidth_gb_s", nan)
        print(f"{config:>6} {b:>6} {t1:>9.3f} {t2:>9.3f} {t3:>9.3f} {t1 / t2:>6.2f}x/{t1 / t3:>6.2f}x "
              f"{c1:>9.1f}/{c2:>9.1f} {bound:>12.1f} {busbw:>11.1f}")
PY
