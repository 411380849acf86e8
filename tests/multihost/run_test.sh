#!/usr/bin/env bash
# ctest entry for one tests/multihost/test_*.sh (or tests/slurm/test_*.sh): skip (exit 77, reason
# printed) where the cluster cannot be built here; otherwise run the test inside a fresh 4-host cluster
# that is torn down afterwards whatever happens (`cluster.sh run`, or `slurm.sh run` when
# COHORT_TEST_CLUSTER names tests/slurm/slurm.sh: the same hosts with Slurm's daemons on them).
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
test_script=${1:?usage: run_test.sh tests/multihost/test_X.sh}
cluster=${COHORT_TEST_CLUSTER:-$here/cluster.sh}
"$cluster" check || exit 77
# Clusters left by tests that were killed (ctest's timeout) and so could not tear theirs down.
COHORT_CLUSTER_QUIET=1 "$here/cluster.sh" gc
# A test may ask for a different host count with a line "# cluster-hosts: K".
k=$(sed -n 's/^# cluster-hosts: *\([0-9]*\).*/\1/p' "$test_script" | head -1)
# A Slurm test may declare its nodes' CPUs with "# slurm-cpus: N" (tests/slurm/slurm.sh).
cpus=$(sed -n 's/^# slurm-cpus: *\([0-9]*\).*/\1/p' "$test_script" | head -1)
[[ -z $cpus ]] || export COHORT_SLURM_CPUS=$cpus
exec "$cluster" run -k "${k:-4}" -- bash "$test_script"
