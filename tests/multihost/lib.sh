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
on_host() { local i=$1; shift; ip netns exec "$(ns "$i")" nsenter --uts --mount -t "$(cat "$COHORT_CLUSTER_DIR/sshd.$i.pid")" "$@"; }
cluster() { "$MH_DIR/cluster.sh" "$@"; }

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
    out+="$p($(tr '\0' ' ' <"/proc/$p/cmdline" | cut -c1-80)) "
  done
  echo "$out"
}
# Fails unless no process of the job remains on any host within $1 seconds.
expect_no_job_processes() {
  local deadline=$((SECONDS + ${1:-3})) i left
  while :; do
    left=""
    for ((i = 0; i < COHORT_CLUSTER_K; i++)); do
      local l; l=$(job_processes_on "$i")
      [[ -z $l ]] || left+="host $i: $l; "
    done
    [[ -z $left ]] && { pass "no process of the job remains on any host"; return; }
    ((SECONDS < deadline)) || { fail "processes left after the job: $left"; return; }
    sleep 0.1
  done
}
finish() {
  if ((MH_FAILS)); then echo "$MH_FAILS check(s) failed" >&2; exit 1; fi
  echo "all checks passed"
}
