#!/usr/bin/env bash
# Makes the real-GPU check bundle from an already-built tree, for a GPU machine without this project's
# build dependencies (e.g. a lent machine with only CUDA and PyTorch): copies (debug info stripped) of
# the binaries that exercise the GPU, the non-glibc shared libraries they need that such an image may
# lack, check.sh and localssh. Builds nothing.
#   scripts/gpu_bundle/make.sh [BUILD_DIR (build)] [BUNDLE_DIR (.devbundle, git-ignored)]
# then, on the GPU machine, from the repo root with the bundle carried along:  bash .devbundle/check.sh
# It ran on an NVIDIA H200 on 2026-11-26 (bench/results/gpu-check-h200-2026-11-26T0211Z.txt).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
build=$(cd "${1:-$repo/build}" && pwd)
mkdir -p "${2:-$repo/.devbundle}"
bundle=$(cd "${2:-$repo/.devbundle}" && pwd)
bins=("$build/tools/cohort" "$build/tests/gpu/gpu_tests")
for b in "${bins[@]}"; do [[ -x $b ]] || { echo "missing: $b" >&2; exit 1; }; done

rm -rf "${bundle:?}/bin" "${bundle:?}/lib" "${bundle:?}/fallback"
mkdir -p "$bundle/bin" "$bundle/lib"
cp "$here/check.sh" "$here/localssh" "$bundle/"
for b in "${bins[@]}"; do
  # Keep the symbol table (readable backtraces), drop DWARF (93 MB -> ~3 MB).
  strip --strip-debug -o "$bundle/bin/$(basename "$b")" "$b"
  if readelf -d "$b" | grep -E 'RPATH|RUNPATH' | grep -q "$build"; then
    echo "note: $b has a RUNPATH into $build; copy those libraries too" >&2
  fi
done

# copy SONAME [SUBDIR]: the library the loader resolves here for our binaries, under its SONAME.
resolve() { ldd "${bins[@]}" | awk -v n="$1" '$1 == n && $2 == "=>" {print $3; exit}'; }
copy() {
  local p dest=$bundle/${2:-lib}
  p=$(resolve "$1")
  [[ -n $p ]] || p=$(ldconfig -p | awk -v n="$1" '$1 == n && /x86-64/ {print $NF; exit}')
  [[ -n $p ]] || { echo "cannot find $1" >&2; exit 1; }
  mkdir -p "$dest"
  cp -L "$p" "$dest/$1"
}
# Always used: not in a stock Ubuntu/NGC image without Debian dev packages.
for n in $(ldd "${bins[@]}" | awk '$2 == "=>" {print $1}' | sort -u); do
  case $n in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|linux-vdso*) ;;  # glibc
    libstdc++.so.*|libgcc_s.so.*) ;;                                                   # newer on the image
    libcrypto.so.*|libssl.so.*|libz.so.*) ;;                                           # base-image libs: fallback only
    *) copy "$n" lib ;;
  esac
done
# Used only when the image lacks them (check.sh asks ldd): each in its own folder so that
# one missing library does not shadow the image's others.
copy libcrypto.so.3 fallback/crypto
copy libz.so.1 fallback/z
copy libstdc++.so.6 fallback/stdcxx   # needed only where the image's libstdc++ predates GLIBCXX_3.4.30 (GCC 12)
copy libgcc_s.so.1 fallback/stdcxx

{
  echo "bundle made $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname) ($(. /etc/os-release; echo "$PRETTY_NAME"))"
  echo "repo HEAD: $(git -C "$repo" log -1 --format='%h %cI %s' 2>/dev/null)"
  for b in "${bins[@]}"; do
    echo "$(basename "$b"): built $(date -u -r "$b" +%Y-%m-%dT%H:%MZ) from $b, sha256 $(sha256sum <"$b" | cut -c1-16)"
  done
  for b in "${bins[@]}"; do
    echo "$(basename "$b") needs: $(objdump -T "$b" | grep -oE '(GLIBC|GLIBCXX|CXXABI)_[0-9.]+' | sort -uV |
      awk -F_ '{m[$1]=$0} END {for (k in m) printf "%s ", m[k]}')"
  done
  echo "files:"; (cd "$bundle" && find bin lib fallback -type f | sort | xargs ls -l | awk '{print "  " $5 "\t" $9}')
} >"$bundle/MANIFEST.txt"
cat "$bundle/MANIFEST.txt"
du -sh "$bundle"
