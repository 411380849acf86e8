#!/usr/bin/env bash
# Builds cohort in a Debian 13 (trixie) chroot and runs tests there: torch 2.6 (the PyTorch backend's
# c10d::Backend branch) and GCC 14, neither of which Debian 12 has. Needs root and the Debian mirror;
# downloads about 1.5 GB the first time. Not part of CI.
#
#   scripts/test_in_trixie.sh [chroot dir (default /var/tmp/cohort-trixie)] [ctest args (default -L python)]
#
# The chroot is made once (debootstrap, then apt-get inside it) and reused. The sources are this
# checkout's committed HEAD, cloned into <chroot>/src (the peers' scripts come with it, in bench/peers).
set -euo pipefail
cd "$(dirname "$0")/.."
root=${1:-/var/tmp/cohort-trixie}
shift || true
ctest_args=("$@")
((${#ctest_args[@]})) || ctest_args=(-L python)
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[[ $(id -u) -eq 0 ]] || { echo "test_in_trixie: needs root (debootstrap, chroot, mounts)" >&2; exit 1; }

if [[ ! -x $root/usr/bin/apt-get ]]; then
  command -v debootstrap >/dev/null || apt-get install -y -q debootstrap
  echo "test_in_trixie: debootstrap trixie into $root"
  debootstrap --variant=minbase --include=ca-certificates trixie "$root" "$mirror"
fi

mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
bind() {  # SOURCE TARGET
  mkdir -p "$2"
  mountpoint -q "$2" || { mount --bind "$1" "$2"; mounts+=("$2"); }
}
bind /proc "$root/proc"
bind /sys "$root/sys"
bind /dev "$root/dev"
mountpoint -q "$root/dev/pts" || { mount -t devpts devpts "$root/dev/pts"; mounts+=("$root/dev/pts"); }

# What scripts/setup.sh installs for the build and the Python tests, by trixie's names.
chroot "$root" bash -c 'export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends build-essential cmake ninja-build pkg-config \
    libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev libfmt-dev libssl-dev \
    zlib1g-dev python3 python3-dev python3-pytest python3-setuptools pybind11-dev python3-torch \
    libtorch-dev libopenblas0-pthread procps iproute2 >/dev/null'

rm -rf "$root/src"
git clone -q "$PWD" "$root/src"
echo "test_in_trixie: building $(git rev-parse --short HEAD) with $(chroot "$root" c++ --version | head -1)"
chroot "$root" bash -c 'cd /src && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null &&
  cmake --build build -j "$(nproc)"'
chroot "$root" bash -c "cd /src/build && ctest --output-on-failure $(printf '%q ' "${ctest_args[@]}")"
