#!/usr/bin/env bash
# Two launcher binaries side by side, for a change that must not change what `cohort run` does or how
# fast it starts (issue 49's splits of launch/plan.cc and the Job class):
#   1. the same plan: `cohort run --dry-run` over command lines of every mode (local, -H with mpirun's
#      mapping, per-node, torchrun's multi-node line, elastic, Ray, parameter servers, Slurm, schedulers'
#      variables, and refused combinations) prints the same text and exits with the same status under both;
#   2. the same speed: the launcher's start-up, `cohort run -n N /bin/true` (plan, store, N workers
#      spawned and reaped), and the plan alone (`cohort run --dry-run` of a fan-out), timed whole, in
#      interleaved rounds (A B, then B A, ...), every round printed with the load, then the medians and
#      the ratio B/A.
#   bench/launch/ab_launcher.sh COHORT_A COHORT_B [ROUNDS=10] [N=8]
# COHORT_A/B: the `cohort` executables (copy a tree's build/tools/cohort first if that tree may rebuild).
set -euo pipefail
a=${1:?usage: ab_launcher.sh COHORT_A COHORT_B [ROUNDS] [N]} b=${2:?usage}
rounds=${3:-10} n=${4:-8}
for x in "$a" "$b"; do [[ -x $x ]] || { echo "$x: not an executable" >&2; exit 1; }; done

# 1. The same plan. Each line is the arguments after `cohort run --dry-run --run-id ab`, run in an empty
# environment (PATH and HOME only); "VAR=value ... :: ARGS" adds those variables (a scheduler's).
lines=(
  "-n 2 /bin/true"
  "-n 4 --bind-to core --tag-output /bin/true"
  "-H 127.0.0.2:2,127.0.0.3:2 --map-by node -n 3 /bin/true"
  "-H 127.0.0.2:1,127.0.0.3:4,127.0.0.4:2 --map-by node -n 6 --rank-by node /bin/true"
  "-H 127.0.0.2:2,127.0.0.3:2 -n 6 --oversubscribe -x AB_VAR=1 /bin/true"
  "--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --nproc-per-node 2 /bin/true"
  "--nnodes 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 --nproc-per-node 2 /bin/true"
  "--nnodes 1:3 --master-addr 127.0.0.1 --nproc-per-node 2 /bin/true"
  "--ray --ray-command /bin/sh --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 /bin/true"
  "HEAD_ADDR=127.0.0.1 HEAD_PORT=6379 RANK=1 :: --ray --ray-command /bin/sh /bin/true"
  "SLURM_JOB_ID=7 SLURM_JOB_NODELIST=ab-n[1-2] SLURM_TASKS_PER_NODE=2(x2) :: /bin/true"
  "SLURM_JOB_ID=7 SLURM_STEP_ID=0 SLURM_STEP_NODELIST=ab-n[1-2] SLURM_NODEID=1 SLURM_NNODES=2 :: /bin/true"
  "MASTER_ADDR=ab-h MASTER_PORT=1234 WORLD_SIZE=2 RANK=0 :: -n 2 /bin/true"
  "PET_NNODES=1:2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29400 :: --nproc-per-node 2 /bin/true"
  "-H 127.0.0.2:2,127.0.0.3:2 --gpus-per-node 2 /bin/true"
  "--ps 2 -n 3 /bin/true"
  "--nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --ps 3 -n 4 /bin/true"
  "-n 2 --append-local-rank --local-rank-arg local-rank /bin/true"
  "-n 2 --log-dir /tmp/ab-logs --redirects 3 --local-ranks-filter 0 /bin/true"
  "-n 2 --timeout 30 --map-by ppr:2:node /bin/true"
  "--map-by node --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 /bin/true"
  "-H 127.0.0.2 --nnodes 2 /bin/true"
  "--ray -n 2 /bin/true"
  "--nnodes 1:2 --ps 1 --master-addr 127.0.0.1 /bin/true"
  "-n 2 --gpu-share /bin/true"
  "-n 2 /no/such/program"
)
plan_of() {  # dry-run text and exit status of binary $1 for line $2 (paths of the binary masked)
  local out rc=0 vars="" args=$2
  if [[ $2 == *" :: "* ]]; then vars=${2%% :: *} args=${2#* :: }; fi
  # shellcheck disable=SC2086  # each line is a list of words
  out=$(env -i PATH="$PATH" HOME="${HOME:-/tmp}" $vars "$1" run --dry-run --run-id ab $args 2>&1) || rc=$?
  printf '%s\nexit %s\n' "${out//$1/COHORT}" "$rc"
}
differ=0
for l in "${lines[@]}"; do
  if ! diff <(plan_of "$a" "$l") <(plan_of "$b" "$l") >/dev/null; then
    echo "plans differ: cohort run --dry-run $l" >&2
    diff <(plan_of "$a" "$l") <(plan_of "$b" "$l") >&2 || true
    differ=1
  fi
done
((differ == 0)) || { echo "the two launchers plan differently (above)" >&2; exit 1; }
echo "# same plans: ${#lines[@]} command lines, --dry-run text and exit status"

# 2. The same speed.
ms() {  # median wall milliseconds of 5 runs of the command "$@"
  local s=() t0 t1
  for _ in 1 2 3 4 5; do
    t0=$(date +%s%N)
    "$@" >/dev/null 2>&1 || { echo "failed: $*" >&2; exit 1; }
    t1=$(date +%s%N)
    s+=($(((t1 - t0) / 1000)))
  done
  printf '%s\n' "${s[@]}" | sort -n | sed -n 3p | awk '{ printf "%.2f", $1 / 1000 }'
}
start() { ms "$1" run -n "$n" /bin/true; }
plan() { ms "$1" run --dry-run -H 127.0.0.2:4,127.0.0.3:4 --map-by node -n "$n" /bin/true; }
start "$a" >/dev/null; start "$b" >/dev/null  # warm-up: page cache
echo "# $(date -u +%FT%TZ), $rounds rounds of 5 runs each (median), N=$n; A = $a, B = $b"
echo "# round  start_A_ms  start_B_ms  plan_A_ms  plan_B_ms  load(1,5,15 min)"
SA=() SB=() PA=() PB=()
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then
    sa=$(start "$a"); sb=$(start "$b"); pa=$(plan "$a"); pb=$(plan "$b")
  else
    sb=$(start "$b"); sa=$(start "$a"); pb=$(plan "$b"); pa=$(plan "$a")
  fi
  SA+=("$sa"); SB+=("$sb"); PA+=("$pa"); PB+=("$pb")
  echo "$r  $sa  $sb  $pa  $pb  $(cut -d' ' -f1-3 /proc/loadavg)"
done
med() { printf '%s\n' "$@" | sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
msa=$(med "${SA[@]}") msb=$(med "${SB[@]}") mpa=$(med "${PA[@]}") mpb=$(med "${PB[@]}")
awk -v a="$msa" -v b="$msb" -v n="$n" 'BEGIN { printf "start-up (run -n %d /bin/true): A %.2f ms, B %.2f ms, B/A %.3f\n", n, a, b, b / a }'
awk -v a="$mpa" -v b="$mpb" 'BEGIN { printf "plan alone (--dry-run fan-out): A %.2f ms, B %.2f ms, B/A %.3f\n", a, b, b / a }'
