# Faults across hosts at the launcher level (workers that only sleep): SIGKILL of a remote worker,
# SIGKILL of a remote agent, a cut link, the head (and its store) killed. Each: the launcher(s)
# exit non-zero with a summary naming the lost rank / host, within a bound, and no process of the
# job remains on any host.
source "$(dirname "$0")/lib.sh"
require_command run
HOSTS=h0:2,h1:2,h2:2,h3:2
WORKER='echo "rank $RANK ready"; exec sleep 300'
fanout() { on_host 0 timeout -k 5 60 "$COHORT" run -H "$HOSTS" --ssh-command "$COHORT_CLUSTER_SSH" --kill-grace 1 "$@" sh -c "$WORKER"; }

# 1. SIGKILL of worker rank 5 (on h2).
fanout >"$MH_TMP/1.out" 2>&1 &
job=$!
victim=$(wait_for_pid 2 "sleep 300" 20) || fail "no worker appeared on h2"
sleep 1
t0=$(now_ms); kill -KILL "$victim"
rc=0; wait "$job" || rc=$?; dt=$(($(now_ms) - t0))
out=$(cat "$MH_TMP/1.out"); echo "$out"
[[ $rc != 0 ]] && pass "worker SIGKILL: launcher exit $rc" || fail "worker SIGKILL: launcher exit 0"
expect_contains "worker SIGKILL: summary names the signal" "$out" "SIGKILL"
expect_contains "worker SIGKILL: summary names the host" "$out" "on h2"
((dt <= 4000)) && pass "worker SIGKILL: job stopped in ${dt} ms" || fail "worker SIGKILL: job took ${dt} ms to stop"
expect_no_job_processes 3

# 2. SIGKILL of the remote agent on h3.
fanout >"$MH_TMP/2.out" 2>&1 &
job=$!
agent=$(wait_for_pid 3 "cohort agent" 20) && wait_for_pid 3 "sleep 300" 20 >/dev/null || fail "no agent/worker on h3"
sleep 1
t0=$(now_ms); kill -KILL "$agent"
rc=0; wait "$job" || rc=$?; dt=$(($(now_ms) - t0))
out=$(cat "$MH_TMP/2.out"); echo "$out"
[[ $rc != 0 ]] && pass "agent SIGKILL: launcher exit $rc" || fail "agent SIGKILL: launcher exit 0"
expect_contains "agent SIGKILL: summary names the host" "$out" "h3"
((dt <= 4000)) && pass "agent SIGKILL: job stopped in ${dt} ms" || fail "agent SIGKILL: job took ${dt} ms to stop"
expect_no_job_processes 3

# 3. h3's link cut mid-job. ssh's keep-alives (2 s x 3 on both sides) bound how soon it is seen.
fanout >"$MH_TMP/3.out" 2>&1 &
job=$!
wait_for_pid 3 "sleep 300" 20 >/dev/null || fail "no worker on h3"
sleep 1
t0=$(now_ms); cluster cut "$COHORT_CLUSTER_DIR" 3
rc=0; wait "$job" || rc=$?; dt=$(($(now_ms) - t0))
out=$(cat "$MH_TMP/3.out"); echo "$out"
[[ $rc != 0 ]] && pass "link cut: launcher exit $rc" || fail "link cut: launcher exit 0"
expect_contains "link cut: summary names the host" "$out" "h3"
((dt <= 15000)) && pass "link cut: job stopped in ${dt} ms" || fail "link cut: job took ${dt} ms to stop"
expect_no_job_processes 12   # h3 learns it is cut off from sshd's ClientAlive (2 s x 3)
cluster heal "$COHORT_CLUSTER_DIR" 3

# 4. Per-node job; node 0's launcher (which hosts the store) is SIGKILLed: the others report the
# store lost and stop; node 0's own workers do not outlive it.
PN_HOSTS=4 run_per_node storelost 60 "$COHORT" run --nnodes 4 --node-rank {node} --nproc-per-node 2 \
  --master-addr h0 --master-port 29600 --kill-grace 1 sh -c "$WORKER" &
