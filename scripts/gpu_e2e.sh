#!/usr/bin/env bash
# One call on the GPU machine for the engine end to end: build the CUDA extension (skipped when
# compilelm/_C for this Python is already there, e.g. carried from an earlier call), run the GPU
# test tier, run benchmarks/bench_decode.py. Logs, the built library and bench_decode.json go to
# $OUT (the device tool brings that folder back), else to /tmp/gpu_e2e.
#
#   bash scripts/gpu_e2e.sh [tests] [bench] [-- bench_decode args...]     (default: tests bench)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_e2e}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stages=() bench_args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; bench_args=("$@"); break; fi
  stages+=("$1"); shift
done
[ ${#stages[@]} -eq 0 ] && stages=(tests bench)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"

# 1. build with the system compiler (the image's /opt/gcc has only a static libstdc++)
tag=$($PY -c 'import sys; print(f"{sys.version_info.major}{sys.version_info.minor}")')
lib=$(ls compilelm/_C.cpython-$tag-*.so 2>/dev/null | head -1)
if [ -z "$lib" ]; then
  start=$(date +%s)
  if ! CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ $PY -m pip install --no-build-isolation --no-deps -e . -v \
      >"$OUT/build.log" 2>&1; then
    grep -E "error|Error" "$OUT/build.log" | head -40
    exit 1
  fi
  echo "build: $(($(date +%s) - start)) s"
  lib=$(ls compilelm/_C.cpython-$tag-*.so | head -1)
  cp "$lib" "$OUT/"
fi
$PY -c "
import torch, compilelm.ops
for op in ('paged_attention', 'reshape_and_cache'):
    assert torch._C._dispatch_has_kernel_for_dispatch_key('compilelm::' + op, 'CUDA'), op + ': no CUDA kernel'
print('CUDA kernels registered')
" || exit 1

rc=0
for stage in "${stages[@]}"; do
  case $stage in
    tests)
      timeout 240 $PY -m pytest -m gpu -x -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest.log"
      rc=$((rc || PIPESTATUS[0])) ;;
    bench)
      timeout 420 $PY benchmarks/bench_decode.py --out "$OUT/bench_decode.json" "${bench_args[@]}" 2>&1 \
        | grep -v "it/s\]$" | tee "$OUT/bench.log"
      rc=$((rc || PIPESTATUS[0])) ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
exit $rc
