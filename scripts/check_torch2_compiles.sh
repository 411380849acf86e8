#!/usr/bin/env bash
# Compiles the PyTorch backend (integrations/python/cohort_torch.cc) against torch 2.x headers, to check
# its torch 2.x branch (c10d::Backend) on a machine that only has Debian 12's torch 1.13.
#
#   scripts/check_torch2_compiles.sh [build dir (default build)] [cache dir (default /tmp/cohort-torch2)]
#
# It takes Debian 13 (trixie)'s libtorch-dev package from the Debian mirror, unpacks it into the cache
# dir without installing anything (dpkg -x), and reruns the build's own compile command for
# cohort_torch.cc with the torch include directories pointed at those headers, as -fsyntax-only: full
# parsing, overload resolution and template instantiation, no object file. It cannot link or run: trixie's
# libtorch needs trixie's glibc. Needs a configured build (ninja) whose cohort_torch target exists.
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

cmd=$(ninja -C "$build" -t commands 2>/dev/null | grep -m1 -- "-c [^ ]*integrations/python/cohort_torch.cc" || true)
[[ -n $cmd ]] || { echo "check_torch2_compiles: no compile command for cohort_torch.cc in $build (is torch found?)" >&2; exit 1; }
# The build's torch include directories (python3-torch's torch/include and its api/include) -> trixie's.
cmd=${cmd//\/usr\/lib\/python3\/dist-packages\/torch\/include\/torch\/csrc\/api\/include/$inc/torch/csrc/api/include}
cmd=${cmd//\/usr\/lib\/python3\/dist-packages\/torch\/include/$inc}
# No object file and no dependency file: only the check.
cmd=$(sed -E 's/ -o [^ ]+/ /; s/ -MD / /; s/ -MT [^ ]+/ /; s/ -MF [^ ]+/ /' <<<"$cmd")

version=$(cd "$build" && eval "${cmd/ -c / -dM -E -o - -c }" | awk '/define TORCH_VERSION_M(AJOR|INOR) /{printf "%s%s", sep, $3; sep="."}')
[[ $version == 2.* ]] || { echo "check_torch2_compiles: the headers say torch '$version', not 2.x" >&2; exit 1; }
echo "check_torch2_compiles: compiling cohort_torch.cc against torch $version headers (-fsyntax-only)"
(cd "$build" && eval "${cmd/ -c / -fsyntax-only -c }")
echo "check_torch2_compiles: OK, the torch $version branch compiles"
