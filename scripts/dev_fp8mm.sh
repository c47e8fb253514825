#!/usr/bin/env bash
# Issue 36, FP8 GEMMs, on the GPU machine (each call <= ~275 s):
#   bash scripts/dev_fp8mm.sh            build if needed, the kernel GPU tests, the kernel table (bench_fp8_gemm)
#   bash scripts/dev_fp8mm.sh engine     the engine test: fp8 compiled + CUDA graphs == fp8 eager, greedy
#   bash scripts/dev_fp8mm.sh e2e        Llama-3.1-8B decode ms/step, bf16 and fp8, batch 1 and 64
#   bash scripts/dev_fp8mm.sh e2e-ab     fp8 only, compilelm's FP8 kernels vs all on torch._scaled_mm
# (every stage builds first if compilelm/_C is absent)
# JSON and logs under $OUT; the tables print last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/dev_fp8mm}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
left() {  # min(cap, budget left), at least 1 (timeout 0 would mean none)
  local l=$((${BUDGET:-275} - ($(date +%s) - START)))
  l=$((l < $1 ? l : $1)); echo $((l < 1 ? 1 : l))
}
stage=${1:-default}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.txt"

tag=$(python3 -c 'import sys; print(f"{sys.version_info.major}{sys.version_info.minor}")')
if ! ls compilelm/_C.cpython-"$tag"-*.so >/dev/null 2>&1; then
  timeout "$(left 170)" env CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ python3 -m pip install --no-build-isolation \
    --no-deps -e . >"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -20; exit 1; }
  echo "build: $(($(date +%s) - START)) s"
fi

case $stage in
  default)
    timeout "$(left 130)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fp8_gemm_gpu.py \
      -k "not engine" >"$OUT/tests.log" 2>&1
    echo "kernel tests rc=$?: $(tail -1 "$OUT/tests.log")"
    grep -hE "^FAILED|^E  " "$OUT/tests.log" | head -12
    timeout "$(left 120)" python3 benchmarks/bench_fp8_gemm.py --out "$OUT/bench_fp8_gemm.json" \
      >"$OUT/bench_fp8_gemm.log" 2>&1
    echo "bench_fp8_gemm rc=$?"
    grep -E "FAILED" "$OUT/bench_fp8_gemm.log" | head -5
    sed -n '/^copy bandwidth/,$p' "$OUT/bench_fp8_gemm.log"
    ;;
  engine)
    timeout "$(left 270)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_fp8_gemm_gpu.py \
      -k "engine" >"$OUT/tests_engine.log" 2>&1
    echo "engine test rc=$?: $(tail -1 "$OUT/tests_engine.log")"
    grep -hE "^FAILED|^E  " "$OUT/tests_engine.log" | head -12
    ;;
  e2e | e2e-ab)
    args=(--quantization none fp8)
    [ "$stage" = e2e-ab ] && args=(--quantization fp8 --fp8-gemm both)
    timeout "$(left 270)" python3 benchmarks/bench_decode.py --no-hf --models dummy:llama-3.1-8b --batches 1 64 \
      --context 1000 "${args[@]}" --out "$OUT/bench_decode_$stage.json" >"$OUT/bench_decode_$stage.log" 2>&1
    echo "bench_decode rc=$?"
    grep -E "ms/step|FAILED" "$OUT/bench_decode_$stage.log"
    sed -n '/^copy bandwidth/,$p' "$OUT/bench_decode_$stage.log"
    ;;
  *) echo "unknown stage $stage (default | engine | e2e | e2e-ab)"; exit 2 ;;
esac
echo "total: $(($(date +%s) - START)) s"
