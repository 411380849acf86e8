#!/usr/bin/env bash
# Issue 51's swing: BERT-mini at 2 ranks, two builds and the 2-process ceiling in interleaved rounds,
# with what the kernel says each process did per step (bench/step_cpu.py: time on a CPU, time waiting
# for one, share of the wall time on a CPU), so that a slow run says why even on a loaded machine.
#
#   bench/bert_swing.sh BEFORE_BUILD AFTER_BUILD [out_file]      ROUNDS=6 STEPS=40
#
# Per round (the builds' order alternates from round to round), fresh processes each:
#   before    BEFORE/tools/cohort run -n 2 BEFORE/examples/bert/bert   (its launcher, its binding)
#   after     AFTER/tools/cohort run -n 2 AFTER/examples/bert/bert
#   ceiling   two AFTER/examples/bert/bert one-process runs at once, one per CPU (taskset), each in a
#             session of its own (setsid), as two independent jobs started from two terminals: no
#             2-rank job can pass their sum
# Each figure is taken over steps 10 to 30 (the first steps and the held-out evaluation are left out).
# The summary line of a round divides each job by the ceiling of that round, and after by before.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh  # bench_ab_builds, bench_ab_header, interleaved_rounds
bench_ab_builds "$@"
ROUNDS=${ROUNDS:-6}
STEPS=${STEPS:-40}
((STEPS > 30)) || { echo "STEPS must be above 30 (the window is steps 10 to 30)" >&2; exit 2; }
for b in "$BEFORE" "$AFTER"; do
  [[ -x $b/tools/cohort && -x $b/examples/bert/bert ]] || { echo "$b: no tools/cohort or examples/bert/bert" >&2; exit 2; }
done
[[ -n ${3:-} ]] && exec > >(tee -a "$3") 2>&1
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
args=(--max-steps "$STEPS" --test-samples 64)
probe=(python3 bench/step_cpu.py --from 10 --to 30)

job() {  # label build
  local line
  line=$("${probe[@]}" "$2/tools/cohort" run -n 2 --no-tag-output "$2/examples/bert/bert" "${args[@]}")
  echo "$line" >"$TMP/$1"
  echo "ROUND $r $1 $line"
}
ceiling() {
  local c pids=()
  for c in 0 1; do
    OMP_NUM_THREADS=1 "${probe[@]}" setsid -w taskset -c "$c" "$AFTER/examples/bert/bert" "${args[@]}" --threads 1 \
      >"$TMP/ceiling$c" &
    pids+=($!)
  done
  wait "${pids[@]}"  # these two only: a bare wait would also wait for the tee of the out_file, forever
  for c in 0 1; do echo "ROUND $r ceiling$c $(cat "$TMP/ceiling$c")"; done
}
one_round() {
  r=$1
  if ((r % 2)); then job before "$BEFORE"; job after "$AFTER"; else job after "$AFTER"; job before "$BEFORE"; fi
  ceiling
  awk -v r="$r" '$1 == "sps" {sps[FILENAME] = $2}
    END {
      n = split("before after ceiling0 ceiling1", k, " ")
      for (i = 1; i <= n; i++) { f = dir "/" k[i]; v[k[i]] = (f in sps) ? sps[f] : 0 }
      ceil = v["ceiling0"] + v["ceiling1"]
      printf "ROUND %d summary: before %.1f, after %.1f, ceiling %.1f samples/s; before/ceiling %.2f, after/ceiling %.2f, after/before %.2f\n",
             r, v["before"], v["after"], ceil, ceil ? v["before"] / ceil : 0, ceil ? v["after"] / ceil : 0,
             v["before"] ? v["after"] / v["before"] : 0 }' dir="$TMP" "$TMP/before" "$TMP/after" "$TMP/ceiling0" "$TMP/ceiling1"
}
echo "# bench/bert_swing.sh: BERT-mini, 2 ranks, $STEPS steps, $ROUNDS rounds, the kernel's autogroups" \
  "$(cat /proc/sys/kernel/sched_autogroup_enabled 2>/dev/null || echo '(unknown)')"
bench_ab_header "$1" "$BEFORE" "$2" "$AFTER"
interleaved_rounds "$ROUNDS" one_round --start-lines
