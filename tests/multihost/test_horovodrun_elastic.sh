# cluster-hosts: 2
# horovodrun's elastic driver across 2 namespace hosts, started on h0: `horovodrun -np 1 --min-np 1 --max-np 2
# --host-discovery-script` whose script prints a file this test rewrites. h0 alone trains to step 2; the test
# lists h1 too: h1's agent starts over the cluster's ssh (the driver's environment, PYTHONPATH included, reaches
# it with the token on ssh's stdin) and joins at the next generation, where both ranks resume from the commit of
# step 2; at step 5 the test lists h0 alone again: h1's agent is stopped (its ssh's stdin closed) and h0's rank
# resumes at step 5 and ends with the weights of a replay (tests/python/hvd_elastic_discovery_worker.py).
# Then no process of the job is left on either host.
source "$(dirname "$0")/lib.sh"
MODULES=${COHORT_BUILD_DIR:-}/integrations/python
if ! ls "$MODULES"/cohort_torch*.so >/dev/null 2>&1; then echo "SKIP: cohort_torch not built (no torch)"; exit 77; fi
HOROVODRUN=$(dirname "$COHORT")/horovodrun
PYDIR=$(cd "$MH_DIR/../python" && pwd)
hosts=$MH_TMP/hosts progress=$MH_TMP/progress
echo "h0:1" >"$hosts"
printf '#!/bin/sh\ncat %s\n' "$hosts" >"$MH_TMP/discover.sh"
chmod +x "$MH_TMP/discover.sh"
list_hosts() { printf "$1" >"$hosts.new" && mv "$hosts.new" "$hosts"; }  # whole, then renamed

# wait_progress WHAT LINE...: until every LINE is in the workers' progress file (shared: one filesystem).
wait_progress() {
  local what=$1 deadline=$((SECONDS + 60)) l missing; shift
  while :; do
    missing=""
    for l in "$@"; do grep -qF "$l" "$progress" 2>/dev/null || missing+=" '$l'"; done
    [[ -z $missing ]] && { pass "$what"; return 0; }
    if ((SECONDS >= deadline)) || ! kill -0 "$driver" 2>/dev/null; then
      fail "$what: not seen:$missing"; cat "$progress" >&2 2>/dev/null; return 1
    fi
    sleep 0.1
  done
}

on_host 0 timeout -k 5 150 env PYTHONPATH="$MODULES:$PYDIR" OMP_NUM_THREADS=1 TMPDIR="$MH_TMP" HVD_PROGRESS="$progress" \
  "$HOROVODRUN" -np 1 --min-np 1 --max-np 2 --host-discovery-script "$MH_TMP/discover.sh" \
  --ssh-command "$COHORT_CLUSTER_SSH" --network-interface eth0 /usr/bin/python3 "$PYDIR/hvd_elastic_discovery_worker.py" \
  >"$MH_TMP/out" 2>&1 &
driver=$!
if wait_progress "h0 alone trained to step 2" "waiting size=1 rank=0 step=2"; then
  list_hosts 'h0:1\nh1:1\n'
  if wait_progress "h1 joined: 2 ranks at step 5" "waiting size=2 rank=0 step=5" "waiting size=2 rank=1 step=5"; then
    expect_contains "both ranks of the grown job resumed from the commit of step 2" "$(cat "$progress")" \
      "size=2 rank=1 resumed=2"
    list_hosts 'h0:1\n'
  fi
fi
wait "$driver" && rc=0 || rc=$?
out=$(cat "$MH_TMP/out")
echo "$out"
expect_eq "horovodrun's elastic job: exit code" "$rc" 0
expect_contains "h1's agent started over ssh" "$out" "host h1 is listed with 1 slot: starting its agent"
expect_contains "h1's agent stopped when the script no longer listed it" "$out" "host h1's agent stopped"
expect_contains "h0 resumed at step 5 and ended with the replay's weights" "$out" "[h0:0] DISCOVERY ELASTIC OK"
expect_no_job_processes 5
finish
