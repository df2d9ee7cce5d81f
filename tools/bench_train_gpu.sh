#!/usr/bin/env bash
# Training throughput and peak GPU memory of `examples/train` (--device cuda --dtype bf16) beside
# `tools/train.py` (PyTorch, bf16 autocast, torch.compile), on the same model, batch and context,
# on one GPU, for two models:
#
#   shipped  the shipped model's config.json (12.6M parameters), 64 sequences × 1,024 tokens per step
#   130m     tools/mamba2_130m_config.json (d_model 768, 24 layers, state 128, vocabulary 50,288:
#            129M parameters, mamba2-130m's shape), 8 sequences × 2,048 tokens per step
#
# Both train from scratch for --steps steps on the same text: the first --books training books of
# the corpus and its last 3 books held out (the split of tools/train.py). tokens/s counts the
# predicted tokens of the steady steps (from the 4th on) for both: ours is the median of its
# train_log.csv rows, scaled by (L−1)/L because a window of L ids predicts L−1 tokens (ours runs
# --seq-len L+1 so that its forward is L tokens long, as train.py's); train.py's is its "steady"
# figure. Peak memory: each program's own (ours: the memory pool's high-water mark; train.py:
# torch.cuda.max_memory_allocated after its first step) and the device's, nvidia-smi sampled every
# 100 ms, less its level before the run.
#
# Here (a CUDA build and the corpus, which travel in git-ignored folders; the shipped config and
# tokenizer are read from weights/, or from .data/ when weights/ stays behind):
#   source <(bash ../shared/gpu/cuda-toolkit.sh --env) && export CUDA_COMPUTE_CAP=90
#   cargo build --release --features cuda --example train
#   bash ../shared/gpu/pack.sh target/release/examples/train
#   mkdir -p .data && cp ../shared/data/gutenberg-114.txt.xz weights/config.json weights/tokenizer.json .data/
# On the GPU machine, with .gpu and .data sent along:
#   bash tools/bench_train_gpu.sh [--steps N] [--books N] [--only shipped|130m] [--no-peer]
# The summary goes to stdout and, when $OUT is set, to $OUT/bench_train_gpu.txt with the logs.
#
# Data parallelism: with --gpus N (N > 1; a train binary built with `--features cuda,nccl`, and
# PyTorch's nvidia-nccl wheel on the machine for libnccl.so.2: tools/nccl-lib.sh --run-env), ours
# runs three times per model on the same global batch and seed — one GPU, N GPUs, one GPU again —
# and the summary adds tokens/s on N GPUs, the scaling efficiency (tokens/s on N ÷ N × on one) and
# the largest per-step difference of the training loss from the one-GPU run, beside the one-GPU
# run's own repeat (the GPU's run-to-run spread). E.g. the issue's check:
#   bash tools/bench_train_gpu.sh --gpus 2 --steps 200 --no-peer
set -uo pipefail

steps=30
books=20
only=""
peer=1
gpus=1
corpus=.data/gutenberg-114.txt.xz
while [[ $# -gt 0 ]]; do
  case $1 in
    --steps) steps=$2; shift 2 ;;
    --books) books=$2; shift 2 ;;
    --only) only=$2; shift 2 ;;
    --no-peer) peer=0; shift ;;
    --gpus) gpus=$2; shift 2 ;;
    --corpus) corpus=$2; shift 2 ;;
    *) echo "bench_train_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $steps =~ ^[0-9]+$ && $steps -ge 8 ]] || { echo "--steps must be a number >= 8 (3 warm-up steps, 5 timed), got $steps" >&2; exit 2; }
[[ $books =~ ^[0-9]+$ && $books -ge 1 ]] || { echo "--books must be a number >= 1, got $books" >&2; exit 2; }
[[ -z $only || $only == shipped || $only == 130m ]] || { echo "--only must be shipped or 130m, got $only" >&2; exit 2; }
[[ $gpus =~ ^[1-9][0-9]*$ ]] || { echo "--gpus must be a number >= 1, got $gpus" >&2; exit 2; }
[[ -f $corpus ]] || { echo "no corpus at $corpus: copy ../shared/data/gutenberg-114.txt.xz into .data/ and carry .data" >&2; exit 2; }
[[ -f .gpu/unpack.sh && ( -f .gpu/train.xz || -x .gpu/train ) ]] || { echo "no packed train binary in .gpu/: build and pack it (see the header of $0)" >&2; exit 2; }
# The shipped model's FILE: weights/FILE, else .data/FILE.
shipped() {
  if [[ -f weights/$1 ]]; then echo "weights/$1"; elif [[ -f .data/$1 ]]; then echo ".data/$1"; fi
}
tokenizer=$(shipped tokenizer.json)
config=$(shipped config.json)
[[ -n $tokenizer && -n $config ]] || { echo "no config.json and tokenizer.json in weights/ or .data/" >&2; exit 2; }

