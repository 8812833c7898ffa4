#!/usr/bin/env bash
# The example draft's pipeline on one accelerator (run on a lent H200 on 2026-12-04: the model card):
# self-instruct prompts + the template pool in 4 phrasings, >= 10M greedy answer tokens by the
# target (transformers generate, bf16, large batches), then training with online features
# (the target runs inside each step: a 10M-token feature cache would be ~60 GB), writing the
# draft in the repo layout (config.json + model.safetensors, bf16, no lm_head/embed_tokens).
#
#   bash tools/train_dspark/gpu.sh                        # on the device machine, repo root
#   DEVICE=cpu BUDGET_TOKENS=300 SI=8 STEPS=2 ... bash tools/train_dspark/gpu.sh   # dry run
#
# Every knob is an environment variable (defaults sized for one H200 and ~10 minutes):
set -euo pipefail
PY=${PY:-python}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-.cache/train_dspark/gpu}
TARGET=${TARGET:-examples/smollm2-135m}
SI=${SI:-20000}                         # self-instruct requests
SI_BATCH=${SI_BATCH:-512}
VARIANTS=${VARIANTS:-4}                 # template pool phrasings (4: ~123k prompts)
BUDGET_TOKENS=${BUDGET_TOKENS:-10000000}
GEN_MINUTES=${GEN_MINUTES:-5}           # generation stops at whichever budget comes first
GEN_BATCH=${GEN_BATCH:-1024}
MAX_NEW=${MAX_NEW:-128}
STEPS=${STEPS:-3000}
TRAIN_MINUTES=${TRAIN_MINUTES:-0}       # > 0: the step count becomes what fits (train.py --budget-minutes)
RESUME_FROM=${RESUME_FROM:-}            # a draft folder to warm-start from instead of --init-from
SEQS=${SEQS:-64}
ANCHORS=${ANCHORS:-48}
LR=${LR:-2e-3}
LAYERS=${LAYERS:-2}
INIT_FROM=${INIT_FROM:-28 29}
DRAFT_OUT=${DRAFT_OUT:-$OUT/draft}
THREADS=${THREADS:-8}
EVAL_LIMIT=${EVAL_LIMIT:-0}             # eval prompts answered for validation (0: all 64)
VAL_LIMIT=${VAL_LIMIT:-0}               # of those, used per validation (0: all)
export HF_HUB_OFFLINE=1 PYTHONPATH=${PYTHONPATH:-.}

t0=$(date +%s)
stamp() { echo "[gpu.sh $(($(date +%s) - t0)) s] $*"; }
mkdir -p "$OUT"
common=(--target "$TARGET" --cache "$OUT/cache" --data "$OUT/data" --variants "$VARIANTS"
        --device "$DEVICE" --threads "$THREADS")

stamp "self-instruct: $SI requests"
$PY -m tools.train_dspark.datagen selfinstruct "${common[@]}" --n "$SI" --batch "$SI_BATCH"
stamp "answers: budget $BUDGET_TOKENS tokens / $GEN_MINUTES min"
$PY -m tools.train_dspark.datagen answers "${common[@]}" --batch "$GEN_BATCH" \
    --max-new-tokens "$MAX_NEW" --budget-tokens "$BUDGET_TOKENS" --budget-minutes "$GEN_MINUTES"
$PY -m tools.train_dspark.datagen pack "${common[@]}"
stamp "eval answers (validation only)"
$PY -m tools.train_dspark.regenerate --target "$TARGET" --batch 64 --max-new-tokens "$MAX_NEW" \
    --threads "$THREADS" --device "$DEVICE" --limit "$EVAL_LIMIT" \
    --prompts tools/train_dspark/data/eval_prompts.jsonl --out "$OUT/cache/eval_answers.jsonl"
stamp "training: $STEPS steps x $SEQS sequences x $ANCHORS anchors (online features)"
init=(--init-from $INIT_FROM)
[[ -n "$RESUME_FROM" ]] && init=(--resume-from "$RESUME_FROM" --val-first)
# shellcheck disable=SC2086
$PY -m tools.train_dspark.train --target "$TARGET" --answers "$OUT/cache/answers.jsonl" \
    --val-answers "$OUT/cache/eval_answers.jsonl" --out "$OUT/run" --device "$DEVICE" \
    --layers "$LAYERS" "${init[@]}" --steps "$STEPS" --budget-minutes "$TRAIN_MINUTES" \
    --seqs-per-step "$SEQS" \
    --anchors "$ANCHORS" --lr "$LR" --warmup $((STEPS / 30 + 1)) --threads "$THREADS" \
    --val-every $((STEPS / 5 + 1)) --save-every $((STEPS / 10 + 1)) --val-limit "$VAL_LIMIT"
mkdir -p "$DRAFT_OUT"
cp "$OUT/run/checkpoint/config.json" "$OUT/run/checkpoint/model.safetensors" "$DRAFT_OUT/"
stamp "draft written to $DRAFT_OUT"
