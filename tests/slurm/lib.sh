# Helpers for tests/slurm/test_*.sh, which run inside `slurm.sh run` (a real Slurm cluster of namespace
# hosts; COHORT_CLUSTER_* and SLURM_CONF describe it). Builds on tests/multihost/lib.sh.
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../multihost/lib.sh"

# Processes of jobs on host $1: everything in its namespace but the cluster's daemons (sshd, slurmd,
# slurmctld and its slurmscriptd, munged). A slurmstepd counts: one left after a job ended is a leak too.
job_processes_on() {
  local p out=""
  for p in $(ip netns pids "$(ns "$1")"); do
    local comm; comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
    case $comm in sshd | slurmd | slurmctld | slurmscriptd | munged) continue ;; esac
    [[ $(awk '/^State:/ {print $2}' "/proc/$p/status" 2>/dev/null) == Z ]] && continue
    out+="$p($({ tr "\0" " " <"/proc/$p/cmdline"; } 2>/dev/null | cut -c1-80)) "
  done
  echo "$out"
}

# submit NAME SBATCH-ARGS... -- SCRIPT-TEXT: writes the batch script, submits it from h0 (in this
# folder), and sets JOB to the job id. The job's output goes to $MH_TMP/NAME.out.
submit() {
  local name=$1; shift
  local args=()
  while [[ $1 != -- ]]; do args+=("$1"); shift; done
  shift
  printf '#!/bin/bash\n%s\n' "$1" >"$MH_TMP/$name.sbatch"
  JOB=$(on_host 0 sbatch --parsable -J "$name" -o "$MH_TMP/$name.out" "${args[@]}" "$MH_TMP/$name.sbatch") ||
    { fail "$name: sbatch refused the job"; return 1; }
  JOB=${JOB%%;*}
}

# job_field JOB FIELD: a field of `scontrol show job` (JobState, ExitCode, ...).
job_field() { on_host 0 scontrol show job "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -1; }

# wait_job JOB SECONDS: until the job has left the queue's running states; fails the test if not.
wait_job() {
  local deadline=$((SECONDS + $2)) state
  while ((SECONDS < deadline)); do
    state=$(job_field "$1" JobState)
    case $state in PENDING | RUNNING | CONFIGURING | COMPLETING | "") sleep 0.2 ;; *) return 0 ;; esac
  done
  fail "job $1 still $(job_field "$1" JobState) after $2 s"
  on_host 0 scancel "$1" 2>/dev/null || true
  return 1
}

# wait_workers N SECONDS PATTERN: until N processes whose command line contains PATTERN run across the
# cluster's hosts; fails the test if they do not within SECONDS.
wait_workers() {
  local want=$1 deadline=$((SECONDS + $2)) n i
  while ((SECONDS < deadline)); do
    n=0
    for ((i = 0; i < COHORT_CLUSTER_K; i++)); do n=$((n + $(pids_matching "$i" "$3" | wc -l))); done
    ((n >= want)) && return 0
    sleep 0.1
  done
  fail "only $n of $want processes matching '$3' started within $2 s"
  return 1
}

# worker_pid HOST RANK PATTERN: pid of the process on HOST whose command line contains PATTERN and whose
# environment has RANK=<RANK> (a worker of the job), or nothing.
worker_pid() {
  local p
  for p in $(pids_matching "$1" "$3"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$2" && { echo "$p"; return 0; }
  done
  return 1
}
