#include "cohort/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cohort/error.h"
#include "common/io.h"

namespace cohort::train {

namespace {
constexpr std::string_view kMagic = "COHORTCKPT1\n";

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw Error(fmt::format("checkpoint: {} {}: {}", what, path, std::strerror(errno)));
}
}  // namespace

void write_file_atomically(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  fs::path target(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(fmt::format("checkpoint: cannot create directory {}: {}", dir.string(), ec.message()));
  // The process id keeps two writers of one path (ranks sharing a folder) off each other's file.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  if (std::string why = io::replace_file(path, tmp, bytes); !why.empty()) throw Error("checkpoint: " + why);
}

std::optional<std::string> read_file_if_exists(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (!std::filesystem::exists(path)) return std::nullopt;
    fail("cannot open", path);
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

namespace {
// FNV-1a over the payload: a checkpoint whose bytes changed after writing is not complete.
uint64_t digest(const std::string& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
  return h;
}
}  // namespace

std::string encode_checkpoint(const TrainingPosition& pos, const std::string& payload) {
  nlohmann::json j = {{"epoch", pos.epoch},
                      {"step_in_epoch", pos.step_in_epoch},
                      {"global_step", pos.global_step},
                      {"world_size", pos.world_size},
                      {"epoch_cursor", pos.epoch_cursor},
                      {"epoch_world", pos.epoch_world},
                      {"payload_bytes", payload.size()},
                      {"payload_fnv1a", fmt::format("{:016x}", digest(payload))}};
  std::string out(kMagic);
  out += j.dump();
  out += '\n';
  out += payload;
  return out;
}

TrainingPosition decode_checkpoint(const std::string& bytes, std::string& payload, const std::string& what) {
  if (bytes.compare(0, kMagic.size(), kMagic) != 0)
    throw InvalidArgument(fmt::format("{} is not a cohort checkpoint (bad header)", what));
  size_t eol = bytes.find('\n', kMagic.size());
  if (eol == std::string::npos) throw InvalidArgument(fmt::format("{}: truncated checkpoint header", what));
  TrainingPosition pos;
  size_t payload_bytes = 0;
  std::string expected_digest;
  try {
    auto j = nlohmann::json::parse(bytes.substr(kMagic.size(), eol - kMagic.size()));
    pos.epoch = j.at("epoch").get<int64_t>();
    pos.step_in_epoch = j.at("step_in_epoch").get<int64_t>();
    pos.global_step = j.at("global_step").get<int64_t>();
    pos.world_size = j.at("world_size").get<int>();
    pos.epoch_cursor = j.value("epoch_cursor", int64_t{-1});
    pos.epoch_world = j.value("epoch_world", pos.world_size);
    payload_bytes = j.at("payload_bytes").get<size_t>();
    expected_digest = j.value("payload_fnv1a", std::string());
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{}: bad checkpoint header: {}", what, e.what()));
  }
  if (bytes.size() - eol - 1 != payload_bytes)
    throw InvalidArgument(fmt::format("{}: checkpoint truncated ({} payload bytes, header says {})", what,
                                      bytes.size() - eol - 1, payload_bytes));
  payload = bytes.substr(eol + 1);
  if (!expected_digest.empty() && fmt::format("{:016x}", digest(payload)) != expected_digest)
    throw InvalidArgument(fmt::format("{}: checkpoint damaged (its payload's digest is not the one written)", what));
  return pos;
}

std::string checkpoint_path(const std::string& dir) { return dir + "/checkpoint.bin"; }
std::string previous_checkpoint_path(const std::string& dir) { return dir + "/checkpoint.1.bin"; }

void write_checkpoint(const std::string& dir, const TrainingPosition& pos, const std::string& payload) {
  const std::string newest = checkpoint_path(dir), previous = previous_checkpoint_path(dir);
  // The newest becomes the previous (a rename: atomic), then the new one is written atomically. A
  // crash in between leaves the previous one to resume from.
  if (::rename(newest.c_str(), previous.c_str()) != 0 && errno != ENOENT) fail("cannot rename to", previous);
  write_file_atomically(newest, encode_checkpoint(pos, payload));
}

std::optional<LoadedCheckpoint> newest_complete_checkpoint(const std::string& dir) {
  std::vector<std::string> skipped;
  bool any = false;
  for (const std::string& path : {checkpoint_path(dir), previous_checkpoint_path(dir)}) {
    auto bytes = read_file_if_exists(path);
    if (!bytes) continue;
    any = true;
    try {
      LoadedCheckpoint c;
      c.position = decode_checkpoint(*bytes, c.payload, path);
      c.path = path;
      c.skipped = skipped;
      return c;
    } catch (const InvalidArgument& e) {
      skipped.push_back(e.what());
    }
  }
  if (any)
    throw InvalidArgument(fmt::format("no complete checkpoint in {}: {}", dir, fmt::join(skipped, "; ")));
  return std::nullopt;
}

}  // namespace cohort::train
