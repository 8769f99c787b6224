#!/usr/bin/env bash
# The small model's training run on one H200 (notes/training.md): build the code part of the corpus
# where the packages are installed, add the prose pack carried from a machine with Debian's mirror
# (scripts/corpus_prose.py), then train and export to $WORK/out. Progress: $WORK/train.log.
#   WORK=/tmp/v41train BUDGET=620 MAX_TOKENS=120000000 bash scripts/train_on_device.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/v41train}
BUDGET=${BUDGET:-620}
MAX_TOKENS=${MAX_TOKENS:-60000000}
PACK=${PACK:-build/corpus_pack/prose.txt.xz}
# DENSE_FRAC, LR and TRAIN_ARGS (e.g. "--init assets/model" to continue the shipped model) pass through;
# the H200 settings; a CPU smoke passes e.g. SHAPE="--cpu --tiny --batch 2 --seq 256 --max-steps 3 --smoke --eval-seq 256 --eval-windows 1"
SHAPE=${SHAPE:---bf16 --compile --checkpoint --batch 28 --seq 4096 --dense-batch 16 --dense-seq 2048}
# near the memory limit (28 x 4,096 peaks at 118 GB) the allocator's expandable segments measured 1.06x
# in the same bench run (benches/results/train-step-h200.md)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$WORK"
trap 'echo failed > "$WORK/DONE"' ERR
start=$(date +%s)
# PACK=none trains on code only (a smoke test where no prose pack was built)
prose_args=(--prose-pack "$PACK")
[[ "$PACK" == none ]] && prose_args=()
python3 scripts/corpus_code.py --out "$WORK/corpus" --workers "$(nproc)" --max-tokens "$MAX_TOKENS" \
  "${prose_args[@]}" > "$WORK/corpus.log" 2>&1
echo "corpus built in $(( $(date +%s) - start )) s" >> "$WORK/corpus.log"
D=$WORK/corpus
code=$(ls "$D"/train_code_*.npy | paste -sd,)
extra=()
[[ "$PACK" != none ]] && extra=(--extra "$(ls "$D"/train_prose*.npy | paste -sd,)" --extra-share 0.3)
heldout=()
for h in "$D"/heldout_*.npy; do heldout+=(--heldout "$(basename "$h" .npy | sed 's/^heldout_//')=$h"); done
python3 -m engine.train train --train "$code" "${extra[@]}" \
  --budget-s "$BUDGET" --dense-frac "${DENSE_FRAC:-0.12}" --quant-frac 0.2 --lr "${LR:-3e-3}" --warmup 30 --log-every 10 \
  "${heldout[@]}" --eval-windows 8 $SHAPE ${TRAIN_ARGS:-} \
  --out "$WORK/out" > "$WORK/train.log" 2>&1
echo done > "$WORK/DONE"
