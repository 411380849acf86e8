#!/usr/bin/env bash
# Side-by-side training benchmark (docs/perf-train.md): cohort's fashion_mnist vs the PyTorch DDP peer
# (/work/shared/peers/ddp_train.py, gloo) on the same model, data and batch, 1 intra-op thread per rank.
#   scripts/bench_train.sh [model ...]      default: seed mlp; REPS=N repetitions (default 1)
# 2-rank cohort runs meet through torchrun-style variables (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT),
# exactly as under `cohort run`/torchrun, so this needs no launcher.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${COHORT_BUILD_DIR:-build}/examples/fashion_mnist/fashion_mnist
peers=${PEERS_DIR:-/work/shared/peers}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo
port=$((29800 + RANDOM % 1000))
models=("$@"); ((${#models[@]})) || models=(seed mlp)
for rep in $(seq 1 "${REPS:-1}"); do
  for m in "${models[@]}"; do
    pm=$m; [[ $m == seed ]] && pm=tiny
    echo "== rep $rep model $m: cohort 1 process"
    "$bin" --model "$m" --threads 1 | grep -E "accuracy|samples/s|communication"
    echo "== rep $rep model $m: cohort 2 ranks"
    port=$((port + 1))
    for r in 1 0; do
      RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
        "$bin" --model "$m" --threads 1 > /tmp/bench_train_rank$r.$$ 2>&1 &
    done
    wait
    grep -E "accuracy|samples/s|communication" /tmp/bench_train_rank0.$$; rm -f /tmp/bench_train_rank?.$$
    echo "== rep $rep model $m: PyTorch 1 process"
    (cd "$peers" && /usr/bin/python3 ddp_train.py --model "$pm" --loader index --threads 1 | grep RESULT)
    echo "== rep $rep model $m: PyTorch DDP 2 ranks (gloo)"
    port=$((port + 1))
    (cd "$peers" && /usr/bin/python3 torchrun311.py --nproc_per_node 2 --master_addr 127.0.0.1 --master_port $port \
        ddp_train.py --model "$pm" --loader index --threads 1 2>&1 | grep RESULT)
  done
done
