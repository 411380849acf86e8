// Reduction kernel throughput, GB/s per dtype and kernel family: dst = dst + src over buffers of
// 64 KiB (cache resident) and 64 MiB (memory bound). Bytes counted = 3 x buffer (read dst, read src,
// write dst), the same convention as bench/peers/membw.c's `a[i] += b[i]`.
//   ./build/bench/reduce_kernels_bench --benchmark_filter=float/
#include <benchmark/benchmark.h>

#include <cstring>
#include <string>
#include <vector>

#include "collectives/reduce_kernels_impl.h"

namespace {

using cohort::DataType;
using cohort::ReduceOp;
using cohort::kernels::KernelFamily;

void BM_Reduce(benchmark::State& state, KernelFamily family, DataType t, ReduceOp op) {
  if (!cohort::kernels::family_supported(family)) {
    state.SkipWithError("kernel family not supported by this CPU");
    return;
  }
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t n = bytes / cohort::dtype_size(t);
  std::vector<uint8_t> dst(bytes), src(bytes);
  // Small positive values (0x01 bytes): finite in every type, no subnormal slow paths.
  std::memset(dst.data(), 1, bytes);
  std::memset(src.data(), 1, bytes);
  for (auto _ : state) {
    cohort::kernels::reduce_to_family(family, dst.data(), dst.data(), src.data(), n, t, op);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(3 * bytes));
}

int register_all() {
  const DataType types[] = {DataType::kInt8,    DataType::kUInt8,    DataType::kInt32,   DataType::kInt64,
                            DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64};
  for (KernelFamily f : {KernelFamily::kScalar, KernelFamily::kAvx2, KernelFamily::kAvx512}) {
    for (DataType t : types) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        const std::string name = std::string(cohort::dtype_name(t)) + "/" + std::string(cohort::reduce_op_name(op)) +
                                 "/" + cohort::kernels::family_name(f);
        benchmark::RegisterBenchmark(name.c_str(), BM_Reduce, f, t, op)->Arg(64 << 10)->Arg(64 << 20)->UseRealTime();
      }
    }
  }
  return 0;
}
const int registered = register_all();

}  // namespace
