# scancel of a running cohort job, in both styles (4 nodes x 2 ranks training the Fashion-MNIST MLP):
# within 5 s of scancel no process of the job is left on any node (no worker, agent, srun or
# slurmstepd) and /dev/shm has nothing new. Prints the time from scancel to the last process gone.
source "$(dirname "$0")/lib.sh"
require_command run
require_training_example
LONG=(--model mlp --train-samples 3000 --epochs 1000)
shm_before=$(shm_entries)

cancel_and_time() {  # NAME
  local t0 t1 left i
  t0=$(now_ms)
  on_host 0 scancel "$JOB"
  while :; do
    left=""
    for ((i = 0; i < COHORT_CLUSTER_K; i++)); do left+=$(job_processes_on "$i"); done
    [[ -z $left ]] && break
    (($(now_ms) - t0 < 10000)) || break
    sleep 0.05
  done
  t1=$(now_ms)
  if [[ -z $left ]]; then
    echo "$1: scancel -> nothing of the job left on any node: $((t1 - t0)) ms"
    ((t1 - t0 <= 5000)) && pass "$1: everything gone $((t1 - t0)) ms after scancel" ||
      fail "$1: the job's processes took $((t1 - t0)) ms to go (more than 5 s)"
  else
    fail "$1: processes left 10 s after scancel: $left"
  fi
  wait_job "$JOB" 30
  expect_eq "$1: job state" "$(job_field "$JOB" JobState)" CANCELLED
}

submit fanout -N 4 --ntasks-per-node=2 -- "\"$COHORT\" run \"$TRAIN\" ${LONG[*]}"
wait_workers 8 60 fashion_mnist && sleep 1
cancel_and_time "fan-out (cohort run in the batch script)"

submit pernode -N 4 --ntasks-per-node=2 -- \
  "export COHORT_JOB_TOKEN=\$(openssl rand -hex 32)
srun --ntasks=4 --ntasks-per-node=1 \"$COHORT\" run --nproc-per-node 2 \"$TRAIN\" ${LONG[*]}"
wait_workers 8 60 fashion_mnist && sleep 1
cancel_and_time "per-node (srun cohort run)"

expect_eq "no /dev/shm entry left" "$(comm -13 <(echo "$shm_before") <(shm_entries) | tr '\n' ' ')" ""
finish
