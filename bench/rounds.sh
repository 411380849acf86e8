#!/usr/bin/env bash
# Issue 22's side-by-side in one command: interleaved rounds, fresh processes every round, every round
# printed (users feel the slowest run, not the median), then the goals checked on all of them.
#
#   bench/rounds.sh [build_dir] [out_file]        ROUNDS=10 (default), about 6 minutes with 10 rounds
#
# Per round, in this order:
#   shm 64 MiB  cohort run -n 2 cohort bench allreduce -b 64M -e 64M      Open MPI default (vader)
#   shm 8 B     the same with -b 8 -e 8                                    Open MPI, 8 B
#   tcp 64 MiB  COHORT_TRANSPORT=tcp cohort ...                            Open MPI btl tcp,self; torch gloo
#   BIG=1 adds shm 1 GiB, a working set (2 ranks x 1 GiB in place) larger than this guest's L3.
#   LOAD=N runs N busy loops (nice 0) for the whole run: a loaded moment, made the same for every peer
#   (a compiler or a data loader next to the job; issue 22's slow rounds came from such moments).
# Method as bench/side_by_side.sh and bench/peers/README.md: 2 ranks, fp32 sum, in place, 3 trials of
# >= 0.3 s each, time = max over ranks, median of the trials; busbw as nccl-tests (2(n-1)/n x algbw = algbw
# for 2 ranks). Each cohort shm round also prints the link its communicator measured at start (the CPUs
# of the two ranks, round trip, cache-to-cache against own-cache copy: docs/perf-shm.md, "The link probe").
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
OUT=${2:-/dev/stdout}
ROUNDS=${ROUNDS:-10}
BIG=${BIG:-0}
PEERS=$(realpath bench/peers)
COHORT=$BUILD/tools/cohort
TMP=$(mktemp -d)
LOAD=${LOAD:-0}
LOADERS=()
trap 'kill "${LOADERS[@]}" 2>/dev/null; rm -rf "$TMP"' EXIT
exec > >(tee -a "$OUT") 2>&1

MPIRUN="mpirun --allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo"
MPI_TCP="--mca pml ob1 --mca btl tcp,self --mca btl_tcp_disable_family 6"
export GLOO_SOCKET_IFNAME=lo
mpicc -O2 -o "$TMP/bench_mpi" "$PEERS/bench_mpi.c" -lm
cp "$PEERS/torchrun311.py" "$PEERS/bench_torch.py" "$TMP/"
# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh

# Each measurement prints one line "ROUND <round> <case> <peer> <busbw GB/s> <time us>".
cohort_round() {  # round case transport bytes
  local out
  out=$(COHORT_TRANSPORT=$3 "$COHORT" run -n 2 --no-tag-output "$COHORT" bench allreduce -b "$4" -e "$4" \
    --trials 3 --min-time 0.3 2>&1)
  grep "^# link:" <<<"$out" | sed "s/^# link:/LINK $1 $2:/"
  awk -v r="$1" -v c="$2" '!/^#/ && NF >= 9 && $1 ~ /^[0-9]+$/ { print "ROUND", r, c, "cohort", $8, $6 }' <<<"$out"
}
mpi_round() {  # round case bytes [tcp]
  local extra="" peer=mpi
  [[ ${4:-} == tcp ]] && { extra=$MPI_TCP; peer=mpi-tcp; }
  # shellcheck disable=SC2086
  $MPIRUN $extra -n 2 "$TMP/bench_mpi" allreduce "$3" 3 0.3 2>&1 | grep RESULT |
    sed -E 's/.*time_us_median=([0-9.]+).*busbw_GBps=([0-9.]+).*/\2 \1/' |
    awk -v r="$1" -v c="$2" -v p="$peer" '{ print "ROUND", r, c, p, $1, $2 }'
}
gloo_round() {  # round case bytes
  /usr/bin/python3 "$TMP/torchrun311.py" --nproc_per_node 2 --master_addr 127.0.0.1 \
    --master_port $((29800 + RANDOM % 100)) "$TMP/bench_torch.py" --op allreduce --sizes "$3" --trials 3 \
    --min-time 0.3 2>&1 | grep RESULT |
    sed -E 's/.*time_us_median=([0-9.]+).*busbw_GBps=([0-9.]+).*/\2 \1/' |
    awk -v r="$1" -v c="$2" '{ print "ROUND", r, c, "gloo", $1, $2 }'
}

