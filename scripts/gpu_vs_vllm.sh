#!/usr/bin/env bash
# compilelm next to vLLM 0.26.0 on the GPU machine, in two device calls issued back to back (the
# machine keeps /tmp only while warm, ~30 s after a call). vLLM comes in two parts built by
# ../shared/peers/build_vllm_site.sh into .vllm/ (ignored by git); see ../shared/peers/README.md.
#
#   call 1, carrying .vllm/part0 (+ COMMIT):   bash scripts/gpu_vs_vllm.sh part0 [CMD...]
#       copies vLLM's first half to /tmp/vp, builds compilelm (unless compilelm/_C for this
#       Python is there), then runs CMD (e.g. the GPU tier) while nothing else waits on it
#   call 2, at once, carrying .vllm/part1:
#       bash scripts/gpu_vs_vllm.sh part1 [--no-attention] [bench_vs_vllm args... [:: args of another run...]]
#       unpacks vLLM to /tmp/vllm_site, runs bench_prefill_attention (with FA3; not with
#       --no-attention) and bench_vs_vllm once per "::"-separated argument list, JSON into $OUT
#       (bench_vs_vllm.json, bench_vs_vllm_1.json, ...)
#
# Issue 35's TP rows, on nvidia-h200-x2 / -x4 (the same two calls; each engine's start includes
# drawing its random weights on the GPUs, ~1-2 min for the 70B shape):
#   part1 --no-attention --models dummy:llama-3.1-8b -tp 2 --decode 1x1000 64x1000 --prefill 16x2000 \
#         --repeat 1 --mixes nano-vllm
#   part1 --no-attention --models dummy:llama-3.1-70b -tp 4 --decode 1x1000 64x1000 --prefill 4x2000 \
#         --repeat 1 --mixes nano-vllm --max-model-len 4096 --timeout 500
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_vs_vllm}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # TP runs: no NVLink multicast (KINDS.md)
stage=${1:?part0 or part1}; shift
case $stage in
  part0)
    (mkdir -p /tmp/vp && cp .vllm/part0/* /tmp/vp/) &
    tag=$(python3 -c 'import sys; print(f"{sys.version_info.major}{sys.version_info.minor}")')
    if ! ls compilelm/_C.cpython-"$tag"-*.so >/dev/null 2>&1; then
      t0=$(date +%s)
      CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ python3 -m pip install --no-build-isolation --no-deps -e . -v \
        >"$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
      echo "build: $(($(date +%s) - t0)) s"
      cp compilelm/_C.cpython-"$tag"-*.so "$OUT/"
    fi
    rc=0
    if [ $# -gt 0 ]; then "$@"; rc=$?; fi
    wait
    exit $rc ;;
  part1)
    cp .vllm/part1/* /tmp/vp/ && mkdir -p /tmp/vllm_site && cat /tmp/vp/site.tar.xz.part* | tar -xJ -C /tmp/vllm_site \
      || { echo "vLLM not unpacked: was part0 copied by the call just before?"; exit 1; }
    if [ "${1:-}" = --no-attention ]; then shift; else
      timeout 150 python3 benchmarks/bench_prefill_attention.py --vllm-site /tmp/vllm_site \
        --out "$OUT/bench_prefill_attention.json" 2>&1 | tail -14
    fi
    # several bench_vs_vllm runs: their argument lists separated by "::", JSON in bench_vs_vllm[_N].json
    n=0; runs=(); cur=()
    for a in "$@" ::; do
      if [ "$a" = :: ]; then runs+=("${cur[*]:-}"); cur=(); else cur+=("$a"); fi
    done
    for r in "${runs[@]}"; do
      out="$OUT/bench_vs_vllm.json"; [ $n -gt 0 ] && out="$OUT/bench_vs_vllm_$n.json"
      # shellcheck disable=SC2086  # each run's arguments, word-split as given
      python3 benchmarks/bench_vs_vllm.py --vllm-site /tmp/vllm_site --out "$out" $r 2>&1 \
        | grep -v "it/s\]$" | grep -E "^dummy|^model|^---|^\{|rror"
      n=$((n + 1))
    done ;;
  *) echo "unknown stage $stage (part0 or part1)"; exit 2 ;;
esac
