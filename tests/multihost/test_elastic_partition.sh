# cluster-hosts: 5
# Elastic jobs cut in two (docs/launcher.md, "Partitions"): exactly one side goes on, the other stops
# with one line saying why, and nothing of the job is left on any host. Workers are shell loops that
# write their generation, rank, world size and store address.
#
# 1. --nnodes 1:4 on h0-h3 (the store on h0); the path between h0 and h1 only is cut. h1 lost the
#    store's host but reaches h2 and h3: before fencing it moved the job's store to its own standby
#    and ran a second copy of the job alone (MIN is 1). Now it finds 1 of 4 votes and stops; h0, h2
#    and h3 go on at generation 1 (world 6) on h0's store.
# 2. --nnodes 1:5 on h0-h4; h0 is cut from every host but P, the first member after it (whose standby
#    store is the first candidate). The three others vote at P's standby (3 of 5) and move the job's
#    store there; P, which still reaches h0, follows its standby; h0, left with fewer than half of
#    generation 0, stops. Generation 1 is P and the three voters (world 8) on P's standby store.
source "$(dirname "$0")/lib.sh"
require_command run
((COHORT_CLUSTER_K >= 5)) || { echo "FAIL: needs 5 hosts, the cluster has $COHORT_CLUSTER_K" >&2; exit 1; }

# worker FILE-PREFIX: generation 0 sleeps (until the cut ends it); later generations run 12 s (longer
# than the losing side takes to give up) and finish.
worker() {
  echo 'echo "$COHORT_RESTART_COUNT $RANK $WORLD_SIZE $COHORT_STORE_ADDR" > '"$MH_TMP/$1"'.$COHORT_RESTART_COUNT.$RANK;' \
    '[ $COHORT_RESTART_COUNT = 0 ] && exec sleep 60; sleep 12; exit 0'
}
# agent HOST BOUNDS PORT PREFIX: one host's `cohort run` (stderr and stdout in $MH_TMP/out.PREFIX.HOST).
# --rdzv-timeout 20: a round waits that long for members that are not back, so a second copy of the job
# (a side that went on where it must not) would show within the test's time.
agent() {
  on_host "$1" timeout -k 5 80 "$COHORT" run --nnodes "$2" --nproc-per-node 2 --master-addr h0 --master-port "$3" \
    --max-restarts 2 --kill-grace 1 --rdzv-timeout 20 --rdzv-conf last_call_timeout=10 sh -c "$(worker "$4")" \
    >"$MH_TMP/out.$4.$1" 2>&1
}
wait_port() {  # HOST PORT: until h0's store answers from HOST (10 s)
  local n
  for ((n = 0; n < 200; n++)); do
    on_host "$1" bash -c "exec 3<>/dev/tcp/h0/$2" 2>/dev/null && return 0
    sleep 0.05
  done
  return 1
}
show_outputs() {  # PREFIX: every agent's output, after a failed check
  local f
  for f in "$MH_TMP/out.$1".*; do echo "--- ${f##*/}:"; sed 's/^/    | /' "$f"; done >&2
}
wait_files() {  # PREFIX N: wait up to 30 s for generation 0's files of ranks 0..N-1
  local n r ok
  for ((n = 0; n < 600; n++)); do
    ok=1
    for ((r = 0; r < $2; r++)); do [[ -s $MH_TMP/$1.0.$r ]] || ok=0; done
    ((ok)) && return 0
    sleep 0.05
  done
  return 1
}
# Fields of every line of generation GEN's files: "GEN RANK WORLD STORE", sorted by rank.
gen_lines() { cat "$MH_TMP/$1.$2".* 2>/dev/null | sort -k2 -n; }

# ---- 1. h0 and h1 cut from each other ----------------------------------------------------------
# h1 arrives right after h0, so that it is node 1 and its own standby store its first candidate (the
# case where the old code moved the store to it and ran a second copy there).
pids=()
agent 0 1:4 29650 p1 &
pids+=($!)
wait_port 1 29650 || fail "case 1: h0's store did not come up"
agent 1 1:4 29650 p1 &
pids+=($!)
sleep 1
for i in 2 3; do agent "$i" 1:4 29650 p1 & pids+=($!); done
wait_files p1 8 || fail "case 1: generation 0 did not start on 4 hosts"
t_cut=$SECONDS
cut_pair 0 1
rcs=()
for i in 0 1 2 3; do rc=0; wait "${pids[$i]}" || rc=$?; rcs+=("$rc"); done
heal_pair 0 1
echo "case 1: exit codes h0-h3: ${rcs[*]} ($((SECONDS - t_cut)) s after the cut)"
expect_eq "case 1: h1, cut off from the store's host, stops (exit 1)" "${rcs[1]}" 1
for i in 0 2 3; do expect_eq "case 1: h$i goes on and finishes (exit 0)" "${rcs[$i]}" 0; done
out1=$(cat "$MH_TMP/out.p1.1")
expect_contains "case 1: h1 says why it stops" "$out1" \
  "generation 0: lost the store's host and could not reach a majority of the last generation (1 of 4 voted at "