for ((i = 0; i < LOAD; i++)); do
  bash -c 'while :; do :; done' &
  LOADERS+=($!)
done
echo "# bench/rounds.sh: $ROUNDS rounds, LOAD=$LOAD busy loops, $(date -u +%Y-%m-%dT%H:%MZ), git $(git rev-parse --short HEAD 2>/dev/null)," \
  "load $(bench_load), L3 $(lscpu | sed -n 's/^L3 cache: *//p')"
one_round() {  # round: every case, each peer in turn
  cohort_round "$1" shm-64M auto 64M
  mpi_round "$1" shm-64M 67108864
  cohort_round "$1" shm-8B auto 8
  mpi_round "$1" shm-8B 8
  cohort_round "$1" tcp-64M tcp 64M
  mpi_round "$1" tcp-64M 67108864 tcp
  gloo_round "$1" tcp-64M 67108864
  if [[ $BIG == 1 ]]; then
    cohort_round "$1" shm-1G auto 1G
    mpi_round "$1" shm-1G 1073741824
  fi
}
interleaved_rounds "$ROUNDS" one_round | tee "$TMP/rounds"

# Every round side by side, then the goals of issue 22 on the slowest and fastest rounds. 8 B compares
# times (busbw at 8 B has too few digits); everything else busbw.
python3 - "$TMP/rounds" <<'PY'
import statistics, sys
busbw, time_us, order = {}, {}, []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) != 6 or f[0] != "ROUND":
        continue
    _, r, case, peer, bw, t = f
    if case not in order:
        order.append(case)
    busbw.setdefault(case, {}).setdefault(peer, {})[int(r)] = float(bw)
    time_us.setdefault(case, {}).setdefault(peer, {})[int(r)] = float(t)
summary = {}
for case in order:
    small = case.endswith("8B")
    table = time_us[case] if small else busbw[case]
    unit = "time per allreduce, us (lower is better)" if small else "busbw, GB/s"
    peers = list(table)
    rounds = sorted({r for p in peers for r in table[p]})
    print(f"\n## {case}: {unit}\n")
    print("| round | " + " | ".join(peers) + " |")
    print("|---|" + "---:|" * len(peers))
    for r in rounds:
        print(f"| {r} | " + " | ".join(f"{table[p][r]:g}" if r in table[p] else "-" for p in peers) + " |")
    for p in peers:
        v = sorted(table[p].values())
        summary[case, p] = (v[0], statistics.median(v), v[-1])
        print(f"{case} {p}: lowest {v[0]:g}, median {statistics.median(v):g}, highest {v[-1]:g} ({len(v)} rounds)")
print()
def goal(text, value, need):
    print(f"goal {text} = {value:.2f} (need >= {need}): {'met' if value >= need else 'NOT met'}")
if ("shm-64M", "cohort") in summary and ("shm-64M", "mpi") in summary:
    goal("shm 64 MiB, cohort slowest / Open MPI fastest", summary["shm-64M", "cohort"][0] / summary["shm-64M", "mpi"][2], 1.5)
if ("tcp-64M", "cohort") in summary and ("tcp-64M", "mpi-tcp") in summary:
    goal("tcp 64 MiB, cohort slowest / Open MPI TCP fastest", summary["tcp-64M", "cohort"][0] / summary["tcp-64M", "mpi-tcp"][2], 1.3)
if ("tcp-64M", "cohort") in summary and ("tcp-64M", "gloo") in summary:
    goal("tcp 64 MiB, cohort slowest / gloo fastest", summary["tcp-64M", "cohort"][0] / summary["tcp-64M", "gloo"][2], 1.5)
if ("shm-8B", "cohort") in summary and ("shm-8B", "mpi") in summary:
    goal("shm 8 B, Open MPI median time / cohort median time", summary["shm-8B", "mpi"][1] / summary["shm-8B", "cohort"][1], 1)
if ("shm-1G", "cohort") in summary and ("shm-1G", "mpi") in summary:
    print(f"(no goal) shm 1 GiB, cohort slowest / Open MPI fastest = {summary['shm-1G', 'cohort'][0] / summary['shm-1G', 'mpi'][2]:.2f}")
PY
