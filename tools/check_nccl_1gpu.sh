#!/usr/bin/env bash
# The NCCL path of the train example at world size 1, on a machine with one GPU, PyTorch (whose
# nvidia-nccl wheel has libnccl.so.2) and no Rust. Built and packed here first:
#   source <(bash ../shared/gpu/cuda-toolkit.sh --env) && source <(bash tools/nccl-lib.sh --env)
#   cargo build --release --features cuda,nccl --example train --test train_nccl
#   bash ../shared/gpu/pack.sh target/release/examples/train \
#     "$(ls -t target/release/deps/train_nccl-* | grep -v '\.d$' | head -1)"
# then there:
#   bash tools/check_nccl_1gpu.sh          (logs also into $OUT when it is set)
# It runs tests/train_nccl.rs, then 200 steps of the shipped model's config in bf16 on this
# repository's text three times — without NCCL, with --all-reduce nccl, and without again (the
# GPU's own run-to-run noise) — and prints the largest loss differences.
set -uo pipefail
cd "$(dirname "$0")/.."
source .gpu/unpack.sh
env=$(bash tools/nccl-lib.sh --run-env) || exit 1
eval "$env"
log=${OUT:-/tmp}/nccl_1gpu.log
{
  echo "== $env"
  test=$(ls .gpu/train_nccl .gpu/train_nccl-* 2>/dev/null | grep -v '\.xz$' | head -1)
  echo "== $test"
  RUST_BACKTRACE=1 timeout 600 "$test" --test-threads 1 --nocapture 2>&1
  echo "train_nccl rc=$?"
  data=/tmp/nccl_check_text.txt
  cat README.md bench/RESULTS.md weights/MODEL_CARD.md tools/train_README.md > "$data"
  for run in plain nccl again; do
    extra=(); [[ $run == nccl ]] && extra=(--all-reduce nccl)
    rm -rf "/tmp/nccl_check_$run"
    echo "== train $run"
    timeout 600 .gpu/train --device cuda --dtype bf16 --data "$data" --config weights/config.json \
      --tokenizer weights/tokenizer.json --out "/tmp/nccl_check_$run" --steps 200 \
      --batch-size 16 --seq-len 256 --lr 3e-3 --warmup 20 --heldout-fraction 0.05 \
      --eval-every 100 --save-every 0 --seed 1 "${extra[@]}" 2>&1 | tail -4
    echo "train $run rc=${PIPESTATUS[0]}"
  done
  python3 - <<'PY'
import csv
def losses(run):
    with open(f"/tmp/nccl_check_{run}/train_log.csv") as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f) if r["train_loss"]]
a, b, c = losses("plain"), losses("nccl"), losses("again")
worst = lambda x, y: max(abs(p - q) for p, q in zip(x, y))
print(f"200 steps: largest |loss difference| with NCCL {worst(a, b):.3e}, "
      f"repeat without NCCL {worst(a, c):.3e}; last losses {a[-1]:.4f} {b[-1]:.4f} {c[-1]:.4f}")
PY
} 2>&1 | tee "$log"
