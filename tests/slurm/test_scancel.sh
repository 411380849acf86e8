# scancel of a running cohort job, in both styles (4 nodes x 2 ranks training the Fashion-MNIST MLP):
# within 5 s of scancel no process of the job is left on any node (no worker, agent, srun or
# slurmstepd), and no process anywhere on this machine still holds one of the job's shared-memory
# segments. Prints the time from scancel to the last process gone.
source "$(dirname "$0")/lib.sh"
require_command run
require_training_example
LONG=(--model mlp --train-samples 3000 --epochs 1000)

# cohort's shared memory is memfds (cohort-shm, cohort-shm-p2p, cohort-flight-recorder-rank<N>): they
# have no name in /dev/shm and live while a process maps them or holds them open. A segment is known by
# its inode, which /proc/PID/maps and a stat of /proc/PID/fd/N both show.
#
# memfd_census PID...: "inode pid name" for every cohort memfd the processes map or hold open (one grep
# and one find over all of them: the census may cover every process of the machine).
memfd_census() {
  (($#)) || return 0
  local dirs=("${@/#//proc/}") fd
  {
    { grep -H '/memfd:cohort' "${dirs[@]/%//maps}" 2>/dev/null || true; } |
      awk '{split($1, f, "/"); print $5, f[3], substr($6, 8)}'
    # (find complains of processes that end while it reads them: those hold nothing any more.)
    { find "${dirs[@]/%//fd}" -lname '/memfd:cohort*' 2>/dev/null || true; } | while read -r fd; do
      echo "$(stat -L -c %i "$fd" 2>/dev/null) $(cut -d/ -f3 <<<"$fd") $(readlink "$fd" | cut -c8- | cut -d' ' -f1)"
    done
  } | sort -u
}
# wait_for_segments SECONDS: until the processes of every host (its sshd and the cluster's daemons too: a
# segment is a leak whoever holds it) hold a cohort-shm segment, the one each host's two ranks share once
# their communicator is up; sets SEGMENTS to the inodes of every cohort memfd held on the hosts then.
# Fails the test if a host has none within SECONDS.
wait_for_segments() {
  local deadline=$((SECONDS + $1)) i census all missing
  while :; do
    all="" missing=""
    for ((i = 0; i < COHORT_CLUSTER_K; i++)); do
      # shellcheck disable=SC2046
      census=$(memfd_census $(ip netns pids "$(ns "$i")"))
      grep -q " cohort-shm$" <<<"$census" || missing+=" h$i"
      all+=$census$'\n'
    done
    SEGMENTS=$(awk 'NF {print $1}' <<<"$all" | sort -u)
    [[ -z $missing ]] && return 0
    ((SECONDS < deadline)) || { fail "no cohort-shm segment held on$missing within $1 s of the job's start"; return 1; }
    sleep 0.1
  done
}
# expect_segments_released NAME INODES: no process on this machine (in a namespace host or not) maps or
# holds one of the job's segments. (A freed memfd's inode number is not given out again soon: they count up.)
expect_segments_released() {
  local held inode pid name
  # shellcheck disable=SC2046
  held=$(memfd_census $(ls /proc | grep -E '^[0-9]+$') | awk 'NR == FNR {job[$1]; next} $1 in job' <(echo "$2") -)
  if [[ -z $held ]]; then
    pass "$1: none of the job's $(wc -l <<<"$2") shared-memory segments is held by any process"
  else
    fail "$1: the job's shared-memory segments still held (inode pid name):"
    while read -r inode pid name; do
      echo "    | $inode $pid($(cat "/proc/$pid/comm" 2>/dev/null)) $name" >&2
    done <<<"$held"
  fi
}

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
  expect_segments_released "$1" "$SEGMENTS"
  wait_job "$JOB" 30
  expect_eq "$1: job state" "$(job_field "$JOB" JobState)" CANCELLED
}

submit fanout -N 4 --ntasks-per-node=2 -- "\"$COHORT\" run \"$TRAIN\" ${LONG[*]}"
wait_workers 8 60 fashion_mnist && wait_for_segments 30
cancel_and_time "fan-out (cohort run in the batch script)"

submit pernode -N 4 --ntasks-per-node=2 -- \
  "export COHORT_JOB_TOKEN=\$(openssl rand -hex 32)
srun --ntasks=4 --ntasks-per-node=1 \"$COHORT\" run --nproc-per-node 2 \"$TRAIN\" ${LONG[*]}"
wait_workers 8 60 fashion_mnist && wait_for_segments 30
cancel_and_time "per-node (srun cohort run)"
finish
