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
#   ceiling           two cohort 1-process runs at once, one per CPU (taskset): the most any 2-rank job can
#                     reach on this machine, with no communication at all
# samples/s counts the timed steps only (after a barrier, to the barrier after the last step); the
# data loading and the held-out evaluation are outside it, in both programs.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-60}
SIZE=${SIZE:-mini}
PEERS=../shared/peers  # relative to the repository root (this script cd-s there)
BERT=$BUILD/examples/bert/bert
COHORT=$BUILD/tools/cohort
TWIN=bench/bert_twin.py
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo
read -r -a extra <<<"${ARGS:-}"
common=(--size "$SIZE" --max-steps "$STEPS" --threads 1 "${extra[@]}")
rate() { grep -o "samples/s: [0-9.]*" | awk '{print $2}'; }
port() { echo $((29800 + RANDOM % 1000)); }

if [[ ${MEMORY:-0} == 1 ]]; then
  # A model whose optimizer state dominates: BERT-base's encoder (109 M parameters), a few steps of
  # batch 2 so that activations stay small beside it.
  # The held-out evaluation of BERT-base on 1 CPU per rank would take minutes: 64 glosses.
  mem=(--size base --max-steps "${MEMSTEPS:-3}" --batch 2 --threads 1 --optimizer adam --test-samples 64 "${extra[@]}")
  for z in 0 1 2; do
    echo "== cohort 2 ranks, --zero $z"
    "$COHORT" run --nproc-per-node 2 "$BERT" "${mem[@]}" --zero "$z" 2>&1 | grep -E "parameters|optimizer state|samples/s"
  done
  for z in 0 1; do
    echo "== PyTorch DDP 2 ranks, --zero $z ($([[ $z == 1 ]] && echo ZeroRedundancyOptimizer || echo Adam))"
    /usr/bin/python3 "$PEERS/torchrun311.py" --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$(port)" \
      "$TWIN" "${mem[@]}" --zero "$z" 2>&1 | grep -E "parameters|optimizer state|samples/s"
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
  for c in 0 1; do taskset -c "$c" "$BERT" "${common[@]}" >"$tmp/$c" 2>&1 & done
  wait
  r[ceil]=$(cat "$tmp/0" "$tmp/1" | rate | awk '{s += $1} END {print s}')
  rm -rf "$tmp"
  echo "round $round: ceiling       ${r[ceil]} samples/s (two 1-process runs at once)"
  awk -v c2="${r[c2]}" -v t2="${r[t2]}" -v c1="${r[c1]}" -v t1="${r[t1]}" -v ceil="${r[ceil]}" -v n="$round" 'BEGIN {
    printf "round %d ratios: cohort/torch 2 ranks %.2f, cohort 2 ranks/ceiling %.2f, cohort/torch 1 proc %.2f\n",
           n, c2 / t2, c2 / ceil, c1 / t1 }'
done