work=$(mktemp -d /tmp/bench_train_gpu.XXXXXX)
report=${OUT:-$work}
mkdir -p "$report"
# shellcheck disable=SC1091
source .gpu/unpack.sh
if [[ $gpus -gt 1 ]]; then
  nccl_env=$(bash tools/nccl-lib.sh --run-env) || exit 2
  eval "$nccl_env"
fi
export PYTHONUNBUFFERED=1

echo "preparing the text: $books training books and the 3 held-out books of $corpus"
python3 - "$corpus" "$books" "$work" "$tokenizer" <<'PY' || exit 1
import json, os, sys
import numpy as np
sys.path.insert(0, "tools")
import train_tokenizer as tt
from tokenizers import Tokenizer

corpus, books, work, tok_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
parts = tt.read_corpus(corpus).split(tt.EOT)
held = parts[-tt.N_HELDOUT_BOOKS:]
train = parts[:-tt.N_HELDOUT_BOOKS][:books]
with open(os.path.join(work, "corpus.txt"), "w", encoding="utf-8") as f:
    f.write(tt.EOT.join(train + held))
tok = Tokenizer.from_file(tok_path)
train_ids = tt.encode_stream(tok, train)
held_ids = np.asarray(tok.encode(tt.EOT.join(held)).ids, dtype=np.uint16)
os.makedirs(os.path.join(work, "tok"))
np.save(os.path.join(work, "tok", "train_tokens.npy"), train_ids)
np.save(os.path.join(work, "tok", "heldout_tokens.npy"), held_ids)
meta = {"tokenizer_sha256": tt.sha256_file(tok_path), "train_tokens": int(train_ids.size),
        "heldout_tokens": int(held_ids.size)}
with open(os.path.join(work, "tok", "meta.json"), "w") as f:
    json.dump(meta, f)
print(f"{train_ids.size:,} training and {held_ids.size:,} held-out tokens")
PY

# The peak of the memory samples in $1 (MiB) less the level $2 before the run, in GiB.
peak_gib() {
  python3 - "$1" "$2" <<'PY'
import sys
v = [float(x) for x in open(sys.argv[1]) if x.strip()]
print(f"{(max(v) - float(sys.argv[2])) / 1024:.2f}" if v else "?")
PY
}

# The median tokens/s of the train_log.csv $1 from step 4 on, as predicted tokens of windows of
# $2 + 1 ids.
steady_tps() {
  python3 - "$1" "$2" <<'PY'
import csv, statistics, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["tokens_per_s"] and int(r["step"]) > 3]
ctx = int(sys.argv[2])
tps = [float(r["tokens_per_s"]) * ctx / (ctx + 1) for r in rows]
print(f"{statistics.median(tps):,.0f}" if tps else "?")
PY
}

used_mib() {
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 | head -1
}

summary=()

# run_ours NAME CONFIG BATCH CTX [TRAIN FLAGS...]
run_ours() {
  local name=$1 config=$2 batch=$3 ctx=$4 log="$report/ours_$1.log" out="$work/ours_$1"
  shift 4
  local base pid rc
  base=$(used_mib)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 100 > "$work/mem_ours_$name" 2>/dev/null &
  pid=$!
  echo "== ours, $name: $batch × $ctx, $steps steps"
  .gpu/train --device cuda --dtype bf16 --data "$work/corpus.txt" --config "$config" \
    --tokenizer "$tokenizer" --out "$out" --steps "$steps" --batch-size "$batch" \
    --seq-len $((ctx + 1)) --lr 3e-3 --final-lr-frac 0.02 --warmup 5 --schedule wsd \
    --eval-every 0 --save-every 0 --seed 1 "$@" > "$log" 2>&1
  rc=$?
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  tail -4 "$log"
  if [[ $rc -ne 0 ]]; then
    summary+=("ours    $name: failed (exit $rc, $log)")
    return
  fi
  local tps own
  tps=$(steady_tps "$out/train_log.csv" "$ctx")
  own=$(grep -o 'peak GPU memory: [0-9.]* GiB in use' "$log" | grep -o '[0-9.]* GiB' || echo "? GiB")
  summary+=("ours    $name: $tps tokens/s; peak memory $own (pool), $(peak_gib "$work/mem_ours_$name" "$base") GiB (nvidia-smi)")
}

