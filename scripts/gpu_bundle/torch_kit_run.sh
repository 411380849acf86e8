#!/usr/bin/env bash
# scripts/gpu_check.sh on a lent GPU machine that has CUDA, PyTorch 2.x and a compiler but none of this
# project's build dependencies (no network, no apt). scripts/gpu_bundle/make_torch_kit.sh makes the kit
# (.devtorch/, this script as run.sh); there, from the repo root, with .devtorch carried along:
#
#   bash .devtorch/run.sh            results: $OUT (default /tmp/devtorch-out), at most 6 files
#
# 1. prints the tools (g++, cmake, ninja, nvcc) and every Python that has torch; no g++: exit 3;
# 2. unpacks Debian 12's -dev packages (debs/) into a private prefix ($DEVTORCH_SYSROOT, default
#    /tmp/devtorch-sysroot; never into /) and points CMake, pkg-config and the loader at it;
#    gives the torch Python pytest (pydebs/, via a .pth file, only where pytest is missing) and,
#    where the interpreter has no Python.h, Python 3.12's headers (pyinc/, as -idirafter);
# 3. runs scripts/gpu_check.sh (bounded: the whole script ends within $DEVTORCH_BUDGET_S, default
#    525 s); when its configure or build fails and time is left, once more without the libtorch part
#    (Torch disabled) or without any torch part (COHORT_BUILD_TORCH=OFF), keeping the first logs;
# 4. copies into $OUT: run.log (all of this output), table.txt (gpu_check's table(s)),
#    build-tail.txt (errors and tail of the failing or last build/configure log), env.txt (tools,
#    pythons, environment), gpu-check-logs.tgz (build-gpu/gpu-check*/ and CMake/ctest logs).
#    The table and the build errors are printed last.
#
# Knobs: COHORT_PYTHON (the torch Python), DEVTORCH_BUILD_TYPE (default Release: no debug info, quicker
# to build), GPU_CHECK_BENCH_MAX, DEVTORCH_RETRY=0 (no second attempt), COHORT_GPU_CMAKE_ARGS (appended).
# DEVTORCH_MODE=prepare: steps 1-2 only. DEVTORCH_MODE=configure: only the dependency setup and gpu_check.sh's configure line into
# $DEVTORCH_BUILD_DIR (plus `cmake --build` of $DEVTORCH_TARGETS), for checking this kit on a machine
# without a GPU; extra cmake arguments in DEVTORCH_CONFIGURE_ARGS.
set -uo pipefail
export LC_ALL=C
export PATH="$PATH:/usr/local/cuda/bin:/usr/local/bin:/usr/sbin:/sbin"

kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$kit/.." && pwd)
cd "$repo" || exit 2
OUT=${OUT:-/tmp/devtorch-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || { echo "cannot create OUT=$OUT"; exit 2; }
MODE=${DEVTORCH_MODE:-full}
BUDGET=${DEVTORCH_BUDGET_S:-525}
SYSROOT=${DEVTORCH_SYSROOT:-/tmp/devtorch-sysroot}
build=${COHORT_GPU_BUILD_DIR:-build-gpu}
export COHORT_GPU_BUILD_DIR=$build
arch=x86_64-linux-gnu
ATT=${DEVTORCH_WORK:-/tmp/devtorch-work}   # each attempt's console output (goes into the tarball)
rm -rf "$ATT" && mkdir -p "$ATT"

left() { echo $((BUDGET - SECONDS)); }
say() { printf '\n== [%3ds] %s\n' "$SECONDS" "$*"; }

# ---------------------------------------------------------------- 1. tools and pythons
find_cxx() {
  local c
  for c in "${CXX:-}" g++ c++ $(compgen -c g++- 2>/dev/null | grep -E '^g\+\+-[0-9]+$' | sort -t- -k2 -rn); do
    [[ -n $c ]] && command -v "$c" >/dev/null && { command -v "$c"; return 0; }
  done
  return 1
}

tools() {
  say "tools"
  echo "host: $(hostname 2>/dev/null), $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"), $(uname -m), $(nproc) CPUs," \
    "glibc $(ldd --version 2>/dev/null | head -n 1 | awk '{print $NF}'), user $(id -un 2>/dev/null || id -u)"
  echo "--- g++ --version"; g++ --version 2>&1 | head -n 2
  echo "--- cmake --version"; cmake --version 2>&1 | head -n 1
  echo "--- ninja --version"; ninja --version 2>&1 | head -n 1
  echo "--- nvcc --version"; nvcc --version 2>&1 | tail -n 2
  echo "--- cc: $(command -v cc gcc 2>/dev/null | tr '\n' ' ')"
  echo "--- nvidia-smi -L"; timeout 20 nvidia-smi -L 2>&1 | head -n 8
  echo "--- libnccl/libcudart known to ldconfig:"; ldconfig -p 2>/dev/null | grep -E 'libnccl\.so|libcudart\.so' | head -n 6
  echo "--- nccl.h: $(ls /usr/include/nccl.h /usr/local/cuda/include/nccl.h 2>/dev/null | tr '\n' ' ')"
  echo "--- python3 -c 'import torch;print(torch.__version__, torch.cuda.is_available())'"
  timeout 90 python3 -c 'import torch;print(torch.__version__, torch.cuda.is_available())' 2>&1 | tail -n 2
}

