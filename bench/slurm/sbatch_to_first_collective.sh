#!/usr/bin/env bash
# Time from `sbatch` to the first collective of a 4 nodes x 2 ranks job on a real Slurm cluster (the
# namespace hosts of tests/slurm/slurm.sh), by launcher, in interleaved rounds, every round printed:
#   cohort fan-out   the batch script runs `cohort run first_collective.py` (agents through srun)
#   cohort per-node  the batch script runs `srun --ntasks-per-node=1 cohort run --nproc-per-node 2 ...`
#   srun torchrun    the batch script runs `srun --ntasks-per-node=1 python3 torchrun311.py --nnodes 4
#                    --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint h0:29400 ...` (the peer)
# The worker is the same Python program for all three (bench/slurm/first_collective.py: gloo from the
# launcher's environment, one allreduce; rank 0 prints the time it completed). Per job: the time from
# just before sbatch to that line, and to the end of the batch script (its last line prints the time:
# `sbatch -W` itself returns only at its next poll of the job's state, 2, 10 or 42 s after submission).
#
#   bench/slurm/sbatch_to_first_collective.sh [build_dir]      ROUNDS=5 (default)
# Needs root and slurm-wlm (scripts/setup.sh installs it). Run on an idle machine: 8 ranks importing
# torch on 2 cores make the CPU the bottleneck, which is what a user of this machine would see.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=$(realpath "${1:-build}")
ROUNDS=${ROUNDS:-5}
COHORT=$BUILD/tools/cohort
WORKER=$(realpath bench/slurm/first_collective.py)
TORCHRUN=$(realpath bench/peers/torchrun311.py)
tests/slurm/slurm.sh check >/dev/null || { tests/slurm/slurm.sh check; exit 1; }
DIR=$(tests/slurm/slurm.sh up -k 4)
TMP=$(mktemp -d)
trap 'tests/slurm/slurm.sh down "$DIR" >/dev/null 2>&1; rm -rf "$TMP"' EXIT
on_h0() { tests/slurm/slurm.sh exec "$DIR" 0 "$@"; }

declare -A SCRIPT
SCRIPT[cohort-fanout]="\"$COHORT\" run --python /usr/bin/python3 \"$WORKER\""
SCRIPT[cohort-pernode]="srun --ntasks=4 --ntasks-per-node=1 \"$COHORT\" run --python /usr/bin/python3 --nproc-per-node 2 \"$WORKER\""
SCRIPT[srun-torchrun]="srun --ntasks=4 --ntasks-per-node=1 /usr/bin/python3 \"$TORCHRUN\" --nnodes 4 --nproc_per_node 2 \
--rdzv_backend c10d --rdzv_endpoint h0:29400 --rdzv_id \$SLURM_JOB_ID --monitor_interval 0.1 \"$WORKER\""
ORDER=(cohort-fanout cohort-pernode srun-torchrun)

echo "sbatch -> first collective, 4 nodes x 2 ranks, $ROUNDS rounds, interleaved ($(date -u +%FT%TZ))"
printf '%-6s %-15s %12s %12s %s\n' round launcher first_coll_s script_end_s state
for ((r = 1; r <= ROUNDS; r++)); do
  for name in "${ORDER[@]}"; do
    printf '#!/bin/bash\n%s\necho "batch script ends at $(date +%%s.%%N)"\n' "${SCRIPT[$name]}" >"$TMP/$name.sbatch"
    t0=$(date +%s.%N)
    job=$(on_h0 sbatch --parsable -W -N 4 --ntasks-per-node=2 -o "$TMP/$name.$r.out" "$TMP/$name.sbatch" 2>/dev/null) || true
    t1=$(grep -o "batch script ends at [0-9.]*" "$TMP/$name.$r.out" 2>/dev/null | awk '{print $5}' | head -1 || true)
    job=${job%%;*}
    first=$(grep -o "first collective done at [0-9.]*" "$TMP/$name.$r.out" 2>/dev/null | awk '{print $5}' | head -1 || true)
    state=$(on_h0 scontrol show job "$job" 2>/dev/null | tr ' ' '\n' | sed -n 's/^JobState=//p' | head -1)
    printf '%-6s %-15s %12s %12s %s\n' "$r" "$name" \
      "$([[ -n $first ]] && awk -v a="$t0" -v b="$first" 'BEGIN{printf "%.2f", b-a}' || echo "-")" \
      "$([[ -n $t1 ]] && awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}' || echo "-")" "${state:-?}"
    [[ -n $first ]] || tail -5 "$TMP/$name.$r.out" | sed 's/^/    | /'
  done
done
