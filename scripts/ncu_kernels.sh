#!/usr/bin/env bash
# Nsight Compute on one launch of each kernel whose name matches a pattern: throughput, occupancy, warp
# stall reasons and the most-stalled SASS lines -- where a kernel's time goes when CUDA-event timing of
# variants cannot tell. ncu reads hardware counters only on some device runtimes (a VM may hide them);
# the clocks are left alone (--clock-control none).
# Usage: scripts/ncu_kernels.sh "NAME1 NAME2 ..." COMMAND...   e.g.
#   scripts/ncu_kernels.sh "wkv7c_intra wkv7c_forward_state" python3 scripts/wkv7_launches.py
# Each name is profiled at its third launch (the first two are warm-ups); reports go to
# $OUT/ncu-NAME.txt (OUT defaults to /tmp/rwkvx-gpu-check), a few summary lines to stdout.
set -uo pipefail
[ $# -ge 2 ] || { sed -n 2,9p "$0"; exit 2; }
cd "$(dirname "$0")/.."
NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
[ -x "$NCU" ] || { echo "ncu not found"; exit 1; }
OUT="${OUT:-/tmp/rwkvx-gpu-check}"
mkdir -p "$OUT"
names=$1; shift
for name in $names; do
  report="$OUT/ncu-$name.txt"
  "$NCU" --clock-control none --kernel-name "$name" --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      --section SourceCounters "$@" >"$report" 2>&1 || { tail -5 "$report"; continue; }
  echo "== $name"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issued Warp Per|No Eligible|Warp Cycles Per Issued|Stall" "$report" | head -24
done
