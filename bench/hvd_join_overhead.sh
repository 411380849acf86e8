#!/bin/bash
# What hvd.join()'s bookkeeping costs the common path (nobody joins): integrations/python/bench/hvd_overhead.py
# on 2 ranks, alternating job by job between a base commit's cohort.horovod.torch (extracted with
# git archive, placed first on PYTHONPATH) and this tree's, with the load printed beside every job.
#
#   bench/hvd_join_overhead.sh BASE_REF [BUILD_DIR] [OUT_FILE]     # JOBS=3 ROUNDS=3 SIZES=4B
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
base_ref=${1:?usage: bench/hvd_join_overhead.sh BASE_REF [BUILD_DIR] [OUT_FILE]}
build=${2:-$here/build}
out=${3:-/dev/null}
python=${COHORT_PYTHON:-/usr/bin/python3}
base=$(mktemp -d)
trap 'rm -rf "$base"' EXIT
git -C "$here" archive "$base_ref" integrations/python/wheel | tar -x -C "$base"
export OMP_NUM_THREADS=1
{
  echo "# hvd_join_overhead $(date -u +%Y-%m-%dT%H:%MZ) base $(git -C "$here" rev-parse --short "$base_ref") tree $(git -C "$here" rev-parse --short HEAD)$(git -C "$here" diff --quiet || echo +changes)"
  for job in $(seq 1 "${JOBS:-3}"); do
    for which in base tree; do
      if [ "$which" = base ]; then path=$base/integrations/python/wheel:$build/integrations/python; else path=$build/integrations/python; fi
      echo "# job $job $which load $(cut -d' ' -f1-3 /proc/loadavg)"
      PYTHONPATH=$path "$build/tools/cohort" run --nproc-per-node 2 "$python" \
        "$here/integrations/python/bench/hvd_overhead.py" --sizes "${SIZES:-4B}" --rounds "${ROUNDS:-3}" 2>&1 \
        | grep -E "^\[[^]]*:0\] +[0-9.]+ [KMGi]*B +(dist|hvd_|hvd_async_|hvd_avg) " | sed "s/^\[[^]]*\] */job $job $which: /"
    done
  done
} | tee -a "$out"
