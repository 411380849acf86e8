#!/usr/bin/env bash
# How fast an elastic job trains again after losing a host: cohort (`cohort run --nnodes 2:4`) and
# torchrun (its c10d rendezvous, `--nnodes 2:4`), side by side, interleaved, on the same network-
# namespace cluster of 4 hosts x 2 ranks (tests/multihost/cluster.sh). Each round starts the
# Fashion-MNIST MLP job fresh, waits for step 100 of epoch 0, SIGKILLs every process of the job on h3
# (agent and workers) and measures the time from the kill to the first step of the next generation
# (the "restart 1: first step done at T" line both programs print), then stops the job.
#   cohort:   build/examples/fashion_mnist/fashion_mnist (checkpoint every 25 steps)
#   torchrun: bench/peers/torchrun311.py (Debian's torchrun, one-function fix) running
#             bench/elastic/torch_elastic_train.py (PyTorch's fault-tolerance tutorial, snapshot every
#             25 steps), gloo on eth0, torchrun's defaults otherwise (monitor interval 5 s)
# Usage (root; writes bench/results/elastic-side-by-side-<time>.txt):
#   ROUNDS=3 bench/elastic/side_by_side.sh [build dir]
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
if [[ -z ${COHORT_CLUSTER_DIR:-} ]]; then
  export COHORT_TOOL=${COHORT_TOOL:-${1:-$repo/build}/tools/cohort} COHORT_BUILD_DIR=${1:-$repo/build}
  export COHORT_CLUSTER_QUIET=1
  exec "$repo/tests/multihost/cluster.sh" run -k 4 -- bash "$0" "$@"
fi
source "$repo/tests/multihost/lib.sh"
set +e
PEERS_DIR=${PEERS_DIR:-$repo/bench/peers}
ROUNDS=${ROUNDS:-3}
TRAIN=$COHORT_BUILD_DIR/examples/fashion_mnist/fashion_mnist
TORCHRUN=$PEERS_DIR/torchrun311.py
PEER=$repo/bench/elastic/torch_elastic_train.py
[[ -x $TRAIN && -f $TORCHRUN && -f $PEER ]] || { echo "needs $TRAIN, $TORCHRUN and $PEER" >&2; exit 1; }
results=$repo/bench/results/elastic-side-by-side-$(date -u +%Y-%m-%dT%H%MZ).txt
mkdir -p "$(dirname "$results")"

wait_for_line() {  # FILE-GLOB PATTERN SECONDS
  local deadline=$((SECONDS + $3))
  while ((SECONDS < deadline)); do
    # shellcheck disable=SC2086
    grep -h -- "$2" $1 2>/dev/null | head -1 && return 0
    sleep 0.05
  done
  return 1
}
stop_everything() {  # PATTERN
  local i p
  for ((i = 0; i < COHORT_CLUSTER_K; i++)); do
    for p in $(pids_matching "$i" "$1"); do kill -KILL "$p" 2>/dev/null; done
  done
  wait 2>/dev/null
}
# One round: $1 = name, $2 = pattern naming the job's processes, then the per-host command.
round() {
  local name=$1 pattern=$2; shift 2
  local dir=$MH_TMP/$name.$r i
  mkdir -p "$dir"
  for i in 0 1 2 3; do
    local args=() a
    for a in "$@"; do args+=("${a//\{dir\}/$dir}"); done
    on_host "$i" timeout -k 5 300 "${args[@]}" >"$dir/h$i.out" 2>&1 &
  done
  if ! wait_for_line "$dir/h*.out" "epoch: 0, step: 100," 240 >/dev/null; then
    echo "$name round $r: never reached step 100" >&2; tail -5 "$dir"/h*.out >&2; stop_everything "$pattern"; echo "n/a"; return
  fi
  local t_kill; t_kill=$(date +%s.%N)
  # shellcheck disable=SC2046
  kill -KILL $(pids_matching 3 "$pattern") 2>/dev/null
  local line; line=$(wait_for_line "$dir/h*.out" "restart 1: first step done at" 120)
  stop_everything "$pattern"
  if [[ -z $line ]]; then echo "$name round $r: no first step after the kill" >&2; tail -5 "$dir"/h*.out >&2; echo "n/a"; return; fi
  awk -v a="$t_kill" -v b="$(sed 's/.*first step done at \([0-9.]*\).*/\1/' <<<"$line")" 'BEGIN { printf "%.2f", b - a }'
}

{
  echo "# elastic recovery, kill of h3 (agent + 2 workers) at step 100 -> first step of the next generation"
  echo "# $(date -u +%FT%TZ), 4 namespace hosts x 2 ranks on $(nproc) CPUs, Fashion-MNIST MLP, checkpoint/snapshot every 25 steps"
  echo "# torchrun: its defaults (last_call_timeout 30 s, monitor interval 5 s); torchrun_tuned: --rdzv_conf last_call_timeout=1 --monitor_interval 1"
  echo "round  cohort_s  torchrun_s  torchrun_tuned_s  ratio(torchrun/cohort)  ratio(tuned/cohort)"
} | tee "$results"
for ((r = 1; r <= ROUNDS; r++)); do
  c=$(round cohort fashion_mnist "$COHORT" run --nnodes 2:4 --nproc-per-node 2 --master-addr h0 --master-port 29630 \
    --run-id "cohort-$r" --max-restarts 3 --kill-grace 2 --ranks-to-console 0 \
    "$TRAIN" --model mlp --lr 0.2 --epochs 2 --checkpoint-every 25 --checkpoint-dir "{dir}/ckpt")
  t=$(round torchrun torch_elastic_train env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 /usr/bin/python3 "$TORCHRUN" \
    --nnodes 2:4 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint h0:29640 --rdzv_id "torch-$r" --max_restarts 3 \
    "$PEER" --snapshot "{dir}/snapshot.pt")
  tt=$(round torchrun_tuned torch_elastic_train env GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 /usr/bin/python3 "$TORCHRUN" \
    --nnodes 2:4 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint h0:29650 --rdzv_id "tuned-$r" --max_restarts 3 \
    --rdzv_conf last_call_timeout=1 --monitor_interval 1 "$PEER" --snapshot "{dir}/snapshot.pt")
  ratio() { awk -v c="$1" -v t="$2" 'BEGIN { if (c > 0 && t > 0) printf "%.2f", t / c; else print "n/a" }'; }
  printf "%5d  %8s  %10s  %16s  %22s  %19s\n" "$r" "$c" "$t" "$tt" "$(ratio "$c" "$t")" "$(ratio "$c" "$tt")" |
    tee -a "$results"
done
echo "written to $results"
