#!/bin/bash
# Horovod's API on cohort against PyTorch DDP (gloo), and DDP over cohort's backend, on the same synthetic
# ResNet-18 training (integrations/python/bench/hvd_synthetic.py), interleaved round by round with fresh
# processes, every round printed (docs/performance.md, "Horovod").
#
#   ROUNDS=3 bench/hvd_side_by_side.sh [BUILD_DIR] [OUT_FILE]     # extra arguments: ARGS="--batch-size 8"
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
out=${2:-/dev/null}
rounds=${ROUNDS:-3}
python=${COHORT_PYTHON:-/usr/bin/python3}
export PYTHONPATH=$build/integrations/python${PYTHONPATH:+:$PYTHONPATH} GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
{
  echo "# hvd_side_by_side $(date -u +%Y-%m-%dT%H:%MZ) git $(git -C "$here" rev-parse --short HEAD) rounds=$rounds args=${ARGS:-}"
  for round in $(seq 1 "$rounds"); do
    for mode in hvd ddp-gloo ddp-cohort; do
      echo "# round $round mode $mode load $(cut -d' ' -f1-3 /proc/loadavg)"
      # shellcheck disable=SC2086
      "$build/tools/cohort" run -n 2 "$python" "$here/integrations/python/bench/hvd_synthetic.py" --mode "$mode" \
        ${ARGS:-} 2>&1 | grep -E "RESULT|iter " | sed "s/^/round $round: /"
    done
  done
} | tee -a "$out"
