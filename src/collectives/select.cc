// Algorithm selection by operation, world size and bytes. The rules and their reasons are in
// docs/algorithms.md; keep the two in step.
#include "collectives/select.h"

#include <array>
#include <string>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/env.h"

namespace cohort::coll {

namespace {

const env::BytesSetting kChunk("COHORT_COLL_CHUNK", 1024 * 1024,
                               "chunk size (bytes) of the pipelined ring and tree collectives");
const env::IntSetting kSlots("COHORT_COLL_SLOTS", 1,
                             "parallel message streams (slots) the ring spreads its chunks over");

const env::StringSetting kAlgoAllreduce("COHORT_ALGO_ALLREDUCE", "auto", "force the allreduce algorithm: ring|rhd|rd");
const env::StringSetting kAlgoReduce("COHORT_ALGO_REDUCE", "auto", "force the reduce algorithm: binomial|ring");
const env::StringSetting kAlgoBroadcast("COHORT_ALGO_BROADCAST", "auto",
                                        "force the broadcast algorithm: binomial|scatter_allgather");
const env::StringSetting kAlgoAllgather("COHORT_ALGO_ALLGATHER", "auto", "force the allgather algorithm: ring|bruck");
const env::StringSetting kAlgoAllgatherv("COHORT_ALGO_ALLGATHERV", "auto", "force the allgatherv algorithm: ring");
const env::StringSetting kAlgoGather("COHORT_ALGO_GATHER", "auto", "force the gather algorithm: linear");
const env::StringSetting kAlgoScatter("COHORT_ALGO_SCATTER", "auto", "force the scatter algorithm: linear");
const env::StringSetting kAlgoReduceScatter("COHORT_ALGO_REDUCE_SCATTER", "auto",
                                            "force the reduce_scatter algorithm: ring");
const env::StringSetting kAlgoAlltoall("COHORT_ALGO_ALLTOALL", "auto", "force the alltoall algorithm: pairwise");
const env::StringSetting kAlgoAlltoallv("COHORT_ALGO_ALLTOALLV", "auto", "force the alltoallv algorithm: pairwise");
const env::StringSetting kAlgoBarrier("COHORT_ALGO_BARRIER", "auto", "force the barrier algorithm: dissemination");

const env::StringSetting& setting_for(OpKind op) {
  switch (op) {
    case OpKind::kAllreduce: return kAlgoAllreduce;
    case OpKind::kReduce: return kAlgoReduce;
    case OpKind::kBroadcast: return kAlgoBroadcast;
    case OpKind::kAllgather: return kAlgoAllgather;
    case OpKind::kAllgatherv: return kAlgoAllgatherv;
    case OpKind::kGather: return kAlgoGather;
    case OpKind::kScatter: return kAlgoScatter;
    case OpKind::kReduceScatter: return kAlgoReduceScatter;
    case OpKind::kAlltoall: return kAlgoAlltoall;
    case OpKind::kAlltoallv: return kAlgoAlltoallv;
    case OpKind::kBarrier:
    case OpKind::kNone:
    case OpKind::kSendRecv:
    case OpKind::kSplit: break;  // only collectives are asked for (env_override)
  }
  return kAlgoBarrier;
}


// The environment override of each op, parsed once (kAuto when unset).
Algorithm env_override(OpKind op) {
  static const std::array<Algorithm, kNumCollectives> overrides = [] {
    std::array<Algorithm, kNumCollectives> out{};
    for (int i = 0; i < kNumCollectives; ++i) {
      const auto o = static_cast<OpKind>(int(OpKind::kAllreduce) + i);
      const auto& s = setting_for(o);
      const std::string value = s.get();
      auto a = parse_algorithm(value);
      if (!a || !algorithm_supported(o, *a)) {
        std::string valid;
        for (int k = 1; k <= static_cast<int>(Algorithm::kDissemination); ++k) {
          if (algorithm_supported(o, static_cast<Algorithm>(k))) {
            valid += std::string(algorithm_name(static_cast<Algorithm>(k))) + "|";
          }
        }
        throw ConfigError(fmt::format("{}={}: expected {}auto", s.name(), value, valid));
      }
      out[static_cast<size_t>(i)] = *a;
    }
    return out;
  }();
  return overrides[static_cast<size_t>(int(op) - int(OpKind::kAllreduce))];
}

}  // namespace

std::string_view algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kRing: return "ring";
    case Algorithm::kHalvingDoubling: return "rhd";
    case Algorithm::kRecursiveDoubling: return "rd";
    case Algorithm::kBinomial: return "binomial";
    case Algorithm::kScatterAllgather: return "scatter_allgather";
    case Algorithm::kBruck: return "bruck";
    case Algorithm::kPairwise: return "pairwise";
    case Algorithm::kLinear: return "linear";
    case Algorithm::kDissemination: return "dissemination";
  }
  return "?";
}

