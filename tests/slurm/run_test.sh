#!/usr/bin/env bash
# ctest entry for one tests/slurm/test_*.sh: skip (exit 77, reason printed) where a Slurm cluster cannot
# run here; otherwise run the test inside a fresh Slurm cluster of 4 namespace hosts (slurm.sh run),
# torn down afterwards whatever happens.
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
test_script=${1:?usage: run_test.sh tests/slurm/test_X.sh}
"$here/slurm.sh" check || exit 77
# Clusters (and their Slurm daemons) left by tests that were killed by ctest's timeout.
COHORT_CLUSTER_QUIET=1 "$here/../multihost/cluster.sh" gc
k=$(sed -n 's/^# cluster-hosts: *\([0-9]*\).*/\1/p' "$test_script" | head -1)
exec "$here/slurm.sh" run -k "${k:-4}" -- bash "$test_script"
