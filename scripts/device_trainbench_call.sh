#!/usr/bin/env bash
# One device call for the training-step bench (issue 13): a small code corpus built where the packages
# are, then benches/train_step.py on this tree against the baseline tree carried in build/train_baseline
# (`git archive <commit> engine assets/configs assets/tokenizer | tar -x -C build/train_baseline`).
#   run(command="bash scripts/device_trainbench_call.sh", carry=["build/train_baseline"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder that comes back}"
export PYTHONUNBUFFERED=1
W=${W:-/tmp/trainbench}
mkdir -p "$W"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 scripts/corpus_code.py --out "$W/corpus" --workers "$(nproc)" --max-tokens "${MAX_TOKENS:-20000000}" \
  > "$W/corpus.log" 2>&1
code=$(ls "$W"/corpus/train_code_*.npy | paste -sd,)
# BASELINE= (empty) measures this tree alone
BASELINE=${BASELINE-build/train_baseline}
timeout "${BENCH_LIMIT:-480}" python3 benches/train_step.py --train "$code" ${BASELINE:+--baseline "$BASELINE"} \
  --shapes "${SHAPES:-24x4096,40x4096}" --baseline-shapes "${BASE_SHAPES:-24x4096}" --phases "${PHASES:-sparse,quant}" \
  --seq-balance "${SEQ_BALANCE:-0.01}" --tree-timeout "${TREE_LIMIT:-300}" --profile --out "$OUT" ${BENCH_ARGS:-} \
  > "$OUT/train-step.log" 2>&1
echo "bench exit $?" >> "$OUT/train-step.log"
[[ -n "${AFTER:-}" ]] && timeout 90 bash -c "$AFTER" > "$OUT/after.log" 2>&1
tail -5 "$W/corpus.log" >> "$OUT/train-step.log"
