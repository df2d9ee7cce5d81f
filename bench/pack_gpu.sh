#!/usr/bin/env bash
# Builds the CUDA test and example binaries here and packs them into .gpu/ for bench/device_run.sh
# (../shared/gpu/pack.sh strips and compresses; the fatbins are copied for the SASS check). With
# --base REV it also builds bench_ssd at commit REV (in a worktree, with a target dir of its own:
# cargo keys a workspace's artifacts by paths relative to it, so two checkouts sharing one target
# dir would take each other's builds as fresh) and packs it as bench_ssd_base, which
# device_run.sh alternates with this build's. With --nccl the build has the `nccl` feature (NCCL
# installed here for linking by tools/nccl-lib.sh) and also packs the train example and
# tests/train_nccl.rs; every binary then needs libnccl.so.2 there (device_run.sh finds it).
#   bash bench/pack_gpu.sh [--base REV] [--nccl]
set -euo pipefail
cd "$(dirname "$0")/.."
base=
features=cuda
tests=(ssd_cuda ssd_errors model_cuda grad_ssd_cuda grad_cuda model_grad_cuda packed_cuda)
examples=(bench_ssd bench_model generate)
while [[ $# -gt 0 ]]; do
  case $1 in
    --base) base=$2; shift 2 ;;
    --nccl)
      features=cuda,nccl
      tests+=(train_nccl)
      examples+=(train)
      bash tools/nccl-lib.sh >/dev/null
      source <(bash tools/nccl-lib.sh --env)
      shift ;;
    *) echo "pack_gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
source <(bash ../shared/gpu/cuda-toolkit.sh --env)
target=${CARGO_TARGET_DIR:-$PWD/target}
json=$(cargo build --release --features "$features" --tests --examples --message-format=json)
pick() {  # the executable of target $1 of kind $2 (test | example)
  python3 -c '
import sys, json
name, kind = sys.argv[1], sys.argv[2]
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t.get("name") == name and kind in t.get("kind", []):
        print(m["executable"])' "$1" "$2" <<< "$json" | tail -1
}
rm -rf .gpu && mkdir -p .gpu/fatbin
bins=()
for t in "${tests[@]}"; do bins+=("$(pick "$t" test)"); done
for e in "${examples[@]}"; do bins+=("$(pick "$e" example)"); done
bash ../shared/gpu/pack.sh "${bins[@]}"
for f in .gpu/*-*.xz; do [[ -e $f ]] && mv "$f" "$(echo "$f" | sed -E 's/-[0-9a-f]{16}\.xz$/.xz/')"; done
out=$(python3 -c '
import sys, json
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "build-script-executed" and "mamba2-kernels" in m.get("package_id", ""): print(m["out_dir"])' <<< "$json" | tail -1)
cp "$out"/*.fatbin .gpu/fatbin/
if [[ -n $base ]]; then
  tree=$(mktemp -d)/base
  git worktree add --detach "$tree" "$base" >/dev/null
  bin=$(cd "$tree" && CARGO_TARGET_DIR=$target-base \
    cargo build --release --features cuda --example bench_ssd --message-format=json \
    | python3 -c 'import sys, json
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)
  strip -o .gpu/bench_ssd_base "$bin" && xz -T0 -6 -f .gpu/bench_ssd_base
  git worktree remove --force "$tree"
fi
ls -la .gpu .gpu/fatbin; du -sh .gpu
