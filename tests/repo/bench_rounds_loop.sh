#!/usr/bin/env bash
# The benchmarks' interleaved rounds have one home, bench/rounds_loop.sh (docs/performance.md,
# "Reproducing"):
#  - interleaved_rounds runs each round's cases in order, framed by the lines the scripts' results and
#    docs/performance.md quote ("# round R start, load L1 L2 L3", "# round R done, load L1 L2 L3");
#  - no other bench/ script writes a round's framing line itself (a loop of its own).
#   tests/repo/bench_rounds_loop.sh SOURCE_DIR
set -euo pipefail
src=$(cd "$1" && pwd)
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# shellcheck source=bench/rounds_loop.sh
source "$src/bench/rounds_loop.sh"
cases() { echo "case A round $1"; echo "case B round $1"; }
load='[0-9]+\.[0-9]+ [0-9]+\.[0-9]+ [0-9]+\.[0-9]+'

expect() {  # name output regex-lines...
  local name=$1 out=$2; shift 2
  mapfile -t got <<<"$out"
  if [[ ${#got[@]} -ne $# ]]; then
    fail "$name: ${#got[@]} lines, expected $#: $out"
    return
  fi
  local i=0 want
  for want in "$@"; do
    [[ ${got[$i]} =~ ^${want}$ ]] || fail "$name: line $((i + 1)) is '${got[$i]}', expected /^${want}\$/"
    i=$((i + 1))
  done
}
expect "with --start-lines" "$(interleaved_rounds 2 cases --start-lines)" \
  "# round 1 start, load $load" "case A round 1" "case B round 1" "# round 1 done, load $load" \
  "# round 2 start, load $load" "case A round 2" "case B round 2" "# round 2 done, load $load"
expect "without" "$(interleaved_rounds 2 cases)" \
  "case A round 1" "case B round 1" "# round 1 done, load $load" \
  "case A round 2" "case B round 2" "# round 2 done, load $load"
[[ $(interleaved_rounds 0 cases) == "" ]] || fail "0 rounds printed something"
# The header of the two-builds comparisons (bench/*_ab.sh): this checkout's commit for a build folder
# in it, "commit unknown" for one outside any checkout.
mapfile -t header < <(bench_ab_header build-a "$src/bench" elsewhere /)
[[ ${#header[@]} == 3 && ${header[0]} =~ ^#\ [0-9T:-]+Z\ .*,\ [0-9]+\ CPUs,\ load:\ $load$ ]] ||
  fail "bench_ab_header's first line: ${header[0]:-}"
[[ ${header[1]:-} == "# before: build-a ($(git -C "$src" rev-parse --short HEAD))" ]] ||
  fail "bench_ab_header's before line: ${header[1]:-}"
[[ ${header[2]:-} == "# after:  elsewhere (commit unknown)" ]] || fail "bench_ab_header's after line: ${header[2]:-}"
# The per-case summary the A/B scripts print (bench/launch/*_cost.sh).
[[ $(bench_summary 3 1 2) == "min 1.000 median 2.000 max 3.000" ]] || fail "bench_summary 3 1 2: $(bench_summary 3 1 2)"
[[ $(bench_summary 0.4 0.1 0.2 0.3) == "min 0.100 median 0.250 max 0.400" ]] ||
  fail "bench_summary 0.4 0.1 0.2 0.3: $(bench_summary 0.4 0.1 0.2 0.3)"

# One loop: a script that frames its own rounds has a loop beside the shared one.
while IFS= read -r f; do
  [[ $f == */rounds_loop.sh ]] && continue
  fail "$f:$(grep -n '# round \$[a-z]* \(start\|done\)' "$f" | head -1 | cut -d: -f1): frames its own rounds; use interleaved_rounds (bench/rounds_loop.sh)"
done < <(grep -l '# round \$[a-z]* \(start\|done\)' "$src"/bench/*.sh "$src"/bench/*/*.sh 2>/dev/null || true)

if ((failures > 0)); then exit 1; fi
echo "ok: interleaved_rounds frames its rounds as the results quote them, and is the only round loop in bench/"
