#!/usr/bin/env bash
# Builds the cohort wheel (cohort_torch, cohort_ps and the `cohort` tool, as CMake built them) with
# Debian's python3-build, without build isolation (nothing is downloaded), into BUILD_DIR/dist.
#   scripts/build_wheel.sh [BUILD_DIR (default build)]        prints the wheel's path
# The build runs in a copy of integrations/python/wheel inside BUILD_DIR, so the source tree gets no
# build/ or egg-info folders. PYTHON (default /usr/bin/python3) must be the interpreter CMake built
# the modules for (COHORT_PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(cd "${1:-build}" && pwd)
python=${PYTHON:-/usr/bin/python3}
"$python" -c 'import build' 2>/dev/null ||
  { echo "scripts/build_wheel.sh: $python has no 'build' module (apt-get install python3-build)" >&2; exit 1; }
stage=$build/wheel-stage
rm -rf "$stage" "$build/dist"
cp -r integrations/python/wheel "$stage"
CMAKE_BINARY_DIR=$build "$python" -m build --wheel --no-isolation --outdir "$build/dist" "$stage" >"$build/wheel.log" 2>&1 ||
  { tail -30 "$build/wheel.log" >&2; exit 1; }
rm -rf "$stage"
ls "$build"/dist/cohort-*.whl
