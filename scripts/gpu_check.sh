#!/usr/bin/env bash
# The whole GPU check in one command, for the H200 machine: install the carried wheels, run the `gpu` tests, the
# memory checker over every kernel we ship, and the benchmarks; logs and JSON go to the folder given (default ./out).
# Usage: bash scripts/gpu_check.sh [OUT_DIR] [STAGES]
#   STAGES: any of tests,memcheck,kernels,offline,overlap,profile,spec,graphs,policy,verify,curve,linear,tiles,long,tp,
#   mixer (default: the first four); graphs times the default pair's draft, verify and decode graphs
#   (bench/spec_graphs.py); policy A/Bs the adaptive policy against bench/policy_sim.py's candidates on the default
#   pair (drafts forced wrong, then its own); verify is issue 5's 2B verify-step benchmark (chain 6 and tree 8, drafts
#   forced wrong) and its profile; curve its forced speed-up curve (chain 6, the first K drafts accepted, K = 0..6: tau
#   = K + 1); overlap runs `offline` with overlap scheduling on and off (two GPUs: side by side, one each); long is the
#   NVlabs-paper point: 2B at 64K context, batch 128 (the preset with max_position_embeddings raised to 131072, room for
#   the 64K prompt plus its output and catch-up steps); mixer decides `JETSERVE_FUSED_MIXER`: the fused kernel's GPU
#   test, its kernel time against the two kernels it replaces, and batch-1 decode with it off and on
# First, here: bash scripts/fetch_gpu_wheels.sh (fills the ignored .whl/), then carry ".whl" in the device call.
# The compiled Triton kernels come back as OUT_DIR/triton-cache.tar.xz: put it in the ignored .gpu-cache/ and carry
# ".gpu-cache" too, and the next call (a fresh machine) starts without recompiling (scripts/triton_cache.sh).
# Each stage fits one 10-minute call: e.g. `bash scripts/gpu_check.sh $OUT tests`, then `... memcheck,kernels`, then
# `... offline`.
set -uo pipefail
OUT_DIR=$(realpath -m "${1:-${OUT:-out}}")  # before the cd: a relative OUT_DIR means one under the caller's folder
STAGES=${2:-tests,memcheck,kernels,offline}
mkdir -p "$OUT_DIR"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
source scripts/carried_wheels.sh
install_carried_wheels || exit 1
source scripts/triton_cache.sh
restore_triton_cache .gpu-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT_DIR/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT_DIR/gpu.txt"
status=0
run() {  # run NAME CMD...: log to OUT_DIR/NAME.log, remember failures
  local name=$1; shift
  echo "=== $name: $*"
  local start=$SECONDS
  "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - start)) s"
  tail -n 25 "$OUT_DIR/$name.log"
  [ $rc -eq 0 ] || status=1
  return $rc
}
PYTEST=(python3 -m pytest -m gpu -p no:cacheprovider -q -o addopts= -rfE --durations=15)
case ",$STAGES," in *,tests,*)
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    # Two GPUs: the engine/speculative modules (graph capture per bucket, the longest) beside the op tests, then the
    # tensor-parallel tests on both.
    CUDA_VISIBLE_DEVICES=0 run gpu_tests_engine "${PYTEST[@]}" tests/engine &
    engine_lane=$!
    CUDA_VISIBLE_DEVICES=1 run gpu_tests_ops "${PYTEST[@]}" --ignore=tests/engine --ignore=tests/distributed tests
    wait $engine_lane || status=1  # the lane ran in a subshell: its `status` stays there
    run gpu_tests_tp "${PYTEST[@]}" -s tests/distributed
  else
    run gpu_tests "${PYTEST[@]}" tests
  fi ;; esac
case ",$STAGES," in *,memcheck,*)
  run memcheck compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    python3 bench/memcheck_kernels.py ;; esac
case ",$STAGES," in *,kernels,*)
  run bench_kernels python3 bench/kernels.py --json "$OUT_DIR/kernels.jsonl" ;; esac
case ",$STAGES," in *,offline,*)
  run bench_offline python3 -m jetserve.cli bench offline --config 2b --batch-sizes 1,64,256 --input-len 4096 \
    --output-len 64 --json ;; esac
case ",$STAGES," in *,overlap,*)  # the same decode benchmark with decode steps launched ahead, and without
  OFFLINE=(python3 -m jetserve.cli bench offline --config 2b --batch-sizes 1,64,256 --input-len 4096 --output-len 64
           --json)
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    CUDA_VISIBLE_DEVICES=0 run bench_overlap_on "${OFFLINE[@]}" --overlap-scheduling &
    on_lane=$!
    CUDA_VISIBLE_DEVICES=1 run bench_overlap_off "${OFFLINE[@]}" --no-overlap-scheduling
    wait $on_lane || status=1
  else
    run bench_overlap_on "${OFFLINE[@]}" --overlap-scheduling
    run bench_overlap_off "${OFFLINE[@]}" --no-overlap-scheduling
  fi ;; esac
case ",$STAGES," in *,profile,*)
  run profile_decode python3 bench/profile_decode.py --config 2b --batch-sizes 1,64 --input-len 4096 --steps 20 \
    --json "$OUT_DIR/profile.jsonl" ;; esac
