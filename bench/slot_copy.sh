#!/usr/bin/env bash
# The copy into shm::Group's staging slots, measured (docs/algorithms-shm.md, "Which copy the slots get"):
# interleaved rounds, fresh processes every run, 2-rank allreduce busbw with COHORT_SHM_COPY=cached,
# streaming and auto (the probe's choice), at each size; every run printed, then min-max per case.
# CHUNKS="256K 4M" adds runs of the cached copy at those COHORT_SHM_SLOT_BYTES (the chunk); COPIES="cached"
# keeps only those copies of the three.
#
#   bench/slot_copy.sh [build_dir] [out_file]          ROUNDS=5 (default), SIZES="1M 64M 1G"
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
OUT=${2:-/dev/stdout}
ROUNDS=${ROUNDS:-5}
SIZES=${SIZES:-1M 64M 1G}
CHUNKS=${CHUNKS:-}
COPIES=${COPIES:-cached streaming auto}
COHORT=$BUILD/tools/cohort
exec > >(tee -a "$OUT") 2>&1
echo "# bench/slot_copy.sh $(date -u +%FT%TZ) git $(git rev-parse --short HEAD 2>/dev/null) ROUNDS=$ROUNDS SIZES='$SIZES' COPIES='$COPIES' CHUNKS='$CHUNKS'"

run() {  # round size label env...
  local round=$1 size=$2 label=$3
  shift 3
  local out
  out=$(env "$@" "$COHORT" run -n 2 "$COHORT" bench allreduce -b "$size" -e "$size" 2>&1)
  local bw link
  bw=$(sed -n 's/.*Avg bus bandwidth *: *//p' <<<"$out")
  link=$(sed -n 's/.*# link: .*slots: \([a-z]*\).*/\1/p' <<<"$out" | head -1)
  echo "ROUND $round $size $label ${bw:-FAILED} (slots: ${link:-?})"
}

for round in $(seq 1 "$ROUNDS"); do
  for size in $SIZES; do
    for copy in $COPIES; do run "$round" "$size" "$copy" COHORT_SHM_COPY=$copy; done
    for chunk in $CHUNKS; do run "$round" "$size" "cached-chunk-$chunk" COHORT_SHM_COPY=cached COHORT_SHM_SLOT_BYTES=$chunk; done
  done
done | tee /dev/stderr | python3 -c '
import sys, collections
runs = collections.OrderedDict()
for line in sys.stdin:
    f = line.split()
    if len(f) >= 5 and f[0] == "ROUND" and f[4] != "FAILED":
        runs.setdefault((f[2], f[3]), []).append(float(f[4]))
print("# size  case  busbw GB/s min-max (every round above)")
for (size, case), v in runs.items():
    print(f"{size:>5} {case:>22} {min(v):6.2f} - {max(v):6.2f}  over {len(v)} rounds")
' 2>&1
