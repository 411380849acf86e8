#!/usr/bin/env bash
# Real-GPU checks of cohort from prebuilt binaries (no build, no network), for a GPU machine that
# lacks this project's build dependencies. Make the bundle here (scripts/gpu_bundle/make.sh copies
# this script into it), carry it over, and run there from the repo root:
#   bash .devbundle/check.sh          (results in $OUT, default /tmp/cohort-gpu-out)
# Steps: find the GPU, libcudart and libnccl (the pip wheels' copies, via python3); the bundle's
# binaries start; gpu_tests (GoogleTest, label gpu) on the real runtime; the allreduce benchmark through
# the launcher (1 rank on NCCL; 2 ranks staged on one GPU; 2 ranks in host memory as reference);
# cohort doctor (its facts line and the full local check). Each step has its own timeout, all of them
# fit in GPU_CHECK_BUDGET_S (default 300 s); a failed step does not stop the next. A table at the end.
# Files in $OUT: summary.log (all of this output), gpu_tests.log, gpu_tests.xml, bench.log, doctor.log.
# Overrides: COHORT_CUDA_RUNTIME / COHORT_NCCL_LIBRARY (paths), COHORT_PYTHON, GPU_CHECK_BENCH_MAX.
set -uo pipefail
export LC_ALL=C
export PATH="$PATH:/usr/local/bin:/usr/local/cuda/bin:/opt/conda/bin:/usr/local/nvidia/bin:/usr/sbin:/sbin"
bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-/tmp/cohort-gpu-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || { echo "cannot create OUT=$OUT"; exit 2; }
BUDGET=${GPU_CHECK_BUDGET_S:-300}
BENCH_MAX=${GPU_CHECK_BENCH_MAX:-256M}
cohort=$bundle/bin/cohort
gpu_tests=$bundle/bin/gpu_tests

rows=()
row() { rows+=("$1|$2|$3"); printf '>> %-34s %-4s %s\n' "$1" "$2" "$3"; }
# tmo WANT: a timeout that keeps the script inside its budget; empty when under 15 s are left.
tmo() {
  local left=$((BUDGET - SECONDS - 10))
  ((left >= 15)) || return 1
  echo $(($1 < left ? $1 : left))
}
# run LOG TIMEOUT CMD...: CMD's output appended to LOG (a file, not a pipe: a stray grandchild that
# outlives the timeout cannot hold the script up), then shown on the console; returns CMD's exit code.
run() {
  local log=$1 t=$2 start
  shift 2
  start=$(wc -l <"$log")
  printf '\n== %s [timeout %ss] %s\n' "$(date -u +%T)" "$t" "$*" >>"$log"
  timeout -k 5 "$t" "$@" </dev/null >>"$log" 2>&1
  local rc=$?
  echo "== exit $rc$( ((rc == 124 || rc == 137)) && echo " (timed out after ${t}s)")" >>"$log"
  tail -n +"$((start + 1))" "$log"
  return "$rc"
}
lastline() { grep -v '^== ' "$1" | grep -v '^[[:space:]]*$' | tail -n 1 | cut -c1-150; }

