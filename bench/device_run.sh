#!/usr/bin/env bash
# One call on the GPU machine (see ../shared/gpu/README.md), after `bash bench/pack_gpu.sh` here:
# SASS check of the kernels, the SSD benchmark (alternating with a previous build's when
# `bash bench/pack_gpu.sh --base REV` packed one), the peer's SSD beside it (mamba_ssm's Triton,
# when .peer/ holds its sources: ../shared/bench/README.md), the model benchmark and
# `generate --device cuda`, then the CUDA tests (ssd_cuda a second time on the cp.async path);
# optionally the shipped model's training alongside the tests.
#   bash bench/device_run.sh [TRAIN_MINUTES]        (default 0: no training)
#   ROUNDS=N       rounds of this build's and the previous build's bench_ssd (default 2)
#   BENCH_MODEL=0  skips bench_model and generate;  PEER_BWD=1 times the peer's backward too
# With a `--nccl` pack (.gpu/train_nccl), libnccl.so.2 comes from PyTorch's wheel, the NCCL check
# at world size 1 runs after the tests, and on a machine of two or more GPUs the data-parallel
# benchmark too (tools/bench_train_gpu.sh --gpus 2; it needs .data, as its header says).
# Logs go to $OUT: kernels.log, peer.log, model.log, tests.log (and train.log with the weights
# bundle).
set -uo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-0}
source .gpu/unpack.sh
nccl=0
if [[ -e .gpu/train_nccl.xz || -x .gpu/train_nccl ]]; then
  nccl_env=$(bash tools/nccl-lib.sh --run-env) && eval "$nccl_env" && nccl=1
fi
{
  echo "== SASS: tensor-core instructions per fatbin (sm_90a image)"
  for f in .gpu/fatbin/*.fatbin; do
    echo "$f: $(cuobjdump --dump-sass "$f" 2>/dev/null | grep -oE '\b(HMMA|HGMMA)[.A-Z0-9]*' | sort | uniq -c | tr '\n' ' ')"
  done
  if [[ -x .gpu/bench_ssd_base ]]; then
    for r in $(seq "${ROUNDS:-2}"); do
      for b in bench_ssd bench_ssd_base; do
        echo "== $b --cuda --gpu-reps 100 (round $r)"
        timeout 200 ".gpu/$b" --cuda --gpu-reps 100 2>&1
        echo "$b rc=$?"
      done
    done
  elif [[ -x .gpu/bench_ssd ]]; then
    echo "== bench_ssd --cuda"
    timeout 200 .gpu/bench_ssd --cuda 2>&1
    echo "bench_ssd rc=$?"
  fi
} > "$OUT/kernels.log" 2>&1
cat "$OUT/kernels.log"
if [[ -e .peer/ssd_peers_bwd.py ]]; then
  {
    mkdir -p /tmp/ms && tar -C /tmp/ms -xJf .peer/mamba_src.tar.xz
    echo "== mamba_ssm $(grep -o '"[0-9.a-z]*"' /tmp/ms/mamba_ssm/__init__.py | head -1) Triton SSD"
    peer=.peer/ssd_peers_bwd.py
    if [[ ${PEER_BWD:-0} != 1 ]]; then
      # The forward alone: the backward columns print as nan.
      sed 's/r += bench(fb)/r += (float("nan"),) * 2/' "$peer" > /tmp/ssd_peers_fwd.py
      peer=/tmp/ssd_peers_fwd.py
    fi
    MAMBA_SRC=/tmp/ms PYTHONUNBUFFERED=1 timeout 300 python3 "$peer" 2>&1
    echo "peer rc=$?"
  } > "$OUT/peer.log" 2>&1
  cat "$OUT/peer.log"
fi
if [[ -x .gpu/bench_model && ${BENCH_MODEL:-1} != 0 ]]; then
  {
    echo "== bench_model: prefill (all models), then decode one model per process"
    timeout 200 .gpu/bench_model --decode "" --peer 130m:1x2048,780m:1x2048 2>&1
    echo "bench_model prefill rc=$?"
    for m in 130m 780m 2.7b; do
      timeout 90 .gpu/bench_model --models $m --prefill "" --peer 130m:d1,130m:d16,2.7b:d1 2>&1
      echo "bench_model decode $m rc=$?"
    done
    echo "== generate --device cuda (a fixture model in the HF layout, byte-level prompt)"
    timeout 60 .gpu/generate --device cuda --weights tests/fixtures/mamba2-130m-hf --prompt hello --max-new-tokens 32 --seed 1 2>&1
    echo "generate rc=$?"
  } > "$OUT/model.log" 2>&1
  cat "$OUT/model.log"
fi
train_pid=
if [[ $minutes != 0 ]]; then
  (PYTHONUNBUFFERED=1 python3 tools/train.py --minutes "$minutes" --out /tmp/w --bundle "$OUT" > "$OUT/train.log" 2>&1) &
  train_pid=$!
fi
for t in ${TESTS:-ssd_cuda ssd_errors model_cuda grad_ssd_cuda grad_cuda model_grad_cuda packed_cuda}; do
  [[ -x .gpu/$t ]] || continue
  echo "== $t" >> "$OUT/tests.log"
  RUST_BACKTRACE=1 timeout 300 ".gpu/$t" --test-threads 1 --nocapture >> "$OUT/tests.log" 2>&1
  echo "$t rc=$?" | tee -a "$OUT/tests.log"
done
# The cp.async path (sm_80's) on this GPU too.
if [[ -x .gpu/ssd_cuda ]]; then
  echo "== ssd_cuda with MAMBA2_NO_TMA=1" >> "$OUT/tests.log"
  MAMBA2_NO_TMA=1 RUST_BACKTRACE=1 timeout 300 .gpu/ssd_cuda --test-threads 1 --nocapture >> "$OUT/tests.log" 2>&1
  echo "ssd_cuda (MAMBA2_NO_TMA=1) rc=$?" | tee -a "$OUT/tests.log"
fi
if [[ -n $train_pid ]]; then
  wait "$train_pid"
  echo "train rc=$?"
  tail -5 "$OUT/train.log"
fi
grep -E "test result|panicked|worst|rel err" "$OUT/tests.log" | head -40
if [[ $nccl == 1 ]]; then
  timeout 900 bash tools/check_nccl_1gpu.sh > "$OUT/nccl_console.log" 2>&1
  echo "check_nccl_1gpu rc=$?"
  grep -E "test result|200 steps" "$OUT/nccl_console.log"
  if [[ $(nvidia-smi -L | wc -l) -ge 2 && -f .data/gutenberg-114.txt.xz ]]; then
    timeout 1200 bash tools/bench_train_gpu.sh --gpus 2 --steps 200 --no-peer > "$OUT/gpus2.log" 2>&1
    echo "bench_train_gpu --gpus 2 rc=$?"
    tail -4 "$OUT/gpus2.log"
  fi
fi
