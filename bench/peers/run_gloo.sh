#!/usr/bin/env bash
# Starts N ranks of bench_gloo on this host, meeting in a fresh FileStore directory; exits non-zero when any
# rank fails. BENCH_GLOO names a compiled bench_gloo; without it, one is compiled for this run (needs
# libgloo-dev).
# Usage: bench/peers/run_gloo.sh N [ALGO [SIZES [TRIALS [MIN_TIME]]]]   (arguments after N: see bench_gloo.cc)
set -euo pipefail
cd "$(dirname "$0")"
n=${1:?usage: run_gloo.sh N [ALGO [SIZES [TRIALS [MIN_TIME]]]]}
shift
work=$(mktemp -d)  # the ranks' FileStore, and bench_gloo when compiled here
trap 'rm -rf "$work"' EXIT
bin=${BENCH_GLOO:-$work/bench_gloo}
[[ -n ${BENCH_GLOO:-} ]] || g++ -O2 -std=c++17 -o "$bin" bench_gloo.cc -lgloo -lpthread
store=$work/store
mkdir "$store"
pids=()
for ((rank = 0; rank < n; rank++)); do
  RANK=$rank SIZE=$n STORE_DIR=$store PREFIX=run "$bin" "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
