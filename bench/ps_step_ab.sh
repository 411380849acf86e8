#!/usr/bin/env bash
# The parameter-server step (bench/ps_bench.cc), two builds against each other: interleaved rounds, fresh
# processes every round, every round printed. For a change to the table or the PS paths that must not
# change their speed (issue 49's split of ps/table.cc).
#
#   bench/ps_step_ab.sh BEFORE_BUILD AFTER_BUILD [out_file]      ROUNDS=3
#
# Each round runs each build's `cohort run --ps 1 --nproc-per-node 2 bench/ps_bench` once (the order
# alternates between rounds): 2 workers on the server's host, so they pull and push through the shared
# rows themselves (the table's read/apply), 4096 ids of dim 64 per step, rows prefilled, 300 timed steps.
# Lines are ps_bench's RESULT lines, tagged with the build's name.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh  # bench_ab_builds, bench_ab_header
bench_ab_builds "$@"
ROUNDS=${ROUNDS:-3}
[ -n "${3:-}" ] && exec > >(tee -a "$3") 2>&1
for b in "$BEFORE" "$AFTER"; do
  [ -x "$b/tools/cohort" ] && [ -x "$b/bench/ps_bench" ] ||
    { echo "$b: no tools/cohort or bench/ps_bench (ninja -C $b cohort ps_bench)" >&2; exit 2; }
done
bench_ab_header "$1" "$BEFORE" "$2" "$AFTER"
run() {  # $1 = build dir, $2 = tag
  local line
  line=$(timeout 300 "$1/tools/cohort" run --ps 1 --nproc-per-node 2 --no-tag-output "$1/bench/ps_bench" \
           --steps 300 --warmup 30 --ids 4096 --dim 64 --rows 262144 --prefill 2>&1 | grep '^RESULT')
  echo "${line:-RESULT missing} build=$2"
}
for round in $(seq 1 "$ROUNDS"); do
  echo "## round $round (load $(cut -d' ' -f1 /proc/loadavg))"
  if [ $((round % 2)) -eq 1 ]; then run "$BEFORE" before; run "$AFTER" after
  else run "$AFTER" after; run "$BEFORE" before; fi
done
