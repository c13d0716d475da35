#!/usr/bin/env bash
# GPU check: build in place (no internet needed), run the GPU tests and the benchmarks, print a table.
# Usage: scripts/gpu_check.sh [pytest -k expression]     Logs go to $OUT (default /tmp/rwkvx-gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/rwkvx-gpu-check}"
mkdir -p "$OUT"
export RWKVX_CACHE_DIR="${RWKVX_CACHE_DIR:-$OUT/nvrtc-cache}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
KEXPR=(); [ $# -gt 0 ] && KEXPR=(-k "$1")
python3 -m pytest tests/gpu -q -rfE -p no:cacheprovider "${KEXPR[@]}" --junitxml="$OUT/gpu-tests.xml" \
    -o junit_family=xunit1 2>&1 | tee "$OUT/gpu-tests.log" | tail -60
if [ -z "${SKIP_BENCH:-}" ]; then
  python3 -m pytest benchmarks -q -p no:cacheprovider "${KEXPR[@]}" --benchmark-json="$OUT/bench.json" \
      2>&1 | tee "$OUT/bench.log" | tail -30
fi
python3 scripts/gpu_summary.py "$OUT"
