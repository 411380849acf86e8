#!/usr/bin/env bash
# The 2-rank DDP step of the main job (examples/fashion_mnist --model mlp), two builds against each
# other, both SGD steps (fused: DistributedSGD; torch: DDP's averaging, then torch's SGD), each round
# beside that round's 2-process ceiling (two independent 1-process runs at once, one per CPU,
# docs/performance.md). Fresh processes every round; the order of the builds alternates; every round
# is printed with the load, and the summary gives each run's share of its own round's ceiling, so that
# a loaded machine's drift between rounds cancels (issue 51).
#
#   bench/ddp_step_ab.sh BEFORE_BUILD AFTER_BUILD [out_file]     ROUNDS=3 SAMPLES=12800 MODEL=mlp
#
# SAMPLES: training images per run (--train-samples; 0 = the whole epoch of 60,000).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh  # bench_ab_builds, bench_ab_header
bench_ab_builds "$@"
ROUNDS=${ROUNDS:-3} SAMPLES=${SAMPLES:-12800} MODEL=${MODEL:-mlp}
[ -n "${3:-}" ] && exec > >(tee -a "$3") 2>&1
for b in "$BEFORE" "$AFTER"; do
  [ -x "$b/tools/cohort" ] && [ -x "$b/examples/fashion_mnist/fashion_mnist" ] ||
    { echo "$b: no tools/cohort or examples/fashion_mnist/fashion_mnist (ninja -C $b cohort fashion_mnist)" >&2; exit 2; }
done
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
out=$(mktemp)
trap 'rm -f "$out" "$out".solo*' EXIT
{
bench_ab_header "$1" "$BEFORE" "$2" "$AFTER"
echo "# model $MODEL, $SAMPLES samples per run (0: the epoch), 1 intra-op thread per rank"
ceiling() {
  local bin=$AFTER/examples/fashion_mnist/fashion_mnist c
  for c in 0 1; do  # each in a session of its own, as independent jobs (docs/launcher.md, "Supervision")
    timeout 600 setsid -w taskset -c $c "$bin" --model "$MODEL" --threads 1 --train-samples "$SAMPLES" > "$out.solo$c" 2>&1 &
  done
  wait
  echo "ceiling load=$(cut -d' ' -f1 /proc/loadavg) $(grep -h 'samples/s:' "$out".solo? | awk '{s += $2} END {print "samples/s=" s}')"
}
job() {  # build tag sgd
  local line
  line=$(timeout 600 "$1/tools/cohort" run --nproc-per-node 2 --no-tag-output "$1/examples/fashion_mnist/fashion_mnist" \
           --model "$MODEL" --threads 1 --sgd "$3" --train-samples "$SAMPLES" 2>&1 | grep -E 'samples/s:|communication wait' |
         awk '/samples\/s:/ {s = $2} /communication/ {w = $3} END {print "samples/s=" s " wait=" w}')
  echo "$2-$3 load=$(cut -d' ' -f1 /proc/loadavg) ${line:-samples/s=missing}"
}
for round in $(seq 1 "$ROUNDS"); do
  echo "## round $round"
  ceiling
  for sgd in fused torch; do
    if [ $((round % 2)) -eq 1 ]; then job "$BEFORE" before $sgd; job "$AFTER" after $sgd
    else job "$AFTER" after $sgd; job "$BEFORE" before $sgd; fi
  done
  ceiling
done
} | tee "$out"
# Per round: each job's samples/s over the mean of the round's two ceilings (before and after its jobs).
python3 - "$out" <<'PY'
import re, sys
rounds, cur = [], None
for line in open(sys.argv[1]):
    if line.startswith("## round"):
        cur = {"ceilings": []}; rounds.append(cur); continue
    m = re.match(r"(\S+) load=(\S+) samples/s=([\d.]+)", line)
    if not m or cur is None: continue
    if m.group(1) == "ceiling": cur["ceilings"].append(float(m.group(3)))
    else: cur[m.group(1)] = float(m.group(3))
keys = ["before-fused", "after-fused", "before-torch", "after-torch"]
print("# round  ceiling  " + "  ".join(f"{k}/ceiling" for k in keys) + "  after-fused/after-torch")
for i, r in enumerate(rounds, 1):
    if len(r["ceilings"]) < 2 or any(k not in r for k in keys): continue
    c = sum(r["ceilings"]) / 2
    print(f"{i:>7} {c:>8.0f}  " + "  ".join(f"{r[k] / c:>{len(k) + 8}.3f}" for k in keys) +
          f"  {r['after-fused'] / r['after-torch']:>23.3f}")
PY