case ",$STAGES," in *,spec,*)
  for mode in right all wrong; do
    run "spec_forced_$mode" python3 -m jetserve.cli bench offline --config 2b --draft random \
      --forced-acceptance "$mode" --batch-sizes 1,16 --input-len 1024 --output-len 64 --json
  done
  for policy in "" --no-spec-adaptive; do  # the trained pair on MT-bench: τ and speed-up, adaptive and always-verify
    run "spec_default${policy:+_full}" python3 -m jetserve.cli bench offline --model default --draft default \
      --dataset mtbench --dtype bfloat16 --batch-sizes 1,8,32 --output-len 128 --json $policy
  done ;; esac
case ",$STAGES," in *,graphs,*)  # the default pair's speculative graphs replayed back to back (µs a replay)
  run spec_graphs python3 bench/spec_graphs.py --batch-sizes 1,8 --json "$OUT_DIR/spec_graphs.jsonl" ;; esac
case ",$STAGES," in *,policy,*)  # "never below 1.0x": the engine's policy and the candidates, in one process each
  for forced in wrong own; do
    run "policy_trace_$forced" python3 bench/policy_trace.py --batch-sizes 1,8 --num-prompts 24 --rounds 2 \
      --policies AdaptivePolicy,FreshExplorationPolicy,BoundedExplorationPolicy \
      $([ "$forced" = wrong ] && echo --forced-acceptance wrong) --json "$OUT_DIR/policy_trace.jsonl"
  done ;; esac
case ",$STAGES," in *,verify,*)  # issue 5's 2B verify step: chain 6 and tree 8, every draft rejected (the overhead)
  for shape in "1 6 7 chain6" "2 3 8 tree8"; do
    read -r topk steps nodes name <<< "$shape"
    run "spec_verify_$name" python3 -m jetserve.cli bench offline --config 2b --draft random --input-len 1024 \
      --output-len 64 --batch-sizes 1,16,64 --spec-topk "$topk" --spec-steps "$steps" --spec-num-draft-tokens "$nodes" \
      --forced-acceptance wrong --no-spec-adaptive
  done
  run profile_verify python3 bench/profile_decode.py --batch-sizes 1,64 --steps 10 --draft random \
    --json "$OUT_DIR/profile_verify.jsonl" ;; esac
case ",$STAGES," in *,curve,*)  # issue 5's forced speed-up curve: chain 6, the first K drafts accepted unchecked
  for depth in 0 1 2 3 4 5 6; do
    run "spec_curve_$depth" python3 -m jetserve.cli bench offline --config 2b --draft random --input-len 1024 \
      --output-len 64 --batch-sizes 1,16 --spec-topk 1 --spec-steps 6 --spec-num-draft-tokens 7 \
      --forced-acceptance all --forced-depth "$depth" --no-spec-adaptive --json
  done ;; esac
case ",$STAGES," in *,long,*)
  python3 -c "import json, sys; from jetserve.checkpoint import preset_config as p
c = p('2b'); c['max_position_embeddings'] = 131072; json.dump(c, open(sys.argv[1], 'w'))" "$OUT_DIR/2b_64k.json"
  run bench_offline_64k python3 -m jetserve.cli bench offline --config "$OUT_DIR/2b_64k.json" --batch-sizes 128 \
    --input-len 65536 --output-len 32 --json ;; esac
case ",$STAGES," in *,tp,*)  # two GPUs: collectives, TP=1 against TP=2 (NCCL and one-shot); TP_CONFIGS="2b 4b" for both
  run bench_tp env OUT="$OUT_DIR/tp" CONFIGS="${TP_CONFIGS:-2b}" BATCH_SIZES=1,64 OUTPUT_LEN=64 bash scripts/bench_tp.sh ;; esac
case ",$STAGES," in *,linear,*)
  run bench_linear python3 bench/linear.py --json "$OUT_DIR/linear.jsonl" ;; esac
case ",$STAGES," in *,tiles,*)  # the sweeps behind the conv decode tiles and the one-row GEMM tilings
  run bench_tile_sweep python3 bench/tile_sweep.py --models 2b,4b --json "$OUT_DIR/tile_sweep.jsonl" ;; esac
case ",$STAGES," in *,mixer,*)
  run gpu_tests_mixer "${PYTEST[@]}" tests/ops/test_jet_mixer.py
  run bench_mixer python3 bench/kernels.py --models 2b,4b --only jet_mixer --json "$OUT_DIR/kernels.jsonl"
  OFFLINE=(python3 -m jetserve.cli bench offline --config 2b --batch-sizes 1 --input-len 4096 --output-len 64 --json)
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    CUDA_VISIBLE_DEVICES=0 JETSERVE_FUSED_MIXER=1 run bench_mixer_on "${OFFLINE[@]}" &
    on_lane=$!
    CUDA_VISIBLE_DEVICES=1 JETSERVE_FUSED_MIXER=0 run bench_mixer_off "${OFFLINE[@]}"
    wait $on_lane || status=1
  else
    JETSERVE_FUSED_MIXER=1 run bench_mixer_on "${OFFLINE[@]}"
    JETSERVE_FUSED_MIXER=0 run bench_mixer_off "${OFFLINE[@]}"
  fi ;; esac
save_triton_cache "$OUT_DIR"
exit $status
