#!/usr/bin/env bash
# cohort's main job, from a fresh Debian 12 machine: installs what is missing (libtorch-dev,
# OpenBLAS, dataset-fashion-mnist, build tools) and builds via scripts/setup.sh, then trains the
# Fashion-MNIST MLP data-parallel on 2 local ranks:
#   scripts/main_job.sh                  # --model mlp (default here)
#   scripts/main_job.sh --model seed     # the MindSpore MNIST tutorial's model (Flatten, Linear 784->10, ReLU)
# Extra arguments go to the training program (see build/examples/fashion_mnist/fashion_mnist --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build_dir=${COHORT_BUILD_DIR:-build}
if [[ ! -x "$build_dir/examples/fashion_mnist/fashion_mnist" ]]; then
  echo "scripts/main_job.sh: $build_dir/examples/fashion_mnist/fashion_mnist was not built (is libtorch-dev installed?)" >&2
  exit 1
fi
if (($# == 0)); then set -- --model mlp; fi
exec "$build_dir/tools/cohort" run --nproc-per-node 2 "$build_dir/examples/fashion_mnist/fashion_mnist" --verbose "$@"
