#!/usr/bin/env bash
# cohort installed into a prefix and used from there, as a user's own project uses it:
#   1. `cmake --install BUILD --prefix P` puts the tool, the libraries, the public headers (and no
#      private one), the CMake package, the pkg-config file, the Python modules, the man page and
#      the docs there;
#   2. an out-of-tree CMake project (tests/install/consumer: a libtorch model trained with
#      cohort::torch::DistributedDataParallel) is configured with find_package(cohort) against P,
#      built, and run under P's `cohort run` on 2 ranks: it must learn and its replicas stay equal;
#   3. a program built with `pkg-config --cflags --libs cohort` alone runs an allreduce on 2 ranks;
#   4. the Python modules import from P, and a 2-rank backend="cohort" job runs with them.
#   tests/install/test_find_package.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/cohort-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
failures=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# 1. The install.
cmake --install "$build" --prefix "$prefix" >"$work/install.log" || { cat "$work/install.log" >&2; exit 1; }
libdir=$(cd "$prefix" && dirname "$(find . -name 'libcohort.so' | head -1)")
libdir=${libdir#./}
for f in bin/cohort include/cohort/cohort.h include/cohort/version.h include/cohort/train/grad_sync.h \
         include/cohort/torch/ddp.h "$libdir/cmake/cohort/cohortConfig.cmake" "$libdir/pkgconfig/cohort.pc" \
         share/man/man1/cohort.1 share/doc/cohort/README.md share/doc/cohort/launcher.md libexec/cohort/fashion_mnist; do
  [[ -e $prefix/$f ]] && pass "installed $f" || fail "not installed: $f"
done
ls "$prefix"/lib/python3/dist-packages/cohort_torch*.so >/dev/null 2>&1 && pass "installed the cohort_torch module" ||
  fail "cohort_torch not in lib/python3/dist-packages"
[[ -e $prefix/lib/python3/dist-packages/cohort/horovod/torch/mpi_ops.py ]] && pass "installed the package cohort.horovod.torch" ||
  fail "cohort/horovod/torch not in lib/python3/dist-packages"
[[ -e $prefix/lib/python3/dist-packages/cohort-horovod.pth && -e $prefix/lib/python3/dist-packages/cohort/horovod_shim/horovod/torch/__init__.py ]] &&
  pass "installed cohort's horovod name (cohort-horovod.pth, cohort/horovod_shim)" || fail "cohort's horovod name is not installed"
[[ -L $prefix/bin/horovodrun && $("$prefix/bin/horovodrun" --help | head -1) == "usage: horovodrun -np N"* ]] &&
  pass "bin/horovodrun runs cohort horovodrun" || fail "no working bin/horovodrun"
# Only the API: every installed header is under include/cohort, and none names a private folder.
stray=$(cd "$prefix/include" && find . -type f ! -path './cohort/*')
[[ -z $stray ]] && pass "every installed header is under include/cohort" || fail "headers outside include/cohort: $stray"
private=$(grep -rhoE '#include "(common|store|transport|collectives|trace|comm|gpu|launch|train|ps)/[^"]*"' \
          "$prefix/include" | sort -u || true)
[[ -z $private ]] && pass "no installed header includes a private one" || fail "installed headers include private ones: $private"
# Every command of `cohort --help` has its entry in the man page.
missing=""
while read -r cmd; do
  grep -q -- "$cmd" "$prefix/share/man/man1/cohort.1" || missing+=" '$cmd'"
done < <("$prefix/bin/cohort" --help | sed -n 's/^  \([a-z][a-z_]*\( [a-z_]*\)\?\)  .*/\1/p' | sed 's/ *$//')
[[ -z $missing ]] && pass "the man page names every command" || fail "the man page lacks:$missing"

# 2. An out-of-tree CMake project against the prefix, run under the installed launcher. Only a build
#    without libtorch (COHORT_INSTALLS_TORCH=OFF, from CMake) has no cohort::torch to offer; where
#    cohort_torch was built, a missing cohortTorchTargets.cmake is the install breakage to catch.
#    (Run by hand without that variable: whether the build tree has libcohort_torch.so.)
torch_targets=$prefix/$libdir/cmake/cohort/cohortTorchTargets.cmake
if [[ -z ${COHORT_INSTALLS_TORCH:-} ]]; then
  COHORT_INSTALLS_TORCH=$([[ -n $(find "$build" -maxdepth 2 -name 'libcohort_torch.so*' -print -quit) ]] && echo ON || echo OFF)
fi
if [[ $COHORT_INSTALLS_TORCH == ON && ! -e $torch_targets ]]; then
  fail "not installed: $libdir/cmake/cohort/cohortTorchTargets.cmake, although this build has cohort_torch" \
       "(cmake/install.cmake); find_package(cohort COMPONENTS torch) cannot work"
elif [[ -e $torch_targets ]]; then
  if cmake -S "$src/tests/install/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
       -DCMAKE_PREFIX_PATH="$prefix" >"$work/consumer.log" 2>&1 &&
     cmake --build "$work/consumer" >>"$work/consumer.log" 2>&1; then
    pass "find_package(cohort COMPONENTS torch): configured and built"
    out=$("$prefix/bin/cohort" run -n 2 "$work/consumer/consumer" 2>&1) && rc=0 || rc=$?
    echo "$out" | sed 's/^/    | /'
    [[ $rc == 0 && $(grep -c "replicas identical" <<<"$out") == 2 ]] &&
      pass "the consumer trained on 2 ranks under the installed cohort run, replicas identical" ||
      fail "the consumer's 2-rank run (exit $rc)"
  else
    fail "the consumer project did not configure or build"; tail -30 "$work/consumer.log" >&2
  fi
else
  echo "SKIP: the consumer project (this cohort was built without libtorch: no cohort::torch)"
fi

# 3. pkg-config alone.
cat >"$work/allreduce.cc" <<'EOF'
#include <cohort/cohort.h>
#include <cstdio>
int main() {
  auto comm = cohort::Communicator::from_env();
  int mine = comm->rank() + 1, sum = 0;
  comm->allreduce(&mine, &sum, 1, cohort::DataType::kInt32, cohort::ReduceOp::kSum);
  std::printf("rank %d: sum %d\n", comm->rank(), sum);
  return sum == comm->size() * (comm->size() + 1) / 2 ? 0 : 1;
}
EOF
pc_flags=$(PKG_CONFIG_PATH=$prefix/$libdir/pkgconfig pkg-config --cflags --libs cohort)
# shellcheck disable=SC2086
if c++ "$work/allreduce.cc" -o "$work/allreduce" $pc_flags -Wl,-rpath,"$prefix/$libdir"; then
  out=$("$prefix/bin/cohort" run -n 2 "$work/allreduce" 2>&1) && rc=0 || rc=$?
  [[ $rc == 0 && $(grep -c "sum 3" <<<"$out") == 2 ]] && pass "pkg-config ($pc_flags): a 2-rank allreduce" ||
    { fail "the pkg-config program's run (exit $rc)"; echo "$out" >&2; }
else
  fail "c++ ... \$(pkg-config --cflags --libs cohort) did not build"
fi

# 4. The Python modules from the prefix.
python=${COHORT_PYTHON:-/usr/bin/python3}
if ls "$prefix"/lib/python3/dist-packages/cohort_torch*.so >/dev/null 2>&1; then
  out=$(PYTHONPATH=$prefix/lib/python3/dist-packages "$prefix/bin/cohort" run --nproc-per-node 2 --python "$python" \
        "$src/tests/python/ddp_script.py" --backend cohort --epochs 1 --samples 512 --out "$work/w.pt" 2>&1) && rc=0 || rc=$?
  [[ $rc == 0 && -s $work/w.pt ]] && pass "a 2-rank backend=\"cohort\" DDP job with the installed cohort_torch" ||
    { fail "the installed cohort_torch's 2-rank job (exit $rc)"; echo "$out" | tail -20 >&2; }
fi

((failures == 0)) || { echo "$failures check(s) failed" >&2; exit 1; }
