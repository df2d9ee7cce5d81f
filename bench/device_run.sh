#!/usr/bin/env bash
# One call on the GPU machine (see ../shared/gpu/README.md): SASS check of the kernels, the SSD
# benchmark, then the shipped model's training with the CUDA kernel tests running beside it.
#   bash bench/device_run.sh TRAIN_MINUTES        (0: no training)
# Binaries come packed in .gpu/ (pack.sh), fatbins in .gpu/fatbin/; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-0}
source .gpu/unpack.sh
log=$OUT/kernels.log
{
  echo "== SASS: tensor-core instructions per fatbin (sm_90a image)"
  for f in .gpu/fatbin/*.fatbin; do
    echo "$f: $(cuobjdump --dump-sass "$f" 2>/dev/null | grep -oE '\b(HMMA|HGMMA)[.A-Z0-9]*' | sort | uniq -c | tr '\n' ' ')"
  done
  echo "== bench_ssd --cuda"
  timeout 150 .gpu/bench_ssd --cuda 2>&1
  echo "bench rc=$?"
} > "$log" 2>&1
cat "$log"
train_pid=
if [[ $minutes != 0 ]]; then
  (PYTHONUNBUFFERED=1 python3 tools/train.py --minutes "$minutes" --out /tmp/w --bundle "$OUT" > "$OUT/train.log" 2>&1) &
  train_pid=$!
fi
for t in ssd_cuda ssd_errors model_cuda; do
  [[ -x .gpu/$t ]] || continue
  echo "== $t" >> "$log"
  RUST_BACKTRACE=1 timeout 300 ".gpu/$t" --test-threads 1 >> "$log" 2>&1
  echo "$t rc=$?" | tee -a "$log"
done
if [[ -n $train_pid ]]; then
  wait "$train_pid"
  echo "train rc=$?"
  tail -25 "$OUT/train.log"
fi
grep -E "test result|panicked|rel err" "$log" | head -40
