# slurm-cpus: 64
# Every template of docs/slurm.md, as the page writes it, submitted with sbatch to the test cluster (nodes
# declared with 64 CPUs each, as a real cluster's nodes have them; the machine's own CPUs run the ranks).
# The templates are the page's `bash` blocks marked `<!-- slurm-template: NAME -->`; a block with #SBATCH
# lines and no mark fails the test, so that none is left out. The cluster has no GPUs: the GPU lines are set
# aside (the `#SBATCH --gpus...` lines and cohort's `--gpus-per-node X`), and the rest runs as written.
# Each rank of each job records what it got (tests/slurm/template_train.py, as the templates' train.py):
#   cpu       32 ranks, 8 per node, each allowed its 4 CPUs (as many as the machine has, if fewer), the
#             training's arguments; the job COMPLETED
#   gpu       the job holds the 64 CPUs of each of its 2 nodes; the slots, which would be the GPUs, are
#             then the tasks Slurm gives a whole node, one per CPU: 64 ranks on each; COMPLETED
#   per-node  32 ranks, 8 per node, each on a node whose 64 CPUs the job holds; COMPLETED
#   elastic   32 ranks; then Slurm is told h3 failed (scontrol: DOWN) and the allocation stays: the 24 ranks
#             of h0-h2 run a second generation; the job is not requeued or cancelled for the node failure
source "$(dirname "$0")/lib.sh"
require_command run
DOC=$MH_DIR/../../docs/slurm.md
mkdir -p "$MH_TMP/bin"
ln -sf "$COHORT" "$MH_TMP/bin/cohort"  # the templates call `cohort` from PATH
export PATH="$MH_TMP/bin:$PATH"
# Every node holds 64 CPUs of Slurm's; the ranks of a node share the machine's.
MACHINE_CPUS=$(nproc)

# extract NAME: the template marked NAME, GPU lines aside; `extract` alone lists the names.
extract() {
  python3 - "$DOC" "$@" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
found = {}
for mark, body in re.findall(r"(?:<!-- slurm-template: ([\w-]+) -->\n)?```bash\n(.*?)```", text, re.S):
    if "#SBATCH" not in body:
        continue
    if not mark:
        sys.exit("docs/slurm.md: a template without its <!-- slurm-template: NAME --> mark:\n" + body)
    if mark in found:
        sys.exit(f"docs/slurm.md: two templates marked {mark}")
    lines = [l for l in body.splitlines() if not l.startswith("#SBATCH --gpus")]
    found[mark] = "\n".join(re.sub(r" --gpus-per-node \S+", "", l) for l in lines) + "\n"
if len(sys.argv) == 2:
    print(" ".join(found))
else:
    sys.stdout.write(found[sys.argv[2]])
PY
}
# results NAME: every rank's record of the job of template NAME, one JSON object a line, by world and rank.
results() { (cd "$MH_TMP/$1/results" 2>/dev/null && for f in $(ls | sort -t. -k1,1n -k2,2n); do cat "$f"; echo; done); }
# check NAME TITLE EXPR: EXPR over `r` (the records, a list of dicts) must be True.
check() {
  local v; v=$(results "$1" | python3 -c 'import json, sys; r = [json.loads(l) for l in sys.stdin if l.strip()]; print(eval(sys.argv[1]))' "$3")
  expect_eq "$1: $2" "$v" True
}
# hosts_ranks WORLD: per host, the local ranks its records hold, for check's EXPR.
hosts_ranks() { echo "{h: sorted(x['local_rank'] for x in r if x['world'] == $1 and x['host'] == h) for h in set(x['host'] for x in r if x['world'] == $1)}"; }

