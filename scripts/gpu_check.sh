#!/usr/bin/env bash
# Every GPU test and the GPU benchmark, in one command, on a machine with an NVIDIA GPU, PyTorch 2.x
# with CUDA, and NCCL (the system's or the one torch's wheels bring). Builds what it needs into
# build-gpu/ (against that torch, so the libtorch DDP and the PyTorch backend get their CUDA paths),
# runs each step, and prints a pass/fail table. Exit code 0 only when no step failed.
#
#   scripts/gpu_check.sh                 all steps; logs and bench tables under build-gpu/gpu-check/
#   COHORT_PYTHON=/path/python3 ...      the Python whose torch to build and test against
#   GPU_CHECK_BENCH_MAX=256M ...         largest bench size (default 256M)
#   COHORT_GPU_CMAKE_ARGS='-DX=Y ...'    extra arguments for the configure step (split on spaces)
#   GPU_CHECK_TARGETS='cohort gpu_tests ...'  build only these targets (default: everything)
#   GPU_CHECK_BUDGET_S=500               every step bounded so that the script ends within this many
#                                        seconds (steps left over are SKIP, the table is always printed)
#   GPU_CHECK_ROUNDS=2                   interleaved rounds of the C++ / PyTorch figures
#   GPU_CHECK_RESNET_SAMPLES=24576, GPU_CHECK_BERT_STEPS=1500: the length of each timed run
#
# Order: build, the GPU tests (C++ with FSDP's libtorch ones, and the Python CUDA tests), the examples
# on the GPU with a checkpoint and --resume (bert --fsdp among them), the C++ / PyTorch DDP + NCCL figures, then the facts, the fake-library
# unit tests and the allreduce benchmark: what matters most runs first when the budget is short.
#
# The CPU-only machines of this project's CI build the same code; there every GPU test is skipped with
# its reason (scripts/skipped_tests.sh), and the GPU paths are exercised against a fake CUDA/NCCL
# library (ctest -L gpu_fake). docs/gpu.md describes both.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$(pwd)
build=${COHORT_GPU_BUILD_DIR:-build-gpu}
out=$build/gpu-check
python=${COHORT_PYTHON:-$(command -v python3)}
bench_max=${GPU_CHECK_BENCH_MAX:-256M}
mkdir -p "$out"

rows=()   # "step|PASS/FAIL/SKIP|detail"
failed=0
row() { rows+=("$1|$2|$3"); [[ $2 == FAIL ]] && failed=1; printf '%-44s %-5s %s\n' "$1" "$2" "$3"; }
budget=${GPU_CHECK_BUDGET_S:-0}   # 0: no budget
# step NAME LOGFILE CMD...: runs CMD, logging to LOGFILE; PASS on exit 0. With a budget, CMD gets at
# most what is left of it (less 10 s for the table), and a step with under 20 s left is SKIP.
step() {
  local name=$1 log=$2 limit=()
  shift 2
  if ((budget > 0)); then
    local left=$((budget - SECONDS - 10))
    if ((left < 20)); then row "$name" SKIP "out of time budget (${budget}s)"; return 2; fi
    limit=(timeout -k 5 "$left")
  fi
  echo "== $name: $*" >"$log"
  local t0=$SECONDS
  "${limit[@]}" "$@" </dev/null >>"$log" 2>&1
  local rc=$?
  echo "== exit $rc after $((SECONDS - t0)) s" >>"$log"
  if ((rc == 0)); then row "$name" PASS "log: $log ($((SECONDS - t0)) s)"; return 0; fi
  row "$name" FAIL "exit $rc (last line: $(grep -v '^== exit' "$log" | tail -n 1 | cut -c1-160))"
  return 1
}
# expect NAME LOG PATTERN: a row that fails unless LOG has a line matching PATTERN (after a PASS step).
expect() {
  if grep -qE "$3" "$2" 2>/dev/null; then row "$1" PASS "$(grep -m1 -E "$3" "$2" | cut -c1-120)"
  else row "$1" FAIL "no line matching '$3' in $2"; fi
}

echo "gpu_check: $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname)"
# ---- what this machine has ----
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >"$out/nvidia-smi.txt" 2>&1; then
  row "GPU present (nvidia-smi -L)" FAIL "$(head -n 1 "$out/nvidia-smi.txt" 2>/dev/null || echo 'nvidia-smi not found')"
  exit 1
