#!/usr/bin/env bash
# BERT-mini at 2 ranks, plain DDP (--zero 0) and the sharded optimizer's stage 2 (--zero 2), two builds
# against each other in interleaved rounds (fresh processes, every run printed): for a change to the
# collectives the sharded optimizer's reduce-scatter and allgather run on (issue 51's re-measure).
#
#   bench/bert_zero_ab.sh BEFORE_BUILD AFTER_BUILD [out_file]      ROUNDS=4 STEPS=80
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
[[ $# -ge 2 ]] || { echo "usage: $0 BEFORE_BUILD AFTER_BUILD [out_file]" >&2; exit 2; }
BEFORE=$(realpath "$1") AFTER=$(realpath "$2")
ROUNDS=${ROUNDS:-4}
STEPS=${STEPS:-80}
for b in "$BEFORE" "$AFTER"; do
  [[ -x $b/tools/cohort && -x $b/examples/bert/bert ]] || { echo "$b: no tools/cohort or examples/bert/bert" >&2; exit 2; }
done
[[ -n ${3:-} ]] && exec > >(tee -a "$3") 2>&1
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh
cpu_file=$(mktemp)
trap 'rm -f "$cpu_file"' EXIT
one_round() {  # r: each build, DDP then stage 2
  local label dir z sps
  for label in before after; do
    dir=$BEFORE
    [[ $label == after ]] && dir=$AFTER
    for z in 0 2; do
      # CPU time and minor page faults of the launcher and both ranks (GNU time): steadier than samples/s
      # under load, and what a change to the step's memory traffic moves.
      sps=$(/usr/bin/time -o "$cpu_file" -f "cpu %U+%S s, minor faults %R" "$dir/tools/cohort" run -n 2 --no-tag-output \
        "$dir/examples/bert/bert" --zero "$z" --max-steps "$STEPS" --test-samples 64 2>&1 |
        grep -o "samples/s: [0-9.]*" | awk '{print $2}')
      echo "ROUND $1 $label zero$z ${sps:-failed} ($(tail -1 "$cpu_file"))"
    done
  done
}
echo "# bench/bert_zero_ab.sh: BERT-mini, 2 ranks, $STEPS steps, $ROUNDS rounds, $(date -u +%FT%TZ)," \
  "before $(git -C "$BEFORE/.." rev-parse --short HEAD 2>/dev/null || echo '?'), after" \
  "$(git -C "$AFTER/.." rev-parse --short HEAD 2>/dev/null || echo '?'), load $(bench_load)"
interleaved_rounds "$ROUNDS" one_round
