#!/usr/bin/env bash
# One device call for the evidence of issues 15, 18 and 20 (notes/parity.md, notes/ced-prefill.md,
# benches/results/): each step under its own time limit. Everything lands in $R; after each step it is
# archived to $OUT/results.tar.gz and the tables copied beside it ($OUT returns at most 8 files).
#   run(command="bash scripts/device_measure_call.sh kernels release parity", timeout_s=600,
#       carry=[".device-cache"])     # Triton's compile cache from the last call, where one came back (below)
# The release step's first pass compiles every kernel (~60 s per role's first layer on the H200): give it
# a call of its own, e.g. RELEASE_LIMIT=480 bash scripts/device_measure_call.sh release
# Steps: parity (kernel path vs CPU reference numerics, 1,000 tokens; PARITY_ARGS="--ops stream_bf16=1" sets
# knobs, PARITY_NAME names its files, parity-gpu by default), ced (prefill timing),
# kernels (benches/kernels.py), release (benches/release_layer.py; RELEASE_ARGS="--graph --profile" adds
# the CUDA-graph decode and profiled passes), profile (ncu on the slowest kernels; NCU_PAIRS="case:kernel ..."
# picks them; source: the first pair's per-line profile, as benches/ncu_source.py's table; NCU_EXTRA adds ncu
# options, e.g. NCU_PAIRS="attn_decode:_sparse_attn_t_kernel"
# NCU_EXTRA="--nvtx --nvtx-include attn_decode_default/" for the decode default's launch).
# KERNELS_ARGS="--only attn,moe" narrows the kernels step. parallel: benches/parallel.py's ranks sharing
# the one GPU (--share-gpus, gloo; PARALLEL_ARGS, default 2 ranks, 4 layers, 4,096 tokens): the parallel
# engine on the kernel path where no two GPUs are lent, its times meaningless. gputests: the GPU-only tests
# (decode graphs, the bf16 decodes' PTX), a pytest process per file.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder that comes back}"
export PYTHONUNBUFFERED=1
R=${R:-/tmp/measure}
mkdir -p "$R"
# Triton's compile cache across sessions (a cold machine compiles for minutes: run 24's last call lost its
# first release role to it): carry .device-cache (run(carry=[".device-cache"])) and the cache comes back as
# $OUT/triton-cache.tar.xz after each step; copy it into .device-cache/ here (replacing the last call's) for
# the next call
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .device-cache/triton-cache.tar.xz ]; then
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .device-cache/triton-cache.tar.xz "$TRITON_CACHE_DIR"
elif ls .device-cache/triton-cache.tar.gz.part-* >/dev/null 2>&1; then
  cat .device-cache/triton-cache.tar.gz.part-* | tar xzf - -C "$TRITON_CACHE_DIR"
