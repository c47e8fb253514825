#!/usr/bin/env bash
# One call on the GPU machine: build the CUDA extension against the machine's own torch, run the
# GPU test tier, run the attention benchmark. Logs and the benchmark JSON go to $OUT (the device
# tool brings that folder back), else to /tmp/gpu_check.
#
#   bash scripts/gpu_check.sh [pytest args...]      (default: tests/gpu)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/env.txt"

# 1. build (editable, in place: compilelm/_C*.so next to the sources; nvcc compiles csrc/cuda/*.cu)
start=$(date +%s)
if ! $PY -m pip install --no-build-isolation --no-deps -e . -v >"$OUT/build.log" 2>&1; then
  grep -E "error|Error" "$OUT/build.log" | head -40
  tail -40 "$OUT/build.log"
  exit 1
fi
echo "build: $(($(date +%s) - start)) s"
grep -E "COMPILELM_CUDA|warning" "$OUT/build.log" | grep -v "BFloat16.h\|Remark" | head -20
$PY -c "
import torch, compilelm.ops
for op in ('paged_attention', 'reshape_and_cache'):
    assert torch._C._dispatch_has_kernel_for_dispatch_key('compilelm::' + op, 'CUDA'), op + ': no CUDA kernel'
print('CUDA kernels registered')
" || exit 1

# 2. GPU tests
$PY -m pytest -m gpu -x -q -p no:cacheprovider "${@:-tests/gpu}" 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

# 3. benchmark
$PY benchmarks/bench_attention.py --out "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $((tests_rc || bench_rc))