fi
gpus=$(grep -c '^GPU ' "$out/nvidia-smi.txt")
row "GPU present (nvidia-smi -L)" PASS "$gpus GPU(s): $(head -n 1 "$out/nvidia-smi.txt")"
torch_info=$("$python" - <<'PY' 2>&1
import os, torch
import torch.distributed as dist
print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), dist.is_nccl_available(), torch.utils.cmake_prefix_path)
# Where torch's wheels keep NCCL and the CUDA runtime, when they do (nvidia-* wheels).
for mod, lib in (("nvidia.nccl", "libnccl.so.2"), ("nvidia.cuda_runtime", "libcudart.so.12")):
    try:
        m = __import__(mod, fromlist=["x"])
        base = list(m.__path__)[0]
        p = os.path.join(base, "lib", lib)
        print(p if os.path.exists(p) else "-")
    except Exception:
        print("-")
PY
)
read -r torch_version torch_cuda torch_sees_gpu torch_nccl torch_prefix <<<"$(head -n 1 <<<"$torch_info")"
wheel_nccl=$(sed -n 2p <<<"$torch_info")
wheel_cudart=$(sed -n 3p <<<"$torch_info")
if [[ $torch_sees_gpu != True || ${torch_version%%.*} -lt 2 ]]; then
  row "PyTorch 2.x with CUDA ($python)" FAIL "$(head -n 3 <<<"$torch_info" | tr '\n' ' ')"
  exit 1
fi
row "PyTorch 2.x with CUDA ($python)" PASS "torch $torch_version, CUDA $torch_cuda, NCCL in torch: $torch_nccl"
# cohort loads libcudart/libnccl at run time: point it at the wheels' copies when the system has none.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2' && [[ -z ${COHORT_NCCL_LIBRARY:-} && $wheel_nccl != - ]]; then
  export COHORT_NCCL_LIBRARY=$wheel_nccl
fi
if ! ldconfig -p 2>/dev/null | grep -q 'libcudart.so' && [[ -z ${COHORT_CUDA_RUNTIME:-} && ! -e /usr/local/cuda/lib64/libcudart.so && $wheel_cudart != - ]]; then
  export COHORT_CUDA_RUNTIME=$wheel_cudart
fi

# ---- build ----
missing=()
for tool in cmake ninja g++; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})) && command -v apt-get >/dev/null && [[ $(id -u) -eq 0 ]]; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q cmake ninja-build g++ libgtest-dev libgmock-dev \
    libbenchmark-dev libcli11-dev nlohmann-json3-dev libfmt-dev libssl-dev zlib1g-dev pybind11-dev >"$out/apt.log" 2>&1
fi
if ! step "configure (against torch $torch_version)" "$out/configure.log" \
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOHORT_PYTHON="$python" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" ${COHORT_GPU_CMAKE_ARGS:-}; then
  exit 1
fi
targets=()
[[ -n ${GPU_CHECK_TARGETS:-} ]] && targets=(--target ${GPU_CHECK_TARGETS})
[[ -n ${GPU_CHECK_TARGETS:-} ]] && echo "building only: $GPU_CHECK_TARGETS"
step "build" "$out/build.log" cmake --build "$build" -j "$(nproc)" "${targets[@]}" || exit 1
tool=$root/$build/tools/cohort

# ---- tests: the GPU tests first (C++ on the real CUDA runtime and NCCL, and the Python CUDA tests) ----
# (FSDP with the model on the GPU among them: fsdp_cuda_tests, built against this torch.)
step "GPU tests (C++ and Python, real CUDA/NCCL)" "$out/gpu.log" ctest --test-dir "$build" -L gpu --output-on-failure
# Gpu.WithoutAGpuTheRequestIsOneClearLine checks the error of a machine without a GPU: it skips here by
# design; Gpu.OneRankPerGpu... needs two GPUs and skips on a machine with one.
expected_skips="WithoutAGpuTheRequestIsOneClearLine"
((gpus >= 2)) || expected_skips+="|OneRankPerGpuInStreamOrderAndTheWatchdog"
if grep "Skipped" "$out/gpu.log" | grep -qvE "$expected_skips"; then
  row "  none of them skipped" FAIL "$(grep "Skipped" "$out/gpu.log" | grep -vE "$expected_skips" | head -n 3 | tr -s ' ' | tr '\n' ' ')"
fi
grep -h "after the hold" "$out/gpu.log" "$build"/Testing/Temporary/LastTest.log 2>/dev/null | head -n 1 | sed 's/^/  watchdog test: /'

