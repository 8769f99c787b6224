#!/usr/bin/env bash
# One device call for the evidence of issues 15, 18 and 20 (notes/parity.md, notes/ced-prefill.md,
# benches/results/): each step under its own time limit, logs and results under $OUT.
#   run(command="bash scripts/device_measure_call.sh parity ced", timeout_s=600)
# Steps: parity (kernel path vs CPU reference numerics, 1,000 tokens), ced (prefill timing),
# kernels (benches/kernels.py), release (benches/release_layer.py), ncu (one profile per kernel case).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder that comes back}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
for step in "$@"; do
  start=$(date +%s)
  case "$step" in
    parity) timeout 240 python3 scripts/parity_reference.py --against engine-cpu --device cuda --tokens 1000 \
              --out "$OUT/parity-gpu.md" --json "$OUT/parity-gpu.json" > "$OUT/parity.log" 2>&1 ;;
    ced) timeout 240 python3 benches/ced_prefill.py --device cuda --tokens 1024 4096 8000 --prompts 1 --repeat 5 \
              --timing-only --out "$OUT/ced-prefill-h200.json" > "$OUT/ced.log" 2>&1 ;;
    kernels) timeout 240 python3 benches/kernels.py --out "$OUT" > "$OUT/kernels.log" 2>&1 ;;
    release) timeout 240 python3 benches/release_layer.py --out "$OUT" --budget-s 200 > "$OUT/release.log" 2>&1 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "$step exit $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
done
