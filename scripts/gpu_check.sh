#!/usr/bin/env bash
# GPU check: build in place (no internet needed), run the GPU tests, the per-kernel and step benchmarks,
# the default training run and a step profile, then print a short table. Logs go to $OUT
# (default /tmp/rwkvx-gpu-check).
# Usage: scripts/gpu_check.sh [pytest -k expression]
#   TEST_JOBS=N (default 4): GPU test processes at once.
#   SKIP_TESTS=1 / SKIP_KERNELS=1 / SKIP_STEP=1 / SKIP_TRAIN=1 / SKIP_PROFILE=1 skip parts.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/rwkvx-gpu-check}"
mkdir -p "$OUT"
export RWKVX_CACHE_DIR="${RWKVX_CACHE_DIR:-/tmp/rwkvx-nvrtc-cache}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 \
    || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
KEXPR=(); [ $# -gt 0 ] && KEXPR=(-k "$1")
if [ -z "${SKIP_TESTS:-}" ]; then
  # TEST_JOBS pytest processes share the GPU (the tests are correctness checks, not timings): the test
  # files, largest first, dealt to the process with the fewest bytes so far; the files in SERIAL_TESTS
  # (they read the device's free memory) run alone afterwards. Each process writes its own junit file.
  JOBS="${TEST_JOBS:-4}"
  SERIAL_TESTS=(tests/gpu/test_recompute_auto.py)
  mapfile -t FILES < <(ls -S tests/gpu/test_*.py | grep -vxF -f <(printf '%s\n' "${SERIAL_TESTS[@]}"))
  declare -a GROUP LOAD
  for ((j = 0; j < JOBS; j++)); do GROUP[j]=""; LOAD[j]=0; done
  for f in "${FILES[@]}"; do
    best=0
    for ((j = 1; j < JOBS; j++)); do [ "${LOAD[j]}" -lt "${LOAD[best]}" ] && best=$j; done
    GROUP[best]="${GROUP[best]} $f"; LOAD[best]=$(( LOAD[best] + $(stat -c %s "$f") ))
  done
  run_tests() {   # run_tests NAME FILES...: one pytest process, its log and junit file under $OUT
    local name=$1; shift
    python3 -m pytest "$@" -v --tb=short -rfE -p no:cacheprovider "${KEXPR[@]}" --durations=15 \
        --junitxml="$OUT/gpu-tests-$name.xml" -o junit_family=xunit1 >"$OUT/gpu-tests-$name.log" 2>&1
  }
  for ((j = 0; j < JOBS; j++)); do
    # shellcheck disable=SC2086  (the group is a list of paths without spaces)
    [ -n "${GROUP[j]}" ] && run_tests "$j" ${GROUP[j]} &
  done
  wait
  run_tests serial "${SERIAL_TESTS[@]}"
  grep -hE "^(FAILED|ERROR)|passed|failed" "$OUT"/gpu-tests-*.log | tail -40
  # per-test lines (-v) survive a run cut short: count what finished
  echo "tests finished: $(cat "$OUT"/gpu-tests-*.log | grep -cE ' (PASSED|XFAIL|SKIPPED)') passed/xfail/skipped," \
       "$(cat "$OUT"/gpu-tests-*.log | grep -cE ' (FAILED|ERROR|XPASS)') failed/error/xpass"
fi
if [ -z "${SKIP_KERNELS:-}" ]; then   # each family's benchmarks/bench_<family>.py, and the GEMMs
  KERNEL_BENCH=(benchmarks/bench_gemm.py)
  for family in rwkvx/cu/*/; do
    f="benchmarks/bench_$(basename "$family").py"
    [ -f "$f" ] && KERNEL_BENCH+=("$f")
  done
  python3 -m pytest "${KERNEL_BENCH[@]}" -q -p no:cacheprovider "${KEXPR[@]}" \
      --benchmark-json="$OUT/kernels.json" >"$OUT/kernels.log" 2>&1 || tail -30 "$OUT/kernels.log"
fi
if [ -z "${SKIP_STEP:-}" ]; then
  python3 -m pytest benchmarks/bench_step.py -q -p no:cacheprovider "${KEXPR[@]}" \
      --benchmark-json="$OUT/bench.json" >"$OUT/bench.log" 2>&1 || tail -30 "$OUT/bench.log"
fi
if [ -z "${SKIP_TRAIN:-}" ]; then   # the README's main job, on the GPU, in fp32 and in bf16
  for p in fp32 bf16; do
    python3 -m rwkvx train --device gpu --precision $p --no-progress --out "$OUT/default-run-$p" \
        >"$OUT/train-$p.log" 2>&1 || tail -30 "$OUT/train-$p.log"
  done
fi
if [ -z "${SKIP_PROFILE:-}" ]; then
  for p in fp32 tf32 bf16; do
    python3 scripts/profile_step.py --preset base --precision $p >"$OUT/profile-$p.log" 2>&1 \
        || tail -20 "$OUT/profile-$p.log"
  done
fi
python3 scripts/gpu_summary.py "$OUT"
