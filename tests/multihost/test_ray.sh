# cluster-hosts: 5
# Ray mode across hosts (docs/ray.md), against the stand-in for Ray's command line (tests/ray/ray: Ray
# itself cannot be installed here). The launcher on h0 fans out to h1-h4, which bring a 4-node Ray cluster
# up: the head first, the others once its GCS answers; the driver runs once, on the head, sees 4 nodes, and
# its exit code is the job's; nothing is left on any host. Then the faults: a node's Ray killed mid-job is
# named; a node whose Ray cannot reach the head's GCS times out with its name; a node cut off from the head
# is named at once. Last, the seed's way: TI-ONE's HEAD_ADDR/HEAD_PORT/RANK on each of h0-h3, each node
# running `cohort run --ray` itself, where a second head on HEAD_PORT is refused before Ray starts; and
# the three variables alone (no node count): the other nodes start only once the driver runs. Where
# real Ray is installed, the bring-up and a killed node run against it too (none was, so far: docs/ray.md).
source "$(dirname "$0")/lib.sh"
require_command run
mkdir -p "$MH_TMP/bin"
RAY=$MH_TMP/bin/ray
cp "$MH_DIR/../ray/ray" "$RAY"
LOG=$MH_TMP/bin/calls.log  # the stand-in's record of every call, on every host (/tmp is shared)
DRIVER=$MH_TMP/driver.sh
cat >"$DRIVER" <<EOF
#!/bin/sh
# What a driver's ray.init() would see: the cluster at RAY_ADDRESS.
echo "driver ran on \$(hostname) RANK=\$RANK HEAD_PORT=\$HEAD_PORT"
echo "driver sees \$($RAY status --address "\$RAY_ADDRESS" | grep -c '^ 1 node_') nodes"
exit \${DRIVER_EXIT:-0}
EOF
chmod +x "$DRIVER"
# query EXPR: EXPR evaluated by Python over `calls`, the stand-in's logged calls (dicts), printed.
query() { python3 -c 'import json, sys; calls = [json.loads(l) for l in open(sys.argv[1])]; print(eval(sys.argv[2]))' "$LOG" "$1"; }
fanout() {
  on_host 0 timeout -k 5 60 "$COHORT" run --ray --ray-command "$RAY" -H h1,h2,h3,h4 --ssh-command "$COHORT_CLUSTER_SSH" \
    --kill-grace 2 "$@"
}

# 1. Bring-up over ssh, the driver once, its exit code, nothing left.
: >"$LOG"
out=$(fanout -x DRIVER_EXIT=5 "$DRIVER" 2>&1) && rc=0 || rc=$?
echo "$out"
expect_eq "the job's exit code is the driver's" "$rc" 5
expect_eq "the driver ran once" "$(grep -c 'driver ran on' <<<"$out")" 1
expect_contains "... on the head, h1, with RANK=0" "$out" "[h1:driver] driver ran on h1 RANK=0 "
expect_contains "the driver sees 4 nodes" "$out" "[h1:driver] driver sees 4 nodes"
expect_eq "one head: on h1's address, with Rank:0" \
  "$(query "[(c['host'], c['ip'], c['resources']) for c in calls if c['event'] == 'started' and c['head']]")" \
  "[('h1', '198.18.0.2', {'Rank:0': 1})]"
expect_eq "h2-h4 joined it from their own addresses, each with its Rank, at their first attempt" \
  "$(query "sorted((c['host'], c['ip'], c['resources'], c['attempts']) for c in calls if c['event'] == 'joined')")" \
  "[('h2', '198.18.0.3', {'Rank:1': 1}, 1), ('h3', '198.18.0.4', {'Rank:2': 1}, 1), ('h4', '198.18.0.5', {'Rank:3': 1}, 1)]"
expect_eq "no node's ray start ran before the head's GCS answered" \
  "$(query "[c['host'] for c in calls if c['event'] == 'start' and not c['head'] and c['t'] < min(h['t'] for h in calls if h['event'] == 'started' and h['head'])]")" \
  "[]"
expect_eq "nothing was refused" "$(query "[c['error'] for c in calls if c['event'] in ('refused', 'failed')]")" "[]"
expect_no_job_processes 5

# 2. h3's Ray (node 2) killed while the driver runs: the job stops, naming the node and its host.
: >"$LOG"
fanout sh -c 'exec sleep 300' >"$MH_TMP/killed.out" 2>&1 &
job=$!
wait_for_pid 1 "sleep 300" 30 >/dev/null || fail "the driver did not start on h1"
victim=$(query "[c['pid'] for c in calls if c['event'] == 'started' and c['host'] == 'h3'][0]")
t0=$(now_ms)
kill -KILL "$victim"
rc=0; wait "$job" || rc=$?; dt=$(($(now_ms) - t0))
out=$(cat "$MH_TMP/killed.out"); echo "$out"
expect_eq "killed node: the job's exit code" "$rc" 137
expect_contains "killed node: the summary names the node and its host" "$out" \
  "job failed (exit 137): Ray node 2 on h3 (pid $victim) was killed by SIGKILL"
