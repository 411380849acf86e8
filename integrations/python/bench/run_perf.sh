#!/bin/bash
# Side-by-side performance of the cohort torch backend against gloo, in one session, rounds
# interleaved (gloo, cohort, gloo, cohort, ...) so that machine noise hits both alike.
#   usage: integrations/python/bench/run_perf.sh [rounds=3] [build dir=build]  > perf_raw.txt
# 1. torch.distributed.all_reduce busbw, 8 B .. 256 MiB, 2 ranks (bench_allreduce.py, the peers'
#    method) under torchrun311.py;
# 2. DDP samples/s on the MLP (ddp_train.py, Fashion-MNIST, 1 epoch, 2 ranks, 1 thread each), with
#    OpenBLAS when it is installed (the configuration where communication dominates the step).
set -euo pipefail
ROUNDS=${1:-3}
BUILD=${2:-build}
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
TORCHRUN="$ROOT/bench/peers/torchrun311.py"
export PYTHONPATH="$ROOT/$BUILD/integrations/python${PYTHONPATH:+:$PYTHONPATH}"
export GLOO_SOCKET_IFNAME=lo
PY=/usr/bin/python3
OPENBLAS_DIR=/usr/lib/x86_64-linux-gnu/openblas-pthread
port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
run2() {  # script args...
  $PY "$TORCHRUN" --nproc_per_node 2 --monitor_interval 0.1 --master_addr 127.0.0.1 \
      --master_port "$(port)" "$@"
}
echo "# $(date -u +%FT%TZ) $(uname -n) rounds=$ROUNDS"
for r in $(seq 1 "$ROUNDS"); do
  for b in gloo cohort; do
    run2 "$HERE/bench_allreduce.py" --op allreduce --backend $b --tag " round=$r" | grep RESULT
  done
done
for r in $(seq 1 "$ROUNDS"); do
  for b in gloo cohort; do
    if [ -d "$OPENBLAS_DIR" ]; then
      LD_LIBRARY_PATH=$OPENBLAS_DIR OPENBLAS_NUM_THREADS=1 \
        run2 "$HERE/ddp_train.py" --model mlp --threads 1 --backend $b --tag " blas=openblas round=$r" | grep RESULT
    else
      run2 "$HERE/ddp_train.py" --model mlp --threads 1 --backend $b --tag " blas=netlib round=$r" | grep RESULT
    fi
  done
done