# ---- the examples on the GPU (libtorch DDP and the sharded optimizer), each with a checkpoint written
# and read back by --resume; when the data sets are here ----
fm=$build/examples/fashion_mnist/fashion_mnist
rn=$build/examples/resnet/resnet
bt=$build/examples/bert/bert
have() {  # NAME BINARY DATA_DIR: whether an example can run; a SKIP row saying why not
  if [[ ! -x $2 ]]; then row "$1" SKIP "not built (libtorch not found at $torch_prefix)"; return 1; fi
  if [[ ! -d $3 ]]; then row "$1" SKIP "no data ($3 is missing: Debian's package is not installed)"; return 1; fi
}
run_on_gpus=("$tool" run --gpus-per-node auto)
# ckpt_resume NAME BINARY ARGS...: a run that checkpoints, then one that resumes from it.
ckpt_resume() {
  local name=$1 bin=$2 dir=$out/ckpt-$1
  shift 2
  rm -rf "$dir"
  step "$name --device cuda, checkpoint" "$out/$name-ckpt.txt" "${run_on_gpus[@]}" "$bin" --device cuda "$@" \
    --checkpoint-dir "$dir" --print-digest || return
  step "$name --device cuda, --resume" "$out/$name-resume.txt" "${run_on_gpus[@]}" "$bin" --device cuda "$@" \
    --checkpoint-dir "$dir" --resume --print-digest && expect "  $name resumed from its checkpoint" "$out/$name-resume.txt" 'resuming from'
}
if have fashion_mnist "$fm" /usr/share/datasets/fashion-mnist; then
  step "fashion_mnist --device cuda (1 rank per GPU)" "$out/fashion_mnist.txt" "${run_on_gpus[@]}" "$fm" --model mlp --device cuda
  # One epoch written; the resumed run goes on to the second.
  rm -rf "$out/ckpt-fashion_mnist"
  step "fashion_mnist --device cuda, checkpoint" "$out/fashion_mnist-ckpt.txt" "${run_on_gpus[@]}" "$fm" --model mlp \
    --device cuda --epochs 1 --train-samples 16384 --checkpoint-dir "$out/ckpt-fashion_mnist" &&
  step "fashion_mnist --device cuda, --resume" "$out/fashion_mnist-resume.txt" "${run_on_gpus[@]}" "$fm" --model mlp \
    --device cuda --epochs 2 --train-samples 16384 --checkpoint-dir "$out/ckpt-fashion_mnist" --resume &&
  expect "  fashion_mnist resumed from its checkpoint" "$out/fashion_mnist-resume.txt" 'resuming from .* epoch 1'
fi
if have resnet "$rn" /usr/share/datasets/fashion-mnist; then
  step "resnet --device cuda (1 rank per GPU)" "$out/resnet.txt" "${run_on_gpus[@]}" "$rn" --device cuda --train-samples 4096
  # ResNet-18 with batch norm, the sharded optimizer (its chunks and state on the GPU, NCCL's
  # reduce-scatter and allgather).
  ckpt_resume resnet-zero2 "$rn" --optimizer adam --zero 2 --max-steps 20
fi
if have bert "$bt" /usr/share/wordnet; then
  ckpt_resume bert-zero1 "$bt" --zero 1 --max-steps 20 --test-samples 64
  ckpt_resume bert-zero2 "$bt" --zero 2 --max-steps 20 --test-samples 64
  # FSDP: the encoder layers' shards, gathers and reduce-scatters in GPU memory, on 2 ranks at least (one
  # rank would send nothing): one GPU each through NCCL, or sharing one GPU, staged through the host.
  # The resumed run prints the weights it loaded: the saving run's final ones.
  one_rank_per_gpu=("${run_on_gpus[@]}")
  ((gpus >= 2)) || run_on_gpus=("$tool" run -n 2 --gpus-per-node 1 --gpu-share)
  fsdp_done=0
  ckpt_resume bert-fsdp "$bt" --fsdp --max-steps 20 --test-samples 64 && fsdp_done=1
  run_on_gpus=("${one_rank_per_gpu[@]}")
  if ((fsdp_done)); then
    saved=$(grep -oE 'final weights digest: [0-9a-f]+' "$out/bert-fsdp-ckpt.txt" | head -n 1 | awk '{print $4}')
    resumed=$(grep -oE 'resumed weights digest: [0-9a-f]+' "$out/bert-fsdp-resume.txt" | head -n 1 | awk '{print $4}')
    if [[ -n $saved && $saved == "$resumed" ]]; then row "  bert-fsdp resumed the saved weights" PASS "digest $saved"
    else row "  bert-fsdp resumed the saved weights" FAIL "saved run's final digest '$saved', resumed run's '$resumed'"; fi
  fi
fi

