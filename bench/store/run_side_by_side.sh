#!/bin/bash
# Store join time, side by side in one run: `cohort bench store` and PyTorch's TCPStore
# (bench/peers/store_bench.py, 4 client processes), same client counts, same machine.
# Usage: bench/store/run_side_by_side.sh [counts...]   (default 64 256 1024 4096 16384)
# Env: COHORT (path of the cohort tool), PEERS (peer scripts), REPS (default 3), TORCH_LIMIT_S.
set -u
cd "$(dirname "$0")/../.."
COHORT=${COHORT:-build/tools/cohort}
PEERS=${PEERS:-bench/peers}  # relative to the repository root (this script cd-s there)
REPS=${REPS:-3}
TORCH_LIMIT_S=${TORCH_LIMIT_S:-300}
COUNTS=${*:-64 256 1024 4096 16384}
ulimit -n "$(ulimit -Hn)"
echo "# $(date -u +%FT%TZ) $(uname -r) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
for N in $COUNTS; do
  echo "## N=$N"
  "$COHORT" bench store --clients "$N" --reps "$REPS" | sed "s/^/cohort (64 source addrs): /"
  "$COHORT" bench store --clients "$N" --reps "$REPS" --source-addrs 1 | tail -1 | sed "s/^/cohort (1 source addr):   /"
  timeout "$TORCH_LIMIT_S" /usr/bin/python3 "$PEERS/store_bench.py" "$N" 4 "$REPS" 2>&1 | grep -E "RESULT|Error|error" | tail -2 |
    sed "s/^/torch TCPStore: /" || true
  [ "${PIPESTATUS[0]}" = 124 ] && echo "torch TCPStore: did not finish within ${TORCH_LIMIT_S} s"
done
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
