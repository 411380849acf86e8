// The sharded checkpoint format of ShardedOptimizer and FullyShardedDataParallel: zero_shards.h.
#include "zero_shards.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <tuple>
#include <type_traits>

#include "cohort/error.h"
#include "cohort/train/checkpoint.h"
#include "common/fd.h"

namespace cohort::torch::zero {

namespace {

constexpr std::string_view kShardMagic = "COHORTZERO1\n";

// `bytes` at `offset` of `fd` (the file `file`), or an error naming the file.
void read_range(int fd, const std::string& file, char* into, size_t bytes, uint64_t offset) {
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, into, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw InvalidArgument(fmt::format("{}: cannot read: {}", file, std::strerror(errno)));
    if (n == 0) throw InvalidArgument(fmt::format("{}: ends at byte {}, before the values its header names", file, offset));
    into += n;
    bytes -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

// The key of a parameter's state in torch::optim::Optimizer::state(): its TensorImpl's address, as a
// pointer in torch 2.x and as that pointer printed to a string before (c10::guts::to_string, which
// torch 2.x no longer has). The map's own key type decides.
using StateMap = std::decay_t<decltype(std::declval<::torch::optim::Optimizer&>().state())>;
template <typename Map = StateMap>  // a template, so that the branch not taken is not compiled
typename Map::key_type state_key(const ::torch::Tensor& t) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;
    key << static_cast<const void*>(t.unsafeGetTensorImpl());
    return key.str();
  } else {
    return t.unsafeGetTensorImpl();
  }
}

}  // namespace

std::string shard_dir(const std::string& dir, int64_t global_step) {
  return fmt::format("{}/zero/step-{}", dir, global_step);
}
std::string shard_path(const std::string& dir, int64_t global_step, int rank, int world) {
  return fmt::format("{}/shard-{}-of-{}.bin", shard_dir(dir, global_step), rank, world);
}

std::string encode_shard(nlohmann::json header, const std::vector<train::ParameterSpec>& params,
                         const std::vector<Piece>& pieces, const std::vector<std::string>& states,
                         const std::function<::torch::Tensor(size_t state, size_t chunk)>& chunk_values) {
  nlohmann::json params_json = nlohmann::json::array();
  for (const auto& p : params) params_json.push_back({p.name, p.numel()});
  header["parameters"] = params_json;
  nlohmann::json pieces_json = nlohmann::json::array();
  size_t elements = 0;
  for (const auto& p : pieces) {
    pieces_json.push_back({p.param, p.param_offset, p.count});
    elements += p.count;
  }
  header["pieces"] = pieces_json;
  header["states"] = states;
  std::string bytes(kShardMagic);
  bytes += header.dump();
  bytes += '\n';
  const size_t values_at = bytes.size();
  bytes.resize(values_at + states.size() * elements * sizeof(float));
  char* out = bytes.data() + values_at;
  for (size_t k = 0; k < states.size(); ++k) {
    std::vector<::torch::Tensor> host;  // per chunk, made once: a chunk holds several pieces
    for (const auto& p : pieces) {
      while (host.size() <= p.chunk) host.push_back(chunk_values(k, host.size()));
      std::memcpy(out, host[p.chunk].data_ptr<float>() + p.in_chunk, p.count * sizeof(float));
      out += p.count * sizeof(float);
    }
  }
  return bytes;
}

