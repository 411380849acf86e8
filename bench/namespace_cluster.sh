# shellcheck shell=bash
# Sourced by the benchmarks that run across the namespace hosts of tests/multihost/cluster.sh
# (bench/bench_bert_multihost.sh, bench/multihost_coll.sh): one way to bring the cluster up for a run.
#
#   bench_cluster_up NAME K RATE TMP
#       K hosts, every link shaped to RATE (tbf); sets D (the cluster's folder), IFACE (host 0's
#       198.18.0.x interface) and the cluster's variables ($D/env: COHORT_CLUSTER_SSH, ..._ADDR_0, ...),
#       and traps EXIT so that the cluster goes down, and TMP is removed, whatever happens (failure,
#       Ctrl-C): nothing outlives the run. NAME prefixes the error lines; any failure exits 1.
# The calling script owns the cluster (COHORT_CLUSTER_OWNER): with the `up` process as its owner, which
# exits at once, any `cluster.sh gc` (run_test.sh calls it before every multi-host test) would delete it
# mid-run.
bench_cluster_up() {
  local name=$1 k=$2 rate=$3 tmp=$4
  CLUSTER=${CLUSTER:-$PWD/tests/multihost/cluster.sh}
  D=$(COHORT_CLUSTER_OWNER=$$ COHORT_CLUSTER_QUIET=1 "$CLUSTER" up -k "$k") || { echo "$name: cluster.sh up failed" >&2; exit 1; }
  # shellcheck disable=SC2064  # the values now, not at exit
  trap "\"$CLUSTER\" down \"$D\" >/dev/null 2>&1; rm -rf \"$tmp\"" EXIT
  trap 'exit 130' INT TERM
  "$CLUSTER" shape "$D" all 0 "$rate" || exit 1
  # shellcheck disable=SC1091
  source "$D/env"
  IFACE=$("$CLUSTER" exec "$D" 0 ip -br -4 addr | awk '$3 ~ /^198\.18\./ {sub(/@.*/, "", $1); print $1; exit}')
  [[ -n $IFACE ]] || { echo "$name: no 198.18.0.x interface in host 0" >&2; exit 1; }
}
