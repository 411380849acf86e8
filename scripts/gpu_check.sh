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
# step NAME LOGFILE CMD...: runs CMD, logging to LOGFILE; PASS on exit 0.
step() {
  local name=$1 log=$2
  shift 2
  echo "== $name: $*" >"$log"
  "$@" >>"$log" 2>&1
  local rc=$?
  if ((rc == 0)); then row "$name" PASS "log: $log"; return 0; fi
  row "$name" FAIL "exit $rc (last line: $(tail -n 1 "$log"))"
  return 1
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
step "build" "$out/build.log" cmake --build "$build" -j "$(nproc)" || exit 1
tool=$root/$build/tools/cohort

# ---- tests ----
step "cohort gpu status (cohort doctor's facts)" "$out/facts.log" \
  bash -c "timeout 60 '$tool' doctor --serve-probe --serve-seconds 1 </dev/null | head -n 1"
if grep -q '"gpus":0' "$out/facts.log"; then row "  cohort sees the GPUs" FAIL "$(grep -o '"gpu_note":"[^"]*"' "$out/facts.log")"; fi
grep -o '"nccl_allreduce":"[^"]*"' "$out/facts.log" | sed 's/^/  /'
step "unit: GPU communicator on the fake library" "$out/gpu_fake.log" ctest --test-dir "$build" -L gpu_fake --output-on-failure
step "GPU tests (C++ and Python, real CUDA/NCCL)" "$out/gpu.log" ctest --test-dir "$build" -L gpu --output-on-failure
# Gpu.WithoutAGpuTheRequestIsOneClearLine checks the error of a machine without a GPU: it skips here by
# design; Gpu.OneRankPerGpu... needs two GPUs and skips on a machine with one.
expected_skips="WithoutAGpuTheRequestIsOneClearLine"
((gpus >= 2)) || expected_skips+="|OneRankPerGpuInStreamOrderAndTheWatchdog"
if grep "Skipped" "$out/gpu.log" | grep -qvE "$expected_skips"; then
  row "  none of them skipped" FAIL "$(scripts/skipped_tests.sh "$build" | grep -vE "$expected_skips" | head -n 3 | tr '\n' ' ')"
fi

# ---- benchmarks: 1 rank on NCCL, 2 ranks staged on one GPU, the same 2 ranks in host memory ----
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

# ---- the main job's model on the GPU (libtorch DDP), when the data set is here ----
fm=$build/examples/fashion_mnist/fashion_mnist
if [[ ! -x $fm ]]; then
  row "fashion_mnist --device cuda" SKIP "not built (libtorch not found at $torch_prefix)"
elif [[ ! -d /usr/share/datasets/fashion-mnist ]]; then
  row "fashion_mnist --device cuda" SKIP "no data (Debian's dataset-fashion-mnist is not installed)"
else
  step "fashion_mnist --device cuda (1 rank per GPU)" "$out/fashion_mnist.txt" \
    "$tool" run --gpus-per-node auto "$fm" --model mlp --device cuda
fi
# ResNet-18 with batch norm on the GPU, plain DDP and the sharded optimizer (its chunks and state on the
# GPU, NCCL's reduce-scatter and allgather), with a checkpoint written and read back by --resume.
rn=$build/examples/resnet/resnet
if [[ ! -x $rn ]]; then
  row "resnet --device cuda" SKIP "not built (libtorch not found at $torch_prefix)"
elif [[ ! -d /usr/share/datasets/fashion-mnist ]]; then
  row "resnet --device cuda" SKIP "no data (Debian's dataset-fashion-mnist is not installed)"
else
  step "resnet --device cuda (1 rank per GPU)" "$out/resnet.txt" \
    "$tool" run --gpus-per-node auto "$rn" --device cuda --train-samples 4096
  rm -rf "$out/resnet-zero2"
  step "resnet --device cuda --zero 2, checkpoint" "$out/resnet-zero2.txt" \
    "$tool" run --gpus-per-node auto "$rn" --device cuda --optimizer adam --zero 2 --max-steps 20 \
    --checkpoint-dir "$out/resnet-zero2"
  step "resnet --device cuda --zero 2, --resume" "$out/resnet-zero2-resume.txt" \
    "$tool" run --gpus-per-node auto "$rn" --device cuda --optimizer adam --zero 2 --max-steps 20 \
    --checkpoint-dir "$out/resnet-zero2" --resume
  # C++ DDP on the GPU against PyTorch DDP with NCCL (bench/resnet_twin.py): the same ResNet-18, batch
  # and samples, 1 rank per GPU, rounds interleaved; then the C++ run with GPU timing, which prints the
  # share of each bucket's allreduce that overlapped backward (on the GPU's clock).
  # On one GPU, C++ DDP skips the buckets (the average of one rank is its gradient) where PyTorch DDP
  # still allreduces them through NCCL: COHORT_DDP_REDUCE_ONE_RANK=1 makes C++ do the same, for the
  # like-for-like figure and the overlap.
  for round in 1 2; do
    step "resnet C++ DDP, round $round" "$out/resnet-cpp-$round.txt" \
      "$tool" run --gpus-per-node auto "$rn" --device cuda --train-samples 8192
    step "resnet C++ DDP, 1-rank allreduce, round $round" "$out/resnet-cpp-reduce-$round.txt" \
      env COHORT_DDP_REDUCE_ONE_RANK=1 "$tool" run --gpus-per-node auto "$rn" --device cuda --train-samples 8192
    step "resnet PyTorch DDP + NCCL, round $round" "$out/resnet-torch-$round.txt" \
      "$tool" run --gpus-per-node auto "$python" bench/resnet_twin.py --device cuda --train-samples 8192
  done
  step "resnet C++ DDP, GPU timing (overlap)" "$out/resnet-overlap.txt" \
    env COHORT_GPU_TIMING=1 COHORT_DDP_REDUCE_ONE_RANK=1 "$tool" run --gpus-per-node auto "$rn" --device cuda \
    --train-samples 8192
fi

echo
printf '%-44s %-5s %s\n' "step" "result" "detail"
for r in "${rows[@]}"; do IFS='|' read -r a b c <<<"$r"; printf '%-44s %-5s %s\n' "$a" "$b" "$c"; done
echo
for f in "$out"/bench-*.txt; do [[ -f $f ]] && { echo "--- $f (largest sizes)"; grep -E '^(\[[^]]*\] )? +[0-9]+ ' "$f" | tail -n 3; }; done
for f in "$out"/resnet*.txt "$out"/fashion_mnist.txt; do
  [[ -f $f ]] && grep -hE 'samples/s|overlapping backward|test accuracy' "$f" | sed "s#^#$(basename "$f"): #"
done
echo
((failed)) && { echo "gpu_check: FAIL"; exit 1; }
echo "gpu_check: PASS (results in $out/)"
