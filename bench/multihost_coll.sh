#!/usr/bin/env bash
# Issue 51 across hosts: allgather and alltoall on 4 namespace hosts x 2 ranks (tests/multihost/cluster.sh),
# every link shaped to 1 Gbit/s, side by side in interleaved rounds (fresh processes every run, every run
# printed with the load):
#   cohort   cohort run -H h0:2,h1:2,h2:2,h3:2 ... cohort bench OP        (TCP between hosts, shm within one)
#   mpi      mpirun -H ... bench_mpi OP: Open MPI's TCP BTL on the namespaces' interface, vader within a
#            host, mpi_yield_when_idle 1 (its default busy polling starves 8 ranks on 2 cores), its ssh
#            launcher through the cluster's wrapper
#   gloo     torch.distributed's gloo (bench/peers/bench_torch.py), one torchrun311.py per host
#
#   bench/multihost_coll.sh [build_dir] [out_file]          (as root: network namespaces)
#     ROUNDS=3  SIZES="1M 16M 64M"  OPS="allgather alltoall"  RATE=1gbit  PEERS_LIST="cohort mpi gloo"
#     BASE=path/to/another/cohort: also that build (peer "base", e.g. main's before a change) in the same
#     interleaved rounds, right after cohort's run
#
# Method (bench/peers/README.md, the same on every side): fp32; the size is the whole buffer of N blocks
# (allgather's output, alltoall's input); a warm-up, then 3 trials of >= 0.3 s; a trial's time per op is
# the slowest rank's; the median of the trials. busbw = algbw x (N-1)/N (nccl-tests). The links' limits
# (0.125 GB/s per host and direction, H = 4 hosts, N = 8 ranks, S the size): an alltoall must send
# 2 x (H-1)/H x S out of each host, so busbw <= 0.0729 GB/s whatever the algorithm; an allgather must bring
# (H-1)/H x S into each host (once, if the host's ranks share it), busbw <= 0.146 GB/s, and a ring over
# host-contiguous ranks passes (N-1)/N x S through each host's link, busbw <= 0.125 GB/s.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUILD=$(realpath "${1:-build}")
ROUNDS=${ROUNDS:-3}
SIZES=${SIZES:-1M 16M 64M}
OPS=${OPS:-allgather alltoall}
RATE=${RATE:-1gbit}
PEERS_LIST=${PEERS_LIST:-cohort mpi gloo}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
K=4 PER_HOST=2
N=$((K * PER_HOST))
CLUSTER=$PWD/tests/multihost/cluster.sh
PEERS=$PWD/bench/peers
TMP=$(mktemp -d)
[[ -n ${2:-} ]] && exec > >(tee -a "$2") 2>&1
# A copy, so that a rebuild while the rounds run does not mix two builds in one table.
cp "$BUILD/tools/cohort" "$TMP/cohort" || exit 1
COHORT=$TMP/cohort
if [[ -n ${BASE:-} ]]; then
  cp "$BASE" "$TMP/cohort-base" || exit 1
  [[ " $PEERS_LIST " == *" base "* ]] || PEERS_LIST=${PEERS_LIST/cohort/cohort base}
fi
mpicc -O2 -o "$TMP/bench_mpi" "$PEERS/bench_mpi.c" -lm || exit 1

# shellcheck source=bench/namespace_cluster.sh
source bench/namespace_cluster.sh
bench_cluster_up multihost_coll "$K" "$RATE" "$TMP"
hosts=$(seq 0 $((K - 1)) | sed "s/^/h/; s/\$/:$PER_HOST/" | paste -sd,)
export OMP_NUM_THREADS=1

# shellcheck source=bench/rounds_loop.sh
source bench/rounds_loop.sh
bytes_of() { numfmt --from=iec "$1"; }