std::optional<Algorithm> parse_algorithm(std::string_view name) {
  for (int k = 0; k <= static_cast<int>(Algorithm::kDissemination); ++k) {
    if (algorithm_name(static_cast<Algorithm>(k)) == name) return static_cast<Algorithm>(k);
  }
  if (name == "halving_doubling" || name == "rabenseifner") return Algorithm::kHalvingDoubling;
  if (name == "recursive_doubling") return Algorithm::kRecursiveDoubling;
  if (name == "tree") return Algorithm::kBinomial;
  return std::nullopt;
}

bool algorithm_supported(OpKind op, Algorithm a) {
  if (a == Algorithm::kAuto) return true;
  switch (op) {
    case OpKind::kAllreduce:
      return a == Algorithm::kRing || a == Algorithm::kHalvingDoubling || a == Algorithm::kRecursiveDoubling;
    case OpKind::kReduce: return a == Algorithm::kBinomial || a == Algorithm::kRing;
    case OpKind::kBroadcast: return a == Algorithm::kBinomial || a == Algorithm::kScatterAllgather;
    case OpKind::kAllgather: return a == Algorithm::kRing || a == Algorithm::kBruck;
    case OpKind::kAllgatherv: return a == Algorithm::kRing;
    case OpKind::kGather:
    case OpKind::kScatter: return a == Algorithm::kLinear;
    case OpKind::kReduceScatter: return a == Algorithm::kRing;
    case OpKind::kAlltoall:
    case OpKind::kAlltoallv: return a == Algorithm::kPairwise;
    case OpKind::kBarrier: return a == Algorithm::kDissemination;
    case OpKind::kNone:
    case OpKind::kSendRecv:
    case OpKind::kSplit: return false;  // not collectives: no algorithms
  }
  return false;
}

Algorithm default_algorithm(OpKind op, int world, size_t bytes) {
  switch (op) {
    case OpKind::kAllreduce:
      if (bytes <= kAllreduceRecursiveDoublingMax) return Algorithm::kRecursiveDoubling;
      // With 2 ranks halving-doubling is the ring without pipelining; the ring is never worse.
      if (world > 2 && bytes <= kAllreduceHalvingDoublingMax) return Algorithm::kHalvingDoubling;
      return Algorithm::kRing;
    case OpKind::kReduce:
      return (world <= 2 || bytes <= kReduceBinomialMax) ? Algorithm::kBinomial : Algorithm::kRing;
    case OpKind::kBroadcast:
      return (world <= 3 || bytes <= kBroadcastBinomialMax) ? Algorithm::kBinomial : Algorithm::kScatterAllgather;
    case OpKind::kAllgather: return bytes <= kAllgatherBruckMax ? Algorithm::kBruck : Algorithm::kRing;
    case OpKind::kAllgatherv: return Algorithm::kRing;
    case OpKind::kGather:
    case OpKind::kScatter: return Algorithm::kLinear;
    case OpKind::kReduceScatter: return Algorithm::kRing;
    case OpKind::kAlltoall:
    case OpKind::kAlltoallv: return Algorithm::kPairwise;
    case OpKind::kBarrier: return Algorithm::kDissemination;
    case OpKind::kNone:
    case OpKind::kSendRecv:
    case OpKind::kSplit: break;  // select_algorithm refuses them
  }
  return Algorithm::kAuto;
}

Algorithm select_algorithm(OpKind op, int world, size_t bytes, Algorithm requested) {
  if (!is_collective(op)) throw InvalidArgument(fmt::format("{} is not a collective: it has no algorithms", op_kind_name(op)));
  if (requested != Algorithm::kAuto) {
    if (!algorithm_supported(op, requested)) {
      throw InvalidArgument(fmt::format("{} has no algorithm '{}'", op_kind_name(op), algorithm_name(requested)));
    }
    return requested;
  }
  const Algorithm forced = env_override(op);
  if (forced != Algorithm::kAuto) return forced;
  return default_algorithm(op, world, bytes);
}

size_t pipeline_chunk_bytes() {
  static const size_t v = kChunk.get() == 0 ? 1024 * 1024 : static_cast<size_t>(kChunk.get());
  return v;
}
int pipeline_slots() {
  static const int v = static_cast<int>(kSlots.get());
  return v;
}

}  // namespace cohort::coll
