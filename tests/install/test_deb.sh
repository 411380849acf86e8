#!/usr/bin/env bash
# The Debian package on a clean Debian 12: `cpack -G DEB` in BUILD_DIR, then, in a root that
# debootstrap made from Debian's mirror (nothing of this machine's /usr in it), `apt-get install
# ./cohort_*.deb` must bring every dependency by Debian's package names, and from the installed files
# alone the main job runs (2-process Fashion-MNIST training under /usr/bin/cohort run), `cohort
# doctor` passes on the host, and `import cohort_torch` works.
#   tests/install/test_deb.sh BUILD_DIR
#   tests/install/test_deb.sh --prepare      only make the minimal root (scripts/test.sh starts this in
#                                            the background before it builds: the download and unpacking
#                                            then overlap the compiling; the test waits for it)
# Exits 77 (ctest: skipped, with the reason) where it cannot run: not root, no debootstrap, no mirror.
# The minimal root is made once and kept (COHORT_DEB_BASE, default /var/tmp/cohort-bookworm-base);
# every run installs into a fresh copy of it. Packages come through this machine's apt cache
# (/var/cache/apt/archives, bind-mounted), so what setup.sh already fetched is not fetched again.
set -euo pipefail
# In a mount namespace of its own: the bind mounts below go with the test's last process, however it
# ends (a ctest timeout kills it).
if [[ -z ${COHORT_DEB_TEST_NS:-} && $(id -u) == 0 ]] && command -v unshare >/dev/null; then
  COHORT_DEB_TEST_NS=1 exec unshare --mount --propagation private "$0" "$@"
fi
base=${COHORT_DEB_BASE:-/var/tmp/cohort-bookworm-base}
skip() { echo "SKIP: $*"; exit 77; }
[[ $(id -u) == 0 ]] || skip "needs root (debootstrap, chroot, mounts)"
command -v debootstrap >/dev/null || skip "no debootstrap (apt-get install debootstrap)"

# The minimal root, made once (under a lock: a --prepare run may be making it right now).
make_base() {
  exec 9>"$base.lock"
  flock 9
  [[ -x $base/usr/bin/apt-get ]] && return 0
  local mirror=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}
  mirror=${mirror:-http://deb.debian.org/debian}
  rm -rf "$base.tmp"
  if ! debootstrap --variant=minbase --cache-dir=/var/cache/apt/archives bookworm "$base.tmp" "$mirror" \
       >"$base.log" 2>&1; then
    tail -5 "$base.log"
    skip "debootstrap bookworm from $mirror failed ($base.log)"
  fi
  mv "$base.tmp" "$base"
}
if [[ $1 == --prepare ]]; then
  make_base
  exit 0
fi
build=$(cd "$1" && pwd)
command -v cpack >/dev/null || skip "no cpack"
command -v dpkg-shlibdeps >/dev/null || skip "no dpkg-shlibdeps (apt-get install dpkg-dev)"

# A root of about 1.5 GB per run, named by this process: those of runs that were killed go now.
for d in /var/tmp/cohort-deb.*; do
  [[ -d $d ]] && ! kill -0 "${d##*.}" 2>/dev/null && rm -rf "$d"
done
work=/var/tmp/cohort-deb.$$
mkdir -p "$work"
root=$work/root
mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
failures=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# 1. The package.
(cd "$build" && cpack -G DEB >"$work/cpack.log" 2>&1) || { tail -30 "$work/cpack.log" >&2; echo "FAIL: cpack -G DEB" >&2; exit 1; }
deb=$(ls "$build"/cohort_*.deb | head -1)
pass "cpack made $(basename "$deb")"
depends=$(dpkg-deb -f "$deb" Depends)
echo "    Depends: $depends"
[[ $depends == *libc6* && $depends == *python3-torch* ]] && pass "its dependencies are Debian package names" ||
  fail "unexpected Depends: $depends"

# 2. A clean Debian 12 root: made once, copied fresh for every run.
make_base
cp -a "$base" "$root"
# The same archives as this machine (updates and security included): the versions the package was
# built against.
if [[ -d /etc/apt/sources.list.d ]]; then cp /etc/apt/sources.list.d/*.sources "$root/etc/apt/sources.list.d/" 2>/dev/null || true; fi
[[ -f /etc/apt/sources.list ]] && cp /etc/apt/sources.list "$root/etc/apt/sources.list"
bind() {  # SOURCE TARGET
  mkdir -p "$2"
  mount --bind "$1" "$2"
  mounts+=("$2")
}
bind /proc "$root/proc"
bind /dev "$root/dev"
bind /sys "$root/sys"
bind /var/cache/apt/archives "$root/var/cache/apt/archives"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
# What Debian's installer writes and debootstrap's minimal root lacks: "localhost" and the host's own
# name resolve (cohort run -H, which cohort doctor runs, hosts the store at this host's name; without
# it the launcher stops with one line, tests/launch/run_test.cc).
[[ -s $root/etc/hosts ]] ||
  printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\t\tlocalhost ip6-localhost ip6-loopback\n' "$(hostname)" >"$root/etc/hosts"
cp "$deb" "$root/tmp/"
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
                   DEBIAN_FRONTEND=noninteractive bash -c "$1"; }

# 3. apt installs it with what it depends on, and no more (recommended packages, python3-torch's among
# them, would bring a desktop's worth); the main job's data set is asked for by name.
if in_root "apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends -o Dpkg::Options::=--force-unsafe-io /tmp/$(basename "$deb") \
            dataset-fashion-mnist" >"$work/apt.log" 2>&1; then
  pass "apt-get install ./$(basename "$deb") in a clean Debian 12 root"
else
  tail -30 "$work/apt.log" >&2
  echo "FAIL: apt-get install of the package" >&2; exit 1
fi

# 4. From the installed files only.
out=$(in_root "cohort --version") && [[ $out == "cohort "* ]] && pass "cohort --version: $out" || fail "cohort --version"
out=$(in_root "cd /tmp && timeout -k 5 240 cohort run --nproc-per-node 2 /usr/libexec/cohort/fashion_mnist --model mlp \
               --epochs 1 --train-samples 6000 2>&1") && rc=0 || rc=$?
echo "$out" | grep -E "test accuracy|epoch: 0, step: 20," | head -3 | sed 's/^/    | /'
[[ $rc == 0 ]] && grep -q "test accuracy" <<<"$out" && pass "the main job trained on 2 processes from the installed files" ||
  { fail "the main job (exit $rc)"; echo "$out" | tail -20 >&2; }
out=$(in_root "cohort doctor 2>&1") && rc=0 || rc=$?
[[ $rc == 0 ]] && pass "cohort doctor on the installed system" || { fail "cohort doctor (exit $rc)"; echo "$out" | tail -20 >&2; }
out=$(in_root "cd /tmp && python3 -c 'import torch, cohort_torch; print(cohort_torch.__file__)'" 2>&1) && rc=0 || rc=$?
[[ $rc == 0 && $out == /usr/lib/python3/dist-packages/cohort_torch* ]] && pass "import cohort_torch: $out" ||
  { fail "import cohort_torch (exit $rc)"; echo "$out" | tail -5 >&2; }
out=$(in_root "man -w cohort 2>/dev/null || ls /usr/share/man/man1/cohort.1*") && pass "the man page: $out" || fail "no man page"

((failures == 0)) || { echo "$failures check(s) failed" >&2; exit 1; }
