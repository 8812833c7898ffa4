#!/usr/bin/env bash
# Short equal-compute runs on the first ~0.1M answer tokens (features in $FEAT): what moves the
# teacher-forced validation tau after $STEPS steps (initialisation, layers, anchors, lr).
# Each run resumes if interrupted; results: $OUT/<name>/train_log.jsonl (last line: val).
set -euo pipefail
PY=${PY:-python}
FEAT=${FEAT:-.cache/train_dspark/distill/features}
VAL=${VAL:-.cache/train_dspark/distill/eval_features}
OUT=${OUT:-.cache/train_dspark/study}
STEPS=${STEPS:-150}
TOKENS=${TOKENS:-100000}
SHIPPED=edgebuild/data/smollm2-135m-dspark
base=(--features "$FEAT" --val-features "$VAL" --max-train-tokens "$TOKENS" --steps "$STEPS"
      --warmup 20 --val-every "$STEPS" --save-every 50 --threads 1 --vocab-subset 1024
      --markov-rank 64)
run() {  # name, extra args
    local name=$1; shift
    if [ -f "$OUT/$name/summary.json" ]; then return; fi
    echo "== $name: $*"
    $PY -m tools.train_dspark.train "${base[@]}" --out "$OUT/$name" "$@" | grep '"val"' || true
}
run base      --layers 2 --init-from 28 29 --lr 3e-3 --seqs-per-step 4 --anchors 32
run warm      --layers 2 --resume-from "$SHIPPED" --lr 3e-3 --seqs-per-step 4 --anchors 32
run random    --layers 2 --lr 3e-3 --seqs-per-step 4 --anchors 32
run layers1   --layers 1 --init-from 29 --lr 3e-3 --seqs-per-step 4 --anchors 32
run layers3   --layers 3 --init-from 27 28 29 --lr 3e-3 --seqs-per-step 4 --anchors 32
run anchors64 --layers 2 --init-from 28 29 --lr 3e-3 --seqs-per-step 2 --anchors 64
run anchors16 --layers 2 --init-from 28 29 --lr 3e-3 --seqs-per-step 8 --anchors 16
run lr1e-3    --layers 2 --init-from 28 29 --lr 1e-3 --seqs-per-step 4 --anchors 32
