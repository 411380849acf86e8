# An elastic job under Slurm: an sbatch script runs `srun --ntasks-per-node=1 cohort run --nnodes 2:4`
# on 4 nodes x 2 ranks (the store's address and port come from the step: its first node, and the port
# derived from the job and step ids). h3's launcher and workers are SIGKILLed mid-epoch, as a lost node
# would be; the three others go on from the last checkpoint at world size 6, finish training, and exit
# 0, while srun (without --kill-on-bad-exit) keeps their step running. Nothing is left on any node.
source "$(dirname "$0")/lib.sh"
require_command run
require_training_example
ARGS=(--model mlp --lr 0.2 --train-samples 20000 --epochs 1 --checkpoint-every 10 --checkpoint-dir "$MH_TMP/ckpt")
submit elastic -N 4 --ntasks-per-node=2 -- "export COHORT_JOB_TOKEN=\$(openssl rand -hex 32)
srun --ntasks=4 --ntasks-per-node=1 sh -c '\"$COHORT\" run --nnodes 2:4 \
--nproc-per-node 2 --max-restarts 3 --kill-grace 2 --rdzv-conf last_call_timeout=3 --ranks-to-console 0 \
\"$TRAIN\" ${ARGS[*]}; echo \"launcher on \$SLURMD_NODENAME exited \$?\"'"
wait_for_line() {  # FILE TEXT SECONDS
  local deadline=$((SECONDS + $3))
  while ((SECONDS < deadline)); do grep -q -- "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}
if wait_for_line "$MH_TMP/elastic.out" "epoch: 0, step: 30," 120; then
  # shellcheck disable=SC2046
  kill -KILL $(pids_matching 3 fashion_mnist)
else
  fail "training did not reach step 30"; tail -20 "$MH_TMP/elastic.out" >&2
fi
wait_job "$JOB" 150
out=$(cat "$MH_TMP/elastic.out")
expect_contains "h3's node was seen lost" "$out" "(h3): its agent's store lease ended"
gen1=$(grep -o "generation 1: 3 node(s) ([^)]*), world size 6" <<<"$out" | head -1 || true)
[[ -n $gen1 && $gen1 != *h3* ]] && pass "generation 1 has the 3 survivors: $gen1" || fail "no generation 1 of h0-h2 at world 6"
expect_contains "generation 1 resumed from the checkpoint" "$out" "written by 8 ranks, 6 now; restart 1"
expect_contains "training finished" "$out" "test accuracy:"
for h in h0 h1 h2; do expect_contains "the launcher on $h exited 0" "$out" "launcher on $h exited 0"; done
expect_no_job_processes 5
finish
