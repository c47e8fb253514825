#!/usr/bin/env bash
# Before/after on the GPU machine: the same benchmarks on a baseline tree and on this one, back to
# back on one warm machine (timings compare only there). The baseline is a `git archive` of the
# commit before the change, unpacked in .baseline/ (ignored by git; name it in the device tool's
# carry):
#
#   rm -rf .baseline && mkdir .baseline && git archive BASE | tar -x -C .baseline && git rev-parse --short BASE > .baseline/COMMIT
#   bash scripts/gpu_ab.sh [decode] [tokens]        (default: both)
#
# decode: bench_decode (no HF rows) on each tree; tokens: scripts/greedy_tokens.py on each tree.
# The baseline is built as a wheel into /tmp/ab_base and runs first, with any editable install's
# import hook hidden (it would win over PYTHONPATH); each side checks which tree it imports.
# JSON and logs go to $OUT (else /tmp/gpu_ab).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(decode tokens)
BENCH=(--no-hf --models dummy:smollm2-135m dummy:llama-3.1-8b --batches 1 64)
TOKEN_MODELS=(dummy:qwen3-0.6b dummy:llama-3.1-8b)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/env.txt"

build() {  # build TREE [--target DIR]: the extension with the system compiler
  local tree=$1; shift
  local start=$(date +%s)
  if ! CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ $PY -m pip install --no-build-isolation --no-deps "$@" "$tree" \
      >"$OUT/build_$(basename "$tree").log" 2>&1; then
    grep -E "error|Error" "$OUT/build_$(basename "$tree").log" | head -20; exit 1
  fi
  echo "build $tree: $(($(date +%s) - start)) s"
}

[ -d .baseline ] || { echo "no .baseline/ (see the header)"; exit 2; }
# An editable install's import hook wins over PYTHONPATH: hide it while the baseline runs.
hooks=$($PY -c "import glob, site; print(' '.join(p for d in site.getsitepackages() for p in glob.glob(d + '/_editable*compilelm*.pth')))")
rc=0
for side in base new; do
  if [ $side = base ]; then
    [ -d /tmp/ab_base/compilelm ] || build .baseline --target /tmp/ab_base
    cp -r .baseline/benchmarks .baseline/scripts .baseline/COMMIT /tmp/ab_base/ 2>/dev/null
    for h in $hooks; do mv "$h" "$h.off"; done
    dir=/tmp/ab_base; env=(env PYTHONPATH=/tmp/ab_base)
  else
    for h in $hooks; do [ -f "$h.off" ] && mv "$h.off" "$h"; done
    ls compilelm/_C.cpython-*.so >/dev/null 2>&1 || build . -e
    dir=.; env=(env)
  fi
  where=$(cd $dir && "${env[@]}" $PY -c "import compilelm, os; print(os.path.dirname(compilelm.__file__))")
  echo "$side: compilelm from $where" | tee -a "$OUT/ab.log"
  case "$where" in /tmp/ab_base/*) [ $side = base ] ;; *) [ $side = new ] ;; esac || { echo "wrong tree for $side"; exit 3; }
  for stage in "${stages[@]}"; do
    case $stage in
      decode)
        (cd $dir && timeout 280 "${env[@]}" $PY benchmarks/bench_decode.py "${BENCH[@]}" --out "$OUT/decode_$side.json") \
          2>&1 | grep -v "it/s\]$" | tail -12 | tee -a "$OUT/ab.log"
        rc=$((rc || PIPESTATUS[0])) ;;
      tokens)
        (cd $dir && timeout 200 "${env[@]}" $PY "$OLDPWD/scripts/greedy_tokens.py" "$OUT/tokens_$side.json" \
          --models "${TOKEN_MODELS[@]}") 2>&1 | grep -v "it/s\]$" | tail -4 | tee -a "$OUT/ab.log"
        rc=$((rc || PIPESTATUS[0])) ;;
    esac
  done
done
for h in $hooks; do [ -f "$h.off" ] && mv "$h.off" "$h"; done
if [ -f "$OUT/tokens_base.json" ] && [ -f "$OUT/tokens_new.json" ]; then
  $PY -c "
import json, sys
a, b = (json.load(open(f'$OUT/tokens_{s}.json')) for s in ('base', 'new'))
for m in a:
    same = a[m] == b.get(m)
    print(f'greedy tokens {m}: ' + ('identical' if same else 'DIFFER ' + str([i for i, (x, y) in enumerate(zip(a[m], b[m])) if x != y])))
" | tee -a "$OUT/ab.log"
fi
$PY - "$OUT" <<'PY' | tee -a "$OUT/ab.log"
import json, os, sys
out = sys.argv[1]
rows = {}
for side in ("base", "new"):
    path = os.path.join(out, f"decode_{side}.json")
    if os.path.exists(path):
        for r in json.load(open(path)).get("rows", []):
            if "ours_ms" in r and r.get("pdl", True) and r.get("hopper_gemm", True):
                rows.setdefault((r["model"], r["batch"]), {})[side] = r["ours_ms"]
print(f"{'model':<22} {'batch':>5} {'base ms':>9} {'new ms':>9} {'new/base':>9}")
for (model, batch), v in sorted(rows.items()):
    b, n = v.get("base"), v.get("new")
    ratio = f"{n / b:.3f}" if b and n else "-"
    print(f"{model:<22} {batch:>5} {b or float('nan'):>9.3f} {n or float('nan'):>9.3f} {ratio:>9}")
PY
exit $rc
