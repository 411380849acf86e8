# cohort doctor on the namespace cluster: all healthy => PASS; then one host unreachable (link cut),
# hosts with a too small somaxconn / SYN backlog / open-files limit => FAIL naming each,
# with the fixing command, and no doctor process left on any host.
# cluster-hosts: 4
source "$(dirname "$0")/lib.sh"
SSH=$COHORT_CLUSTER_SSH
HF=$COHORT_CLUSTER_HOSTFILE

out=$(on_host 0 "$COHORT" doctor --hostfile "$HF" --ssh-command "$SSH" --timeout 8 --probe-bytes 1M 2>&1) && rc=0 || rc=$?
echo "$out"
expect_eq "healthy cluster: exit code" "$rc" 0
expect_contains "healthy cluster: verdict" "$out" "verdict: PASS"
expect_contains "healthy cluster: link 4 -> 1 measured" "$out" "$(addr 3) -> $(addr 0)"
n_ok_links=$(grep -cE "^$(echo "$COHORT_CLUSTER_ADDR_0" | cut -d. -f1-3)\.[0-9]+ -> .* ok " <<<"$out" || true)
expect_eq "healthy cluster: 12 links ok" "$n_ok_links" 12
if "$COHORT" --help | grep -q "^  bench allreduce "; then
  expect_contains "healthy cluster: tiny allreduce through cohort run" "$out" "--check ... ok"
else
  expect_contains "healthy cluster: allreduce skipped with the reason" "$out" "allreduce: skipped (this cohort build has no"
fi
expect_no_job_processes 3

# Faults: host 3's link cut; host 1's somaxconn and host 2's SYN backlog below world 8 + 4 agents;
# host 2's sessions get a soft RLIMIT_NOFILE of 64 (< 2 x 8 + 64), inherited from its sshd.
cluster cut "$COHORT_CLUSTER_DIR" 3
on_host 1 sysctl -qw net.core.somaxconn=4
on_host 2 sysctl -qw net.ipv4.tcp_max_syn_backlog=8
prlimit --pid "$(cat "$COHORT_CLUSTER_DIR/sshd.2.pid")" --nofile=64:4096
start=$SECONDS
out=$(on_host 0 "$COHORT" doctor --hostfile "$HF" --ssh-command "$SSH" --timeout 8 --probe-bytes 1M 2>&1) && rc=0 || rc=$?
took=$((SECONDS - start))
echo "$out"
expect_eq "faulty cluster: exit code" "$rc" 1
expect_contains "faulty cluster: verdict" "$out" "verdict: FAIL (4 problem(s)"
expect_contains "unreachable host named" "$out" "FAIL $(addr 3): unreachable over ssh"
expect_contains "somaxconn named" "$out" "FAIL $(addr 1): net.core.somaxconn is 4, the job needs >= 12"
expect_contains "somaxconn fix printed" "$out" "fix: sysctl -w net.core.somaxconn=4096"
expect_contains "syn backlog named" "$out" "FAIL $(addr 2): net.ipv4.tcp_max_syn_backlog is 8, the job needs >= 12"
expect_contains "nofile named" "$out" "FAIL $(addr 2): RLIMIT_NOFILE soft limit is 64, a worker may open 80"
expect_contains "nofile fix printed" "$out" "fix: ulimit -n 80"
expect_not_contains "host 0 is fine" "$out" "FAIL $(addr 0)"
expect_contains "links to the lost host are not tested, with the reason" "$out" "not tested: $(addr 3) unreachable over ssh"
if ((took <= 20)); then pass "doctor finished in ${took}s with a host unreachable"; else fail "doctor took ${took}s"; fi
expect_no_job_processes 3
finish
