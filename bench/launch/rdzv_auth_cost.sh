#!/usr/bin/env bash
# What the job token costs a per-node job's rendezvous (issue 47): N one-rank nodes, each its own
# `cohort run --nnodes N --node-rank I --nproc-per-node 1` on its own namespace host (tests/multihost/
# cluster.sh: own network namespace, address and hostname; the ranks meet over TCP as on real nodes),
# each running examples/barrier (communicator from the environment, one barrier, exit). Timed from the
# start of the N launchers to the end of the last, with a --token-file (store handshake with HMAC, every
# TCP connection through the authenticated hello) and without (open: the same exchanges keyed with the
# empty string), in interleaved rounds, every round printed, then min / median / max of each.
#   tests/multihost/cluster.sh run -k N -- bench/launch/rdzv_auth_cost.sh [ROUNDS=8] [BUILD=build]
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
source "$here/../../tests/multihost/lib.sh"
# shellcheck source=bench/rounds_loop.sh
source "$here/../rounds_loop.sh"  # bench_summary
rounds=${1:-8} build=$(readlink -f "${2:-$here/../../build}")
n=$COHORT_CLUSTER_K
cohort=$build/tools/cohort barrier=$build/examples/barrier/barrier
[[ -x $cohort && -x $barrier ]] || { echo "$build: tools/cohort or examples/barrier/barrier not built" >&2; exit 1; }
# Static neighbour entries on every host: 64 hosts that all open their first connections at once send
# thousands of ARP requests over one bridge, and the kernel gave up on some ("No route to host").
for ((i = 0; i < n; i++)); do mac[$i]=$(ip -n "$(ns "$i")" -br link show eth0 | awk '{print $3}'); done
for ((i = 0; i < n; i++)); do
  for ((j = 0; j < n; j++)); do ((i == j)) || echo "neigh replace $(addr "$j") lladdr ${mac[$j]} dev eth0 nud permanent"; done |
    ip -n "$(ns "$i")" -batch -
done
(umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$MH_TMP/token")
port=29600
once() {  # MODE (token|open): wall seconds of one job of N nodes
  local mode=$1 i pids=() t0 t1 args=()
  [[ $mode == token ]] && args=(--token-file "$MH_TMP/token")
  port=$((port + 1))
  t0=$(date +%s%N)
  for ((i = 0; i < n; i++)); do
    # Node 0's launcher hosts the store: on real nodes it has cores of its own, here it shares two with
    # 127 other processes, and at normal priority its store missed its replies' 1 s grace (the job ended
    # "lost the job's store"). It runs at nice -10 (its one worker too); everything else at 0.
    local prio=0; ((i == 0)) && prio=-10
    on_host "$i" nice -n "$prio" env -u COHORT_JOB_TOKEN timeout -k 5 120 "$cohort" run --nnodes "$n" --node-rank "$i" \
      --nproc-per-node 1 --master-addr h0 --master-port "$port" "${args[@]}" "$barrier" \
      >"$MH_TMP/$mode.$i.out" 2>&1 &
    pids+=($!)
  done
  local failed=0
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed=$((failed + 1)); done
  t1=$(date +%s%N)
  ((failed == 0)) || { echo "$mode round: $failed node(s) failed; node 0 said: $(tail -3 "$MH_TMP/$mode.0.out")" >&2; exit 1; }
  awk -v d=$((t1 - t0)) 'BEGIN { printf "%.3f", d / 1e9 }'
}
once open >/dev/null; once token >/dev/null  # warm-up: page cache
grep -q "this job is open" "$MH_TMP/open.0.out" || { echo "the open round did not run open" >&2; exit 1; }
! grep -q "this job is open" "$MH_TMP"/token.*.out || { echo "the token round ran open" >&2; exit 1; }
O=() T=()
echo "# $n nodes x 1 rank, namespace hosts, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# round  open_s  token_s"
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then x=$(once open); y=$(once token); else y=$(once token); x=$(once open); fi
  O+=("$x"); T+=("$y")
  echo "$r $x $y"
done
echo "open:  $(bench_summary "${O[@]}")"
echo "token: $(bench_summary "${T[@]}")"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
