#!/usr/bin/env bash
# ResNet-18 side by side (docs/performance.md, "Data-parallel training"; bench/results/performance-diary-2026-11.md, "ResNet-18 on Fashion-MNIST 32x32"): examples/resnet
# against its PyTorch twin bench/resnet_twin.py on the same model, data, batch, seed and optimizer,
# 1 intra-op thread per rank, STEPS steps per rank (--max-steps). Each round runs, one after the other:
#   cohort 1 process; PyTorch 1 process; the ceiling (two independent cohort 1-process runs at once,
#   one per CPU, no communication: the most any 2-rank job can reach here); cohort 2 ranks through
#   `cohort run --nproc-per-node 2` (workers bound to a CPU each); PyTorch DDP 2 ranks (gloo, through
#   bench/peers/torchrun311.py: Debian's own torchrun dies before starting a worker).
# Rounds are interleaved so that drift in the guest's speed lands on every row alike; every round is
# printed, then a table of every round's figures and ratios.
#   bench/bench_resnet.sh            ROUNDS=3 STEPS=20 WIDTH=64 BATCH=32; further arguments go to both programs
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${COHORT_BUILD_DIR:-build}/examples/resnet/resnet
cohort=${COHORT_BUILD_DIR:-build}/tools/cohort
peers=${PEERS_DIR:-bench/peers}  # relative to the repository root (this script cd-s there)
for f in "$bin" "$cohort" "$peers/torchrun311.py"; do
  [[ -e $f ]] || { echo "bench_resnet.sh: $f is missing (build resnet and cohort; PEERS_DIR= for torchrun311.py)" >&2; exit 2; }
done
rounds=${ROUNDS:-3} steps=${STEPS:-20} width=${WIDTH:-64} batch=${BATCH:-32}
# Enough images for STEPS steps of 2 ranks in one epoch; only 100 test images (evaluation is not timed).
common=(--width "$width" --batch "$batch" --max-steps "$steps" --train-samples $((steps * batch * 2))
        --test-samples 100 --threads 1 "$@")
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo
port=$((29800 + RANDOM % 1000))
out=$(mktemp /tmp/bench_resnet.XXXXXX)
trap 'rm -f "$out" "$out".solo?' EXIT
# Every run gets a deadline: a hung rank must not hold the benchmark (ResNet-18 at 1 thread: ~1 s a step).
limit=$((60 + steps * 30))
{
echo "# $(date -u +%FT%TZ) git $(git rev-parse --short HEAD 2>/dev/null) rounds $rounds steps $steps width $width batch $batch; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq 1 "$rounds"); do
  # Whether anything else is compiling: this guest's 2 CPUs are shared with whoever builds.
  echo "# round $round at $(date -u +%TZ): load $(cut -d' ' -f1-3 /proc/loadavg); compilers running: $(ps -eo comm= | grep -cxE 'cc1plus|cc1|ld|collect2')"
  echo "== round $round: cohort 1 process"
  timeout "$limit" "$bin" "${common[@]}" 2>&1 | grep -E "samples/s|accuracy"
  echo "== round $round: PyTorch 1 process"
  timeout "$limit" /usr/bin/python3 bench/resnet_twin.py "${common[@]}" 2>&1 | grep -E "samples/s|accuracy"
  echo "== round $round: ceiling: cohort 2 independent 1-process runs at once"
  for c in 0 1; do  # each in a session of its own, as independent jobs (docs/launcher.md, "Supervision")
    timeout "$limit" setsid -w taskset -c $c "$bin" "${common[@]}" > "$out.solo$c" 2>&1 &
  done
  wait
  grep -h "samples/s" "$out.solo0" "$out.solo1"
  echo "== round $round: cohort 2 ranks (cohort run --nproc-per-node 2)"
  timeout "$limit" "$cohort" run --nproc-per-node 2 "$bin" "${common[@]}" 2>&1 | grep -E "samples/s|accuracy|communication"
  echo "== round $round: PyTorch DDP 2 ranks (gloo)"
  port=$((port + 1))
  timeout "$limit" /usr/bin/python3 "$peers/torchrun311.py" --nproc_per_node 2 --master_addr 127.0.0.1 \
      --master_port $port bench/resnet_twin.py "${common[@]}" 2>&1 | grep -E "samples/s|accuracy"
done
echo "# end $(date -u +%FT%TZ); load: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out"
python3 - "$out" <<'PY'
import re, sys
rounds, key = {}, None
for line in open(sys.argv[1]):
    m = re.match(r"== round (\d+): (\S+ \S+ \S+)", line)
    if m:
        rnd, key = int(m.group(1)), m.group(2)
        rounds.setdefault(rnd, {})
        continue
    m = re.search(r"samples/s: ([\d.]+)", line)
    if m and key:
        r = rounds[rnd]
        r[key] = r.get(key, 0.0) + float(m.group(1))  # the ceiling's two runs add up
names = [("cohort 1 process", "C++ 1p"), ("PyTorch 1 process", "Py 1p"), ("ceiling: cohort 2", "ceiling"),
         ("cohort 2 ranks", "cohort 2r"), ("PyTorch DDP 2", "DDP 2r")]
print("# samples/s per round, and ratios")
print("round " + " ".join(f"{short:>9}" for _, short in names) + "  C++/Py(1p)  cohort/DDP(2r)  cohort/ceiling  cohort2r/1p")
for rnd in sorted(rounds):
    r = rounds[rnd]
    v = [r.get(k) for k, _ in names]
    if None in v:
        print(f"{rnd:>5} incomplete: {r}")
        continue
    c1, p1, ceil, c2, d2 = v
    print(f"{rnd:>5} " + " ".join(f"{x:>9.1f}" for x in v) +
          f"  {c1 / p1:>10.3f}  {c2 / d2:>14.3f}  {c2 / ceil:>14.3f}  {c2 / c1:>11.3f}")
PY
