# Helpers for tests/multihost/test_*.sh; sourced by each test, which runs inside `cluster.sh run`
# (so COHORT_CLUSTER_* describe the cluster; see cluster.sh).
set -euo pipefail
MH_DIR=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
COHORT=${COHORT_TOOL:-$MH_DIR/../../build/tools/cohort}
[[ -x $COHORT ]] || { echo "FAIL: cohort tool not found at $COHORT (set COHORT_TOOL)" >&2; exit 1; }
MH_FAILS=0
MH_TMP=$(mktemp -d "${TMPDIR:-/tmp}/cohort-mh-test.XXXXXX")
trap 'rm -rf "$MH_TMP"' EXIT

addr() { local v="COHORT_CLUSTER_ADDR_$1"; echo "${!v}"; }
ns() { local v="COHORT_CLUSTER_NS_$1"; echo "${!v}"; }
# Runs a command inside host $1's namespace.
on_host() { local i=$1; shift; ip netns exec "$(ns "$i")" nsenter --uts --mount --wd="$PWD" -t "$(cat "$COHORT_CLUSTER_DIR/sshd.$i.pid")" "$@"; }
cluster() { "$MH_DIR/cluster.sh" "$@"; }
# cut_pair I J / heal_pair I J: the path between hosts I and J only (cluster.sh cut-pair).
cut_pair() { cluster cut-pair "$COHORT_CLUSTER_DIR" "$1" "$2"; }
heal_pair() { cluster heal-pair "$COHORT_CLUSTER_DIR" "$1" "$2"; }

