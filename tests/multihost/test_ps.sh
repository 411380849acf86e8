# Parameter-server jobs across hosts: `cohort run -H ... --ps 2` fans out 4 workers and 2 servers
# (server k on host k mod 4, after its workers), the workers reach both servers over TCP; then a
# server host's server is SIGKILLed mid-job: every worker fails naming it, the job ends naming it,
# nothing is left behind.
source "$(dirname "$0")/lib.sh"
require_command "ps serve"
WORKER=$COHORT_BUILD_DIR/tests/ps/ps_worker
[[ -x $WORKER ]] || { echo "SKIP: $WORKER not built"; exit 77; }

out=$(on_host 0 timeout -k 5 60 "$COHORT" run -H h0:1,h1:1,h2:1,h3:1 --ps 2 --ps-mode bsp \
  --ssh-command "$COHORT_CLUSTER_SSH" "$WORKER" basic 2>&1) && rc=0 || rc=$?
echo "$out"
expect_eq "4 workers + 2 servers on 4 hosts: exit code" "$rc" 0
for w in 0 1 2 3; do expect_contains "worker $w done" "$out" "worker $w of 4 ok (2 servers, mode bsp, RANK=$w WORLD_SIZE=4)"; done
expect_no_job_processes 3

log=$(mktemp)
on_host 0 timeout -k 5 60 "$COHORT" run -H h0:1,h1:1,h2:1,h3:1 --ps 2 --ssh-command "$COHORT_CLUSTER_SSH" \
  "$WORKER" loop >"$log" 2>&1 &
launcher=$!
for ((i = 0; i < 300; i++)); do [[ $(grep -c looping "$log") -ge 4 ]] && break; sleep 0.05; done
server=$(wait_for_pid 1 "ps serve" 10) || fail "no server process on h1"
t0=$(now_ms)
kill -9 "$server"
wait "$launcher" && rc=0 || rc=$?
elapsed=$(($(now_ms) - t0))
out=$(cat "$log")
rm -f "$log"
echo "$out"
echo "kill to launcher exit: $elapsed ms"
expect_eq "killed server: launcher exit code" "$rc" 137
expect_contains "summary names the server and its host" "$out" "parameter server 1 on h1"
expect_contains "a worker names the lost server" "$out" "failed: lost parameter server 1 (h1)"
expect_not_contains "no worker blames another worker" "$(grep "ps_worker:" <<<"$out")" "lost worker"
((elapsed <= 2000)) && pass "job over within 2 s of the kill ($elapsed ms)" || fail "job took $elapsed ms after the kill"
expect_no_job_processes 5
finish
