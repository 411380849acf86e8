#!/usr/bin/env bash
# Makes the kit that builds and tests cohort on a GPU machine that has CUDA, PyTorch 2.x, CMake and a
# compiler but none of this project's Debian packages and no network (a lent machine): Debian 12's -dev
# packages that the build needs (debs/, unpacked there into a private prefix, never into /), Debian's
# pytest for a torch Python without one (pydebs/), the examples' data (data/: dataset-fashion-mnist and wordnet-base,
# data files only), and torch_kit_run.sh as run.sh. About 38 MB. Downloads from Debian's mirror here.
#   scripts/gpu_bundle/make_torch_kit.sh [KIT_DIR (.devtorch, git-ignored)]
# then, on the GPU machine, from the repo root with the kit carried along:  bash .devtorch/run.sh
# It built against torch 2.11 + CUDA 13 on an NVIDIA H200 on 2026-11-26 and ran scripts/gpu_check.sh
# (bench/results/gpu-check-h200-torch-2026-11-26T0309Z.txt).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
kit=${1:-$repo/.devtorch}
mkdir -p "$kit/debs" "$kit/pydebs" "$kit/data"
(cd "$kit/debs" && apt-get download -q libbenchmark-dev libbenchmark1debian libcli11-dev libfmt-dev libfmt9 \
  libgmock-dev libgtest-dev libssl-dev libssl3 nlohmann-json3-dev pybind11-dev zlib1g-dev zlib1g)
(cd "$kit/pydebs" && apt-get download -q python3-pytest python3-attr python3-iniconfig python3-more-itertools \
  python3-packaging python3-pkg-resources python3-pluggy python3-py python3-setuptools)
(cd "$kit/data" && apt-get download -q dataset-fashion-mnist wordnet-base)  # fashion_mnist/resnet; bert
cp "$here/torch_kit_run.sh" "$kit/run.sh"
du -sh "$kit"
