# Faults in the middle of an allreduce across hosts (4 hosts x 2 ranks, 256 KiB allreduces in a loop).
# With --no-abort-on-failure the launcher does not stop the survivors, so each survivor must fail
# on its own, naming the lost rank and host; the launcher then exits non-zero with its summary and no
# process of the job remains on any host.
source "$(dirname "$0")/lib.sh"
require_command run
require_command "bench allreduce"
LONG=("$COHORT" bench allreduce -b 256K -e 256K -n 1000000 -w 1 --trials 1)

start_job() {  # OUTFILE extra-run-args...
  local outf=$1; shift
  on_host 0 timeout -k 5 60 "$COHORT" run -H h0:2,h1:2,h2:2,h3:2 --ssh-command "$COHORT_CLUSTER_SSH" \
    --kill-grace 1 "$@" "${LONG[@]}" >"$outf" 2>&1 &
  JOB=$!
}
survivors_name() {  # NAME OUTPUT TEXT RANKS...: each listed rank's error line contains TEXT
  local name=$1 out=$2 text=$3; shift 3
  local r missing=""
  for r in "$@"; do grep -E "^\[h[0-9]:$r\] .*$text" <<<"$out" >/dev/null || missing+=" $r"; done
  if [[ -z $missing ]]; then pass "$name: every survivor ($*) reports '$text'"
  else fail "$name: ranks$missing did not report '$text'"; echo "$out" | grep -v OMP_NUM | sed 's/^/    | /' >&2; fi
}

# 1. SIGKILL of rank 5 (h2) mid-allreduce, 10 times (COHORT_KILL_ROUNDS; 20 or more for a thorough look): in every round every
# survivor must name rank 5 (h2). Its neighbours see its connections close; the others hear it in a
# failure notice, passed on by every rank that fails (also by one that failed because of a notice), and
# sent even when the connection was in the middle of a message (docs/errors.md, "Which rank a survivor
# names"). Before that, a survivor sometimes saw a neighbour that had already failed close its
# connection first and named it instead.
rounds=${COHORT_KILL_ROUNDS:-10}
right=0; slowest=0
for ((round = 1; round <= rounds; round++)); do
  start_job "$MH_TMP/1.out" --no-abort-on-failure -x COHORT_TIMEOUT=10
  victim=$(wait_rank_pid 2 5 "bench allreduce") || fail "round $round: rank 5 not found on h2"
  sleep 1   # inside the allreduce loop
  t0=$(now_ms); kill -KILL "$victim"
  rc=0; wait "$JOB" || rc=$?; dt=$(($(now_ms) - t0))
  ((dt > slowest)) && slowest=$dt
  out=$(cat "$MH_TMP/1.out")
  [[ $rc != 0 ]] || fail "round $round: launcher exit 0"
  wrong=""
  for r in 0 1 2 3 4 6 7; do grep -qE "^\[h[0-9]:$r\] .*lost rank 5 \(h2\)" <<<"$out" || wrong+=" $r"; done
  if [[ -z $wrong ]]; then
    right=$((right + 1))
  else
    fail "round $round: ranks$wrong did not name rank 5 (h2)"; echo "$out" | grep -v OMP_NUM | sed 's/^/    | /' >&2
  fi
  ((dt <= 2500)) || fail "round $round: ${dt} ms until the job ended"
  grep -q "rank 5 on h2" <<<"$out" || fail "round $round: the launcher's summary does not name rank 5 on h2"
  expect_no_job_processes 3 >/dev/null
done
expect_eq "worker SIGKILL: rounds in which all 7 survivors named rank 5 (h2)" "$right" "$rounds"
((slowest <= 2500)) && pass "worker SIGKILL: the slowest of $rounds rounds ended ${slowest} ms after the kill" ||
  fail "worker SIGKILL: the slowest round took ${slowest} ms"
expect_no_job_processes 3

# 2. Default policy: the launcher's summary names the root cause (rank 5 on h2, SIGKILL).
start_job "$MH_TMP/2.out" -x COHORT_TIMEOUT=10
victim=$(wait_rank_pid 2 5 "bench allreduce") || fail "rank 5 not found on h2"
sleep 2
t0=$(now_ms); kill -KILL "$victim"
rc=0; wait "$JOB" || rc=$?; dt=$(($(now_ms) - t0))
out=$(cat "$MH_TMP/2.out")
# Rank 5's neighbours report "lost rank 5 (h2)" and exit, and their reports may reach the store before
# h2's agent reaps the kill; the launcher still makes the kill the root cause (summary and exit code).
[[ $rc == 137 ]] && pass "worker SIGKILL (abort policy): launcher exit 137 (rank 5's SIGKILL)" \
  || fail "worker SIGKILL (abort policy): launcher exit $rc, expected 137"
summary=$(sed -n '/cohort run .*: job failed/,$p' <<<"$out")
expect_contains "worker SIGKILL (abort policy): summary names rank 5 on h2 and its SIGKILL" "$summary" \
  "rank 5 on h2"
