#!/usr/bin/env bash
# torch.distributed.all_reduce latency through the cohort backend, two builds against each other, each next
# to gloo in the same job: interleaved rounds, fresh processes every round, every round printed.
#
#   bench/torch_latency_ab.sh BEFORE_BUILD AFTER_BUILD [out_file]     ROUNDS=3, SIZES=4KiB,1MiB
#
# Each round runs integrations/python/bench/allreduce_latency.py under `cohort run --nproc-per-node 2` once
# per build (its own launcher and cohort_torch module; the order alternates between rounds); inside a job,
# gloo and cohort alternate per size (see that script). Lines are tagged with the build's name.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh  # bench_ab_builds, bench_ab_header
bench_ab_builds "$@"
OUT=${3:-/dev/stdout}
ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-4KiB,1MiB}
exec > >(tee -a "$OUT") 2>&1
for b in "$BEFORE" "$AFTER"; do
  [ -x "$b/tools/cohort" ] && ls "$b"/integrations/python/cohort_torch*.so >/dev/null 2>&1 ||
    { echo "$b: no tools/cohort or cohort_torch module (ninja -C $b cohort cohort_torch)" >&2; exit 2; }
done
bench_ab_header "$1" "$BEFORE" "$2" "$AFTER"
run() {  # $1 = build dir, $2 = tag
  env -u MASTER_ADDR -u MASTER_PORT -u RANK -u WORLD_SIZE PYTHONPATH="$1/integrations/python" \
    GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 timeout 300 "$1/tools/cohort" run --nproc-per-node 2 --no-tag-output \
    /usr/bin/python3 integrations/python/bench/allreduce_latency.py --sizes "$SIZES" --rounds 3 --tag "$2" |
    grep -v '^$'
}
for round in $(seq 1 "$ROUNDS"); do
  echo "## round $round (load $(cut -d' ' -f1 /proc/loadavg))"
  if [ $((round % 2)) -eq 1 ]; then run "$BEFORE" before; run "$AFTER" after
  else run "$AFTER" after; run "$BEFORE" before; fi
done
