#!/usr/bin/env bash
# Builds the torch-free CUDA extension `deepinfer_cuda` (sm_90a, sm_100a) with nvcc + pybind11.
#   bash csrc/cuda/build.sh              -> deepinfer/backends/nvidia/deepinfer_cuda<EXT_SUFFIX>
#   bash csrc/cuda/build.sh --check      -> compile and link into a temp dir only (CI, tests)
#   bash csrc/cuda/build.sh --out PATH   -> write the module to PATH (setup.py's build_ext)
# Env: PYTHON (default python3), NVCC (default nvcc), NVCC_THREADS (default 2).
# pybind11 (headers only) is pip-installed into $PYTHON when missing.
#
# No --use_fast_math: it swaps expf for the approximate __expf, division for an approximate
# reciprocal and flushes denormals, which moves results away from the cpu reference that the
# kernels are tested against (1e-5). Contracting a*b+c into FMA stays on: deterministic.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
NVCC="${NVCC:-nvcc}"

mode=install
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) mode=check ;;
    --out) out="$2"; shift ;;
    *) echo "usage: build.sh [--check] [--out PATH]" >&2; exit 2 ;;
  esac
  shift
done

command -v "$NVCC" >/dev/null 2>&1 || { echo "build.sh: nvcc not found (set NVCC or PATH)" >&2; exit 1; }
if ! "$PYTHON" -c "import pybind11" >/dev/null 2>&1; then
  echo "build.sh: installing pybind11 into $("$PYTHON" -c 'import sys; print(sys.prefix)')" >&2
  "$PYTHON" -m pip install --quiet "pybind11>=2.12"
fi
suffix="$("$PYTHON" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")"

tmp=""
if [ "$mode" = check ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  out="$tmp/deepinfer_cuda$suffix"
elif [ -z "$out" ]; then
  out="$root/deepinfer/backends/nvidia/deepinfer_cuda$suffix"
fi
mkdir -p "$(dirname "$out")"

# shellcheck disable=SC2046  # the includes are several words
cmd=("$NVCC" -std=c++17 -O3
     -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_100a,code=sm_100a
     --threads "${NVCC_THREADS:-2}" -Xcompiler -fPIC,-fvisibility=hidden -shared
     $("$PYTHON" -m pybind11 --includes) -I"$here"
     "$here/bindings.cpp" "$here/sparse_decode_attention.cu" -o "$out")
echo "${cmd[*]}"
"${cmd[@]}"

if [ "$mode" = check ]; then
  # linked and loadable: importing needs no GPU (cudart is static; the driver is opened on first use)
  "$PYTHON" -c "import sys; sys.path.insert(0, sys.argv[1]); import deepinfer_cuda as m; m.sparse_decode_attention" \
    "$tmp" \
    || { echo "build.sh: $out does not import" >&2; exit 1; }
  echo "build.sh --check: ok ($(du -h "$out" | cut -f1) linked)"
else
  echo "build.sh: wrote $out"
fi
