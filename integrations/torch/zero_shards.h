#pragma once
// The sharded checkpoint format that ShardedOptimizer (ZeRO 1 and 2) and FullyShardedDataParallel
// (ZeRO 3) share, and the access to a libtorch optimizer's per-parameter state both need. Internal to
// cohort_libtorch (not installed).
//
// <dir>/zero/step-<global_step>/shard-<r>-of-<N>.bin, one file per rank: "COHORTZERO1\n", one JSON
// header line, then each state's float32 values over the rank's pieces, back to back. The header holds
// "parameters" ([name, numel] of every parameter of the model, in a fixed order), "pieces" ([parameter,
// first element, count]: the runs of parameter elements the rank holds) and "states" (what the values
// are). ShardedOptimizer's states are its optimizer's ("exp_avg", ...); FSDP writes "parameter" (the
// master weights) first, then its optimizer's. A load at any world size reads, from every old shard,
// only the ranges that overlap its own pieces.
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cohort/train/grad_sync.h"

namespace cohort::torch::zero {

std::string shard_dir(const std::string& dir, int64_t global_step);
std::string shard_path(const std::string& dir, int64_t global_step, int rank, int world);

// One contiguous run of a rank's chunk: `count` elements of parameter `param` from element
// `param_offset`, at position `position` of the rank's chunks laid back to back (chunk `chunk`, from
// element `in_chunk` of it).
struct Piece {
  size_t param = 0;
  size_t param_offset = 0;
  size_t count = 0;
  size_t position = 0;
  size_t chunk = 0;
  size_t in_chunk = 0;
};

// An old rank's shard as its header line describes it: the states it holds, its runs of parameter
// elements (Piece::position: where the run starts among the shard's values of one state), and where
// the values start in the file.
struct OldShard {
  std::string file;
  int64_t step = 0;
  std::vector<std::string> states;
  std::vector<Piece> pieces;
  size_t elements = 0;     // values per state
  uint64_t values_at = 0;  // the file offset of the first state's first value
};

// The shard file: `header` (kind, world, rank, steps...) with "parameters", "pieces" and "states" added,
// then for each state k the values of `chunk_values(k, chunk)` (a contiguous float32 CPU tensor per
// chunk) over `pieces`.
std::string encode_shard(nlohmann::json header, const std::vector<train::ParameterSpec>& params,
                         const std::vector<Piece>& pieces, const std::vector<std::string>& states,
                         const std::function<::torch::Tensor(size_t state, size_t chunk)>& chunk_values);

// Reads shard `s` of `old_world` (named by the checkpoint `checkpoint`) up to its header line and checks
// it against this model's parameters and the file's length; reads none of its values. Throws one line
// naming the file: missing, not a shard, damaged, another model (the first parameter that differs), or
// a length that is not the header's.
OldShard read_shard_header(const std::string& file, int s, int old_world, const std::string& checkpoint,
                           const std::vector<train::ParameterSpec>& params);

// Fills into[n][chunk] (float32 CPU tensors shaped as this rank's chunks) with the values of state
// names[n] that `shards` hold for this rank's pieces `mine`. A state no shard holds is left as it was.
void read_overlaps(const std::vector<OldShard>& shards, std::vector<Piece> mine, const std::vector<std::string>& names,
                   std::vector<std::vector<::torch::Tensor>>& into);

// Rank 0, after writing the checkpoint of `global_step`: removes the shard directories of every step
// but that one and the previous checkpoint's.
void remove_old_shard_dirs(const std::string& dir, int64_t global_step);

// ---- a libtorch optimizer's per-parameter state (SGD, Adam, AdamW) ----

// "sgd", "adam" or "adamw"; "" for another optimizer.
std::string optimizer_kind(const ::torch::optim::Optimizer& optimizer);
// The state tensors' names: "momentum_buffer"; "exp_avg", "exp_avg_sq" and with amsgrad "max_exp_avg_sq".
std::vector<std::string> state_names(const ::torch::optim::Optimizer& optimizer, const std::string& kind);
// State `name` of parameter `param`, or an undefined tensor before its first step.
::torch::Tensor state_tensor(const ::torch::optim::Optimizer& optimizer, const std::string& kind,
                             const ::torch::Tensor& param, const std::string& name);
// Adam's and AdamW's step count (their bias correction) of `param`; 0 for SGD or before the first step.
int64_t state_step(const ::torch::optim::Optimizer& optimizer, const std::string& kind, const ::torch::Tensor& param);
// Replaces `param`'s state by `tensors` (in state_names order) and `step`.
void set_state(::torch::optim::Optimizer& optimizer, const std::string& kind, const ::torch::Tensor& param,
               const std::vector<::torch::Tensor>& tensors, int64_t step);

}  // namespace cohort::torch::zero
