#!/usr/bin/env bash
# Compiles cohort's torch code against torch 2.x headers, on a machine that only has Debian 12's torch
# 1.13: the PyTorch backend (integrations/python/cohort_torch_*.cc, its torch 2.x branch: c10d::Backend
# and the CUDA routing; one unity file, or each file where COHORT_UNITY_BUILD is off), the libtorch integration (integrations/torch/*.cc: DDP, the sharded
# optimizer, FSDP; and, where the build has cohort_libtorch_cuda_check, the same sources' COHORT_TORCH_CUDA
# code against torch 2.x's c10/cuda) and the examples built on it (every examples/ file compiled against libtorch).
#
#   scripts/check_torch2_compiles.sh [build dir (default build)] [cache dir (default /tmp/cohort-torch2)]
#
# It takes Debian 13 (trixie)'s libtorch-dev package from the Debian mirror, unpacks it into the cache
# dir without installing anything (dpkg -x), and reruns the build's own compile command for each file
# with the torch include directories pointed at those headers, as -fsyntax-only: full parsing,
# overload resolution and template instantiation, no object file. It cannot link or run: trixie's
# libtorch needs trixie's glibc. Needs a configured build (ninja) whose torch targets exist
# (cohort_torch needs python3-torch, the rest libtorch-dev). Every file is checked, and each that does
# not compile is named at the end (exit 1).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cache=${2:-/tmp/cohort-torch2}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$cache"

if [[ ! -d $cache/root/usr/include/torch/csrc/distributed/c10d ]]; then
  echo "check_torch2_compiles: fetching trixie's package index from $mirror"
  curl -fsS -o "$cache/Packages.xz" "$mirror/dists/trixie/main/binary-amd64/Packages.xz"
  xz -d -f "$cache/Packages.xz"
  file=$(awk '/^Package: libtorch-dev$/ {p=1} p && /^Filename:/ {print $2; exit}' "$cache/Packages")
  [[ -n $file ]] || { echo "check_torch2_compiles: no libtorch-dev in trixie's index" >&2; exit 1; }
  echo "check_torch2_compiles: fetching $file"
  curl -fsS -o "$cache/libtorch-dev.deb" "$mirror/$file"
  dpkg -x "$cache/libtorch-dev.deb" "$cache/root"
fi
inc=$cache/root/usr/include

commands=$(ninja -C "$build" -t commands 2>/dev/null || true)

# The build's compile command for one source file, its torch include directories pointed at trixie's
# headers, without object or dependency file. Two kinds of torch in the build:
# - python3-torch's (cohort_torch_*.cc): .../dist-packages/torch/include and its api/include;
# - Debian's libtorch-dev (integrations/torch, the examples): its headers are in /usr/include itself,
#   so trixie's include dir goes first, before the compiler's own /usr/include.
torch2_command() {
  local cmd=$1
  cmd=${cmd//\/usr\/lib\/python3\/dist-packages\/torch\/include\/torch\/csrc\/api\/include/$inc/torch/csrc/api/include}
  cmd=${cmd//\/usr\/lib\/python3\/dist-packages\/torch\/include/$inc}
  cmd=${cmd//-isystem \/usr\/include\/torch\/csrc\/api\/include/-isystem $inc -isystem $inc/torch/csrc/api/include}
  sed -E 's/ -o [^ ]+/ /; s/ -MD / /; s/ -MT [^ ]+/ /; s/ -MF [^ ]+/ /' <<<"$cmd"
}

# The PyTorch backend's files first: their headers tell the torch version. Its compile commands: the
# unity file of the cohort_torch target, or each cohort_torch_*.cc where COHORT_UNITY_BUILD is off.
mapfile -t python_cmds < <(grep -E -- "-c [^ ]*integrations/python/(cohort_torch_[a-z0-9_]+\.cc|CMakeFiles/cohort_torch\.dir/Unity/[^ ]+)( |$)" <<<"$commands" | sort -u)
if ((${#python_cmds[@]} == 0)); then
  echo "check_torch2_compiles: no compile command for the cohort_torch module in $build (is torch found?)" >&2
  exit 1
fi
python_cmd=$(torch2_command "${python_cmds[0]}")
version=$(cd "$build" && eval "${python_cmd/ -c / -dM -E -o - -c }" |
          awk '/define TORCH_VERSION_M(AJOR|INOR) /{printf "%s%s", sep, $3; sep="."}')
[[ $version == 2.* ]] || { echo "check_torch2_compiles: the headers say torch '$version', not 2.x" >&2; exit 1; }

# The libtorch files: every integrations/torch and examples source whose command includes libtorch.
mapfile -t libtorch_cmds < <(grep -E -- "-c [^ ]*/(integrations/torch|examples)/[^ ]*\.cc( |$)" <<<"$commands" |
                             grep -F -- "-isystem /usr/include/torch/csrc/api/include" | sort -u)
if ((${#libtorch_cmds[@]} == 0)); then
  echo "check_torch2_compiles: no libtorch compile commands in $build (is libtorch-dev found?)" >&2
  exit 1
fi

failed=()
check() {
  local cmd=$1 source
  source=$(grep -oE -- "-c [^ ]+" <<<"$cmd" | cut -c4-)
  source=${source#"$PWD/"}
  echo "check_torch2_compiles: $source against torch $version headers (-fsyntax-only)"
  if ! (cd "$build" && eval "${cmd/ -c / -fsyntax-only -c }"); then failed+=("$source"); fi
}
for cmd in "${python_cmds[@]}"; do check "$(torch2_command "$cmd")"; done
for cmd in "${libtorch_cmds[@]}"; do check "$(torch2_command "$cmd")"; done

if ((${#failed[@]})); then
  echo "check_torch2_compiles: FAILED against torch $version: ${failed[*]}" >&2
  exit 1
fi
echo "check_torch2_compiles: OK, $((${#python_cmds[@]} + ${#libtorch_cmds[@]})) files compile against torch $version"
