#!/usr/bin/env bash
# The test suite under the sanitizers (scripts/test.sh runs this after the ordinary suite; set
# COHORT_SANITIZERS=0 there to skip it):
#   ASan + UBSan: every unit and multi-process test (all but python, torch_integration, fuzz, multihost,
#                 gpu and repo, which need torch, clang's fuzzing runtime, namespaces or a GPU, or check
#                 the tree rather than the code; and the parameter-server example's accuracy run,
#                 PsExample, 46 s of training under ASan whose code paths the ps tests cover);
#   TSan:         the transport, comm, store and parameter-server tests (the threads that share state
#                 live there), and the flight recorder ring under concurrent writers and a reader
#                 (FlightRing.*). It builds only what those tests run: their programs, and the tool
#                 with the commands they start (`run`, `store serve`, `bench store`, `ps serve`).
# Both build without the PyTorch integrations and the benchmarks, at -O1 -g1 (what is off the data path --
# launcher, tool commands, examples -- at -O0: COHORT_OFF_PATH_OPT in CMakeLists.txt): about half the compile
# time of -O2 -g on the 2-core CI machine, with line numbers in every report.
# ASan + UBSan builds with clang: GCC 12 took 44-63 s for src/comm/communicator_impl.cc with both
# sanitizers at -O1, clang 14 31-39 s, and the whole build about 40 % less (docs/testing.md). A second
# compiler's diagnostics come with it. TSan stays with GCC, which compiles it faster than clang.
#
# Builds beside tests: while one sanitizer's tests run, the next sanitizer's tree compiles in the
# background at the lowest CPU priority (SCHED_IDLE: a test's process always takes the CPU first), on
# what the tests leave idle -- most of these tests wait on processes, sockets and deadlines.
# scripts/test.sh starts `--build-only` the same way while the ordinary suite runs. A tree is locked
# (<dir>/.sanitize.lock) while it is built or tested, so a run waits for a background build of the same
# tree, prints its log, and then finds nothing left to do (or builds what it left, at full priority).
#   scripts/sanitize.sh [address] [thread]      default: both, into build-asan/ and build-tsan/
#   scripts/sanitize.sh --build-only [kinds]    only build them (at the lowest CPU priority; each tree's
#                                               output in <dir>/.sanitize-background.log)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build_only=0
if [[ ${1:-} == --build-only ]]; then
  build_only=1
  shift
fi
kinds=("$@")
((${#kinds[@]})) || kinds=(address thread)
for kind in "${kinds[@]}"; do
  [[ $kind == address || $kind == thread ]] || { echo "sanitize: unknown sanitizer '$kind' (address or thread)" >&2; exit 2; }
done
base=${COHORT_BUILD_DIR:-build}
common=(-G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -g1" "-DCMAKE_C_FLAGS_RELEASE=-O1 -g1"
        -DCOHORT_BUILD_TORCH=OFF -DCOHORT_BUILD_BENCHMARKS=OFF)

dir_of() { if [[ $1 == address ]]; then echo "$base-asan"; else echo "$base-tsan"; fi; }

# The lowest CPU priority there is (SCHED_IDLE), or nice 19 where chrt cannot set it.
idle=(nice -n 19)
if chrt --idle 0 true 2>/dev/null; then idle=(chrt --idle 0); fi

build() {  # KIND [command prefix, e.g. the idle priority]
  local kind=$1 dir
  shift
  dir=$(dir_of "$kind")
  case $kind in
    address)
      echo "sanitize: ASan + UBSan build in $dir"
      "$@" cmake -S . -B "$dir" "${common[@]}" -DCOHORT_SANITIZE=address \
        -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null &&
        "$@" cmake --build "$dir" -j "$(nproc)"
      ;;
    thread)
      echo "sanitize: TSan build in $dir (transport, comm, store and ps tests; the flight recorder ring's)"
      # The tool with only the commands these tests start (tools/CMakeLists.txt).
      "$@" cmake -S . -B "$dir" "${common[@]}" -DCOHORT_SANITIZE=thread \
        "-DCOHORT_TOOL_COMMANDS=run;store;bench_store;ps" >/dev/null &&
        "$@" cmake --build "$dir" -j "$(nproc)" --target transport_tests comm_tests comm_worker store_tests \
          trace_tests ps_tests ps_worker cohort
      ;;
  esac
}

run_tests() {  # KIND
  local kind=$1 dir rc=0
  dir=$(dir_of "$kind")
  case $kind in
    address)
      # Leaks inside a library cohort talks to (libpmix) are suppressed by library
      # (scripts/lsan_suppressions.txt); every leak in cohort's own code still fails its test.
      # The Descriptors tests run the launcher with no descriptor to spare, and the sanitizers' runtime
      # needs some of its own: UBSan's vptr check probes memory through a pipe, and with none to be had
      # it reports every virtual call as "invalid vptr" (seen there on the EventQueue's shared_ptr).
      (cd "$dir" && LSAN_OPTIONS="suppressions=$root/scripts/lsan_suppressions.txt:print_suppressions=0" \
        ctest --output-on-failure -j 2 -LE 'python|torch_integration|fuzz|multihost|slurm|gpu$|repo' \
        -E '^(PsExample|Descriptors)\.') || rc=1
      ;;
    thread)
      # Not the parameter-server example's accuracy run (41 s under TSan), as under ASan.
      (cd "$dir" && ctest --output-on-failure -j 2 -L 'transport|comm|store|ps' -E '^PsExample\.') || rc=1
      (cd "$dir" && ctest --output-on-failure --no-tests=error -R '^FlightRing\.') || rc=1
      ;;
  esac
  return $rc
}

# Builds KINDS one after the other in the background at the lowest priority, each under its tree's lock
# (taken here, in the order given, before the first build starts), its output in the tree's log.
background_build() {  # KINDS...
  (
    fds=()
    for kind; do
      dir=$(dir_of "$kind")
      mkdir -p "$dir"
      exec {fd}>"$dir/.sanitize.lock"
      flock "$fd"
      fds+=("$fd")
    done
    i=0
    for kind; do
      dir=$(dir_of "$kind")
      build "$kind" "${idle[@]}" >"$dir/.sanitize-background.log" 2>&1 || true
      eval "exec ${fds[$i]}>&-"
      i=$((i + 1))
    done
  ) </dev/null
}

if ((build_only)); then
  background_build "${kinds[@]}"
  exit 0
fi

rc=0
bg=""
for ((k = 0; k < ${#kinds[@]}; k++)); do
  kind=${kinds[$k]}
  dir=$(dir_of "$kind")
  mkdir -p "$dir"
  exec {lock}>"$dir/.sanitize.lock"
  flock "$lock"  # a background build of this tree (scripts/test.sh's, or the loop's below) ends first
  if [[ -s $dir/.sanitize-background.log ]]; then
    echo "sanitize: $dir was built in the background, beside the tests before; its output:"
    cat "$dir/.sanitize-background.log"
    rm -f "$dir/.sanitize-background.log"
  fi
  if build "$kind"; then
    # The next trees compile while this one's tests run.
    if [[ -z $bg ]] && ((k + 1 < ${#kinds[@]})); then
      { exec {lock}>&-; background_build "${kinds[@]:k+1}"; } &
      bg=$!
    fi
    run_tests "$kind" {lock}>&- || rc=1  # the tests do not inherit the lock
  else
    rc=1
  fi
  exec {lock}>&-
done
[[ -z $bg ]] || wait "$bg" || true
exit $rc
