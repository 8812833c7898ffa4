#!/usr/bin/env bash
# The data-size study of the model card: the same recipe (warm start from the example draft of
# commit 9c46676, lr 1e-3, 1,000 steps x 4 sequences x 32 anchors, vocabulary subset 1,024,
# seed 0, one thread) on nested prefixes of the committed data, features in $FEAT.
# Each run resumes if interrupted; results: $OUT/tok<N>/train_log.jsonl (val every 250 steps).
#
#   FEAT=.cache/train_dspark/rebuild/features VAL=.cache/train_dspark/rebuild/eval_features \
#       bash tools/train_dspark/study_data.sh 100000 230000 500000 0     # 0: all the data
set -euo pipefail
PY=${PY:-python}
FEAT=${FEAT:-.cache/train_dspark/rebuild/features}
VAL=${VAL:-.cache/train_dspark/rebuild/eval_features}
OUT=${OUT:-.cache/train_dspark/study_data}
STEPS=${STEPS:-1000}
export HF_HUB_OFFLINE=1 PYTHONPATH=${PYTHONPATH:-.} OMP_NUM_THREADS=1
mkdir -p "$OUT/seed_9c46676"
for f in config.json model.safetensors; do
    git show "9c46676:edgebuild/data/smollm2-135m-dspark/$f" > "$OUT/seed_9c46676/$f"
done
for tok in "$@"; do
    [ -f "$OUT/tok$tok/summary.json" ] && continue
    echo "== tok$tok"
    $PY -m tools.train_dspark.train --features "$FEAT" --val-features "$VAL" \
        --out "$OUT/tok$tok" --max-train-tokens "$tok" --steps "$STEPS" --warmup 20 \
        --val-every 250 --save-every 100 --threads 1 --vocab-subset 1024 --markov-rank 64 \
        --layers 2 --resume-from "$OUT/seed_9c46676" --lr 1e-3 --seqs-per-step 4 --anchors 32 |
        grep '"val"' || true
done