expect_contains "case 1: ... in one line that ends the job" "$out1" "stopping so that one copy of the job runs"
expect_not_contains "case 1: h1 never moved the job's store" "$out1" "the job's store moved to"
expect_not_contains "case 1: h1 never ran generation 1" "$out1" "generation 1:"
out0=$(cat "$MH_TMP/out.p1.0")
expect_contains "case 1: h0 saw h1's lease end" "$out0" "(h1): its agent's store lease ended"
gen1=$(grep -o "generation 1: 3 node(s) ([^)]*), world size 6" <<<"$out0" || true)
[[ -n $gen1 && $gen1 != *h1* ]] && pass "case 1: $gen1" || fail "case 1: no generation 1 of h0, h2, h3 at world 6"
lines=$(gen_lines p1 1)
expect_eq "case 1: generation 1 ran 6 ranks, all on h0's store" \
  "$(awk '{print $3, $4}' <<<"$lines" | sort -u | tr '\n' ' ')" "6 h0:29650 "
expect_eq "case 1: one copy of the job: 6 ranks in generation 1" "$(wc -l <<<"$lines" | tr -d ' ')" 6
((MH_FAILS == 0)) || show_outputs p1
expect_no_job_processes 5
fails_before=$MH_FAILS

# ---- 2. h0 cut from all but P: the majority moves the store to P's standby; P follows ----------------
pids=()
for i in 0 1 2 3 4; do agent "$i" 1:5 29660 p2 & pids+=($!); done
wait_files p2 10 || fail "case 2: generation 0 did not start on 5 hosts"
order=$(grep -o "generation 0: 5 node(s) ([^)]*)" "$MH_TMP/out.p2.0" | head -1 | sed 's/.*(\(.*\))/\1/')
p_host=$(awk -F', ' '{print $2}' <<<"$order")
p=${p_host#h}
echo "case 2: generation 0 is ($order); P = $p_host"
voters=()
for i in 1 2 3 4; do ((i == p)) || { cut_pair 0 "$i"; voters+=("$i"); }; done
t_cut=$SECONDS
rcs=()
for i in 0 1 2 3 4; do rc=0; wait "${pids[$i]}" || rc=$?; rcs+=("$rc"); done
for i in "${voters[@]}"; do heal_pair 0 "$i"; done
echo "case 2: exit codes h0-h4: ${rcs[*]} ($((SECONDS - t_cut)) s after the cut)"
expect_eq "case 2: h0, left with fewer than half of generation 0, stops (exit 1)" "${rcs[0]}" 1
for i in 1 2 3 4; do expect_eq "case 2: h$i goes on and finishes (exit 0)" "${rcs[$i]}" 0; done
expect_contains "case 2: h0 says why it stops" "$(cat "$MH_TMP/out.p2.0")" \
  "fewer than half: the others may be cut off from this store and go on without it; stopping so that one copy of the job runs"
outp=$(cat "$MH_TMP/out.p2.$p")
expect_contains "case 2: P learns that its standby store was promoted" "$outp" "this agent's standby store"
expect_contains "case 2: P hosts the job's store now" "$outp" ", this agent) at epoch 1"
moved=$(grep -o "the job's store moved to [0-9.]*:[0-9]*" <<<"$outp" | head -1 | awk '{print $6}' || true)
expect_eq "case 2: the store moved to P's address" "${moved%:*}" "$(addr "$p")"
for i in "${voters[@]}"; do
  expect_contains "case 2: h$i voted at P's standby store" "$(cat "$MH_TMP/out.p2.$i")" \
    "voting to move the job's store to $p_host's standby store"
done
lines=$(gen_lines p2 1)
expect_eq "case 2: generation 1 ran 8 ranks, all on P's store" \
  "$(awk '{print $3, $4}' <<<"$lines" | sort -u | tr '\n' ' ')" "8 $moved "
expect_eq "case 2: one copy of the job: 8 ranks in generation 1" "$(wc -l <<<"$lines" | tr -d ' ')" 8
((MH_FAILS == fails_before)) || show_outputs p2
expect_no_job_processes 5
finish
