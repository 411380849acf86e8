#!/usr/bin/env bash
# What the authenticated TCP hello (src/transport/tcp/hello.h, issue 47) costs from launch to the first
# collective: `cohort run -n N examples/barrier` (communicator from the environment, one barrier, exit)
# with every pair of ranks on TCP (COHORT_TRANSPORT=tcp: on one host the ranks would otherwise meet in
# shared memory and open no TCP connection), timed whole, for two builds in interleaved rounds (A, B,
# A, B, ...), every round printed, then min / median / max per build.
#   bench/launch/tcp_hello_cost.sh BUILD_A BUILD_B [N=8] [ROUNDS=10]
# Each build's own `cohort` launches its own `examples/barrier/barrier`.
set -euo pipefail
# shellcheck source=bench/rounds_loop.sh
source "$(dirname "$(readlink -f "$0")")/../rounds_loop.sh"  # bench_summary
a=${1:?usage: tcp_hello_cost.sh BUILD_A BUILD_B [N] [ROUNDS]} b=${2:?usage}
n=${3:-8} rounds=${4:-10}
for d in "$a" "$b"; do
  [[ -x $d/tools/cohort && -x $d/examples/barrier/barrier ]] ||
    { echo "$d: tools/cohort or examples/barrier/barrier not built" >&2; exit 1; }
done
once() {  # wall seconds of one job of build $1
  local t0 t1
  t0=$(date +%s%N)
  COHORT_TRANSPORT=tcp "$1/tools/cohort" run -n "$n" "$1/examples/barrier/barrier" >/dev/null 2>&1 ||
    { echo "the job of $1 failed" >&2; exit 1; }
  t1=$(date +%s%N)
  awk -v d=$((t1 - t0)) 'BEGIN { printf "%.3f", d / 1e9 }'
}
once "$a" >/dev/null; once "$b" >/dev/null  # warm-up: page cache, ccache'd binaries
A=() B=()
echo "# $n ranks, COHORT_TRANSPORT=tcp, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# round  A_s  B_s    (A = $a, B = $b)"
for ((r = 1; r <= rounds; r++)); do
  x=$(once "$a"); y=$(once "$b")
  A+=("$x"); B+=("$y")
  echo "$r $x $y"
done
echo "A: $(bench_summary "${A[@]}")"
echo "B: $(bench_summary "${B[@]}")"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
