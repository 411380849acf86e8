#!/bin/bash
# hvd.poll() busy loops against hvd.synchronize() on a 15-byte allreduce, alternated op by op in one job
# (integrations/python/bench/hvd_poll.py), 4 ranks on 2 simulated hosts (TCP between them), with the load
# printed beside every job (docs/horovod.md, "Waiting for an operation").
#
#   bench/hvd_poll.sh [BUILD_DIR] [OUT_FILE]       # JOBS=2 ROUNDS=3 OPS=200
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
out=${2:-/dev/null}
python=${COHORT_PYTHON:-/usr/bin/python3}
export PYTHONPATH=$build/integrations/python${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
{
  echo "# hvd_poll $(date -u +%Y-%m-%dT%H:%MZ) git $(git -C "$here" rev-parse --short HEAD)"
  for job in $(seq 1 "${JOBS:-2}"); do
    echo "# job $job load $(cut -d' ' -f1-3 /proc/loadavg)"
    "$build/tools/cohort" run -n 4 "$python" "$here/integrations/python/bench/hvd_poll.py" --simulated-hosts 2 \
      --rounds "${ROUNDS:-3}" --ops "${OPS:-200}" 2>&1 | grep -E "round " | sed "s/^/job $job: /"
  done
} | tee -a "$out"