# run_peer NAME BATCH CTX TRAIN.PY-MODEL-FLAGS...
run_peer() {
  local name=$1 batch=$2 ctx=$3 log="$report/peer_$1.log"
  shift 3
  local base pid rc
  base=$(used_mib)
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 -lms 100 > "$work/mem_peer_$name" 2>/dev/null &
  pid=$!
  echo "== tools/train.py, $name: $batch × $ctx, $steps steps"
  python3 tools/train.py --data-dir "$work/tok" --tokenizer "$tokenizer" --out "$work/peer_$name" --max-steps "$steps" \
    --batch "$batch" --ctx "$ctx" --lr 3e-3 --final-lr-frac 0.02 --warmup 5 --minutes 15 \
    --reserve-s 0 --eval-every 1000000 --eval-windows 2 --sample-tokens 1 "$@" > "$log" 2>&1
  rc=$?
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  grep -E 'first step|training done' "$log" | tail -2
  if [[ $rc -ne 0 ]]; then
    summary+=("train.py $name: failed (exit $rc, $log)")
    return
  fi
  local tps own
  tps=$(grep -o 'steady [0-9,]* tok/s' "$log" | grep -o '[0-9,]*' | head -1)
  own=$(grep -o 'max mem [0-9.]* GiB' "$log" | grep -o '[0-9.]* GiB' | head -1)
  summary+=("train.py $name: ${tps:-?} tokens/s; peak memory ${own:-? GiB} (torch, first step), $(peak_gib "$work/mem_peer_$name" "$base") GiB (nvidia-smi)")
}

# compare_gpus NAME CTX: tokens/s on $gpus GPUs against one (counted as steady_tps counts them),
# and the training losses' largest per-step difference from the one-GPU run, with its repeat's
# beside it.
compare_gpus() {
  local name=$1 ctx=$2
  summary+=("$(python3 - "$work/ours_$name" "$work/ours_${name}_${gpus}gpu" "$work/ours_${name}_again" "$gpus" "$name" "$ctx" <<'PY'
import csv, statistics, sys
one, many, again, n, name, ctx = *sys.argv[1:4], int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
def rows(run):
    try:
        return list(csv.DictReader(open(f"{run}/train_log.csv")))
    except OSError:
        return []
def losses(run):
    return [float(r["train_loss"]) for r in rows(run) if r["train_loss"]]
def tps(run):
    v = [float(r["tokens_per_s"]) * ctx / (ctx + 1) for r in rows(run)
         if r["tokens_per_s"] and int(r["step"]) > 3]
    return statistics.median(v) if v else float("nan")
a, b, c = losses(one), losses(many), losses(again)
if not (a and b and c):
    print(f"ours    {name}: {n} GPUs: a run is missing (see the logs)")
    sys.exit()
worst = lambda x, y: max(abs(p - q) for p, q in zip(x, y))
t1, tn = tps(one), tps(many)
print(f"ours    {name}: {n} GPUs {tn:,.0f} tokens/s against {t1:,.0f} on one: efficiency "
      f"{tn / (n * t1):.1%}; training loss over {min(len(a), len(b))} steps: largest difference "
      f"from one GPU {worst(a, b):.3e}, one GPU's own repeat {worst(a, c):.3e}")
PY
)")
}

# run_model NAME CONFIG BATCH CTX: ours (and with --gpus, on N GPUs and on one again).
run_model() {
  run_ours "$@"
  if [[ $gpus -gt 1 ]]; then
    local name=$1
    shift
    run_ours "${name}_${gpus}gpu" "$@" --gpus "$gpus"
    run_ours "${name}_again" "$@"
    compare_gpus "$name" "$3"
  fi
}

if [[ -z $only || $only == shipped ]]; then
  run_model shipped "$config" 64 1024
  [[ $peer == 1 ]] && run_peer shipped 64 1024
fi
if [[ -z $only || $only == 130m ]]; then
  run_model 130m tools/mamba2_130m_config.json 8 2048
  [[ $peer == 1 ]] && run_peer 130m 8 2048 --hidden 768 --layers 24 --state 128 --head-dim 64 \
    --expand 2 --vocab-size 50288 --max-weight-mb 0
fi

{
  echo "training throughput on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $steps steps from scratch, bf16"
  printf '%s\n' "${summary[@]}"
} | tee "$report/bench_train_gpu.txt"
