#!/usr/bin/env bash
# One device call that trains the small model and hands it back (notes/training.md): everything must
# happen inside a single `run` of at most 10 minutes, because the machine is given back after 30 s idle
# and what it held is lost. Corpus + training + export run under scripts/train_on_device.sh; the
# exported checkpoint leaves through $OUT in 15 MiB parts (the tool returns files of at most 16 MiB).
#   run(command="bash scripts/device_train_call.sh", carry=["build/corpus_pack"], timeout_s=600)
# Back here: python3 scripts/install_trained_model.py <files_at>
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder that comes back}"
WORK=${WORK:-/tmp/v41train}
export WORK BUDGET=${BUDGET:-300} MAX_TOKENS=${MAX_TOKENS:-160000000}
timeout "${TRAIN_TIMEOUT:-560}" bash scripts/train_on_device.sh
echo "train_on_device exit $?" > "$WORK/call.txt"
# $OUT returns at most 8 files: the logs travel as one archive, train_log.json beside it (the installer
# copies it to assets/training/), then the sums and at most 5 parts of 15 MiB (the 64 MiB budget fits).
[[ -f "$WORK/out/train_log.json" ]] && gzip -c "$WORK/out/train_log.json" > "$OUT/train_log.json.gz"
# the compile cache (TRAIN_ARGS "--compile-cache-out $WORK/compile_cache.bin") comes back when it fits
# one file; carried to a later call as build/compile_cache.bin (TRAIN_ARGS "--compile-cache build/compile_cache.bin")
if [[ -f "$WORK/compile_cache.bin" ]] && (( $(stat -c %s "$WORK/compile_cache.bin") < 15000000 )); then
  cp "$WORK/compile_cache.bin" "$OUT/compile_cache.bin"
fi
if [[ -f "$WORK/out/model/model.safetensors.index.json" ]]; then
  (cd "$WORK/out" && tar cf - model | split -b 15M - "$OUT/model.tar.part-")
  (cd "$WORK/out/model" && sha256sum -- *) > "$OUT/model.sha256"
fi
ls -l "$OUT" >> "$WORK/call.txt"
logs=()
for f in call.txt train.log corpus.log corpus/index.json profile.txt; do [[ -f "$WORK/$f" ]] && logs+=("$f"); done
tar czf "$OUT/logs.tar.gz" -C "$WORK" "${logs[@]}"
