# The two ways users run cohort under Slurm, against the real daemons, training the Fashion-MNIST MLP
# across 4 Slurm nodes (1 rank each):
#   fan-out:  an sbatch script runs `cohort run PROG` once; cohort reads the allocation and starts an
#             agent on every other node through srun (no -H, no ssh: this test's PATH has an `ssh` that
#             fails and records that it was called);
#   per-node: an sbatch script runs `srun --ntasks-per-node=1 cohort run --nproc-per-node 1 PROG`.
# Both must reach the test accuracy of the same job with 4 ranks on one host, with rank R on node hR and
# SLURM_PROCID=R (each worker says where it runs before it trains: the accuracy alone is also what 4
# ranks on the batch host would reach). Also: `salloc -N 4 cohort run` places its ranks on the
# allocation's nodes, and srun with the batch job's task count (2 cohorts on a node) is refused with one
# line that says what to write instead.
source "$(dirname "$0")/lib.sh"
require_command run
require_training_example
ARGS=(--model mlp --train-samples 3000)
# An ssh that must not be used: srun starts the agents.
mkdir -p "$MH_TMP/bin"
printf '#!/bin/sh\necho "ssh $*" >>%s/ssh-called\nexit 255\n' "$MH_TMP" >"$MH_TMP/bin/ssh"
chmod +x "$MH_TMP/bin/ssh"
export PATH="$MH_TMP/bin:$PATH" HOME="$MH_TMP"
# A worker that says where it runs (print_env.sh's line, then its Slurm task variables), then runs the
# rest of its command line, if any.
PLACED=$MH_TMP/placed.sh
cat >"$PLACED" <<EOF
#!/bin/sh
"$MH_DIR/print_env.sh"
echo "slurm procid=\$SLURM_PROCID localid=\$SLURM_LOCALID nodeid=\$SLURM_NODEID ntasks=\$SLURM_NTASKS rank=\$RANK"
[ \$# -eq 0 ] || exec "\$@"
EOF
chmod +x "$PLACED"
# check_placed NAME OUTPUT WORLD PER_NODE: each rank R ran on node h<R / PER_NODE> (check_rank_lines) with
# SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID and SLURM_NTASKS its own, as if srun had started every rank
# (not its agent's step's 0 of 1), for programs that read their rank from Slurm.
check_placed() {
  local name=$1 out=$2 world=$3 per=$4 r bad=""
  check_rank_lines "$name" "$(grep -v "slurm procid" <<<"$out")" "$world" "$per"
  for ((r = 0; r < world; r++)); do
    grep -q "slurm procid=$r localid=$((r % per)) nodeid=$((r / per)) ntasks=$world rank=$r$" <<<"$out" || bad+=" $r"
  done
  [[ -z $bad ]] && pass "$name: every worker's SLURM_PROCID/LOCALID/NODEID/NTASKS are its own" ||
    { fail "$name: workers whose Slurm task variables are not their own:$bad"; grep "slurm procid" <<<"$out" >&2; }
}

single=$(on_host 0 timeout -k 5 120 "$COHORT" run --nproc-per-node 4 "$TRAIN" "${ARGS[@]}" 2>&1 |
  grep -o "test accuracy: [0-9.]*" | head -1)
[[ -n $single ]] && pass "one host, 4 ranks: $single" || fail "one host, 4 ranks printed no accuracy"

submit fanout -N 4 --ntasks-per-node=1 -- "\"$COHORT\" run \"$PLACED\" \"$TRAIN\" ${ARGS[*]}"
wait_job "$JOB" 120
out=$(cat "$MH_TMP/fanout.out")
check_placed "fan-out" "$out" 4 1
expect_eq "fan-out job $JOB: state" "$(job_field "$JOB" JobState)" COMPLETED
expect_eq "fan-out job $JOB: exit code" "$(job_field "$JOB" ExitCode)" "0:0"
expect_eq "fan-out: same accuracy as 4 ranks on one host" "$(grep -o "test accuracy: [0-9.]*" <<<"$out" | head -1)" "$single"
expect_eq "fan-out: ssh never called" "$(cat "$MH_TMP/ssh-called" 2>/dev/null)" ""
expect_no_job_processes 5

# The batch script makes the job token and srun hands it to every node's launcher (docs/slurm.md's
# per-node template): the job runs closed, and no node says it is open.
submit pernode -N 4 --ntasks-per-node=1 -- "export COHORT_JOB_TOKEN=\$(openssl rand -hex 32)
srun --ntasks-per-node=1 \"$COHORT\" run --nproc-per-node 1 \"$PLACED\" \"$TRAIN\" ${ARGS[*]}"
wait_job "$JOB" 120
out=$(cat "$MH_TMP/pernode.out")
check_placed "per-node" "$out" 4 1
expect_eq "per-node job $JOB: state" "$(job_field "$JOB" JobState)" COMPLETED
expect_not_contains "per-node: the job runs with a token" "$out" "this job is open"
expect_eq "per-node: same accuracy as 4 ranks on one host" "$(grep -o "test accuracy: [0-9.]*" <<<"$out" | head -1)" "$single"
expect_no_job_processes 5

# salloc: the command runs on the submitting host (h0, in the allocation); ranks go to every node.
out=$(on_host 0 timeout -k 5 60 salloc -N 4 --ntasks-per-node=2 "$COHORT" run "$PLACED" 2>&1) && rc=0 || rc=$?
expect_eq "salloc -N 4 cohort run: exit code" "$rc" 0
check_placed "salloc -N 4 --ntasks-per-node=2" "$out" 8 2

# The classic mistake: srun inherits the batch job's 2 tasks per node and ignores --ntasks-per-node=1.
submit twice -N 2 --ntasks-per-node=2 -- "srun --ntasks-per-node=1 \"$COHORT\" run \"$MH_DIR/print_env.sh\""
wait_job "$JOB" 60
out=$(cat "$MH_TMP/twice.out")
expect_contains "two cohorts per node are refused" "$out" "srun started 2 cohort launchers on node h0 (SLURM_STEP_TASKS_PER_NODE=2(x2))"
expect_contains "the refusal says what to write" "$out" "srun --ntasks=2 --ntasks-per-node=1 cohort run"
expect_eq "the refused job failed" "$(job_field "$JOB" JobState)" FAILED
finish