# Every interpreter we can see, with its torch; picks COHORT_PYTHON when not given.
pick_python() {
  say "pythons with torch"
  local cands=() seen=" " py info best="" anytorch=""
  for py in "${COHORT_PYTHON:-}" "$(command -v python3)" "$(command -v python)" /opt/torch/.venv/bin/python3 \
      /opt/conda/bin/python3 /usr/local/bin/python3 /usr/bin/python3 /opt/*/bin/python3 /opt/*/.venv/bin/python3 \
      /venv/bin/python3 /workspace/.venv/bin/python3; do
    [[ -n $py && -x $py ]] || continue
    [[ $seen == *" $py "* ]] && continue
    seen+="$py "
    info=$(timeout 90 "$py" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1 | tail -n 1)
    echo "$py: $info"
    if [[ $info =~ ^3\.[0-9]+\.[0-9]+\ ([0-9]+)\.[^\ ]*\ [^\ ]+\ (True|False)$ ]]; then
      [[ -z $anytorch ]] && anytorch=$py
      [[ -z $best && ${BASH_REMATCH[1]} -ge 2 && ${BASH_REMATCH[2]} == True ]] && best=$py
    fi
  done
  if [[ -z ${COHORT_PYTHON:-} ]]; then
    COHORT_PYTHON=${best:-${anytorch:-$(command -v python3)}}
  fi
  export COHORT_PYTHON
  echo "COHORT_PYTHON=$COHORT_PYTHON"
}

