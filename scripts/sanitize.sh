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
#   scripts/sanitize.sh [address] [thread]      default: both, into build-asan/ and build-tsan/
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
kinds=("$@")
((${#kinds[@]})) || kinds=(address thread)
base=${COHORT_BUILD_DIR:-build}
common=(-G Ninja -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -g1" "-DCMAKE_C_FLAGS_RELEASE=-O1 -g1"
        -DCOHORT_BUILD_TORCH=OFF -DCOHORT_BUILD_BENCHMARKS=OFF)
rc=0
for kind in "${kinds[@]}"; do
  case $kind in
    address)
      dir=$base-asan
      echo "sanitize: ASan + UBSan build in $dir"
      cmake -S . -B "$dir" "${common[@]}" -DCOHORT_SANITIZE=address \
        -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ >/dev/null
      cmake --build "$dir" -j "$(nproc)"
      # Leaks inside a library cohort talks to (libpmix) are suppressed by library
      # (scripts/lsan_suppressions.txt); every leak in cohort's own code still fails its test.
      (cd "$dir" && LSAN_OPTIONS="suppressions=$root/scripts/lsan_suppressions.txt:print_suppressions=0" \
        ctest --output-on-failure -j 2 -LE 'python|torch_integration|fuzz|multihost|slurm|gpu$|repo' \
        -E '^PsExample\.') || rc=1
      ;;
    thread)
      dir=$base-tsan
      echo "sanitize: TSan build in $dir (transport, comm, store and ps tests; the flight recorder ring's)"
      # The tool with only the commands these tests start (tools/CMakeLists.txt).
      cmake -S . -B "$dir" "${common[@]}" -DCOHORT_SANITIZE=thread \
        "-DCOHORT_TOOL_COMMANDS=run;store;bench_store;ps" >/dev/null
      cmake --build "$dir" -j "$(nproc)" --target transport_tests comm_tests comm_worker store_tests trace_tests \
        ps_tests ps_worker cohort
      # Not the parameter-server example's accuracy run (41 s under TSan), as under ASan.
      (cd "$dir" && ctest --output-on-failure -j 2 -L 'transport|comm|store|ps' -E '^PsExample\.') || rc=1
      (cd "$dir" && ctest --output-on-failure --no-tests=error -R '^FlightRing\.') || rc=1
      ;;
    *) echo "sanitize: unknown sanitizer '$kind' (address or thread)" >&2; exit 2 ;;
  esac
done
exit $rc
