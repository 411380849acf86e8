# A worker killed on one node ends a Slurm job in both styles: the job's output names the rank, the
# signal and the host; the batch job is FAILED with a non-zero exit code in `scontrol show job` (this
# cluster runs no accounting daemon, so not sacct); nothing of the job is left on any node.
source "$(dirname "$0")/lib.sh"
require_command run
require_training_example
LONG=(--model mlp --train-samples 3000 --epochs 1000)

kill_rank5() {  # NAME
  local victim
  victim=$(worker_pid 2 5 fashion_mnist) || { fail "$1: rank 5 not found on h2"; return; }
  kill -KILL "$victim"
  wait_job "$JOB" 30
  local out; out=$(cat "$MH_TMP/$1.out")
  expect_contains "$1: the output names rank 5" "$out" "rank 5"
  expect_contains "$1: ... its signal" "$out" "SIGKILL"
  expect_contains "$1: ... and its host" "$out" "h2"
  expect_eq "$1: job state" "$(job_field "$JOB" JobState)" FAILED
  local code; code=$(job_field "$JOB" ExitCode)
  [[ -n $code && $code != 0:0 ]] && pass "$1: job exit code $code" || fail "$1: job exit code '$code', expected non-zero"
  expect_no_job_processes 5
}

submit fanout -N 4 --ntasks-per-node=2 -- "\"$COHORT\" run \"$TRAIN\" ${LONG[*]}"
wait_workers 8 60 fashion_mnist && kill_rank5 fanout

submit pernode -N 4 --ntasks-per-node=2 -- \
  "export COHORT_JOB_TOKEN=\$(openssl rand -hex 32)
srun --ntasks=4 --ntasks-per-node=1 \"$COHORT\" run --nproc-per-node 2 \"$TRAIN\" ${LONG[*]}"
wait_workers 8 60 fashion_mnist && kill_rank5 pernode
finish
