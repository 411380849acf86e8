# Collectives across hosts: `cohort bench allreduce --check` on 4 hosts x 2 ranks (ssh fan-out, also with
# --map-by node, and per-node mode), several dtypes and ops; every size must check out (#wrong 0) exactly as the same
# benchmark does with 8 ranks on one host.
source "$(dirname "$0")/lib.sh"
require_command run
require_command "bench allreduce"
BENCH=("$COHORT" bench allreduce -b 8 -e 1M -f 32 -n 2 -w 1 --trials 1 --check)

check_table() {  # NAME OUTPUT: 4 sizes (8, 256, 8K, 256K), all with #wrong 0, and the final "0 OK"
  local rows; rows=$(grep -E '^\[h?[a-z0-9.]*:0\] +[0-9]+ +[0-9]+ ' <<<"$2" || true)
  local n; n=$(grep -c . <<<"$rows" || true)
  local bad; bad=$(awk '$NF != 0' <<<"$rows")
  if [[ $n == 4 && -z $bad ]] && grep -q "Out of bounds values : 0 OK" <<<"$2"; then pass "$1: 4 sizes (8 B - 256 KiB), all correct"
  else fail "$1: expected 4 rows with #wrong 0 and '0 OK'"; echo "$2" | sed 's/^/    | /' >&2; fi
}

for spec in "float sum" "int32 max" "bfloat16 sum" "double avg"; do
  set -- $spec
  out=$(on_host 0 timeout -k 5 90 "$COHORT" run -H h0:2,h1:2,h2:2,h3:2 --ssh-command "$COHORT_CLUSTER_SSH" \
    "${BENCH[@]}" -d "$1" -o "$2" 2>&1) && rc=0 || rc=$?
  expect_eq "4x2 fan-out allreduce $1 $2: exit code" "$rc" 0
  check_table "4x2 fan-out allreduce $1 $2" "$out"
done
expect_no_job_processes 3

# Ranks dealt round robin over the hosts (mpirun's --map-by node: h0 has ranks 0 and 4, ...): the ranks of
# each host still share memory and the hosts still meet over TCP.
out=$(on_host 0 timeout -k 5 90 "$COHORT" run -H h0:2,h1:2,h2:2,h3:2 --map-by node --ssh-command "$COHORT_CLUSTER_SSH" \
  "${BENCH[@]}" -d float -o sum 2>&1) && rc=0 || rc=$?
expect_eq "4x2 fan-out --map-by node allreduce float sum: exit code" "$rc" 0
check_table "4x2 fan-out --map-by node allreduce float sum" "$out"
expect_no_job_processes 3

run_per_node coll 90 "$COHORT" run --nnodes 4 --node-rank {node} --nproc-per-node 2 --master-addr h0 \
  --master-port 29700 "${BENCH[@]}" -d float -o sum
for ((i = 0; i < 4; i++)); do v="PN_RC_$i"; expect_eq "per-node allreduce: launcher on h$i exit code" "${!v}" 0; done
check_table "per-node 4x2 allreduce float sum" "$PN_OUT"
expect_no_job_processes 3

# The reference: the same benchmark with 8 ranks on one host.
out=$(on_host 0 timeout -k 5 90 "$COHORT" run --nproc-per-node 8 "${BENCH[@]}" -d float -o sum 2>&1) && rc=0 || rc=$?
expect_eq "single host 8 ranks: exit code" "$rc" 0
check_table "single host 8 ranks allreduce float sum" "$out"
finish