expect_contains "killed node: ... and says what it means" "$out" "h3's Ray node is gone"
((dt <= 8000)) && pass "killed node: the job stopped in ${dt} ms" || fail "killed node: the job took ${dt} ms to stop"
expect_no_job_processes 5

# 3. h4's Ray cannot reach the head's GCS (dropped as by a firewall): the head names it at the deadline.
: >"$LOG"
start=$SECONDS
out=$(fanout --join-timeout 4 -x FAKE_RAY_GCS_UNREACHABLE_FROM=h4 "$DRIVER" 2>&1) && rc=0 || rc=$?
took=$((SECONDS - start))
echo "$out"
expect_eq "missing node: exit code" "$rc" 1
expect_contains "missing node: named with its host and address at the deadline" "$out" \
  "job stopped (exit 1): Ray node 3 (h4, 198.18.0.5) did not join the Ray cluster at 198.18.0.2:"
expect_contains "missing node: ... with what Ray says" "$out" \
  "within 4 s (--join-timeout); \`ray status\` lists the Rank:<n> of nodes 0-2 only"
expect_not_contains "missing node: the driver never ran" "$out" "driver ran"
((took <= 15)) && pass "missing node: gave up in ${took} s (--join-timeout 4)" || fail "missing node: took ${took} s"
expect_no_job_processes 5

# 4. h4 cut off from h1, the head (cluster.sh cut-pair; both still reach h0, the store's host).
: >"$LOG"
cut_pair 4 1
out=$(fanout --join-timeout 10 "$DRIVER" 2>&1) && rc=0 || rc=$?
heal_pair 4 1
echo "$out"
[[ $rc != 0 ]] && pass "cut off: exit $rc" || fail "cut off: exit 0"
expect_contains "cut off: the node and the head's address are named" "$out" "node 3 (h4): cannot join the Ray head at 198.18.0.2:"
expect_contains "cut off: ... and why" "$out" "no route to 198.18.0.2"
expect_no_job_processes 5

# 5. The seed's way: each node runs cohort run --ray itself with TI-ONE's HEAD_ADDR, HEAD_PORT and RANK.
# First another Ray head holds HEAD_PORT on h0: refused before any ray start of the job.
: >"$LOG"
on_host 0 "$RAY" start --head --port 6379 --node-ip-address 198.18.0.1 >/dev/null
tione() {
  run_per_node "$1" 60 env HEAD_ADDR=h0 HEAD_PORT=6379 RANK={node} "$COHORT" run --ray --nnodes 4 --ray-command "$RAY" \
    --kill-grace 2 --join-timeout 20 "$DRIVER"
}
PN_HOSTS=4 tione taken
echo "$PN_OUT"
for ((i = 0; i < 4; i++)); do v="PN_RC_$i"; [[ ${!v} != 0 ]] && pass "HEAD_PORT taken: node $i exits ${!v}" || fail "HEAD_PORT taken: node $i exit 0"; done
expect_contains "HEAD_PORT taken: one line naming it" "$PN_OUT" \
  "node 0 (h0): the Ray head's GCS port 6379 (HEAD_PORT) is in use on h0: another Ray head"
expect_eq "HEAD_PORT taken: no ray start of the job ran" "$(query "len([c for c in calls if c['event'] == 'start'])")" 1
expect_contains "ray stop ends the other head" "$(on_host 0 "$RAY" stop)" "Stopped all 1 Ray processes."
: >"$LOG"
PN_HOSTS=4 tione seed
echo "$PN_OUT"
for ((i = 0; i < 4; i++)); do v="PN_RC_$i"; expect_eq "seed: node $i exit code" "${!v}" 0; done
expect_eq "seed: the driver ran once" "$(grep -c 'driver ran on' <<<"$PN_OUT")" 1
expect_contains "seed: ... on h0, RANK=0, HEAD_PORT=6379" "$PN_OUT" "driver ran on h0 RANK=0 HEAD_PORT=6379"
expect_contains "seed: the driver sees 4 nodes" "$PN_OUT" "driver sees 4 nodes"
expect_eq "seed: the head on h0:6379" \
  "$(query "[c['gcs'] for c in calls if c['event'] == 'started' and c['head']]")" "['198.18.0.1:6379']"
expect_eq "seed: h1-h3 joined with RANK's Rank:<n>" \
  "$(query "sorted((c['host'], c['resources']) for c in calls if c['event'] == 'joined')")" \
  "[('h1', {'Rank:1': 1}), ('h2', {'Rank:2': 1}), ('h3', {'Rank:3': 1})]"
expect_no_job_processes 5