OldShard read_shard_header(const std::string& file, int s, int old_world, const std::string& checkpoint,
                           const std::vector<train::ParameterSpec>& params) {
  UniqueFd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd && errno == ENOENT)
    throw InvalidArgument(fmt::format("{}: the shard of rank {} of {} is missing ({} names it)", file, s, old_world,
                                      checkpoint));
  if (!fd) throw InvalidArgument(fmt::format("{}: cannot open: {}", file, std::strerror(errno)));
  struct stat st{};
  if (::fstat(fd.get(), &st) != 0) throw InvalidArgument(fmt::format("{}: cannot stat: {}", file, std::strerror(errno)));
  const auto size = static_cast<uint64_t>(st.st_size);
  // The header line is a few kilobytes (one entry per parameter and per run): read in growing steps
  // until its end, so that a small shard is not read whole for its header.
  std::string text;
  size_t eol = std::string::npos;
  for (size_t step = 4096; eol == std::string::npos && text.size() < size; step *= 2) {
    const size_t searched = text.size();
    text.resize(std::min<uint64_t>(size, searched + step));
    read_range(fd.get(), file, text.data() + searched, text.size() - searched, searched);
    eol = text.find('\n', std::max(searched, kShardMagic.size()));
  }
  if (text.compare(0, kShardMagic.size(), kShardMagic) != 0 || eol == std::string::npos)
    throw InvalidArgument(fmt::format("{}: not a cohort shard", file));
  OldShard shard;
  shard.file = file;
  shard.values_at = eol + 1;
  try {
    const auto header = nlohmann::json::parse(text.substr(kShardMagic.size(), eol - kShardMagic.size()));
    const auto& old_params = header.at("parameters");
    // The first parameter that differs names the difference (another model, or the same one resized).
    for (size_t i = 0; i < std::max(params.size(), old_params.size()); ++i) {
      auto describe = [](const std::string& name, size_t numel) { return fmt::format("{} of {} elements", name, numel); };
      const std::string there = i < old_params.size()
                                    ? describe(old_params[i][0].get<std::string>(), old_params[i][1].get<size_t>())
                                    : "none";
      const std::string here = i < params.size() ? describe(params[i].name, params[i].numel()) : "none";
      if (there != here)
        throw InvalidArgument(fmt::format("{}: written for another model: its parameter {} is {}, this model's is {}",
                                          file, i, there, here));
    }
    shard.step = header.at("step").get<int64_t>();
    shard.states = header.at("states").get<std::vector<std::string>>();
    for (const auto& p : header.at("pieces")) {
      Piece piece;
      piece.param = p[0].get<size_t>();
      piece.param_offset = p[1].get<size_t>();
      piece.count = p[2].get<size_t>();
      piece.position = shard.elements;
      if (piece.param >= params.size() || piece.param_offset + piece.count > params[piece.param].numel())
        throw InvalidArgument(fmt::format("{}: a damaged header: a run of {} elements from element {} of parameter {}, "
                                          "outside the model",
                                          file, piece.count, piece.param_offset, piece.param));
      shard.elements += piece.count;
      shard.pieces.push_back(piece);
    }
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{}: a damaged header: {}", file, e.what()));
  }
  const uint64_t want = shard.values_at + shard.states.size() * shard.elements * sizeof(float);
  if (size != want) throw InvalidArgument(fmt::format("{}: {} bytes, not the {} its header says", file, size, want));
  return shard;
}

void read_overlaps(const std::vector<OldShard>& shards, std::vector<Piece> mine, const std::vector<std::string>& names,
                   std::vector<std::vector<::torch::Tensor>>& into) {
  // This rank's runs sorted by parameter, to find the runs an old shard overlaps. Only the overlapping
  // ranges are read: each rank reads about 1/N of the values, not every shard whole.
  std::sort(mine.begin(), mine.end(),
            [](const Piece& a, const Piece& b) { return std::tie(a.param, a.param_offset) < std::tie(b.param, b.param_offset); });
  for (const auto& shard : shards) {
    UniqueFd fd(::open(shard.file.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) throw InvalidArgument(fmt::format("{}: cannot open: {}", shard.file, std::strerror(errno)));
    for (size_t k = 0; k < shard.states.size(); ++k) {
      const auto at = std::find(names.begin(), names.end(), shard.states[k]);
      if (at == names.end()) continue;  // e.g. max_exp_avg_sq, now without amsgrad
      const size_t n = static_cast<size_t>(at - names.begin());
      const uint64_t state_at = shard.values_at + k * shard.elements * sizeof(float);
      for (const auto& old_piece : shard.pieces) {
        const size_t param = old_piece.param, lo = old_piece.param_offset, hi = lo + old_piece.count;
        // Runs of this rank that overlap [lo, hi) of the parameter: from the last starting at or before lo.
        auto it = std::upper_bound(mine.begin(), mine.end(), std::make_pair(param, lo), [](const auto& key, const Piece& p) {
          return std::tie(key.first, key.second) < std::tie(p.param, p.param_offset);
        });
        if (it != mine.begin()) --it;
        for (; it != mine.end() && it->param <= param; ++it) {
          if (it->param < param) continue;
          const size_t from = std::max(lo, it->param_offset), to = std::min(hi, it->param_offset + it->count);
          if (it->param_offset >= hi) break;
          if (from >= to) continue;
          read_range(fd.get(), shard.file,
                     reinterpret_cast<char*>(into[n][it->chunk].data_ptr<float>() + it->in_chunk + (from - it->param_offset)),
                     (to - from) * sizeof(float), state_at + (old_piece.position + (from - lo)) * sizeof(float));
        }
      }
    }
  }
}

void remove_old_shard_dirs(const std::string& dir, int64_t global_step) {
  // Keep the shards of the two checkpoints on disk (the newest and the one before it).
  std::vector<int64_t> keep{global_step};
  for (const auto& path : {train::previous_checkpoint_path(dir)}) {
    auto previous = train::read_file_if_exists(path);
    if (!previous) continue;
    try {
      std::string body;
      keep.push_back(train::decode_checkpoint(*previous, body, path).global_step);
    } catch (const std::exception&) {
    }
  }
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir + "/zero", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0) continue;
    int64_t step = std::atoll(name.c_str() + 5);
    if (std::find(keep.begin(), keep.end(), step) == keep.end()) std::filesystem::remove_all(entry.path(), ec);
  }
}