fail() { echo "FAIL: $*" >&2; MH_FAILS=$((MH_FAILS + 1)); }
pass() { echo "ok: $*"; }
# expect_contains NAME HAYSTACK NEEDLE
expect_contains() {
  if [[ $2 == *"$3"* ]]; then pass "$1"; else fail "$1: expected to find '$3' in:"; echo "$2" | sed 's/^/    | /' >&2; fi
}
expect_not_contains() {
  if [[ $2 != *"$3"* ]]; then pass "$1"; else fail "$1: did not expect '$3' in:"; echo "$2" | sed 's/^/    | /' >&2; fi
}
expect_eq() { if [[ $2 == "$3" ]]; then pass "$1"; else fail "$1: expected '$3', got '$2'"; fi; }
# Processes in host $1's namespace other than its sshd (and the ssh sessions' sshd children).
job_processes_on() {
  local p out=""
  for p in $(ip netns pids "$(ns "$1")"); do
    local comm; comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
    [[ $comm == sshd ]] && continue
    [[ $(awk '/^State:/ {print $2}' "/proc/$p/status" 2>/dev/null) == Z ]] && continue
    out+="$p($({ tr "\0" " " <"/proc/$p/cmdline"; } 2>/dev/null | cut -c1-80)) "
  done
  echo "$out"
}
# Fails unless no process of the job remains on any host within $1 seconds.
expect_no_job_processes() {
  local deadline=$((SECONDS + ${1:-3})) i left t0; t0=$(now_ms)
  while :; do
    left=""
    for ((i = 0; i < COHORT_CLUSTER_K; i++)); do
      local l; l=$(job_processes_on "$i")
      [[ -z $l ]] || left+="host $i: $l; "
    done
    [[ -z $left ]] && { pass "no process of the job remains on any host (checked after $(($(now_ms) - t0)) ms)"; return; }
    ((SECONDS < deadline)) || { fail "processes left after the job: $left"; return; }
    sleep 0.1
  done
}
finish() {
  if ((MH_FAILS)); then echo "$MH_FAILS check(s) failed" >&2; exit 1; fi
  echo "all checks passed"
}
# check_rank_lines NAME OUTPUT WORLD PER_HOST: one "rank=R ..." line per rank 0..WORLD-1, rank R on
# host h<R / PER_HOST> with local rank R % PER_HOST, every line with world=WORLD.
check_rank_lines() {
  local name=$1 out=$2 world=$3 per=$4 r bad=""
  for ((r = 0; r < world; r++)); do
    local want="rank=$r local=$((r % per)) world=$world local_world=$per node=$((r / per)) host=h$((r / per)) "
    local n; n=$(grep -c -- "$want" <<<"$out" || true)
    [[ $n == 1 ]] || bad+=" rank $r: $n line(s) matching '$want';"
  done
  local total; total=$(grep -c "rank=" <<<"$out" || true)
  [[ $total == "$world" ]] || bad+=" $total rank lines, expected $world;"
  if [[ -z $bad ]]; then pass "$name: $world ranks placed as planned"; else fail "$name:$bad"; echo "$out" | sed 's/^/    | /' >&2; fi
}
# Sets TRAIN to the built Fashion-MNIST example, or skips (77) the test when it or its data is missing.
require_training_example() {
  TRAIN=${COHORT_BUILD_DIR:-}/examples/fashion_mnist/fashion_mnist
  if [[ ! -x $TRAIN ]]; then echo "SKIP: $TRAIN not built (libtorch missing)"; exit 77; fi
  if [[ ! -e /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]]; then
    echo "SKIP: dataset-fashion-mnist is not installed"; exit 77
  fi
}
# require_command "bench allreduce": fails the test (exit 1, never a skip) unless `cohort <command>
# --help` succeeds. Every build has every command, so one that lacks it or crashes is broken; asking
# the command itself, rather than reading the layout of `cohort --help`, leaves help's format free.
require_command() {
  local rc=0 err
  # shellcheck disable=SC2086  # "bench allreduce" is two words
  err=$("$COHORT" $1 --help 2>&1 >/dev/null) || rc=$?
  if ((rc != 0)); then
    echo "FAIL: '$COHORT $1 --help' exited $rc (this build lacks the '$1' command, or it crashed): ${err:0:300}" >&2
    exit 1
  fi
}
# run_per_node NAME TIMEOUT CMD...: runs CMD on every host at once (on hosts 0..PN_HOSTS-1 when set),
# each "{node}" in CMD replaced by the host index; waits for all; sets PN_RC_<i> and PN_OUT (all
# outputs, host order).
run_per_node() {
  local name=$1 tmo=$2; shift 2
  local i pids=()
  local n=${PN_HOSTS:-$COHORT_CLUSTER_K}
  for ((i = 0; i < n; i++)); do
    local args=() a
    for a in "$@"; do args+=("${a//\{node\}/$i}"); done
    on_host "$i" timeout -k 5 "$tmo" "${args[@]}" >"$MH_TMP/$name.$i.out" 2>&1 &
    pids+=($!)
  done
  PN_OUT=""
  for ((i = 0; i < n; i++)); do
    local rc=0
    wait "${pids[$i]}" || rc=$?
    printf -v "PN_RC_$i" '%s' "$rc"
    PN_OUT+=$(cat "$MH_TMP/$name.$i.out")$'\n'
  done
}
# Pids of processes on host $1 whose command line contains $2 (sshd and zombies excluded).
pids_matching() {
  local p
  for p in $(ip netns pids "$(ns "$1")"); do
    [[ $(cat "/proc/$p/comm" 2>/dev/null) == sshd ]] && continue
    [[ $(awk '/^State:/ {print $2}' "/proc/$p/status" 2>/dev/null) == Z ]] && continue
    { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null | grep -qF -- "$2" && echo "$p"
  done
  return 0
}
# rank_pid HOST RANK PATTERN: pid of the `cohort` worker process on HOST whose command line contains
# PATTERN and whose environment has RANK=<RANK>; wait_rank_pid tries for 15 s.
rank_pid() {
  local p
  for p in $(pids_matching "$1" "$3"); do
    [[ $(cat "/proc/$p/comm" 2>/dev/null) == cohort ]] || continue
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$2" && { echo "$p"; return 0; }
  done
  return 1
}
wait_rank_pid() { local i; for ((i = 0; i < 300; i++)); do rank_pid "$@" && return 0; sleep 0.05; done; return 1; }
# wait_for_pid HOST PATTERN SECONDS: echoes the first matching pid, fails the test if none appears.
wait_for_pid() {
  local deadline=$((SECONDS + $3)) p
  while ((SECONDS < deadline)); do
    p=$(pids_matching "$1" "$2" | head -1)
    [[ -n $p ]] && { echo "$p"; return 0; }
    sleep 0.05
  done
  return 1
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }
# The entries of /dev/shm, sorted, less those that tests running beside this one make for a moment:
# Python multiprocessing's semaphores (sem.*) and Open MPI's shared-memory segments (vader_segment.*).
# cohort's own segments are memfds, which have no name there: any other new entry is a leak of the job.
shm_entries() { ls /dev/shm | grep -v -E '^(sem\.|vader_segment\.)' | sort || true; }
