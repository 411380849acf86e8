#!/usr/bin/env bash
# Side-by-side training benchmark (docs/perf-train.md): cohort's fashion_mnist vs the PyTorch DDP peer
# (../shared/peers/ddp_train.py, gloo) on the same model, data and batch, 1 intra-op thread per rank.
#   scripts/bench_train.sh [model ...]      default: seed mlp; REPS=N repetitions (default 1)
# The 2-rank cohort run goes through `cohort run`, as the main job does.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${COHORT_BUILD_DIR:-build}/examples/fashion_mnist/fashion_mnist
cohort=${COHORT_BUILD_DIR:-build}/tools/cohort
peers=${PEERS_DIR:-../shared/peers}  # relative to the repository root (this script cd-s there)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo
port=$((29800 + RANDOM % 1000))
models=("$@"); ((${#models[@]})) || models=(seed mlp)
for rep in $(seq 1 "${REPS:-1}"); do
  for m in "${models[@]}"; do
    pm=$m; [[ $m == seed ]] && pm=tiny
    echo "== rep $rep model $m: cohort 1 process"
    "$bin" --model "$m" --threads 1 | grep -E "accuracy|samples/s|communication"
    # The machine's ceiling for any 2-rank run: two independent 1-process runs at once, one per CPU,
    # with no communication at all. Their summed samples/s is the most 2 ranks can reach here (the two
    # vCPUs share memory bandwidth and, it seems, a physical core: each runs ~25 % slower than alone).
    echo "== rep $rep model $m: cohort 2 independent 1-process runs at once (ceiling, no communication)"
    for c in 0 1; do
      taskset -c $c "$bin" --model "$m" --threads 1 > /tmp/bench_train_solo$c.$$ 2>&1 &
    done
    wait
    grep -h "samples/s" /tmp/bench_train_solo?.$$; rm -f /tmp/bench_train_solo?.$$
    echo "== rep $rep model $m: cohort 2 ranks (cohort run: the main job's way, workers bound to a CPU each)"
    "$cohort" run --nproc-per-node 2 "$bin" --model "$m" --threads 1 2>&1 | grep -E "accuracy|samples/s|communication"
    echo "== rep $rep model $m: PyTorch 1 process"
    (cd "$peers" && /usr/bin/python3 ddp_train.py --model "$pm" --loader index --threads 1 | grep RESULT)
    echo "== rep $rep model $m: PyTorch DDP 2 ranks (gloo)"
    port=$((port + 1))
    (cd "$peers" && /usr/bin/python3 torchrun311.py --nproc_per_node 2 --master_addr 127.0.0.1 --master_port $port \
        ddp_train.py --model "$pm" --loader index --threads 1 2>&1 | grep RESULT)
  done
done