// ---- optimizer state ----

std::string optimizer_kind(const ::torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const ::torch::optim::SGD*>(&optimizer)) return "sgd";
  if (dynamic_cast<const ::torch::optim::AdamW*>(&optimizer)) return "adamw";
  if (dynamic_cast<const ::torch::optim::Adam*>(&optimizer)) return "adam";
  return "";
}

std::vector<std::string> state_names(const ::torch::optim::Optimizer& optimizer, const std::string& kind) {
  if (kind == "sgd") return {"momentum_buffer"};
  std::vector<std::string> names{"exp_avg", "exp_avg_sq"};
  const auto& options = optimizer.param_groups().at(0).options();
  const bool amsgrad = kind == "adam" ? static_cast<const ::torch::optim::AdamOptions&>(options).amsgrad()
                                      : static_cast<const ::torch::optim::AdamWOptions&>(options).amsgrad();
  if (amsgrad) names.push_back("max_exp_avg_sq");
  return names;
}

::torch::Tensor state_tensor(const ::torch::optim::Optimizer& optimizer, const std::string& kind,
                             const ::torch::Tensor& param, const std::string& name) {
  const auto& state = optimizer.state();
  auto it = state.find(state_key(param));
  if (it == state.end()) return {};
  const auto* s = it->second.get();
  if (kind == "sgd") return static_cast<const ::torch::optim::SGDParamState*>(s)->momentum_buffer();
  if (kind == "adam") {
    const auto* a = static_cast<const ::torch::optim::AdamParamState*>(s);
    return name == "exp_avg" ? a->exp_avg() : name == "exp_avg_sq" ? a->exp_avg_sq() : a->max_exp_avg_sq();
  }
  const auto* a = static_cast<const ::torch::optim::AdamWParamState*>(s);
  return name == "exp_avg" ? a->exp_avg() : name == "exp_avg_sq" ? a->exp_avg_sq() : a->max_exp_avg_sq();
}

int64_t state_step(const ::torch::optim::Optimizer& optimizer, const std::string& kind, const ::torch::Tensor& param) {
  if (kind == "sgd") return 0;
  const auto& state = optimizer.state();
  auto it = state.find(state_key(param));
  if (it == state.end()) return 0;
  if (kind == "adam") return static_cast<const ::torch::optim::AdamParamState*>(it->second.get())->step();
  return static_cast<const ::torch::optim::AdamWParamState*>(it->second.get())->step();
}

void set_state(::torch::optim::Optimizer& optimizer, const std::string& kind, const ::torch::Tensor& param,
               const std::vector<::torch::Tensor>& tensors, int64_t step) {
  const auto names = state_names(optimizer, kind);
  auto get = [&](const std::string& name) {
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == name) return tensors.at(i);
    return ::torch::Tensor();
  };
  std::unique_ptr<::torch::optim::OptimizerParamState> state;
  if (kind == "sgd") {
    auto s = std::make_unique<::torch::optim::SGDParamState>();
    s->momentum_buffer(get("momentum_buffer"));
    state = std::move(s);
  } else if (kind == "adam") {
    auto s = std::make_unique<::torch::optim::AdamParamState>();
    s->step(step).exp_avg(get("exp_avg")).exp_avg_sq(get("exp_avg_sq"));
    if (auto m = get("max_exp_avg_sq"); m.defined()) s->max_exp_avg_sq(m);
    state = std::move(s);
  } else {
    auto s = std::make_unique<::torch::optim::AdamWParamState>();
    s->step(step).exp_avg(get("exp_avg")).exp_avg_sq(get("exp_avg_sq"));
    if (auto m = get("max_exp_avg_sq"); m.defined()) s->max_exp_avg_sq(m);
    state = std::move(s);
  }
  optimizer.state()[state_key(param)] = std::move(state);
}

}  // namespace cohort::torch::zero
