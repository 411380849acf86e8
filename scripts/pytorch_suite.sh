#!/usr/bin/env bash
# PyTorch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py, as the
# installed torch ships it) with backend cohort and with gloo beside it, then the comparison
# (tests/torch_suite/compare.py; the table in docs/pytorch.md comes from it). Not part of CI: a whole
# run takes about 20 minutes per backend and world size on 2 cores.
#
#   scripts/pytorch_suite.sh [WORLD_SIZE ...]      default: 2 3
#   SHARDS=N            each run in N interleaved parts at once (default 2: one per core)
#   BACKENDS="cohort"   only these backends (default "gloo cohort")
#   OUT=dir             results (default build/pytorch-suite/torch-<version>)
#   PYTHON=python3      the interpreter whose torch is tested (default /usr/bin/python3)
#   COHORT_TORCH_MODULE_DIR=dir   where cohort_torch is (default build/integrations/python)
#
# Needs the built extension module (scripts/setup.sh builds it into build/integrations/python).
set -euo pipefail
cd "$(dirname "$0")/.."
worlds=("$@")
((${#worlds[@]})) || worlds=(2 3)
python=${PYTHON:-/usr/bin/python3}
shards=${SHARDS:-2}
build_dir=${COHORT_BUILD_DIR:-build}
module_dir=${COHORT_TORCH_MODULE_DIR:-$(cd "$build_dir/integrations/python" && pwd)}
version=$("$python" -c 'import torch; print(torch.__version__)')
out=${OUT:-$build_dir/pytorch-suite/torch-$version}
mkdir -p "$out"
export PYTHONPATH="$module_dir${PYTHONPATH:+:$PYTHONPATH}"
for world in "${worlds[@]}"; do
  for backend in ${BACKENDS:-gloo cohort}; do
    echo "pytorch_suite: torch $version, $backend, world size $world ($shards parts)"
    pids=()
    for ((i = 1; i <= shards; i++)); do
      "$python" tests/torch_suite/run_pytorch_suite.py --backend "$backend" --world-size "$world" \
        --shard "$i/$shards" --json "$out/$backend-$world.part$i.json" >"$out/$backend-$world.part$i.log" 2>&1 &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    # One file per backend and world size, the parts' results in the suite's order.
    "$python" - "$out" "$backend" "$world" "$shards" <<'PY'
import json, sys
out, backend, world, shards = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
merged = None
for i in range(1, shards + 1):
    with open(f"{out}/{backend}-{world}.part{i}.json") as f:
        part = json.load(f)
    if merged is None:
        merged = part
    else:
        merged["results"] += part["results"]
merged["results"].sort(key=lambda r: r["test"])
with open(f"{out}/{backend}-{world}.json", "w") as f:
    json.dump(merged, f, indent=1)
PY
    grep -h "world size $world: ran" "$out/$backend-$world".part*.log || true
  done
done
"$python" tests/torch_suite/compare.py "$out" | tee "$out/comparison.txt"