# ---- C++ DDP on the GPU against PyTorch DDP with NCCL: the same model, batch and samples, 1 rank per
# GPU, rounds interleaved, each run long enough to mean something ----
# On one GPU, C++ DDP skips the buckets (the average of one rank is its gradient) where PyTorch DDP
# still allreduces them through NCCL: COHORT_DDP_REDUCE_ONE_RANK=1 makes C++ do the same, for the
# like-for-like figure. The last run of each model is timed on the GPU's clock (the overlap line).
rounds=${GPU_CHECK_ROUNDS:-2}
rsamples=${GPU_CHECK_RESNET_SAMPLES:-24576}
bsteps=${GPU_CHECK_BERT_STEPS:-1500}
like=(env COHORT_DDP_REDUCE_ONE_RANK=1)
((gpus >= 2)) && like=(env)
for ((round = 1; round <= rounds; round++)); do
  if [[ -x $rn && -d /usr/share/datasets/fashion-mnist ]]; then
    step "resnet C++ DDP, round $round" "$out/fig-resnet-cpp-$round.txt" \
      "${like[@]}" "${run_on_gpus[@]}" "$rn" --device cuda --train-samples "$rsamples" --test-samples 1000
    step "resnet PyTorch DDP + NCCL, round $round" "$out/fig-resnet-torch-$round.txt" \
      "${run_on_gpus[@]}" "$python" bench/resnet_twin.py --device cuda --train-samples "$rsamples" --test-samples 1000
  fi
  if [[ -x $bt && -d /usr/share/wordnet ]]; then
    step "bert-mini C++ DDP, round $round" "$out/fig-bert-cpp-$round.txt" \
      "${like[@]}" "${run_on_gpus[@]}" "$bt" --device cuda --max-steps "$bsteps" --test-samples 256
    step "bert-mini PyTorch DDP + NCCL, round $round" "$out/fig-bert-torch-$round.txt" \
      "${run_on_gpus[@]}" "$python" bench/bert_twin.py --device cuda --max-steps "$bsteps" --test-samples 256
  fi
done
if [[ -x $rn && -d /usr/share/datasets/fashion-mnist ]]; then
  step "resnet C++ DDP, GPU timing (overlap)" "$out/fig-resnet-overlap.txt" \
    env COHORT_GPU_TIMING=1 "${like[@]:1}" "${run_on_gpus[@]}" "$rn" --device cuda --train-samples 8192
fi

# ---- what cohort sees, the fake-library unit tests, the allreduce benchmark ----
step "cohort gpu status (cohort doctor's facts)" "$out/facts.log" \
  bash -c "timeout 60 '$tool' doctor --serve-probe --serve-seconds 1 </dev/null | head -n 1"
if grep -qs '"gpus":0' "$out/facts.log"; then row "  cohort sees the GPUs" FAIL "$(grep -o '"gpu_note":"[^"]*"' "$out/facts.log")"; fi
grep -so '"nccl_allreduce":"[^"]*"' "$out/facts.log" | sed 's/^/  /'
step "unit: GPU communicator on the fake library" "$out/gpu_fake.log" ctest --test-dir "$build" -L gpu_fake --output-on-failure
# 1 rank on NCCL, 2 ranks staged on one GPU, the same 2 ranks in host memory.
bench=(bench allreduce -b 8 -e "$bench_max" -f 4 --check)
step "bench: 1 rank, NCCL, GPU memory" "$out/bench-nccl-1rank.txt" \
  "$tool" run -n 1 --gpus-per-node 1 "$tool" "${bench[@]}" --device cuda
step "bench: 2 ranks sharing GPU 0, staged" "$out/bench-staged-2ranks.txt" \
  "$tool" run -n 2 --gpus-per-node 1 --gpu-share "$tool" "${bench[@]}" --device cuda
if ((gpus >= 2)); then
  step "bench: $gpus ranks, NCCL, one GPU each" "$out/bench-nccl-${gpus}ranks.txt" \
    "$tool" run --gpus-per-node auto "$tool" "${bench[@]}" --device cuda
fi
step "bench: 2 ranks, host memory (reference)" "$out/bench-host-2ranks.txt" \
  "$tool" run -n 2 "$tool" "${bench[@]}"

echo
printf '%-44s %-5s %s\n' "step" "result" "detail"
for r in "${rows[@]}"; do IFS='|' read -r a b c <<<"$r"; printf '%-44s %-5s %s\n' "$a" "$b" "$c"; done
echo
for f in "$out"/bench-*.txt; do [[ -f $f ]] && { echo "--- $f (largest sizes)"; grep -E '^(\[[^]]*\] )? +[0-9]+ ' "$f" | tail -n 3; }; done
for f in "$out"/fashion_mnist*.txt "$out"/resnet*.txt "$out"/bert*.txt "$out"/fig-*.txt; do
  [[ -f $f ]] && grep -v '^== ' "$f" | grep -hE 'samples/s|overlapping backward|accuracy|digest|resuming from' | sed "s#^#$(basename "$f"): #"
done
echo
((failed)) && { echo "gpu_check: FAIL"; exit 1; }
echo "gpu_check: PASS (results in $out/)"
