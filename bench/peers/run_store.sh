#!/usr/bin/env bash
# torch's TCPStore at rendezvous (store_bench.py): K clients in 4 processes, REPS repetitions each.
# Each client holds two sockets: the open-files limit must allow it (store_bench.py raises its soft limit
# up to the hard one; 4096 clients need a hard limit above 17,000).
# Usage: bench/peers/run_store.sh   (KS="64 256 1024 4096", REPS=3)
set -euo pipefail
cd "$(dirname "$0")"
for k in ${KS:-64 256 1024 4096}; do /usr/bin/python3 store_bench.py "$k" 4 "${REPS:-3}"; done