# ---------------------------------------------------------------- 2. the dependencies
unpack_sysroot() {
  say "unpacking $(ls "$kit"/debs/*.deb | wc -l) Debian 12 packages into $SYSROOT"
  rm -rf "$SYSROOT" && mkdir -p "$SYSROOT" || return 1
  local d l t
  for d in "$kit"/debs/*.deb; do
    if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$d" "$SYSROOT" || return 1
    else (cd "$SYSROOT" && ar p "$d" "$(ar t "$d" | grep '^data\.tar')" | tar -x -J -f - 2>/dev/null ||
          ar p "$d" "$(ar t "$d" | grep '^data\.tar')" | tar -x -f -) || return 1
    fi
  done
  rm -rf "$SYSROOT/usr/src" "$SYSROOT/usr/share/doc" "$SYSROOT/usr/share/man"   # sources link to absent ones; docs
  # Absolute symlinks (libz.so -> /lib/.../libz.so.1.2.13) would point into the host: into the prefix.
  while IFS= read -r l; do
    t=$(readlink "$l")
    [[ $t == /* ]] && ln -sfn "$SYSROOT$t" "$l"
  done < <(find "$SYSROOT" -type l)
  # OpenSSL's multiarch headers (opensslconf.h, configuration.h): next to the others, so that the one
  # include directory CMake passes (-isystem $SYSROOT/usr/include) has them all.
  for l in "$SYSROOT"/usr/include/$arch/openssl/*.h; do
    [[ -f $l ]] && cp -p "$l" "$SYSROOT/usr/include/openssl/"
  done
  # pkg-config files name /usr.
  find "$SYSROOT" -name '*.pc' -exec sed -i "s#=/usr#=$SYSROOT/usr#g; s#-I/usr#-I$SYSROOT/usr#g; s#-L/usr#-L$SYSROOT/usr#g" {} +
  # What the loader needs at run time (nothing else, so the host's libssl/libz stay first for others).
  mkdir -p "$SYSROOT/rt"
  for l in libfmt.so.9 libbenchmark.so.1debian; do ln -sfn "$SYSROOT/usr/lib/$arch/$l" "$SYSROOT/rt/$l"; done
  local bad
  bad=$(find "$SYSROOT" -xtype l | head -n 5)
  [[ -z $bad ]] || echo "dangling links in the prefix: $bad"
  echo "prefix: $(du -sh "$SYSROOT" | cut -f1); fmt $(grep -m1 'define FMT_VERSION' "$SYSROOT/usr/include/fmt/core.h" | awk '{print $3}')," \
    "gtest $(ls "$SYSROOT"/usr/lib/$arch/libgtest.a >/dev/null 2>&1 && echo ok), openssl $(grep -m1 'OPENSSL_VERSION_STR' "$SYSROOT/usr/include/openssl/opensslv.h" | awk '{print $NF}')"
}

export_env() {
  local pre=$SYSROOT/usr
  export CMAKE_PREFIX_PATH="$pre${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export OPENSSL_ROOT_DIR=$pre
  export ZLIB_ROOT=$pre
  export CMAKE_INCLUDE_PATH="$pre/include${CMAKE_INCLUDE_PATH:+:$CMAKE_INCLUDE_PATH}"
  export CMAKE_LIBRARY_PATH="$pre/lib/$arch${CMAKE_LIBRARY_PATH:+:$CMAKE_LIBRARY_PATH}"
  export PKG_CONFIG_PATH="$pre/lib/$arch/pkgconfig:$pre/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$SYSROOT/rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # CMake 4 refuses policy versions below 3.5 in old package files; harmless for CMake 3.
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  local cxx
  cxx=$(find_cxx) && export CXX=$cxx
  if [[ -z ${CC:-} ]] && ! command -v cc >/dev/null && ! command -v gcc >/dev/null; then
    local gcc=${cxx/g++/gcc}
    [[ -x $gcc ]] && export CC=$gcc
  fi
}

python_side() {
  local py=$COHORT_PYTHON
  [[ -x $py ]] || { echo "no python to prepare"; return 0; }
  say "python side ($py)"
  # pybind11: the interpreter's own (pip) copy first, Debian's 2.10 (in the prefix) otherwise.
  local pyb
  pyb=$(timeout 60 "$py" -c 'import pybind11, os; print(os.path.dirname(pybind11.get_cmake_dir().rstrip("/")))' 2>/dev/null | tail -n 1)
  if [[ -n $pyb && -d $pyb ]]; then
    pyb=$(cd "$pyb/../.." && pwd)   # .../pybind11 (share/cmake/pybind11 below it)
    export pybind11_ROOT=$pyb
    echo "pybind11: $(timeout 60 "$py" -c 'import pybind11; print(pybind11.__version__)' 2>/dev/null) from $pyb"
  else
    echo "pybind11: not in $py; Debian's 2.10.3 from the prefix"
  fi
  # Python.h
  local inc ver
  inc=$(timeout 60 "$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null | tail -n 1)
  ver=$(timeout 60 "$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null | tail -n 1)
  if [[ -f $inc/Python.h ]]; then
    echo "Python.h: $inc"
  elif [[ $ver == 3.12 && -f $kit/pyinc/python3.12-include.tgz ]]; then
    mkdir -p "$SYSROOT/pyinc" && tar -C "$SYSROOT/pyinc" -xzf "$kit/pyinc/python3.12-include.tgz"
    export CXXFLAGS="${CXXFLAGS:+$CXXFLAGS }-idirafter$SYSROOT/pyinc/python3.12"
    echo "Python.h: none in '$inc'; using CPython 3.12.1's headers ($SYSROOT/pyinc/python3.12, -idirafter)"
  else
    echo "Python.h: none in '$inc' (python $ver; a kit may carry 3.12's as pyinc/python3.12-include.tgz): cohort_torch will not compile"
  fi
  # pytest (tests/python) and setuptools (torch.utils.cpp_extension): Debian's, appended to sys.path by a
  # .pth file in the interpreter's site-packages (ctest sets PYTHONPATH itself, so PYTHONPATH cannot).
  local need=""
  timeout 60 "$py" -c 'import pytest' >/dev/null 2>&1 || need+="pytest "
  timeout 120 "$py" -c 'import torch.utils.cpp_extension' >/dev/null 2>&1 || need+="cpp_extension(setuptools?) "
  if [[ -n $need ]]; then
    mkdir -p "$SYSROOT/py"
    local d
    for d in "$kit"/pydebs/*.deb; do dpkg-deb -x "$d" "$SYSROOT/py" 2>/dev/null || (cd "$SYSROOT/py" && ar p "$d" "$(ar t "$d" | grep '^data\.tar')" | tar -x -J -f -); done
    local site
    site=$(timeout 60 "$py" -c 'import site, sysconfig; s = site.getsitepackages(); print(s[0] if s else sysconfig.get_paths()["purelib"])' 2>/dev/null | tail -n 1)
    if [[ -d $site ]] && echo "$SYSROOT/py/usr/lib/python3/dist-packages" >"$site/zz_devtorch_debian.pth"; then
      echo "missing: $need-> added $site/zz_devtorch_debian.pth (Debian 12's pytest 7.2.1, setuptools 66, at the end of sys.path)"
    else
      echo "missing: $need; cannot write a .pth into '$site'"
    fi
    echo "now: $(timeout 60 "$py" -c 'import pytest; print("pytest", pytest.__version__)' 2>&1 | tail -n 1);" \
      "$(timeout 120 "$py" -c 'import torch.utils.cpp_extension as c; print("cpp_extension ok")' 2>&1 | tail -n 1)"
  else
    echo "pytest and torch.utils.cpp_extension import already"
  fi
}

print_env() {
  say "environment for the build"
  local v
  for v in CXX CC CXXFLAGS COHORT_PYTHON CMAKE_PREFIX_PATH OPENSSL_ROOT_DIR ZLIB_ROOT pybind11_ROOT CMAKE_INCLUDE_PATH \
      CMAKE_LIBRARY_PATH PKG_CONFIG_PATH LD_LIBRARY_PATH CMAKE_BUILD_PARALLEL_LEVEL COHORT_GPU_CMAKE_ARGS GPU_CHECK_BENCH_MAX; do
    echo "$v=${!v-<unset>}"
  done
}

# ---------------------------------------------------------------- 3. gpu_check.sh
attempt=0
run_gpu_check() {   # ARGS...: extra configure arguments
  attempt=$((attempt + 1))
  local t=$(( $(left) - 15 ))
  export COHORT_GPU_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=${DEVTORCH_BUILD_TYPE:-Release} -DCOHORT_BUILD_TORCH=ON $*${USER_CMAKE_ARGS:+ $USER_CMAKE_ARGS}"
  say "gpu_check.sh attempt $attempt (timeout ${t}s), COHORT_GPU_CMAKE_ARGS=$COHORT_GPU_CMAKE_ARGS"
  # Into a file, shown as it grows (a pipe could be held open by a stray grandchild after the timeout).
  local f=$ATT/attempt$attempt.txt
  : >"$f"
  timeout -k 10 "$t" bash "${DEVTORCH_GPU_CHECK:-scripts/gpu_check.sh}" </dev/null >"$f" 2>&1 &
  local pid=$!
  tail -n +1 -f --pid="$pid" "$f" 2>/dev/null
  wait "$pid"
  local rc=$?
  echo "== gpu_check.sh attempt $attempt: exit $rc$( ((rc == 124 || rc == 137)) && echo " (timed out after ${t}s)")"
  return "$rc"
}

failed_step() {   # configure | build | "" (from the latest attempt's rows)
  local f=$ATT/attempt$attempt.txt
  grep -qE '^configure \(against torch.* FAIL ' "$f" && { echo configure; return; }
  grep -qE '^build +FAIL ' "$f" && { echo build; return; }
  echo ""
}

# What to drop for a second attempt, from the failing log; empty: nothing sensible.
retry_args() {
  local step=$1 log
  if [[ $step == configure ]]; then
    log=$build/gpu-check/configure.log
    local errs
    errs=$(grep -A 12 'CMake Error' "$log" 2>/dev/null)
    if grep -qE 'integrations/python' <<<"$errs"; then
      echo "-DCOHORT_BUILD_TORCH=OFF"
    elif grep -qE 'Torch|Caffe2|integrations/torch|examples/fashion_mnist|tests/torch_integration' <<<"$errs"; then
      echo "-DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON"
    fi
    return
  fi
  log=$build/gpu-check/build.log
  local failed
  failed=$(grep -E '^FAILED: ' "$log" 2>/dev/null)
  echo "failed build edges: $(tr '\n' ' ' <<<"$failed" | cut -c1-300)" >&2
  [[ -n $failed ]] || return
  if grep -q 'integrations/python' <<<"$failed"; then
    echo "-DCOHORT_BUILD_TORCH=OFF"
  elif ! grep -vqE 'integrations/torch|examples/fashion_mnist|tests/torch_integration' <<<"$failed"; then
    echo "-DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON"
  fi
}

# ---------------------------------------------------------------- 4. results
error_excerpt() {   # LOG: compiler/CMake errors first, then the tail
  local log=$1
  [[ -f $log ]] || { echo "(no $log)"; return; }
  echo "--- $log: $(wc -l <"$log") lines; errors:"
  grep -nE '^FAILED: |error:|Error|CMake Error|undefined reference|No such file' "$log" | head -n 40 | cut -c1-400
  echo "--- first failure in context:"
  awk '/^FAILED: /{p=1} p{print; if (++n >= 60) exit}' "$log" | cut -c1-400
  echo "--- last 40 lines:"
  tail -n 40 "$log" | cut -c1-400
}

collect() {
  say "collecting results into $OUT"
  local g=$build/gpu-check log
  # The log to show: the failing step's, else the build log.
  case $(failed_step) in
    configure) log=$g/configure.log ;;
    *) log=$g/build.log; [[ -f $log ]] || log=$g/configure.log ;;
  esac
  {
    local a
    for a in "$ATT"/attempt*.txt; do
      [[ -f $a ]] || continue
      echo "### $(basename "$a" .txt)"
      awk '/^step +result +detail/{p=1} p' "$a"
      grep -qE '^step +result +detail' "$a" || grep -E ' (PASS|FAIL|SKIP) ' "$a"
    done
  } >"$OUT/table.txt"
  {
    if [[ -d $build/gpu-check-attempt1 ]]; then
      echo "##### attempt 1"
      local l1=$build/gpu-check-attempt1/build.log
      [[ -f $l1 ]] || l1=$build/gpu-check-attempt1/configure.log
      error_excerpt "$l1"
      echo; echo "##### attempt 2"
    fi
    error_excerpt "$log"
    if [[ $log == *configure.log ]]; then
      echo "--- CMake's own error log:"
      tail -n 60 "$build/CMakeFiles/CMakeError.log" 2>/dev/null | cut -c1-300
      grep -n -B2 -A20 'CMake Error' "$log" | head -n 80 | cut -c1-300
    fi
    # The step that was running last (the one a timeout cut short, if any).
    local newest
    newest=$(ls -t "$g"/*.log "$g"/*.txt 2>/dev/null | head -n 1)
    if [[ -n $newest && $newest != "$log" ]]; then
      echo "--- most recent log: $newest (last 15 lines)"
      tail -n 15 "$newest" | cut -c1-300
    fi
  } >"$OUT/build-tail.txt"
  local extra=()
  for f in "$build/CMakeCache.txt" "$build/CMakeFiles/CMakeError.log" "$build/CMakeFiles/CMakeConfigureLog.yaml" \
      "$build/Testing/Temporary/LastTest.log" "$build/Testing/Temporary/LastTestsFailed.log" "$build/.ninja_log"; do
    [[ -f $f ]] && extra+=("$f")
  done
  tar -czf "$OUT/gpu-check-logs.tgz" "$build"/gpu-check* "${extra[@]}" "$ATT" 2>/dev/null
  ls -l "$OUT" | sed 's/^/  /'
}

main() {
  echo "devtorch run.sh: $(date -u +%Y-%m-%dT%H:%M:%SZ), repo $repo ($(git -C "$repo" log -1 --format='%h %s' 2>/dev/null | cut -c1-80))," \
    "mode $MODE, budget ${BUDGET}s, OUT $OUT"
  { tools; } 2>&1 | tee "$OUT/env.txt"
  if ! find_cxx >/dev/null; then
    echo "NO C++ COMPILER: no g++ (nor c++, g++-N) on this machine; cannot build. Stopping (exit 3)." | tee -a "$OUT/env.txt"
    return 3
  fi
  { pick_python; } 2>&1 | tee -a "$OUT/env.txt"
  COHORT_PYTHON=$(grep -m1 '^COHORT_PYTHON=' "$OUT/env.txt" | cut -d= -f2-)
  export COHORT_PYTHON
  # cmake/ninja from the interpreter's pip packages, where the system has none.
  local t pybin
  pybin=$(dirname "$COHORT_PYTHON")
  for t in cmake ninja; do
    if ! command -v "$t" >/dev/null && [[ -x $pybin/$t ]]; then
      export PATH="$PATH:$pybin"; echo "$t: not on PATH; using $pybin/$t" | tee -a "$OUT/env.txt"
    fi
  done
  unpack_sysroot 2>&1 | tee -a "$OUT/env.txt"
  # The examples' data (Debian's dataset-fashion-mnist and wordnet-base: data files only) at their
  # packaged paths, so that gpu_check.sh runs fashion_mnist, resnet and bert with --device cuda.
  for d in "$kit"/data/*.deb; do
    [[ -f $d ]] || continue
    dpkg-deb -x "$d" / 2>/dev/null || (cd / && ar p "$d" "$(ar t "$d" | grep '^data\.tar')" | tar -x -J -f - 2>/dev/null ||
      ar p "$d" "$(ar t "$d" | grep '^data\.tar')" | tar -x -f -)
    echo "data: $(basename "$d")" | tee -a "$OUT/env.txt"
  done
  echo "fashion-mnist: $(ls /usr/share/datasets/fashion-mnist 2>&1 | tr '\n' ' '); wordnet: $(ls /usr/share/wordnet 2>&1 | grep -c '^data\.') data files" |
    tee -a "$OUT/env.txt"
  export_env
  if [[ $MODE == full || $MODE == prepare ]]; then
    # Not in a pipeline: its exports (pybind11_ROOT, CXXFLAGS) must stay in this shell.
    python_side >"$ATT/python_side.txt" 2>&1
    tee -a "$OUT/env.txt" <"$ATT/python_side.txt"
  fi
  USER_CMAKE_ARGS=${COHORT_GPU_CMAKE_ARGS:-}
  print_env 2>&1 | tee -a "$OUT/env.txt"

  [[ $MODE == prepare ]] && return 0
  if [[ $MODE == configure ]]; then
    local bdir=${DEVTORCH_BUILD_DIR:-/tmp/devtorch-cfg}
    say "configure only into $bdir (gpu_check.sh's configure line)"
    cmake -S . -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOHORT_PYTHON="$COHORT_PYTHON" \
      ${DEVTORCH_CONFIGURE_ARGS:-} ${USER_CMAKE_ARGS:-} || return 1
    if [[ -n ${DEVTORCH_TARGETS:-} ]]; then
      say "building $DEVTORCH_TARGETS"
      cmake --build "$bdir" -j "${DEVTORCH_JOBS:-2}" --target $DEVTORCH_TARGETS || return 1
    fi
    return 0
  fi

  rm -rf "$build/gpu-check" "$build/gpu-check-attempt1"
  local can_args=1
  if ! grep -q 'COHORT_GPU_CMAKE_ARGS' "${DEVTORCH_GPU_CHECK:-scripts/gpu_check.sh}"; then
    can_args=0
    echo "note: this scripts/gpu_check.sh ignores COHORT_GPU_CMAKE_ARGS: RelWithDebInfo build, no second attempt"
  fi
  run_gpu_check
  local rc=$? step args
  step=$(failed_step)
  if [[ -n $step && ${DEVTORCH_RETRY:-1} != 0 && $can_args == 1 ]]; then
    args=$(retry_args "$step")
    if [[ -z $args ]]; then
      echo "== the $step step failed; nothing to drop for a second attempt"
    elif (( $(left) < 150 )); then
      echo "== the $step step failed; only $(left)s left, no second attempt (would use: $args)"
    else
      echo "== the $step step failed; second attempt with $args (attempt 1's logs: $build/gpu-check-attempt1/)"
      cp -a "$build/gpu-check" "$build/gpu-check-attempt1"
      run_gpu_check "$args"
      rc=$?
    fi
  fi
  collect
  say "done (gpu_check.sh exit $rc); gpu_check's table(s):"
  cat "$OUT/table.txt"
  say "build log excerpt ($OUT/build-tail.txt; every log in gpu-check-logs.tgz)"
  head -c 6000 "$OUT/build-tail.txt"
  echo
  echo "devtorch run.sh: exit $rc after ${SECONDS}s"
  return "$rc"
}

main 2>&1 | tee "$OUT/run.log.tmp"
rc=${PIPESTATUS[0]}
mv -f "$OUT/run.log.tmp" "$OUT/run.log"
exit "$rc"