main() {
  echo "gpu_bundle check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname 2>/dev/null || cat /proc/sys/kernel/hostname)," \
    "$(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"), glibc $(ldd --version 2>/dev/null | head -n 1 | awk '{print $NF}')"
  echo "bundle: $bundle"; sed -n '1,4p' "$bundle/MANIFEST.txt" 2>/dev/null | sed 's/^/  /'
  echo "OUT: $OUT; budget ${BUDGET}s"

  # ---- 1. the GPU ----
  echo; echo "== GPU"
  local smi gpus=0
  if smi=$(timeout 20 nvidia-smi -L 2>&1); then
    echo "$smi"
    gpus=$(grep -c '^GPU ' <<<"$smi")
    timeout 20 nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv 2>&1
    timeout 20 nvidia-smi 2>&1 | grep -m1 'CUDA Version'
    row "GPU present (nvidia-smi -L)" "$( ((gpus > 0)) && echo PASS || echo FAIL)" "$gpus GPU(s): $(head -n 1 <<<"$smi" | cut -c1-80)"
  else
    echo "$smi"
    row "GPU present (nvidia-smi -L)" FAIL "$(head -n 1 <<<"${smi:-nvidia-smi not found}" | cut -c1-100)"
  fi
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}; /dev/shm: $(df -h /dev/shm 2>/dev/null | awk 'NR==2 {print $2 " total, " $4 " free"}')"

  # ---- 2. libcudart and libnccl: the pip wheels' copies (nvidia.nccl, nvidia.cuda_runtime / nvidia.cu13) ----
  echo; echo "== CUDA runtime and NCCL libraries"
  local py dirs="" cands=() seen=" "
  for py in "${COHORT_PYTHON:-}" "$(command -v python3)" "$(command -v python)" /usr/local/bin/python3 \
      /opt/conda/bin/python3 /usr/bin/python3 /opt/*/bin/python3 /venv/bin/python3; do
    [[ -n $py && -x $py && $seen != *" $py "* ]] || continue
    seen+="$py "
    cands+=("$py")
  done
  # Every Python's wheels: those with nvidia.* packages first (in PATH order), then torch/lib folders.
  local nv_dirs="" t_dirs=""
  for py in "${cands[@]}"; do
    local found
    found=$(timeout 15 "$py" - 2>&1 <<'PY'
import importlib, importlib.util, os, re, sys
for mod in ("nvidia", "nvidia.nccl", "nvidia.cuda_runtime", "nvidia.cu13", "nvidia.cu12"):
    try:
        m = importlib.import_module(mod)
        for p in getattr(m, "__path__", []):
            if os.path.isdir(p):
                print("nv", p)
    except Exception:
        pass
spec = importlib.util.find_spec("torch")
if spec and spec.origin:
    tdir = os.path.dirname(spec.origin)
    try:
        v = re.search(r"__version__\s*=\s*'([^']+)'", open(os.path.join(tdir, "version.py")).read()).group(1)
    except Exception:
        v = "?"
    print("torch", v, tdir)
    print("tl", os.path.join(tdir, "lib"))
PY
)
    echo "python $py: $(grep -c '^nv ' <<<"$found") nvidia folder(s); $(grep '^torch ' <<<"$found" || echo 'no torch')"
    nv_dirs+=$(sed -n 's/^nv //p' <<<"$found")$'\n'
    t_dirs+=$(sed -n 's/^tl //p' <<<"$found")$'\n'
  done
  dirs=$(printf '%s\n%s\n' "$nv_dirs" "$t_dirs" | grep -v '^$' | awk '!s[$0]++')
  local libs=""
  if [[ -n $dirs ]]; then
    mapfile -t darr <<<"$dirs"
    libs=$(timeout 20 find "${darr[@]}" -maxdepth 4 \( -name 'libcudart.so*' -o -name 'libnccl.so*' \) 2>/dev/null)
  fi
  libs+=$'\n'$(ls /usr/local/cuda/lib64/libcudart.so* 2>/dev/null)
  libs+=$'\n'$(ldconfig -p 2>/dev/null | awk '/(libcudart|libnccl)\.so/ && /x86-64/ {print $NF}')
  if ! grep -q libnccl.so <<<"$libs"; then
    echo "no libnccl in the wheels or the loader's cache: searching / (20 s at most)"
    libs+=$'\n'$(timeout 20 find / -xdev \( -path /proc -o -path /sys \) -prune -o \( -name 'libnccl.so.2' -o -name 'libcudart.so.1[23]' \) -print 2>/dev/null)
  fi
  libs=$(grep -v '^$' <<<"$libs" | awk '!s[$0]++')
  echo "candidates:"; sed 's/^/  /' <<<"${libs:-  (none)}"
  pick() { local n; for n in "$@"; do grep -m1 "/$n\$" <<<"$libs" && return 0; done; return 1; }
  local how_cuda="set by caller" how_nccl="set by caller"
  if [[ -z ${COHORT_CUDA_RUNTIME:-} ]]; then
    COHORT_CUDA_RUNTIME=$(pick libcudart.so.13 libcudart.so.12 'libcudart.so.1[0-9]*' libcudart.so) && how_cuda=found || how_cuda="none found: cohort searches itself"
  fi
  if [[ -z ${COHORT_NCCL_LIBRARY:-} ]]; then
    COHORT_NCCL_LIBRARY=$(pick libnccl.so.2 'libnccl.so.2*' libnccl.so) && how_nccl=found || how_nccl="none found: cohort searches itself"
  fi
  [[ -n ${COHORT_CUDA_RUNTIME:-} ]] && export COHORT_CUDA_RUNTIME || unset COHORT_CUDA_RUNTIME
  [[ -n ${COHORT_NCCL_LIBRARY:-} ]] && export COHORT_NCCL_LIBRARY || unset COHORT_NCCL_LIBRARY
  echo "COHORT_CUDA_RUNTIME=${COHORT_CUDA_RUNTIME:-<unset>} ($how_cuda)"
  echo "COHORT_NCCL_LIBRARY=${COHORT_NCCL_LIBRARY:-<unset>} ($how_nccl)"
  row "libcudart + libnccl found" "$([[ -n ${COHORT_CUDA_RUNTIME:-} && -n ${COHORT_NCCL_LIBRARY:-} ]] && echo PASS || echo FAIL)" \
    "$(basename "${COHORT_CUDA_RUNTIME:-no-cudart}"), $(basename "${COHORT_NCCL_LIBRARY:-no-nccl}")"
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

  # ---- 3. the bundle's binaries and their shared libraries ----
  echo; echo "== bundle binaries"
  local ldp=$bundle/lib lddout sub name extra=""
  lddout=$(LD_LIBRARY_PATH=$ldp ldd "$cohort" "$gpu_tests" 2>&1)
  for sub in crypto:libcrypto.so.3 z:libz.so.1 stdcxx:libstdc++.so.6 stdcxx:libgcc_s.so.1; do
    name=${sub#*:}
    if grep -qF -e "$name => not found" -e "$name: version" <<<"$lddout" && [[ $ldp != *fallback/${sub%%:*}* ]]; then
      ldp+=":$bundle/fallback/${sub%%:*}"; extra+=" ${sub%%:*}"
    fi
  done
  export LD_LIBRARY_PATH=$ldp${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH (fallbacks used:${extra:- none})"
  ldd "$cohort" "$gpu_tests" 2>&1 | grep -E "$bundle|not found" | sed 's/ (0x[0-9a-f]*)//; s/^[[:space:]]*/  /' | awk '!s[$0]++'
  local v ntests
  v=$("$cohort" --version 2>&1 | head -n 1)
  ntests=$("$gpu_tests" --gtest_list_tests 2>&1 | grep -c '^  ')
  echo "cohort --version: $v; gpu_tests lists $ntests test(s)"
  if ldd "$cohort" "$gpu_tests" 2>&1 | grep -q 'not found' || ((ntests == 0)); then
    row "bundle binaries start" FAIL "$(ldd "$cohort" "$gpu_tests" 2>&1 | grep -m1 'not found' || echo "$v")"
  else
    row "bundle binaries start" PASS "$v; $ntests gpu tests;${extra:+ fallback libs:$extra}"
  fi

  # ---- 4. gpu_tests: the GPU communicator on the real CUDA runtime and NCCL ----
  local t log=$OUT/gpu_tests.log rc
  : >"$log"
  if t=$(tmo 100); then
    run "$log" "$t" "$gpu_tests" --gtest_output="xml:$OUT/gpu_tests.xml" --gtest_print_time=1 --gtest_color=no; rc=$?
    local pass fail skip skipped_names reason
    pass=$(grep -cE '^\[       OK \] .* \([0-9]+ ms\)' "$log")
    fail=$(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)' "$log")
    skipped_names=$(grep -E '^\[  SKIPPED \] .* \([0-9]+ ms\)' "$log" | awk '{print $4}')
    skip=$(grep -c . <<<"$skipped_names")
    reason=$(grep -A1 -m1 ': Skipped$' "$log" | tail -n 1 | cut -c1-90)
    # Gpu.WithoutAGpuTheRequestIsOneClearLine is skipped on a GPU machine by design.
    local bad_skips
    # Gpu.OneRankPerGpuInStreamOrderAndTheWatchdog needs two GPUs.
    bad_skips=$(grep -vE '^Gpu\.(WithoutAGpuTheRequestIsOneClearLine|OneRankPerGpuInStreamOrderAndTheWatchdog)$' <<<"$skipped_names" |
      grep -c .)
    if ((rc != 0 || fail > 0 || pass == 0)); then
      row "gpu_tests (real CUDA/NCCL)" FAIL "exit $rc: $pass ok, $fail failed, $skip skipped; $(grep -m1 -E 'Failure|error|FAILED' "$log" | cut -c1-80)"
    elif ((bad_skips > 0)); then
      row "gpu_tests (real CUDA/NCCL)" SKIP "$pass ok, $skip skipped: $reason"
    else
      row "gpu_tests (real CUDA/NCCL)" PASS "$pass ok, $skip skipped ($(tr '\n' ' ' <<<"$skipped_names"| sed 's/Gpu\.//g'))"
    fi
  else
    row "gpu_tests (real CUDA/NCCL)" SKIP "out of time budget"
  fi

  # ---- 5. benchmarks through the launcher (scripts/gpu_check.sh's, with shorter trials) ----
  log=$OUT/bench.log
  : >"$log"
  bench_step() {  # NAME WANT_TIMEOUT EXPECT_IN_BUFFERS_LINE MAX_BYTES LAUNCHER_ARGS... -- BENCH_EXTRA...
    local name=$1 want=$2 expect=$3
    local bench=(bench allreduce -b 8 -e "$4" -f 4 --check --trials 3 --min-time 0.25)
    shift 4
    local largs=() bextra=()
    while [[ $# -gt 0 && $1 != -- ]]; do largs+=("$1"); shift; done
    shift
    bextra=("$@")
    local t rc
    t=$(tmo "$want") || { row "$name" SKIP "out of time budget"; return; }
    local start
    start=$(wc -l <"$log")
    run "$log" "$t" "$cohort" run "${largs[@]}" --kill-grace 2 "$cohort" "${bench[@]}" "${bextra[@]}"; rc=$?
    local part bufline oob big
    part=$(tail -n +"$((start + 1))" "$log")
    bufline=$(grep -m1 -o '# buffers: .*' <<<"$part" | cut -c12-)
    oob=$(grep -m1 -o 'Out of bounds values : .*' <<<"$part")
    big=$(grep -E '^(\[[^]]*\] )? +[0-9]+ +[0-9]+ ' <<<"$part" | sed -E 's/^\[[^]]*\] //' | tail -n 1 |
      awk '{printf "%s B: %s us, busbw %s GB/s, #wrong %s", $1, $6, $8, $9}')
    if ((rc == 0)) && [[ $oob == *": 0 OK"* && $bufline == *$expect* ]]; then
      row "$name" PASS "$big | $(cut -c1-80 <<<"$bufline")"
    else
      row "$name" FAIL "exit $rc; ${oob:-no check line}; $(cut -c1-80 <<<"${bufline:-no buffers line}"); last: $(tail -n 2 <<<"$part" | head -n 1 | cut -c1-100)"
    fi
  }
  bench_step "bench: 1 rank, NCCL, GPU memory" 75 "NCCL" "$BENCH_MAX" -n 1 --gpus-per-node 1 -- --device cuda
  bench_step "bench: 2 ranks on GPU 0, staged" 75 "staged" "$BENCH_MAX" -n 2 --gpus-per-node 1 --gpu-share -- --device cuda

  # ---- 6. cohort doctor: this host's facts line, then the full check of localhost ----
  log=$OUT/doctor.log
  : >"$log"
  if t=$(tmo 40); then
    local facts
    run "$log" "$t" "$cohort" doctor --serve-probe --serve-seconds 1 --check-ports 29500
    facts=$(grep -m1 '^{' "$log")
    local fg fn fa
    fg=$(grep -o '"gpus":[0-9]*' <<<"$facts" | cut -d: -f2)
    fn=$(grep -o '"nccl_version":"[^"]*"' <<<"$facts" | cut -d'"' -f4)
    fa=$(grep -o '"nccl_allreduce":"[^"]*"' <<<"$facts" | cut -d'"' -f4)
    if [[ ${fg:-0} -gt 0 && $fa == ok* ]]; then
      row "doctor facts (GPUs, NCCL allreduce)" PASS "gpus $fg, runtime $(grep -o '"cuda_runtime":"[^"]*"' <<<"$facts" | cut -d'"' -f4), nccl $fn, $fa"
    else
      row "doctor facts (GPUs, NCCL allreduce)" FAIL "gpus ${fg:-?}, nccl ${fn:-none}: $(cut -c1-110 <<<"${fa:-$(grep -o '"gpu_note":"[^"]*"' <<<"$facts" || lastline "$log")}")"
    fi
  else
    row "doctor facts (GPUs, NCCL allreduce)" SKIP "out of time budget"
  fi
  if t=$(tmo 60); then
    local start
    start=$(wc -l <"$log")
    run "$log" "$t" "$cohort" doctor --ssh-command "$bundle/localssh" --timeout 15; rc=$?
    local part verdict gpuline
    part=$(tail -n +"$((start + 1))" "$log")
    verdict=$(grep -m1 '^verdict:' <<<"$part")
    gpuline=$(grep -A1 -m1 '^host .*nccl allreduce' <<<"$part" | tail -n 1 | tr -s ' ')
    [[ -z $gpuline ]] && gpuline=$(grep -m1 '^gpus:' <<<"$part" | cut -c1-70)
    if [[ $verdict == *PASS* ]] && grep -q '^host .*nccl allreduce' <<<"$part"; then
      row "doctor (localhost, full)" PASS "$verdict; $gpuline"
    else
      row "doctor (localhost, full)" FAIL "exit $rc; ${verdict:-no verdict}; $gpuline"
    fi
  else
    row "doctor (localhost, full)" SKIP "out of time budget"
  fi

  # ---- 7. reference: the same benchmark in host memory (proves the launcher and transport) ----
  log=$OUT/bench.log
  bench_step "bench: 2 ranks, host memory (ref)" 40 "host memory" 64M -n 2 --

  # ---- table ----
  echo
  echo "================ gpu_bundle check summary ($(date -u +%T), ${SECONDS}s) ================"
  printf '%-36s %-4s %s\n' "step" "res" "detail"
  local r a b c failed=0
  for r in "${rows[@]}"; do
    IFS='|' read -r a b c <<<"$r"
    printf '%-36s %-4s %s\n' "$a" "$b" "$c"
    [[ $b == PASS ]] || failed=1
  done
  ((failed)) && echo "OVERALL: FAIL (files in $OUT: $(cd "$OUT" && ls | tr '\n' ' '))" ||
    echo "OVERALL: PASS (files in $OUT: $(cd "$OUT" && ls | tr '\n' ' '))"
  return "$failed"
}

main "$@" 2>&1 | tee "$OUT/summary.log"
exit "${PIPESTATUS[0]}"
