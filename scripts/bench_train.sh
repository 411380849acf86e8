#!/usr/bin/env bash
# Side-by-side training benchmark (docs/perf-train.md): cohort's fashion_mnist vs the PyTorch DDP peer
# (bench/peers/ddp_train.py, gloo) on the same model, data and batch, 1 intra-op thread per rank.
#   scripts/bench_train.sh [model ...]      default: seed mlp; REPS=N repetitions (default 1)
# The 2-rank cohort run goes through `cohort run`, as the main job does.
# BRACKET=1 runs the ceiling (two independent processes) again right after the 2-rank job, so that each
# rep's job sits between two ceilings: this guest's speed drifts over the ~20 s between a ceiling and
# the job, and the mean of the two brackets shows how much of a rep's share is that drift.
# The end prints a summary per rep (2-rank job / ceiling, and / DDP). The 2-rank job steps with
# DistributedSGD (the SGD step fused with the averaging, the example's default); each rep also runs it
# with --sgd torch (DDP's averaging, then torch's SGD step) for comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${COHORT_BUILD_DIR:-build}/examples/fashion_mnist/fashion_mnist
cohort=${COHORT_BUILD_DIR:-build}/tools/cohort
peers=${PEERS_DIR:-bench/peers}  # relative to the repository root (this script cd-s there)
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo
port=$((29800 + RANDOM % 1000))
models=("$@"); ((${#models[@]})) || models=(seed mlp)
ceiling() {  # rep model label
  echo "== rep $1 model $2: cohort 2 independent 1-process runs at once ($3)"
  for c in 0 1; do  # each in a session of its own, as independent jobs (docs/launcher.md, "Supervision")
    setsid -w taskset -c $c "$bin" --model "$2" --threads 1 > /tmp/bench_train_solo$c.$$ 2>&1 &
  done
  wait
  grep -h "samples/s" /tmp/bench_train_solo?.$$; rm -f /tmp/bench_train_solo?.$$
}
{
for rep in $(seq 1 "${REPS:-1}"); do
  for m in "${models[@]}"; do
    pm=$m; [[ $m == seed ]] && pm=tiny
    echo "== rep $rep model $m: cohort 1 process"
    "$bin" --model "$m" --threads 1 | grep -E "accuracy|samples/s|communication"
    # The machine's ceiling for any 2-rank run: two independent 1-process runs at once, one per CPU,
    # with no communication at all. Their summed samples/s is the most 2 ranks can reach here (the two
    # vCPUs share memory bandwidth and, it seems, a physical core: each runs ~25 % slower than alone).
    ceiling "$rep" "$m" "ceiling, no communication"
    echo "== rep $rep model $m: cohort 2 ranks (cohort run: the main job's way, workers bound to a CPU each)"
    "$cohort" run --nproc-per-node 2 "$bin" --model "$m" --threads 1 2>&1 | grep -E "accuracy|samples/s|communication"
    [[ ${BRACKET:-0} == 1 ]] && ceiling "$rep" "$m" "ceiling again, after the job"
    echo "== rep $rep model $m: unfused: cohort 2 ranks with --sgd torch (DDP averages during backward, then torch's SGD)"
    "$cohort" run --nproc-per-node 2 "$bin" --model "$m" --threads 1 --sgd torch 2>&1 | grep -E "accuracy|samples/s|communication"
    echo "== rep $rep model $m: PyTorch 1 process"
    (cd "$peers" && /usr/bin/python3 ddp_train.py --model "$pm" --loader index --threads 1 | grep RESULT)
    echo "== rep $rep model $m: PyTorch DDP 2 ranks (gloo)"
    port=$((port + 1))
    (cd "$peers" && /usr/bin/python3 torchrun311.py --nproc_per_node 2 --master_addr 127.0.0.1 --master_port $port \
        ddp_train.py --model "$pm" --loader index --threads 1 2>&1 | grep RESULT)
  done
done
} | tee /tmp/bench_train_out.$$
# Summary: per rep and model, the 2-rank job's samples/s over its ceiling (the two independent runs'
# sum; with BRACKET=1 also over the one after the job and over the mean of both) and over PyTorch DDP.
python3 - /tmp/bench_train_out.$$ <<'PY'
import re, sys
reps, key, part = {}, None, None
for line in open(sys.argv[1]):
    m = re.match(r"== rep (\d+) model (\S+): (.*)", line)
    if m:
        key, part = (int(m.group(1)), m.group(2)), m.group(3)
        reps.setdefault(key, {})
        continue
    if key is None:
        continue
    r = reps[key]
    if "samples/s:" in line and "ceiling again" in part:
        r["after"] = r.get("after", 0) + float(line.split("samples/s:")[1].split()[0])
    elif "samples/s:" in line and "ceiling" in part:
        r["before"] = r.get("before", 0) + float(line.split("samples/s:")[1].split()[0])
    elif "samples/s:" in line and part.startswith("cohort 2 ranks"):
        r["job"] = float(line.split("samples/s:")[1].split()[0])
    elif "samples/s:" in line and part.startswith("unfused"):
        r["unfused"] = float(line.split("samples/s:")[1].split()[0])
    elif "RESULT" in line and "DDP" in part:
        r["ddp"] = float(re.search(r"samples_per_s=([\d.]+)", line).group(1))
print("# rep model  2-rank samples/s  ceiling  job/ceiling  [ceiling after  job/after  job/mean]  DDP  job/DDP"
      "  [--sgd torch  its /ceiling]")
for (rep, model), r in sorted(reps.items()):
    if "job" not in r or "before" not in r:
        continue
    cols = [f"{rep:>3} {model:>5} {r['job']:>10.0f} {r['before']:>9.0f} {r['job'] / r['before']:>7.3f}"]
    if "after" in r:
        mean = (r["before"] + r["after"]) / 2
        cols.append(f"{r['after']:>9.0f} {r['job'] / r['after']:>7.3f} {r['job'] / mean:>7.3f}")
    if "ddp" in r:
        cols.append(f"{r['ddp']:>7.0f} {r['job'] / r['ddp']:>5.2f}")
    if "unfused" in r:
        cols.append(f"{r['unfused']:>9.0f} {r['unfused'] / r['before']:>7.3f}")
    print("  ".join(cols))
PY
rm -f /tmp/bench_train_out.$$
