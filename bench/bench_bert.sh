#!/usr/bin/env bash
# The BERT example side by side with its PyTorch twin (issue 32): interleaved rounds, fresh processes
# every round, every round printed, then the ratios of each round.
#
#   bench/bench_bert.sh [build_dir]          ROUNDS=3 STEPS=60 SIZE=mini ARGS="..." (extra flags for both)
#   MEMORY=1 bench/bench_bert.sh             instead: the optimizer state and peak RSS per rank of a ~110 M
#                                            parameter model (--size base) for DDP + Adam, ZeRO stage 1 and 2,
#                                            PyTorch DDP + Adam and PyTorch's ZeroRedundancyOptimizer
#
# Per round, in this order (1 intra-op thread per rank, batch 32 per rank, the same seed):
#   cohort  2 ranks   cohort run --nproc-per-node 2 bert              (DDP, AdamW)
#   torch   2 ranks   torchrun311.py --nproc_per_node 2 bert_twin.py  (PyTorch DDP over gloo, AdamW)
#   cohort  1 proc    bert                                            (no communication)
#   torch   1 proc    bert_twin.py
#   ceiling           two cohort 1-process runs at once, one per CPU (taskset), each in a session of its
#                     own (setsid) as two independent jobs are: the most any 2-rank job can reach on this
#                     machine, with no communication at all. (In one session they would split one
#                     session's CPU share under the kernel's autogroups while anything else runs, and
#                     cohort's ranks, each in a session of its own, could pass it: docs/launcher.md.)
# samples/s counts the timed steps only (after a barrier, to the barrier after the last step); the
# data loading and the held-out evaluation are outside it, in both programs.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-60}
SIZE=${SIZE:-mini}
PEERS=bench/peers  # relative to the repository root (this script cd-s there)
BERT=$BUILD/examples/bert/bert
COHORT=$BUILD/tools/cohort
TWIN=bench/bert_twin.py
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo
read -r -a extra <<<"${ARGS:-}"
common=(--size "$SIZE" --max-steps "$STEPS" --threads 1 "${extra[@]}")
source bench/descendants.sh
rate() { grep -o "samples/s: [0-9.]*" | awk '{print $2}'; }
port() { echo $((29800 + RANDOM % 1000)); }

# Runs "$@" in the background and samples /proc/<pid>/smaps_rollup of every worker (its descendants
# whose command line matches $pattern: bench/descendants.sh) every 0.1 s; prints each worker's peak Rss and peak Pss. Pss splits a page shared by k processes
# k ways: cohort's buckets are shared memory that the peer rank maps, so Rss counts them once per
# rank that touched them, and only the Pss of the ranks adds up to what the machine holds.
sample_memory() {  # pattern command...
  local pattern=$1 job pid rss pss
  shift
  "$@" >"$tmpout" 2>&1 &
  job=$!
  declare -A peak_rss=() peak_pss=()
  while kill -0 "$job" 2>/dev/null; do
    for pid in $(descendants_matching "$job" "$pattern"); do
      read -r rss pss < <(awk '/^Rss:/ {r = $2} /^Pss:/ {p = $2} END {print r + 0, p + 0}' \
        "/proc/$pid/smaps_rollup" 2>/dev/null) || continue
      ((rss > ${peak_rss[$pid]:-0})) && peak_rss[$pid]=$rss
      ((pss > ${peak_pss[$pid]:-0})) && peak_pss[$pid]=$pss
    done
    sleep 0.1
  done
  wait "$job"
  grep -E "parameters|optimizer state|samples/s" "$tmpout"
  for pid in "${!peak_rss[@]}"; do
    echo "sampled worker $pid: peak Rss $((peak_rss[$pid] / 1024)) MB, peak Pss $((peak_pss[$pid] / 1024)) MB"
  done | sort
}

if [[ ${MEMORY:-0} == 1 ]]; then
  # A model whose optimizer state dominates: BERT-base's encoder (109 M parameters), a few steps of
  # batch 2 so that activations stay small beside it.
  # The held-out evaluation of BERT-base on 1 CPU per rank would take minutes: 64 glosses.
  mem=(--size base --max-steps "${MEMSTEPS:-3}" --batch 2 --threads 1 --optimizer adam --test-samples 64 "${extra[@]}")
  tmpout=$(mktemp)
  trap 'rm -f "$tmpout"' EXIT
  for z in 0 1 2; do
    echo "== cohort 2 ranks, --zero $z"
    sample_memory "^$BERT " "$COHORT" run --nproc-per-node 2 "$BERT" "${mem[@]}" --zero "$z"
  done
  for z in 0 1; do
    echo "== PyTorch DDP 2 ranks, --zero $z ($([[ $z == 1 ]] && echo ZeroRedundancyOptimizer || echo Adam))"
    sample_memory "^/usr/bin/python3 -u $TWIN " /usr/bin/python3 "$PEERS/torchrun311.py" --nproc_per_node 2 \
      --master_addr 127.0.0.1 --master_port "$(port)" "$TWIN" "${mem[@]}" --zero "$z"
  done
  exit 0
fi

echo "bench_bert: $ROUNDS rounds, size $SIZE, $STEPS steps, $(getconf _NPROCESSORS_ONLN) CPUs, $(date -u +%FT%TZ)"
declare -A r
for round in $(seq 1 "$ROUNDS"); do
  r[c2]=$("$COHORT" run --nproc-per-node 2 "$BERT" "${common[@]}" 2>&1 | rate)
  echo "round $round: cohort 2 ranks ${r[c2]} samples/s"
  r[t2]=$(/usr/bin/python3 "$PEERS/torchrun311.py" --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$(port)" \
    "$TWIN" "${common[@]}" 2>&1 | rate)
  echo "round $round: torch  2 ranks ${r[t2]} samples/s (PyTorch DDP, gloo)"
  r[c1]=$("$BERT" "${common[@]}" 2>&1 | rate)
  echo "round $round: cohort 1 proc  ${r[c1]} samples/s"
  r[t1]=$(/usr/bin/python3 "$TWIN" "${common[@]}" 2>&1 | rate)
  echo "round $round: torch  1 proc  ${r[t1]} samples/s"
  tmp=$(mktemp -d)
  for c in 0 1; do setsid -w taskset -c "$c" "$BERT" "${common[@]}" >"$tmp/$c" 2>&1 & done
  wait
  r[ceil]=$(cat "$tmp/0" "$tmp/1" | rate | awk '{s += $1} END {print s}')
  rm -rf "$tmp"
  echo "round $round: ceiling       ${r[ceil]} samples/s (two 1-process runs at once)"
  awk -v c2="${r[c2]}" -v t2="${r[t2]}" -v c1="${r[c1]}" -v t1="${r[t1]}" -v ceil="${r[ceil]}" -v n="$round" 'BEGIN {
    printf "round %d ratios: cohort/torch 2 ranks %.2f, cohort 2 ranks/ceiling %.2f, cohort/torch 1 proc %.2f\n",
           n, c2 / t2, c2 / ceil, c1 / t1 }'
done