# 6. TI-ONE's three variables alone, as the platform sets them (no node count): the head's launcher starts
# the driver once its Ray is up, before any other node has started; the driver waits for nodes 1-3 as Ray
# holds a task that asks for Rank:<n> until node n joins; they start afterwards, join the head, and stay
# until the driver ends; every launcher exits 0.
: >"$LOG"
rm -f "$MH_TMP/driver-started"
RANKS_DRIVER=$MH_TMP/ranks_driver.sh
cat >"$RANKS_DRIVER" <<EOF
#!/bin/sh
nodes() { $RAY status --address "\$RAY_ADDRESS" | grep -c '^ 1 node_'; }
echo "driver started with \$(nodes) node(s)"
: >"$MH_TMP/driver-started"
i=0
# Rank:1-3 in Ray's usage: nodes 1-3 have joined (30 s at most).
while [ "\$($RAY status --address "\$RAY_ADDRESS" | grep -c ' Rank:[123]\$')" != 3 ]; do
  i=\$((i + 1)); [ \$i -le 300 ] || { echo "nodes 1-3 never joined"; exit 3; }
  sleep 0.1
done
echo "driver sees \$(nodes) nodes"
EOF
chmod +x "$RANKS_DRIVER"
uncounted() {  # NODE: that node's launcher, with only HEAD_ADDR, HEAD_PORT and RANK
  on_host "$1" timeout -k 5 60 env HEAD_ADDR=h0 HEAD_PORT=6379 RANK="$1" "$COHORT" run --ray --ray-command "$RAY" \
    --kill-grace 2 --join-timeout 20 "$RANKS_DRIVER" >"$MH_TMP/uncounted.$1.out" 2>&1
}
uncounted 0 &
pids=($!)
for ((i = 0; i < 300; i++)); do [[ -e $MH_TMP/driver-started ]] || ! kill -0 "${pids[0]}" 2>/dev/null && break; sleep 0.1; done
[[ -e $MH_TMP/driver-started ]] && pass "uncounted: the driver started on the head alone" ||
  fail "uncounted: the driver did not start within 30 s with the head alone"
expect_eq "uncounted: ... before any other node's ray start" \
  "$(query "len([c for c in calls if c['event'] == 'start' and not c['head']])")" 0
for n in 1 2 3; do uncounted "$n" & pids+=($!); done
for n in 0 1 2 3; do
  rc=0; wait "${pids[$n]}" || rc=$?
  cat "$MH_TMP/uncounted.$n.out"
  expect_eq "uncounted: node $n's launcher exit code" "$rc" 0
done
out=$(cat "$MH_TMP/uncounted.0.out")
expect_contains "uncounted: the driver started with the head only" "$out" "driver started with 1 node(s)"
expect_contains "uncounted: ... and saw nodes 1-3 join" "$out" "driver sees 4 nodes"
expect_contains "uncounted: the head says why it did not wait" "$out" "the job does not say how many nodes it has"
expect_eq "uncounted: h1-h3 joined the head with RANK's Rank:<n>" \
  "$(query "sorted((c['host'], c['gcs'], c['resources']) for c in calls if c['event'] == 'joined')")" \
  "[('h1', '198.18.0.1:6379', {'Rank:1': 1}), ('h2', '198.18.0.1:6379', {'Rank:2': 1}), ('h3', '198.18.0.1:6379', {'Rank:3': 1})]"
expect_no_job_processes 5

# 7. Real Ray, where one is installed (a `ray` on PATH, or COHORT_TEST_REAL_RAY): the bring-up, the driver
# once, its exit code, a node's Ray killed, nothing left. What ran is printed, for docs/ray.md.
real_ray=${COHORT_TEST_REAL_RAY:-$(command -v ray || true)}
if [[ -z $real_ray ]]; then
  echo "note: no ray but the stand-in here: nothing was run against real Ray"
else
  echo "against real Ray: $real_ray ($("$real_ray" --version 2>&1 | head -1))"
  REAL_DRIVER=$MH_TMP/real_driver.sh
  sed "s|$RAY|$real_ray|" "$DRIVER" >"$REAL_DRIVER"
  chmod +x "$REAL_DRIVER"
  real() {
    on_host 0 timeout -k 5 170 "$COHORT" run --ray --ray-command "$real_ray" -H h1,h2,h3,h4 \
      --ssh-command "$COHORT_CLUSTER_SSH" --join-timeout 90 --kill-grace 10 "$@"
  }
  out=$(real -x DRIVER_EXIT=5 "$REAL_DRIVER" 2>&1) && rc=0 || rc=$?
  echo "$out"
  expect_eq "real Ray: the job's exit code is the driver's" "$rc" 5
  expect_eq "real Ray: the driver ran once" "$(grep -c 'driver ran on' <<<"$out")" 1
  expect_contains "real Ray: the driver sees 4 nodes" "$out" "[h1:driver] driver sees 4 nodes"
  expect_no_job_processes 15
  real sh -c 'exec sleep 300' >"$MH_TMP/real_killed.out" 2>&1 &
  job=$!
  wait_for_pid 1 "sleep 300" 120 >/dev/null || fail "real Ray: the driver did not start on h1"
  victim=$(pids_matching 3 "ray start" | head -1)
  [[ -n $victim ]] && kill -KILL "$victim"
  rc=0; wait "$job" || rc=$?
  out=$(cat "$MH_TMP/real_killed.out"); echo "$out"
  expect_contains "real Ray: a killed node is named" "$out" "Ray node 2 on h3"
  expect_no_job_processes 15
fi
finish
