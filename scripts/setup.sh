#!/usr/bin/env bash
# Installs what cohort needs to build and test on Debian 12 (as root, with apt-get), then configures
# and builds into ./build. Safe to run again: packages already present are not fetched again.
#   scripts/setup.sh            build dependencies + test dependencies, Release-ish build
#   COHORT_BUILD_DIR=dir        build somewhere else
#   COHORT_CMAKE_ARGS="..."     extra CMake arguments (e.g. -DCOHORT_SANITIZE=address)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  # toolchain and libraries
  # (clang: the fuzz targets and the ASan + UBSan build; llvm: llvm-symbolizer, file:line in its reports)
  build-essential cmake ninja-build pkg-config clang libclang-rt-14-dev llvm
  libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libfmt-dev libssl-dev zlib1g-dev
  # PyTorch integrations and the training example (libtorch C++ API, the Python backend, BLAS, data)
  python3 python3-dev python3-pytest pybind11-dev python3-torch libtorch-dev
  libopenblas0-pthread dataset-fashion-mnist wordnet-base
  # peers and multi-host tests: Open MPI, network namespaces with sshd, iperf3, Gloo's headers (the Gloo C++
  # peer, bench/peers/bench_gloo.cc); PMIx's headers, against which the build checks the declarations it
  # loads libpmix with (mpirun without MASTER_ADDR, src/comm/pmix.h)
  openmpi-bin libopenmpi-dev libpmix-dev iproute2 openssh-server openssh-client iperf3 procps libgloo-dev
  # a real Slurm cluster on the namespace hosts (tests/slurm): slurmctld, slurmd, srun/sbatch/scancel, munge
  slurm-wlm munge
  # the install tests (tests/install): the wheel built with Debian's tools into a venv, the .deb in a
  # clean Debian 12 root
  python3-build python3-venv python3-wheel debootstrap
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "scripts/setup.sh: missing packages (${missing[*]}); run as root or install them with apt-get" >&2
    exit 1
  fi
  echo "scripts/setup.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # Recommends are installed too: the tools here were built and tested with them (e.g. clang needs
  # libclang-rt for libFuzzer, python3-torch its recommended runtime pieces).
  apt-get install -y -q "${missing[@]}"
fi

# Debian's libtorch links the reference BLAS through the alternatives system; OpenBLAS is ~13x faster
# for the training example. Select it when it is installed and the reference one is selected.
if [[ $(id -u) -eq 0 ]] && [[ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ]]; then
  update-alternatives --set libblas.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || true
  update-alternatives --set liblapack.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/openblas-pthread/liblapack.so.3 >/dev/null 2>&1 || true
fi

# scripts/test.sh's hook: a command to start in the background once the packages are in, so that it
# overlaps the build (the install test's clean Debian root: downloads and unpacking, little CPU).
if [[ -n ${COHORT_SETUP_BACKGROUND:-} ]]; then
  bash -c "$COHORT_SETUP_BACKGROUND" </dev/null >/dev/null 2>&1 &
fi

build_dir=${COHORT_BUILD_DIR:-build}
# The store protocol fuzz target is built (clang, libFuzzer) so the test suite can run it for a bounded time.
# Debug information as line tables only (-g1): backtraces, sanitizer reports and perf keep file:line,
# and the build of these template-heavy sources takes about 30 % less time than with full -g (CI has 2
# cores). Pass COHORT_CMAKE_ARGS="-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=..." for other flags.
# shellcheck disable=SC2086
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOHORT_BUILD_FUZZERS=ON \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
  ${COHORT_CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" -j "$(nproc)"
