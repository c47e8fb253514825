#!/usr/bin/env bash
# Compile csrc/cuda/*.cu for sm_90a on a machine without a GPU (a CPU torch and nvcc suffice), so a
# CUDA change is known to build before it costs GPU time. The CPU wheel ships ATen's CUDA headers
# but not those of the CUDA libraries they name (cuBLAS, cuSPARSE, cuSOLVER): stand-ins declare
# the handle and status types. Prints nvcc's errors, and registers / spills per kernel with -v.
#
#   bash scripts/cuda_compile_check.sh [-v] [file.cu ...]      (default: every csrc/cuda/*.cu)
set -uo pipefail
cd "$(dirname "$0")/.."
VERBOSE=0
if [ "${1:-}" = "-v" ]; then VERBOSE=1; shift; fi
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "nvcc not found (set NVCC)"; exit 2; }
PY=${PYTHON:-.venv/bin/python}
TORCH_INC=$($PY -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))") || exit 2
STUBS=$(mktemp -d)
trap 'rm -rf "$STUBS"' EXIT
mkdir -p "$STUBS/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$STUBS/c10/cuda/impl/cuda_cmake_macros.h"
printf '#pragma once\ntypedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n' > "$STUBS/cublas_v2.h"
printf '#pragma once\ntypedef struct cublasLtContext* cublasLtHandle_t;\n' > "$STUBS/cublasLt.h"
printf '#pragma once\ntypedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n' > "$STUBS/cusparse.h"
printf '#pragma once\ntypedef struct cusolverDnContext* cusolverDnHandle_t;\n' > "$STUBS/cusolverDn.h"
printf '#pragma once\ntypedef int cusolverStatus_t;\n' > "$STUBS/cusolver_common.h"
FILES=("$@")
[ ${#FILES[@]} -eq 0 ] && FILES=(csrc/cuda/*.cu)
failed=0
for f in "${FILES[@]}"; do
  log=$("$NVCC" -std=c++20 -arch=sm_90a -c "$f" -o /dev/null -I csrc -I "$STUBS" -I "$TORCH_INC" \
        -I "$TORCH_INC/torch/csrc/api/include" --expt-relaxed-constexpr -Xptxas -v 2>&1)
  if [ $? -ne 0 ]; then
    failed=1
    echo "FAILED $f"
    grep -E "error" <<<"$log" | head -20
  else
    spills=$(grep -cE "[1-9][0-9]* bytes spill" <<<"$log")
    echo "ok     $f ($(grep -c 'Compiling entry' <<<"$log") kernels, $spills with spills)"
    [ $VERBOSE = 1 ] && grep -E "Compiling entry|registers|spill" <<<"$log" | sed 's/^/       /'
  fi
done
exit $failed
