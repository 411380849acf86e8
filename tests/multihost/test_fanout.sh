# ssh fan-out from host 0: `cohort run --hostfile H --ssh-command <wrapper> prog` on 4 hosts x 2 ranks,
# by address and by name, and with mpirun's --map-by node; then no process of the job remains on any host.
source "$(dirname "$0")/lib.sh"
require_command run
PROG=$MH_DIR/print_env.sh
out=$(on_host 0 timeout -k 5 60 "$COHORT" run --hostfile "$COHORT_CLUSTER_HOSTFILE" --ssh-command "$COHORT_CLUSTER_SSH" "$PROG" 2>&1) && rc=0 || rc=$?
echo "$out"
expect_eq "fan-out by address: exit code" "$rc" 0
check_rank_lines "fan-out by address" "$out" 8 2
expect_no_job_processes 3

out=$(on_host 0 timeout -k 5 60 "$COHORT" run -H h0:2,h1:2,h2:2,h3:2 --ssh-command "$COHORT_CLUSTER_SSH" "$PROG" 2>&1) && rc=0 || rc=$?
echo "$out"
expect_eq "fan-out by name (-H): exit code" "$rc" 0
check_rank_lines "fan-out by name" "$out" 8 2
expect_contains "the store is on host 0" "$out" "rank=5 local=1 world=8 local_world=2 node=2 host=h2 master=h0:"
expect_no_job_processes 3

# mpirun's --map-by node: the ranks dealt round robin over the hosts (rank r on h(r mod 4), its local rank
# r div 4 among that host's).
out=$(on_host 0 timeout -k 5 60 "$COHORT" run -H h0:2,h1:2,h2:2,h3:2 --map-by node --ssh-command "$COHORT_CLUSTER_SSH" \
  "$PROG" 2>&1) && rc=0 || rc=$?
echo "$out"
expect_eq "fan-out --map-by node: exit code" "$rc" 0
misplaced=""
for ((r = 0; r < 8; r++)); do
  want="rank=$r local=$((r / 4)) world=8 local_world=2 node=$((r % 4)) host=h$((r % 4)) "
  [[ $(grep -c -- "$want" <<<"$out" || true) == 1 ]] || misplaced+=" rank $r"
done
if [[ -z $misplaced ]]; then pass "fan-out --map-by node: rank r on h(r mod 4) with local rank r div 4"
else fail "fan-out --map-by node: misplaced:$misplaced"; fi
expect_no_job_processes 3

# A failing rank on a remote host: the job fails with that rank's exit code, the summary names it.
out=$(on_host 0 timeout -k 5 60 "$COHORT" run -H h0:2,h1:2,h2:2,h3:2 --ssh-command "$COHORT_CLUSTER_SSH" \
  sh -c '[ "$RANK" = 5 ] && exit 7; sleep 30' 2>&1) && rc=0 || rc=$?
echo "$out"
expect_eq "rank 5 exits 7: launcher exit code" "$rc" 7
expect_contains "summary names rank 5" "$out" "rank 5"
expect_contains "summary names its host" "$out" "h2"
expect_no_job_processes 5
finish
