# cluster-hosts: 5
# An elastic job across hosts (`cohort run --nnodes 2:4`, one agent per host, torchrun style): 4 hosts
# x 2 ranks train the Fashion-MNIST MLP; h3's agent and workers are SIGKILLed mid-epoch; the other
# three go on from the last checkpoint at the next generation (world 6); a 5th host started then is
# admitted at the generation after (world 8). The final test accuracy must be within 1 point of the
# same job uninterrupted, every surviving agent exits 0, and nothing of the job is left on any host
# (no process, no /dev/shm entry). Prints the time from the kill to the first step of generation 1
# (docs/performance.md, "Slurm and elastic jobs"). Then the store's host itself is lost: the survivors move the
# job's store to the standby store of h1 or h2 and go on.
source "$(dirname "$0")/lib.sh"
require_command run
require_training_example
((COHORT_CLUSTER_K >= 5)) || { echo "FAIL: needs 5 hosts, the cluster has $COHORT_CLUSTER_K" >&2; exit 1; }
shm_before=$(shm_entries)
# 2 epochs of 32,000 samples at lr 0.2 (global batch 256 on 8 ranks): far enough into training that a
# world size changing mid-run moves the final accuracy by well under a point (0.80-0.81 either way).
ARGS=(--model mlp --lr 0.2 --epochs 2 --train-samples 32000 --checkpoint-every 25)
agent() {  # agent HOST-INDEX PORT CHECKPOINT-DIR: one host's `cohort run`
  on_host "$1" timeout -k 5 170 "$COHORT" run --nnodes 2:4 --nproc-per-node 2 --master-addr h0 --master-port "$2" \
    --max-restarts 3 --kill-grace 2 --rdzv-conf last_call_timeout=5 --ranks-to-console 0 \
    "$TRAIN" "${ARGS[@]}" --checkpoint-dir "$3"
}
accuracy() { grep -o "test accuracy: [0-9.]*" "$1" | head -1 | awk '{print $3}'; }
# Waits up to $3 s for file $1 to contain $2.
wait_for_line() {
  local deadline=$((SECONDS + $3))
  while ((SECONDS < deadline)); do grep -q -- "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done
  return 1
}

# 1. The same job uninterrupted: the reference accuracy.
for i in 0 1 2 3; do agent "$i" 29610 "$MH_TMP/ref" >"$MH_TMP/ref.$i.out" 2>&1 & done
rc=0; wait || rc=$?
ref=$(accuracy "$MH_TMP/ref.0.out")
[[ -n $ref ]] && pass "uninterrupted run: test accuracy $ref" || { fail "uninterrupted run printed no accuracy"; tail -20 "$MH_TMP/ref.0.out" >&2; }
expect_no_job_processes 5

# 2. The same job, h3 killed mid-epoch, h4 joining afterwards.
pids=()
for i in 0 1 2 3; do agent "$i" 29620 "$MH_TMP/el" >"$MH_TMP/el.$i.out" 2>&1 & pids+=($!); done
# Mid-epoch: after step 50 of epoch 0 (of 125: 32,000 samples, half the set, keep CI's serial path
# short), with checkpoints written every 25 steps.
if ! wait_for_line "$MH_TMP/el.0.out" "epoch: 0, step: 50," 120; then
  fail "training did not reach step 50"
  for i in 0 1 2 3; do echo "--- h$i:"; tail -5 "$MH_TMP/el.$i.out"; done >&2
fi
victims=$(pids_matching 3 fashion_mnist)
t_kill=$(date +%s.%N)
# shellcheck disable=SC2086
kill -KILL $victims
wait_for_line "$MH_TMP/el.0.out" "restart 1: first step done at" 60 || fail "no first step of generation 1 on h0"
t_first=$(grep -o "restart 1: first step done at [0-9.]*" "$MH_TMP/el.0.out" | awk '{print $7}')
recovery=$(awk -v a="$t_kill" -v b="$t_first" 'BEGIN { printf "%.2f", b - a }')
echo "kill of h3 -> first step of generation 1: $recovery s"
awk -v r="$recovery" 'BEGIN { exit !(r > 0 && r < 10) }' && pass "generation 1 stepped $recovery s after the kill" ||
  fail "generation 1's first step came $recovery s after the kill"
# h4 joins once generation 1 has trained a while at world 6 (and checkpointed): the final weights then
# come from both world sizes.
wait_for_line "$MH_TMP/el.0.out" "epoch: 0, step: 110," 60 || fail "generation 1 did not reach step 110"
agent 4 29620 "$MH_TMP/el" >"$MH_TMP/el.4.out" 2>&1 &
pids+=($!)
for i in 0 1 2 4; do
  rc=0; wait "${pids[$i]}" || rc=$?
  expect_eq "agent on h$i exits 0" "$rc" 0
