#!/usr/bin/env bash
# The PyTorch training peer (ddp_train.py, 1 epoch of Fashion-MNIST): one process without DDP, and 2 ranks of
# DDP over gloo under torchrun, for the models and loaders in CONFIGS, REPS interleaved repetitions.
# BLAS: "netlib" is what Debian's torch uses as installed (the reference BLAS); "openblas" loads OpenBLAS
# instead for these processes only (LD_LIBRARY_PATH, apt-get install libopenblas0-pthread), and is skipped
# when it is not installed. One process runs with 1 thread (and 2 with OpenBLAS); DDP ranks with 1 each.
# Prints ddp_train.py's RESULT lines with blas= and rep= added; feed them to agg_ddp.py for a table.
# Usage: bench/peers/run_ddp.sh   (REPS=3, CONFIGS="tiny:dataloader tiny:index mlp:dataloader",
#                                  EXTRA="--limit 3200" for a quick check)
set -euo pipefail
cd "$(dirname "$0")"
export GLOO_SOCKET_IFNAME=lo
openblas=/usr/lib/x86_64-linux-gnu/openblas-pthread
blases=(netlib)
[[ -e $openblas/libblas.so.3 ]] && blases+=(openblas)
port=$((29700 + RANDOM % 200))
with_blas() {  # BLAS THREADS COMMAND...: runs COMMAND with that BLAS
  local blas=$1 threads=$2
  shift 2
  if [[ $blas == openblas ]]; then
    LD_LIBRARY_PATH=$openblas OPENBLAS_NUM_THREADS=$threads "$@"
  else
    "$@"
  fi
}
for ((rep = 1; rep <= ${REPS:-3}; rep++)); do
  for blas in "${blases[@]}"; do
    for config in ${CONFIGS:-tiny:dataloader tiny:index mlp:dataloader}; do
      model=${config%:*} loader=${config#*:}
      threads=(1)
      [[ $blas == openblas ]] && threads+=(2)
      for t in "${threads[@]}"; do
        with_blas "$blas" "$t" /usr/bin/python3 ddp_train.py --model "$model" --loader "$loader" --threads "$t" \
          ${EXTRA:-} --tag " blas=$blas rep=$rep" | grep RESULT
      done
      port=$((port + 1))
      with_blas "$blas" 1 /usr/bin/python3 torchrun311.py --nproc_per_node 2 --master_addr 127.0.0.1 \
        --master_port "$port" ddp_train.py --model "$model" --loader "$loader" --threads 1 ${EXTRA:-} \
        --tag " blas=$blas rep=$rep" 2>&1 | grep RESULT
    done
  done
done