submit_template() {  # NAME: submits it from its own folder with template_train.py as train.py; sets JOB
  mkdir -p "$MH_TMP/$1"
  cp "$MH_DIR/../slurm/template_train.py" "$MH_TMP/$1/train.py"
  extract "$1" >"$MH_TMP/$1/job.sbatch"
  echo "--- template $1, as submitted:"; cat "$MH_TMP/$1/job.sbatch"
  JOB=$(cd "$MH_TMP/$1" && on_host 0 sbatch --parsable job.sbatch) || { fail "$1: sbatch refused the template"; return 1; }
  JOB=${JOB%%;*}
}
job_output() { cat "$MH_TMP/$1"/train.*.out "$MH_TMP/$1"/slurm-*.out 2>/dev/null || true; }
completed() {  # NAME: the job's state and exit code
  wait_job "$JOB" "$2" || { job_output "$1" >&2; return 1; }
  expect_eq "$1: job $JOB state" "$(job_field "$JOB" JobState)" COMPLETED
  expect_eq "$1: job $JOB exit code" "$(job_field "$JOB" ExitCode)" "0:0"
}

names=$(extract) || { fail "$names"; finish; }
expect_eq "the templates of docs/slurm.md" "$names" "cpu gpu per-node elastic"
full=$(hosts_ranks 32)
for name in $names; do
  case $name in
    cpu)
      submit_template cpu || continue
      completed cpu 120
      check cpu "32 ranks, 8 on each node" "$full == {h: list(range(8)) for h in ('h0', 'h1', 'h2', 'h3')} and len(r) == 32"
      check cpu "each rank may run on its 4 CPUs (the machine has $MACHINE_CPUS)" \
        "sorted(set(x['cpus'] for x in r)) == [min(4, $MACHINE_CPUS)]"
      check cpu "the training's arguments" "all(x['args'] == ['--epochs', '10'] for x in r)"
      ;;
    gpu)
      submit_template gpu || continue
      completed gpu 60
      check gpu "64 ranks on each of 2 nodes (the slots, GPUs aside: a task per CPU of the node)" \
        "$(hosts_ranks 128) == {h: list(range(64)) for h in ('h0', 'h1')} and len(r) == 128"
      check gpu "each node's 64 CPUs are the job's" "set(x['slurm_cpus_on_node'] for x in r) == {'64'}"
      ;;
    per-node)
      submit_template per-node || continue
      completed per-node 120
      check per-node "32 ranks, 8 on each node" "$full == {h: list(range(8)) for h in ('h0', 'h1', 'h2', 'h3')} and len(r) == 32"
      check per-node "each node's 64 CPUs are the job's" "set(x['slurm_cpus_on_node'] for x in r) == {'64'}"
      ;;
    elastic)
      submit_template elastic || continue
      deadline=$((SECONDS + 90))
      while ((SECONDS < deadline)) && (($(ls "$MH_TMP/elastic/results" 2>/dev/null | grep -c '^32\.') < 32)); do sleep 0.2; done
      check elastic "32 ranks in the first generation, 8 on each node" "$full == {h: list(range(8)) for h in ('h0', 'h1', 'h2', 'h3')}"
      # What Slurm does when a node really fails: the node is DOWN, its tasks are killed.
      on_host 0 scontrol update NodeName=h3 State=DOWN Reason=cohort-template-test
      deadline=$((SECONDS + 90))
      while ((SECONDS < deadline)); do
        state=$(job_field "$JOB" JobState)
        [[ $state == RUNNING || $state == COMPLETING ]] || break
        sleep 0.2
      done
      job_output elastic
      expect_eq "elastic: the node failure did not requeue the job" "$(job_field "$JOB" Restarts)" 0
      [[ $state == COMPLETED || $state == FAILED ]] && pass "elastic: the job ran to its end ($state)" ||
        fail "elastic: job $JOB is $state after h3 failed (cancelled or requeued for the node's failure?)"
      check elastic "the 24 ranks of h0-h2 ran a second generation" \
        "$(hosts_ranks 24) == {h: list(range(8)) for h in ('h0', 'h1', 'h2')} and len([x for x in r if x['world'] == 24]) == 24"
      check elastic "... with the checkpoint folder" "all(x['args'] == ['--checkpoint-dir', 'ckpt'] for x in r)"
      ;;
    *) fail "template $name: this test has no checks for it (add them)" ;;
  esac
  expect_no_job_processes 5
done
finish
