#!/usr/bin/env bash
# One command: rebuild the shipped example draft from the committed data (seeded, CPU).
#
#   bash tools/train_dspark/rebuild.sh [OUT_DIR]      # default: .cache/train_dspark/rebuild
#
# committed data (tools/train_dspark/data/distill/: prompts + the target's greedy answer ids)
#   -> answers jsonl (prompt ids re-made by the chat template)
#   -> eval answers (the target on the 64 eval prompts; validation only)
#   -> features (bf16 target pass, fp16 taps on disk, resumable)
#   -> training (resumable: rerun the same command after an interruption)
#   -> OUT_DIR/draft (config.json + model.safetensors), then compare with the shipped one.
# Wall time on the project's shared 2-core machine: see the draft's model card.
set -euo pipefail
PY=${PY:-python}
OUT=${1:-.cache/train_dspark/rebuild}
THREADS=${THREADS:-1}
export HF_HUB_OFFLINE=1 PYTHONPATH=${PYTHONPATH:-.} OMP_NUM_THREADS=$THREADS
# the shipped draft's recipe (model card); override for experiments. It warm-starts from the
# previous example draft (tau 1.77, itself rebuilt from commit 9c46676 by this script's
# earlier recipe: STEPS=1500 SEED_COMMIT=9c46676, lr 3e-3, 4 x 32), taken from git history.
STEPS=${STEPS:-4200}
SEED_COMMIT=${SEED_COMMIT:-d3b5a4a}
PARTS=${PARTS:-2}   # feature processes (one thread each: one per core)
TRAIN_ARGS=${TRAIN_ARGS:---layers 2 --resume-from $OUT/seed_draft --lr 1e-3 --warmup 30 --seqs-per-step 8 --anchors 16 --val-anchors 32 --vocab-subset 1024 --val-every 700 --val-first}
t0=$(date +%s)
mkdir -p "$OUT/seed_draft"
for f in config.json model.safetensors; do
    git show "$SEED_COMMIT:edgebuild/data/smollm2-135m-dspark/$f" > "$OUT/seed_draft/$f"
done
$PY -m tools.train_dspark.datagen unpack --out "$OUT/answers.jsonl"
$PY -m tools.train_dspark.regenerate --threads "$THREADS" --batch 64 --max-new-tokens 128 \
    --prompts tools/train_dspark/data/eval_prompts.jsonl --out "$OUT/eval_answers.jsonl"
pids=()
for ((i = 0; i < PARTS; i++)); do
    $PY -m tools.train_dspark.cache_features --answers "$OUT/answers.jsonl" \
        --out "$OUT/features" --threads "$THREADS" --batch 8 --shard 256 --part "$i/$PARTS" &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done   # set -e: a failed part stops the rebuild
$PY -m tools.train_dspark.cache_features --answers "$OUT/eval_answers.jsonl" \
    --out "$OUT/eval_features" --threads "$THREADS" --batch 8 --shard 64
# shellcheck disable=SC2086
$PY -m tools.train_dspark.train --features "$OUT/features" --val-features "$OUT/eval_features" \
    --out "$OUT/run" --steps "$STEPS" --threads "$THREADS" --save-every 100 \
    $TRAIN_ARGS
mkdir -p "$OUT/draft"
cp "$OUT/run/checkpoint/config.json" "$OUT/run/checkpoint/model.safetensors" "$OUT/draft/"
echo "rebuilt $OUT/draft in $(($(date +%s) - t0)) s"
