# The flight recorder across hosts (4 hosts x 2 ranks, fan-out): rank 5 on h2 is stopped (SIGSTOP)
# in the middle of an allreduce loop. The head's stall inspector, which reads every node's rings through the
# store, names rank 5 and its stopped process once; the job ends at the communicators' deadline, and
# the head's failure summary (from every node's rings) says rank 5 stopped first, with every rank's
# dump in the head's trace directory.
source "$(dirname "$0")/lib.sh"
require_command run
require_command "bench allreduce"
LONG=("$COHORT" bench allreduce -b 4K -e 4K -n 1000000 -w 1 --trials 1)

DUMPS="$MH_TMP/dumps"
on_host 0 env COHORT_STALL_WARN_S=1 timeout -k 5 60 "$COHORT" run -H h0:2,h1:2,h2:2,h3:2 \
  --ssh-command "$COHORT_CLUSTER_SSH" --kill-grace 1 --trace-dir "$DUMPS" -x COHORT_TIMEOUT=6 \
  -x COHORT_SLOW_WARNING=60 "${LONG[@]}" >"$MH_TMP/out" 2>&1 &
JOB=$!
victim=$(wait_rank_pid 2 5 "bench allreduce") || fail "rank 5 not found on h2"
sleep 2   # well inside the allreduce loop
kill -STOP "$victim"
rc=0; wait "$JOB" || rc=$?
out=$(cat "$MH_TMP/out")
[[ $rc != 0 ]] && pass "stopped rank: launcher exit $rc" || fail "stopped rank: launcher exit 0"
expect_contains "the head's stall warning names rank 5 and its stopped process" "$out" \
  "rank 5 last #"
expect_contains "the stall warning says the process is stopped" "$out" "process stopped (SIGSTOP)"
n=$(grep -c "warning: stall:" <<<"$out" || true)
[[ $n == 1 ]] && pass "one stall warning" || fail "$n stall warnings (expected 1)"
expect_contains "the failure summary names rank 5 as the first to stop" "$out" \
  "flight recorder: rank 5 stopped first"
expect_contains "the head wrote every rank's dump" "$out" "dumps of every rank in $DUMPS"
ndumps=$(ls "$DUMPS"/rank*.json 2>/dev/null | wc -l)
[[ $ndumps == 8 ]] && pass "8 rank dumps on the head" || fail "$ndumps rank dumps on the head (expected 8)"
[[ $MH_FAILS == 0 ]] || echo "$out" | grep -v OMP_NUM | sed 's/^/    | /' >&2
expect_no_job_processes 3
finish