elif [ -f .device-cache/triton-cache.tar.gz ]; then tar xzf .device-cache/triton-cache.tar.gz -C "$TRITON_CACHE_DIR"; fi
save_cache() {  # the binaries and metadata alone (a cache hit reads the cubin and the json; no test reads a
  # cached kernel's PTX), xz-compressed: ~4-5 MB against 18+ MB of the whole cache gzipped, which with the tracked
  # files passed the 64 MiB a call may carry. TRITON_CACHE_BACK=0 for every invocation of a call but its last
  [ "${TRITON_CACHE_BACK:-1}" = 1 ] || return 0
  rm -f "$OUT"/triton-cache.tar.*
  tar cf - -C "$TRITON_CACHE_DIR" --exclude='*.llir' --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.source' --exclude='*.ptx' . \
    | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(sys.stdin.buffer, lzma.open(sys.argv[1], 'wb', preset=6))" \
      "$OUT/triton-cache.tar.xz"
  [ "$(stat -c %s "$OUT/triton-cache.tar.xz")" -le $((15 << 20)) ] \
    || { echo "triton cache too large to bring back" >> "$R/steps.txt"; rm -f "$OUT/triton-cache.tar.xz"; }
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$R/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$R/gpu.txt" 2>&1
for step in "$@"; do
  start=$(date +%s)
  case "$step" in
    parity) timeout "${PARITY_LIMIT:-90}" python3 scripts/parity_reference.py --against engine-cpu --device cuda --tokens 1000 ${PARITY_ARGS:-} \
              --out "$R/${PARITY_NAME:-parity-gpu}.md" --json "$R/${PARITY_NAME:-parity-gpu}.json" \
              > "$R/${PARITY_NAME:-parity-gpu}.log" 2>&1 ;;
    ced) timeout 240 python3 benches/ced_prefill.py --device cuda --tokens 1024 4096 8000 --prompts 1 --repeat 5 \
              --timing-only --out "$R/ced-prefill-h200.json" > "$R/ced.log" 2>&1 ;;
    kernels) timeout "${KERNELS_LIMIT:-220}" python3 benches/kernels.py ${KERNELS_ARGS:-} --out "$R" > "$R/kernels.log" 2>&1 ;;
    release) timeout "${RELEASE_LIMIT:-150}" python3 benches/release_layer.py ${RELEASE_ARGS:-} --out "$R" --budget-s "$(( ${RELEASE_LIMIT:-150} - 40 ))" > "$R/release.log" 2>&1 ;;
    parallel) timeout "${PARALLEL_LIMIT:-240}" python3 benches/parallel.py --share-gpus --kernels on \
              ${PARALLEL_ARGS:---nproc 2 --layers 4 --tokens 4096} --out "$R/parallel-share-gpu.json" \
              > "$R/parallel.log" 2>&1; rc=$?; cp "$R/parallel.log" "$R/parallel-share-gpu.md"; (exit $rc) ;;
    profile) # Nsight Compute: the first launch of each kernel, one bench case per ncu run (-c counts launches
      # across every kernel the filter matches, so one run with -c 8 saw only the first case's kernel)
      for pair in ${NCU_PAIRS:-mhc:_mhc_main_kernel attn:_sparse_attn_t_kernel indexer:_indexer_kernel \
                  topk:_row_select_kernel moe:_gemv_gate_up_kernel moe:_moe_gate_up_kernel}; do
        timeout "${NCU_LIMIT:-45}" ncu --clock-control none --kernel-name-base function -k "regex:${pair#*:}" -c 1 ${NCU_EXTRA:-} \
              --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
              --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
              python3 benches/kernels.py --only "${pair%%:*}" --out "$R/ncu-run" >> "$R/ncu.txt" 2>&1
      done
      cp "$R/ncu.txt" "$R/ncu-report.md" ;;
    source) # Nsight Compute per instruction (warp stall samples, executed instructions a SASS line, its CUDA
      # line where line info is there): NCU_PAIRS' first pair, the full set, the source page exported as CSV (xz)
      pair=${NCU_PAIRS%% *}; name=$(echo "${pair#*:}" | tr -c 'A-Za-z0-9_\n' _)
      timeout "${NCU_LIMIT:-120}" ncu --clock-control none --kernel-name-base function -k "regex:${pair#*:}" -c 1 \
            --set full --import-source yes ${NCU_EXTRA:-} -f -o "$R/ncu-$name" \
            python3 benches/kernels.py --only "${pair%%:*}" --out "$R/ncu-run" >> "$R/ncu-source.log" 2>&1
      ncu -i "$R/ncu-$name.ncu-rep" --page source --csv --print-source sass,cuda > "$R/ncu-$name-source.csv" 2>> "$R/ncu-source.log" \
        || ncu -i "$R/ncu-$name.ncu-rep" --page source --csv > "$R/ncu-$name-source.csv" 2>> "$R/ncu-source.log"
      ncu -i "$R/ncu-$name.ncu-rep" --page details > "$R/ncu-$name-details.txt" 2>> "$R/ncu-source.log"
      python3 benches/ncu_source.py "$R/ncu-$name-source.csv" --out "$R/ncu-$name-source.md" >> "$R/ncu-source.log" 2>&1
      xz -k -6 "$R/ncu-$name-source.csv"; cp "$R/ncu-$name-source.csv.xz" "$OUT/" 2>/dev/null
      cp "$R/ncu-source.log" "$R/ncu-source.md" ;;
    gputests) # the GPU-only tests, each file in a pytest process of its own (the interpreter tests set
      # TRITON_INTERPRET=1 at import, which would make a GPU test in the same process run interpreted)
      # GPUTESTS_ONLY="fp8_linear glue" keeps the entries whose text holds one of the words; GPUTESTS_K a pytest -k
      # expression for them (an entry with its own -k takes the last one)
      for t in tests/test_decode_graphs.py "tests/test_kernels_sparse_attn.py -k on_the_gpu" \
               "tests/test_kernels_fp8_linear.py -k on_the_gpu" "tests/test_kernels_moe.py -k on_the_gpu" \
               tests/test_kernels_glue_on_the_gpu.py tests/test_kernels_moe_ws.py \
               tests/test_kernels_sparse_attn_wgmma.py; do
        if [ -n "${GPUTESTS_ONLY:-}" ]; then
          keep=0; for w in $GPUTESTS_ONLY; do case "$t" in *"$w"*) keep=1 ;; esac; done
          [ "$keep" = 1 ] || continue
        fi
        timeout "${GPUTESTS_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider --durations=0 $t \
          ${GPUTESTS_K:+-k "$GPUTESTS_K"} >> "$R/gputests.log" 2>&1
        echo "$t exit $?" >> "$R/gputests.log"
      done
      cp "$R/gputests.log" "$R/gputests.md" ;;
    *) echo "unknown step $step" ;;
  esac
  echo "$step exit $? in $(( $(date +%s) - start )) s" | tee -a "$R/steps.txt"
  tar czf "$OUT/results.tar.gz" --exclude="*.ncu-rep" --exclude="*-source.csv" -C "$R" .
  cp "$R"/*.md "$R/steps.txt" "$OUT/" 2>/dev/null
  save_cache
done