pn=$!
head_pid=""
for ((i = 0; i < 200; i++)); do
  head_pid=""
  for p in $(pids_matching 0 "--node-rank 0"); do [[ $(cat "/proc/$p/comm" 2>/dev/null) == cohort ]] && head_pid=$p; done
  [[ -n $head_pid && -n $(pids_matching 3 "sleep 300") ]] && break
  sleep 0.1
done
[[ -n $head_pid ]] || fail "node 0's launcher not found"
sleep 1
t0=$(now_ms); kill -KILL "$head_pid"
wait "$pn" || true
dt=$(($(now_ms) - t0))
out=""; for ((i = 1; i < 4; i++)); do out+=$(cat "$MH_TMP/storelost.$i.out")$'\n'; done
echo "$out"
expect_contains "store killed: the other nodes say the store is lost" "$out" "lost the job's store"
expect_contains "store killed: ... and where it was" "$out" "h0:29600"
for ((i = 1; i < 4; i++)); do
  grep -q "job stopped\|job failed" "$MH_TMP/storelost.$i.out" && pass "store killed: node $i stopped with a summary" || fail "store killed: node $i printed no summary"
done
((dt <= 10000)) && pass "store killed: every node stopped in ${dt} ms" || fail "store killed: nodes took ${dt} ms to stop"
expect_no_job_processes 3
# 5. Per-node job; h3's link cut: its agent is cut off from the job's store (node 0). Every store call
# of a joined agent has a 2 s deadline, and its watcher's waits give up 1 s after their own 0.5 s
# slice, so the agent sees the loss within ~1.5 s, stops its workers at once and exits: within 2 s of
# the cut (measured 1.36 s).
PN_HOSTS=4 run_per_node cut 60 "$COHORT" run --nnodes 4 --node-rank {node} --nproc-per-node 2 \
  --master-addr h0 --master-port 29610 --kill-grace 1 sh -c "$WORKER" &
pn=$!
for ((i = 0; i < 200; i++)); do [[ -n $(pids_matching 3 "sleep 300") && -n $(pids_matching 0 "sleep 300") ]] && break; sleep 0.1; done
cut_agent=""
for p in $(pids_matching 3 "--node-rank 3"); do [[ $(cat "/proc/$p/comm" 2>/dev/null) == cohort ]] && cut_agent=$p; done
[[ -n $cut_agent ]] || fail "h3's launcher not found"
sleep 1
t0=$(now_ms); cluster cut "$COHORT_CLUSTER_DIR" 3
while [[ -d /proc/$cut_agent && $(awk '/^State:/ {print $2}' "/proc/$cut_agent/status" 2>/dev/null) != Z ]] &&
  (($(now_ms) - t0 < 10000)); do sleep 0.02; done
dt=$(($(now_ms) - t0))
((dt <= 2000)) && pass "store link cut: h3's launcher stopped ${dt} ms after the cut (bound 2 s)" ||
  fail "store link cut: h3's launcher took ${dt} ms to stop"
[[ -z $(pids_matching 3 "sleep 300") ]] && pass "store link cut: h3's workers are gone" || fail "store link cut: workers left on h3"
# The others are not told (a static per-node job has no leases): interrupt them.
for ((h = 0; h < 3; h++)); do for p in $(pids_matching "$h" "--node-rank $h"); do kill -TERM "$p" 2>/dev/null; done; done
wait "$pn" || true
expect_contains "store link cut: h3 says it lost the job's store" "$(cat "$MH_TMP/cut.3.out")" "lost the job's store"
expect_contains "store link cut: ... and where it was" "$(cat "$MH_TMP/cut.3.out")" "store at h0:29610 unreachable: no answer"
expect_no_job_processes 5
cluster heal "$COHORT_CLUSTER_DIR" 3
finish