done
wait "${pids[3]}" 2>/dev/null || true
out=$(cat "$MH_TMP/el.0.out")
# Node order is the order of arrival in generation 0 (survivors keep theirs; newcomers come last).
expect_contains "h0 saw h3's node lost" "$out" "(h3): its agent's store lease ended"
gen1=$(grep -o "generation 1: 3 node(s) ([^)]*), world size 6" <<<"$out" || true)
[[ -n $gen1 && $gen1 != *h3* ]] && pass "generation 1 has the 3 survivors: $gen1" || fail "no generation 1 of h0-h2 at world 6"
expect_contains "generation 1 resumed from the checkpoint" "$out" "written by 8 ranks, 6 now; restart 1"
expect_contains "h4 was admitted at the next generation" "$out" "h4 joins the job"
expect_contains "generation 2 has 4 nodes again, h4 last" "$out" "h4), world size 8"
expect_contains "generation 2 resumed from generation 1's checkpoint" "$out" "written by 6 ranks, 8 now; restart 2"
expect_contains "h4 ran in generation 2" "$(cat "$MH_TMP/el.4.out")" "generation 2: 4 node(s)"
got=$(accuracy "$MH_TMP/el.0.out")
if [[ -n $got && -n $ref ]] && awk -v a="$got" -v b="$ref" 'BEGIN { d = a - b; exit !(d < 0.01 && d > -0.01) }'; then
  pass "accuracy after the kill and the join ($got) is within 1 point of the uninterrupted run ($ref)"
else
  fail "accuracy after the kill and the join ($got) is not within 1 point of the uninterrupted run ($ref)"
  tail -30 "$MH_TMP/el.0.out" >&2
fi
expect_no_job_processes 5

# 3. The store's host lost: h0, h1, h2 run an elastic job of sleeping workers; h0 (the store's host,
# node 0) is SIGKILLed. h1 and h2 move the job's store to the first standby store that answers, in
# generation 0's node order (h1's or h2's, on its address), and go on at generation 1 with 4 ranks,
# which then finish.
WORKER='echo "$RANK $WORLD_SIZE $COHORT_STORE_ADDR $MASTER_ADDR" > '"$MH_TMP"'/fo.$COHORT_RESTART_COUNT.$RANK; [ $COHORT_RESTART_COUNT = 0 ] && exec sleep 60; exit 0'
fopids=()
for i in 0 1 2; do
  on_host "$i" timeout -k 5 60 "$COHORT" run --nnodes 1:3 --nproc-per-node 2 --master-addr h0 --master-port 29640 \
    --max-restarts 1 --kill-grace 1 --rdzv-conf last_call_timeout=10 sh -c "$WORKER" >"$MH_TMP/fo.$i.out" 2>&1 &
  fopids+=($!)
done
for ((n = 0; n < 400; n++)); do [[ -s $MH_TMP/fo.0.5 && -s $MH_TMP/fo.0.0 ]] && break; sleep 0.05; done
# shellcheck disable=SC2046
kill -KILL $(pids_matching 0 "--master-port 29640")
for i in 1 2; do rc=0; wait "${fopids[$i]}" || rc=$?; expect_eq "store's host lost: the agent on h$i exits 0" "$rc" 0; done
wait "${fopids[0]}" 2>/dev/null || true
out=$(cat "$MH_TMP/fo.1.out" "$MH_TMP/fo.2.out")
# The store goes to the first member of generation 0 (in its node order) whose standby answers.
moved=$(grep -o "the job's store moved to [0-9.]*:[0-9]*" <<<"$out" | head -1 | awk '{print $6}')
[[ ${moved%:*} == "$(addr 1)" || ${moved%:*} == "$(addr 2)" ]] && pass "store's host lost: the store moved to $moved" ||
  fail "store's host lost: the store did not move to h1 or h2 ('$moved')"
gen1=$(grep -o "generation 1: 2 node(s) ([^)]*), world size 4" <<<"$out" | head -1)
[[ $gen1 == *h1* && $gen1 == *h2* ]] && pass "store's host lost: $gen1" || fail "store's host lost: no generation 1 of h1 and h2"
read -r _ world store master <"$MH_TMP/fo.1.0" || true
expect_eq "store's host lost: generation 1's world size" "$world" 4
expect_eq "store's host lost: generation 1's workers use the moved store" "$store" "$moved"
expect_eq "store's host lost: MASTER_ADDR follows it (rank 0 on the store's new host)" "$master" "${moved%:*}"
expect_no_job_processes 5

shm_after=$(shm_entries)
expect_eq "no /dev/shm entry left" "$(comm -13 <(echo "$shm_before") <(echo "$shm_after") | tr '\n' ' ')" ""
finish
