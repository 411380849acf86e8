# The training example across hosts: examples/fashion_mnist (MLP, 3000 samples) on 2 hosts x 2 ranks
# through ssh fan-out, where allreduce takes the hierarchical path (shared memory inside each host, one
# TCP ring per local rank across them). Its test accuracy must equal the same job's with 4 ranks on one
# host, and no process of the job may remain. (The weights agree to rounding, not bit for bit: the
# hierarchical sum adds the ranks in another order: (r0+r1)+(r2+r3) instead of ((r0+r1)+r2)+r3.)
source "$(dirname "$0")/lib.sh"
require_command run
require_training_example
ARGS=(--model mlp --train-samples 3000 --verbose)

out=$(on_host 0 timeout -k 5 120 "$COHORT" run -H h0:2,h1:2 --ssh-command "$COHORT_CLUSTER_SSH" -x COHORT_LOG_LEVEL=debug \
  "$TRAIN" "${ARGS[@]}" 2>&1) && rc=0 || rc=$?
expect_eq "2x2 fan-out training: exit code" "$rc" 0
expect_contains "2x2 fan-out training chose the hierarchical allreduce" "$out" "hierarchical allreduce"
across=$(grep -o "test accuracy: [0-9.]*" <<<"$out" | head -1)
expect_no_job_processes 1

out1=$(on_host 0 timeout -k 5 120 "$COHORT" run --nproc-per-node 4 "$TRAIN" "${ARGS[@]}" 2>&1) && rc=0 || rc=$?
expect_eq "one host, 4 ranks: exit code" "$rc" 0
single=$(grep -o "test accuracy: [0-9.]*" <<<"$out1" | head -1)
if [[ -n $across && $across == "$single" ]]; then pass "same accuracy across hosts and on one host ($across)"
else fail "accuracy across hosts '$across' differs from one host '$single'"; echo "$out" | tail -5 | sed 's/^/    | /' >&2; fi
finish