# One line per measurement: ROUND <round> <op> <bytes> <peer> <time us> <busbw GB/s>
cohort_case() {  # round op size [peer name [binary]]
  local out peer=${4:-cohort} bin=${5:-$COHORT}
  out=$(timeout "$RUN_TIMEOUT" "$CLUSTER" exec "$D" 0 "$bin" run -H "$hosts" --ssh-command "$COHORT_CLUSTER_SSH" \
    --no-tag-output "$bin" bench "$2" -b "$3" -e "$3" --trials 3 --min-time 0.3 2>&1)
  awk -v r="$1" -v op="$2" -v p="$peer" '!/^#/ && NF >= 9 && $1 ~ /^[0-9]+$/ { print "ROUND", r, op, $1, p, $6, $8 }' <<<"$out"
  grep -q "^# Out of bounds values : 0 OK" <<<"$out" || { echo "# $peer bench $2 $3 failed:"; tail -5 <<<"$out" | sed 's/^/#   /'; }
}
base_case() { cohort_case "$1" "$2" "$3" base "$TMP/cohort-base"; }
result_lines() {  # round op peer: RESULT lines (bench_mpi.c, bench_torch.py) -> ROUND lines
  grep RESULT | sed -E 's/.*bytes=([0-9]+).*time_us_median=([0-9.]+).*busbw_GBps=([0-9.]+).*/\1 \2 \3/' |
    awk -v r="$1" -v op="$2" -v p="$3" '{ print "ROUND", r, op, $1, p, $2, $3 }'
}
mpi_case() {  # round op size
  local out
  out=$(timeout "$RUN_TIMEOUT" "$CLUSTER" exec "$D" 0 mpirun --allow-run-as-root --mca plm_rsh_agent "$COHORT_CLUSTER_SSH" \
    -H "$hosts" -n "$N" --mca btl_tcp_if_include "$IFACE" --mca oob_tcp_if_include "$IFACE" --mca btl tcp,self,vader \
    --mca mpi_yield_when_idle 1 "$TMP/bench_mpi" "$2" "$(bytes_of "$3")" 3 0.3 2>&1)
  result_lines "$1" "$2" mpi <<<"$out"
  grep -q RESULT <<<"$out" || { echo "# Open MPI $2 $3 failed:"; tail -5 <<<"$out" | sed 's/^/#   /'; }
}
gloo_case() {  # round op size: one torchrun per host, node 0's output has rank 0's RESULT line
  local port=$((29500 + RANDOM % 1000)) i pids=() log=$TMP/gloo
  for ((i = K - 1; i >= 0; i--)); do
    timeout "$RUN_TIMEOUT" "$CLUSTER" exec "$D" "$i" env GLOO_SOCKET_IFNAME="$IFACE" OMP_NUM_THREADS=1 \
      /usr/bin/python3 "$PEERS/torchrun311.py" --nnodes $K --node_rank "$i" --nproc_per_node $PER_HOST \
      --master_addr "$COHORT_CLUSTER_ADDR_0" --master_port "$port" "$PEERS/bench_torch.py" --op "$2" --sizes "$3" \
      --trials 3 --min-time 0.3 >"$log.$i" 2>&1 &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i"; done
  result_lines "$1" "$2" gloo <"$log.0"
  grep -q RESULT "$log.0" || { echo "# gloo $2 $3 failed:"; grep -v Warning "$log.0" | tail -5 | sed 's/^/#   /'; }
}

echo "# bench/multihost_coll.sh: $ROUNDS rounds, $K hosts x $PER_HOST ranks, links $RATE (tbf, no added delay)," \
  "sizes $SIZES, ops $OPS, $(date -u +%Y-%m-%dT%H:%MZ), git $(git rev-parse --short HEAD 2>/dev/null)," \
  "$(getconf _NPROCESSORS_ONLN) CPUs, load $(bench_load)"
one_round() {  # r: every size, op and peer, the peers one after another
  local size op peer
  for size in $SIZES; do
    for op in $OPS; do
      for peer in $PEERS_LIST; do "${peer}_case" "$1" "$op" "$size"; done
    done
  done
}
interleaved_rounds "$ROUNDS" one_round --start-lines | tee "$TMP/rounds"

python3 - "$TMP/rounds" "$PEERS_LIST" <<'PY'
import sys
peers = sys.argv[2].split()
t, bw, order = {}, {}, []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) != 7 or f[0] != "ROUND":
        continue
    _, r, op, size, peer, us, busbw = f
    key = (op, int(size))
    if key not in order:
        order.append(key)
    t.setdefault(key, {}).setdefault(peer, {})[int(r)] = float(us) / 1e3
    bw.setdefault(key, {}).setdefault(peer, {})[int(r)] = float(busbw)
others = [p for p in peers if p != "cohort"]
print("\n## Every round: time per op in ms (busbw GB/s); ratios = cohort busbw / the peer's, same round\n")
print("| op | size | round | " + " | ".join(peers) + " | " + " | ".join(f"vs {p}" for p in others) + " |")
print("|---|---|---:|" + "---:|" * (len(peers) + len(others)))
for key in order:
    rounds = sorted(set().union(*[t[key].get(p, {}).keys() for p in peers]))
    for r in rounds:
        cells = [f"{t[key][p][r]:.1f} ({bw[key][p][r]:.4f})" if r in t[key].get(p, {}) else "-" for p in peers]
        c = bw[key].get("cohort", {}).get(r)
        ratios = [f"{c / bw[key][p][r]:.2f}x" if c and r in bw[key].get(p, {}) else "-" for p in others]
        print(f"| {key[0]} | {key[1] / 2**20:g} MiB | {r} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
print("\n## cohort's slowest round against each peer's fastest (busbw)\n")
for key in order:
    c = bw[key].get("cohort", {})
    for p in others:
        m = bw[key].get(p, {})
        if c and m:
            print(f"{key[0]} {key[1] / 2**20:g} MiB vs {p}: {min(c.values()):.4f} / {max(m.values()):.4f} GB/s = "
                  f"{min(c.values()) / max(m.values()):.2f}x")
PY
