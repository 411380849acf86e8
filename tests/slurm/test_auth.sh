# A Slurm per-node job (`srun cohort run`) runs authenticated with no token from the user (issue 47):
# node 0's launcher makes the job token and serves one munge credential of it per node, restricted to the
# job's uid, which each other node's launcher decodes (src/launch/munge.h). The batch script sets
# COHORT_REQUIRE_AUTH=1, so a node without the token would refuse to start. While the job's 3 nodes
# (h0-h2) wait at a gate, h3, outside the job and knowing its id and store port (both follow from the
# Slurm job id):
#   - connects to node 0's store without the token and writes the job's end key: refused;
#   - fetches node 1's credential, as anyone may, and decodes it as another uid (setpriv --reuid=65534):
#     munged refuses it ("Unauthorized credential"), so the token stays the job's.
# The job then completes with every allreduce value right and no node calls it open. Where munged cannot be
# reached, the job runs open with one warning that says why, and COHORT_REQUIRE_AUTH=1 refuses it on every
# node at once.
source "$(dirname "$0")/lib.sh"
require_command "bench allreduce"
IMPOSTOR=$MH_DIR/impostor.py
# As on a real cluster (/run/munge is 0755), every user reaches munged: a stranger's decode must be
# refused by munged for its uid, not by a folder's mode. (Search permission only: nobody can list the
# cluster's folders, and its keys stay 0400/0600.)
chmod 0711 "$COHORT_CLUSTER_DIR" "$COHORT_CLUSTER_DIR/munge"
# Each node's one rank waits for $MH_TMP/go, then sums buffers with the others and checks every value.
GATED=$MH_TMP/gated.sh
cat >"$GATED" <<EOF
#!/bin/sh
for i in \$(seq 600); do [ -e "$MH_TMP/go" ] && break; sleep 0.05; done
exec "$COHORT" bench allreduce -e 64K -n 2 --check
EOF
chmod +x "$GATED"

submit closed -N 3 --ntasks-per-node=1 -- "export COHORT_REQUIRE_AUTH=1
srun --ntasks-per-node=1 \"$COHORT\" run --nproc-per-node 1 \"$GATED\""
# A worker starts only after its launcher joined node 0's store, so with the token.
if wait_workers 3 60 gated.sh; then
  JOB_ID=slurm-$JOB.0
  PORT=$((20000 + JOB % 1000 * 10))  # the store port every node derives from the job and step ids (docs/slurm.md)
  STORE_OUT=$(on_host 3 timeout 20 python3 "$IMPOSTOR" store "$(addr 0)" "$PORT" "$JOB_ID" 2>&1 || true)
  echo "$STORE_OUT"
  expect_contains "h3's store connection without the token is refused" "$STORE_OUT" \
    "store: refused: the client has no job token"
  CRED=$(on_host 3 timeout 20 python3 "$IMPOSTOR" notice "$(addr 0)" "$PORT" cohort/munge-credential/node/1 2>&1 || true)
  [[ $CRED == MUNGE:* ]] && pass "anyone can fetch node 1's munge credential from the store" ||
    fail "node 1's munge credential: expected 'MUNGE:...', got '$CRED'"
  rc=0
  DECODE=$(on_host 3 setpriv --reuid=65534 --regid=65534 --clear-groups \
    unmunge --socket="$COHORT_CLUSTER_DIR/munge/munge.sock" <<<"$CRED" 2>&1) || rc=$?
  [[ $rc != 0 ]] && pass "another uid cannot decode it (unmunge exit $rc)" ||
    fail "uid 65534 decoded node 1's credential: $DECODE"
  expect_contains "munged names why" "$DECODE" "Unauthorized credential"
fi
touch "$MH_TMP/go"
wait_job "$JOB" 60
OUT=$(cat "$MH_TMP/closed.out")
echo "$OUT" | grep -v '^\[h[0-9]:[0-9]*\] *[0-9]' || true
expect_eq "closed job $JOB: state" "$(job_field "$JOB" JobState)" COMPLETED
expect_eq "closed job: every allreduce value right on each node" "$(grep -c "Out of bounds values : 0 OK" <<<"$OUT")" 1
expect_not_contains "closed job: no node calls it open" "$OUT" "this job is open"
expect_not_contains "closed job: no node refuses to run open" "$OUT" "refuses to start it open"
expect_no_job_processes 5

# No munged to ask (COHORT_MUNGE_SOCKET names none): open, as before, with one warning saying why.
submit open -N 2 --ntasks-per-node=1 -- "export COHORT_MUNGE_SOCKET=$MH_TMP/no-munged
srun --ntasks-per-node=1 \"$COHORT\" run --nproc-per-node 1 /bin/true"
wait_job "$JOB" 60
OUT=$(cat "$MH_TMP/open.out")
echo "$OUT"
expect_eq "no munged: job $JOB state" "$(job_field "$JOB" JobState)" COMPLETED
expect_eq "no munged: one warning" "$(grep -c 'warning: this job is open' <<<"$OUT")" 1
expect_contains "no munged: the warning says why" "$OUT" "no munge token: munged is not running here (no socket $MH_TMP/no-munged"
# ... and COHORT_REQUIRE_AUTH=1 refuses it on both nodes, at once (node 1 does not wait for node 0).
submit required -N 2 --ntasks-per-node=1 -- "export COHORT_MUNGE_SOCKET=$MH_TMP/no-munged COHORT_REQUIRE_AUTH=1
srun --ntasks-per-node=1 \"$COHORT\" run --nproc-per-node 1 /bin/true"
wait_job "$JOB" 30
OUT=$(cat "$MH_TMP/required.out")
echo "$OUT"
expect_eq "no munged, COHORT_REQUIRE_AUTH=1: job $JOB state" "$(job_field "$JOB" JobState)" FAILED
expect_eq "no munged, COHORT_REQUIRE_AUTH=1: both nodes refuse" "$(grep -c 'refuses to start it open' <<<"$OUT")" 2
expect_no_job_processes 5
finish