expect_contains "worker SIGKILL (abort policy): summary says SIGKILL" "$summary" "was killed by SIGKILL"
((dt <= 2500)) && pass "worker SIGKILL (abort policy): job ended in ${dt} ms" || fail "worker SIGKILL (abort policy): ${dt} ms"
expect_no_job_processes 3

# 3. SIGKILL of the agent on h3 mid-allreduce: its workers go with it; the others name the lost ranks.
start_job "$MH_TMP/3.out" --no-abort-on-failure -x COHORT_TIMEOUT=10
wait_rank_pid 3 7 "bench allreduce" >/dev/null || fail "rank 7 not found on h3"
agent=""; for p in $(pids_matching 3 "cohort agent"); do agent=$p; done
sleep 2
t0=$(now_ms); kill -KILL "$agent"
rc=0; wait "$JOB" || rc=$?; dt=$(($(now_ms) - t0))
out=$(cat "$MH_TMP/3.out")
[[ $rc != 0 ]] && pass "agent SIGKILL: launcher exit $rc" || fail "agent SIGKILL: launcher exit 0"
expect_contains "agent SIGKILL: summary names the host" "$out" "the agent for host h3 (node 3, ranks 6-7)"
# Every survivor names a rank of h3 (its own loss, or in a failure notice passed on). The launcher
# holds back its stop signal for a short report window (docs/launcher.md), so every survivor gets to
# print its own error before it is stopped.
survivors_name "agent SIGKILL" "$out" "lost rank [67] \(h3\)" 0 1 2 3 4 5
((dt <= 2500)) && pass "agent SIGKILL: job ended in ${dt} ms" || fail "agent SIGKILL: ${dt} ms"
expect_no_job_processes 3

# 4. h3's link cut mid-allreduce, COHORT_TIMEOUT=3: survivors give up by their deadline naming h3's
# ranks; the launcher notices h3's ssh session is gone (keep-alive 2 s x 3).
start_job "$MH_TMP/4.out" --no-abort-on-failure -x COHORT_TIMEOUT=3
wait_rank_pid 3 7 "bench allreduce" >/dev/null || fail "rank 7 not found on h3"
sleep 2
t0=$(now_ms); cluster cut "$COHORT_CLUSTER_DIR" 3
rc=0; wait "$JOB" || rc=$?; dt=$(($(now_ms) - t0))
out=$(cat "$MH_TMP/4.out")
[[ $rc != 0 ]] && pass "link cut: launcher exit $rc" || fail "link cut: launcher exit 0"
expect_contains "link cut: summary names h3" "$out" "h3"
# Every survivor fails by its deadline naming a rank and host. Which one: the peer it was waiting for,
# which is h3's ranks or (seen in ~1 of 3 runs) a ring neighbour blocked behind them ("waiting for
# rank(s) 5 ... (h2)"): reported to the comm owner as a diagnosis gap; the head's summary names h3.
survivors_name "link cut" "$out" "(timed out|lost).*rank\(?s?\)? ?[0-9]+.*\(h[0-9]\)" 0 1 2 3 4 5
n3=$(grep -cE "^\[h[0-2]:[0-5]\] .*rank [67] \(h3\)" <<<"$out" || true)
echo "info: $n3 of 6 survivors named a rank on h3 itself"
((dt <= 12000)) && pass "link cut: job ended in ${dt} ms (COHORT_TIMEOUT 3 s, ssh keep-alive 6 s)" || fail "link cut: ${dt} ms"
# h3 is cut off: its workers must be gone (their own deadline); its agent learns of the cut from
# sshd's keep-alive ending the session (checked below, after the other hosts).
left=""
for ((i = 0; i < 150; i++)); do
  left=""; for ((h = 0; h < 4; h++)); do left+=$(pids_matching "$h" "bench allreduce"); done
  [[ -z $left ]] && break; sleep 0.1
done
[[ -z $left ]] && pass "link cut: no worker remains on any host" || fail "link cut: workers left: $left"
for ((h = 0; h < 3; h++)); do
  l=$(job_processes_on "$h"); [[ -z $l ]] && pass "link cut: nothing of the job left on h$h" || fail "link cut: left on h$h: $l"
done
# The cut-off h3 stops on its own: its workers time out (COHORT_TIMEOUT 3 s), publishing their failure
# to the unreachable store gives up after 5 s, and sshd's keep-alive (6 s) closes the agent's control
# channel. Allow 20 s from the cut.
for ((i = 0; i < 200; i++)); do
  l=$(job_processes_on 3); [[ -z $l ]] && break
  (($(now_ms) - t0 > 20000)) && break; sleep 0.1
done
[[ -z $l ]] && pass "link cut: nothing of the job left on the cut-off h3 ($(($(now_ms) - t0)) ms after the cut)" \
  || fail "link cut: still on the cut-off h3 20 s after the cut: $l"
cluster heal "$COHORT_CLUSTER_DIR" 3
finish
