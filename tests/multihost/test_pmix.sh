# Open MPI's mpirun across hosts with nothing else set: `mpirun -H h0:2,h1:2,h2:2,h3:2 -n 8 cohort bench`
# (no MASTER_ADDR, no cohort run). The ranks meet through mpirun's PMIx servers; rank 0's store must be
# published at the address the other hosts reach (h0's, on the route to them), not at loopback.
source "$(dirname "$0")/lib.sh"
require_command "bench allreduce"
MPIRUN=$(command -v mpirun || true)
[[ -n $MPIRUN ]] || { echo "SKIP: mpirun is not installed"; exit 77; }

# Only what mpirun sets tells a rank where it is: a clean environment (PATH for orted on the other hosts).
out=$(on_host 0 timeout -k 5 120 env -i PATH="$PATH" HOME="${HOME:-/root}" COHORT_LOG_LEVEL=info \
  "$MPIRUN" --allow-run-as-root --mca plm_rsh_agent "$COHORT_CLUSTER_SSH" -H h0:2,h1:2,h2:2,h3:2 -n 8 \
  --mca oob_tcp_if_include eth0 -x COHORT_LOG_LEVEL \
  "$COHORT" bench allreduce -b 8 -e 1M -f 32 -n 2 -w 1 --trials 1 --check 2>&1) && rc=0 || rc=$?
expect_eq "mpirun -n 8 over 4 hosts: exit code" "$rc" 0
expect_contains "mpirun -n 8 over 4 hosts: 8 ranks" "$out" "# cohort bench allreduce: 8 ranks"
expect_contains "mpirun -n 8 over 4 hosts: every size correct" "$out" "Out of bounds values : 0 OK"
expect_contains "rank 0 publishes h0's address on the route to the other hosts" "$out" \
  "the job's store is at $(addr 0):"
expect_not_contains "no rank is told a loopback store" "$out" "the job's store is at 127.0.0.1"
expect_no_job_processes 5
finish
