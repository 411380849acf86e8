# cluster-hosts: 2
# Horovod's API (cohort.horovod.torch) across hosts: tests/python/hvd_ops_worker.py, every collective
# against torch's own ops, on 2 hosts x 2 ranks through ssh fan-out, where cohort's allreduce crosses
# TCP. Horovod's topology there: local_size 2, cross_rank = the host's node rank, cross_size 2; a
# process set {0, 2} spans both hosts; a mismatch raises on every rank of both hosts and the rebuilt
# group works. No process of the job may remain.
# (Its poll() loops stalled for seconds here on a quiet machine while the backend's worker thread waited for
# the GIL those loops held; tests/python/busy_wait_worker.py covers that on one host.)
source "$(dirname "$0")/lib.sh"
require_command run
TORCH_DIR=${COHORT_BUILD_DIR:-$MH_DIR/../../build}/integrations/python
if ! ls "$TORCH_DIR"/cohort_torch*.so >/dev/null 2>&1; then echo "SKIP: cohort_torch is not built in $TORCH_DIR"; exit 77; fi
SRC=$(cd "$MH_DIR/../.." && pwd)
PY=${COHORT_PYTHON:-/usr/bin/python3}

out=$(on_host 0 timeout -k 5 120 "$COHORT" run -H h0:2,h1:2 --ssh-command "$COHORT_CLUSTER_SSH" \
  -x "PYTHONPATH=$TORCH_DIR:$SRC/integrations/python/wheel" -x OMP_NUM_THREADS=1 \
  "$PY" "$SRC/tests/python/hvd_ops_worker.py" 2>&1) && rc=0 || rc=$?
expect_eq "hvd collectives on 2 hosts x 2 ranks: exit code" "$rc" 0
oks=$(grep -cE "^\[h[01]:[0-3]\] OK [0-9]+" <<<"$out" || true)
expect_eq "every rank passed its checks" "$oks" 4
if ((rc != 0 || oks != 4)); then echo "$out" | tail -40 | sed 's/^/    | /' >&2; fi
expect_no_job_processes 1
finish
