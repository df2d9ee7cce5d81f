#!/usr/bin/env bash
# Installs NCCL's library for linking the `nccl` build here (cudarc, through candle, links
# `-lnccl` dynamically), from the nvidia-nccl-cu13 wheel: PREFIX/lib/libnccl.so.2 and a
# libnccl.so link to it. The binaries then need libnccl.so.2 at run time: on a GPU machine with
# PyTorch it is in the nvidia-nccl wheel beside torch (README, "Training on several GPUs").
# The wheel's 2.27.7 is the oldest for CUDA 13: a binary linked against it needs no newer
# symbols than the NCCL it runs with.
#
#   usage: tools/nccl-lib.sh [PREFIX]       (default PREFIX: /opt/nccl-pip)
#   then:  source <(tools/nccl-lib.sh --env [PREFIX])   # sets LIBRARY_PATH for the linker
# Idempotent: a second run only says where it is. On a machine that runs an `nccl` build (with
# PyTorch's nvidia-nccl wheel):
#   source <(bash tools/nccl-lib.sh --run-env)   # LD_LIBRARY_PATH to libnccl.so.2, NVLS off
set -euo pipefail
if [[ ${1:-} == --run-env ]]; then
  lib=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0] + "/lib")' 2>/dev/null || true)
  if [[ ! -e $lib/libnccl.so.2 ]]; then
    lib=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' \
      | xargs -n1 -I{} find {} -name libnccl.so.2 2>/dev/null | head -1 | xargs -r dirname)
  fi
  [[ -n $lib && -e $lib/libnccl.so.2 ]] || { echo "no libnccl.so.2 found in Python's packages" >&2; exit 1; }
  # NVLink multicast stays off on these machines (the train example forces it too).
  echo "export LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH} NCCL_NVLS_ENABLE=0"
  exit 0
fi
if [[ ${1:-} == --env ]]; then
  echo "export LIBRARY_PATH=${2:-/opt/nccl-pip}/lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
  exit 0
fi
PREFIX=${1:-/opt/nccl-pip}
if [[ -e $PREFIX/lib/libnccl.so.2 && -L $PREFIX/lib/libnccl.so ]]; then
  echo "NCCL is in $PREFIX/lib"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp/whl" nvidia-nccl-cu13==2.27.7
python3 -m zipfile -e "$tmp"/whl/*.whl "$tmp/x"     # a wheel is a zip
mkdir -p "$PREFIX/lib" "$PREFIX/include"
cp "$tmp/x/nvidia/nccl/lib/libnccl.so.2" "$PREFIX/lib/"
cp "$tmp/x/nvidia/nccl/include/nccl.h" "$PREFIX/include/"
ln -sf libnccl.so.2 "$PREFIX/lib/libnccl.so"
echo "installed in $PREFIX/lib; now: source <($0 --env $PREFIX)"
