#!/usr/bin/env bash
# Two launcher binaries side by side, for a change that must not change what `cohort run` does or how
# fast it starts (issue 49's splits of launch/plan.cc and the Job class):
#   1. the same plan: `cohort run --dry-run` over command lines of every mode (local, -H with mpirun's
#      mapping, per-node, torchrun's multi-node line, elastic, Ray, parameter servers, Slurm, schedulers'
#      variables, and refused combinations) prints the same text and exits with the same status under both;
#   2. the same speed: the launcher's start-up, `cohort run -n N /bin/true` (plan, store, N workers
#      spawned and reaped), a fan-out's (`-H` of two hosts through a local ssh stand-in: the head, its
#      store and two `cohort agent`s with N/2 workers each), and the plan alone (`cohort run --dry-run` of
#      a fan-out), wall and CPU time,
#      in interleaved rounds (A B, then B A, ...), every round printed with the load, then the median
#      of the rounds' ratios B/A.
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

# 2. The same speed. Wall time as a user waits, and CPU time (user + system of the launcher and the
# workers it reaped), which a loaded machine disturbs less than the wall time.
TIMEFORMAT='%3R %3U %3S'
measure() {  # "WALL_MS CPU_MS": the medians of 5 runs of the command "$@"
  local w=() c=() t
  for _ in 1 2 3 4 5; do
    t=$({ time "$@" >/dev/null 2>&1; } 2>&1) || { echo "failed: $*" >&2; exit 1; }
    read -r real user sys <<<"$t"
    w+=("$real"); c+=("$(awk -v u="$user" -v s="$sys" 'BEGIN { print u + s }')")
  done
  printf '%s %s\n' "$(med "${w[@]}")" "$(med "${c[@]}")" | awk '{ printf "%.1f %.1f", $1 * 1000, $2 * 1000 }'
}
med() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
start() { measure "$1" run -n "$n" /bin/true; }
# The ssh stand-in runs the agent here, as tests/launch's shim does: "fake-ssh [options] HOST COMMAND...".
shim_dir=$(mktemp -d); trap 'rm -rf "$shim_dir"' EXIT
printf '#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do if [ "$1" = -o ]; then shift; fi; shift; done\nshift\nexec "$@"\n' \
  >"$shim_dir/fake-ssh"
chmod +x "$shim_dir/fake-ssh"
fanout() {
  measure "$1" run -H "ab-a:$((n / 2)),ab-b:$((n / 2))" --master-addr 127.0.0.1 --ssh-command "$shim_dir/fake-ssh" \
    /bin/true
}
plan() { measure "$1" run --dry-run -H 127.0.0.2:4,127.0.0.3:4 --map-by node -n "$n" /bin/true; }
start "$a" >/dev/null; start "$b" >/dev/null  # warm-up: page cache
echo "# $(date -u +%FT%TZ), $rounds rounds, each the medians of 5 runs, N=$n; A = $a, B = $b"
echo "# round  start_wall_ms(A B)  start_cpu_ms(A B)  plan_wall_ms(A B)  plan_cpu_ms(A B)  fanout_wall_ms(A B)" \
  " fanout_cpu_ms(A B)  load(1,5,15 min)"
R=()  # per round: the six ratios B/A
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then
    read -r sw_a sc_a <<<"$(start "$a")"; read -r sw_b sc_b <<<"$(start "$b")"
    read -r pw_a pc_a <<<"$(plan "$a")"; read -r pw_b pc_b <<<"$(plan "$b")"
    read -r fw_a fc_a <<<"$(fanout "$a")"; read -r fw_b fc_b <<<"$(fanout "$b")"
  else
    read -r sw_b sc_b <<<"$(start "$b")"; read -r sw_a sc_a <<<"$(start "$a")"
    read -r pw_b pc_b <<<"$(plan "$b")"; read -r pw_a pc_a <<<"$(plan "$a")"
    read -r fw_b fc_b <<<"$(fanout "$b")"; read -r fw_a fc_a <<<"$(fanout "$a")"
  fi
  [[ -n $sw_a && -n $sw_b && -n $pw_a && -n $pw_b && -n $fw_a && -n $fw_b ]] ||
    { echo "round $r: a run failed (above)" >&2; exit 1; }
  echo "$r  $sw_a $sw_b  $sc_a $sc_b  $pw_a $pw_b  $pc_a $pc_b  $fw_a $fw_b  $fc_a $fc_b  $(cut -d' ' -f1-3 /proc/loadavg)"
  R+=("$(awk -v a="$sw_a $sc_a $pw_a $pc_a $fw_a $fc_a" -v b="$sw_b $sc_b $pw_b $pc_b $fw_b $fc_b" 'BEGIN {
    split(a, x); split(b, y); for (i = 1; i <= 6; i++) printf "%s%.4f", (i > 1 ? " " : ""), (x[i] > 0 ? y[i] / x[i] : 1) }')")
done
# The median over the rounds of each round's ratio B/A: a drift of the load between rounds cancels.
names=("start-up wall (run -n $n /bin/true)" "start-up CPU" "plan alone wall (--dry-run, fan-out)" "plan alone CPU"
  "fan-out start-up wall (-H 2 hosts, ssh stand-in)" "fan-out start-up CPU")
for i in 1 2 3 4 5 6; do
  mapfile -t column < <(printf '%s\n' "${R[@]}" | awk -v i="$i" '{ print $i }')
  printf '%s: B/A %.3f (median of %d rounds)\n' "${names[i - 1]}" "$(med "${column[@]}")" "$rounds"
done
