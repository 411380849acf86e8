// The worker side's save and load (client_impl.h; docs/parameter-server.md, "Save and load"): staged on
// every server, then committed, or discarded where any server refused. The saving worker writes the
// manifest that publishes the servers' shards.
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "common/fd.h"
#include "common/io.h"
#include "common/log.h"
#include "ps/client_impl.h"
#include "ps/config_json.h"
#include "ps/decode.h"

namespace cohort::ps::client_internal {

// Save and load are staged on every server, then committed, or discarded where any server refused
// (docs/parameter-server.md, "Save and load"): all or nothing, and one error naming the server and file.
//
// A save is one step that cannot be half done: the servers write into a fresh folder of `dir` that
// no manifest names, and the rename of manifest.json, naming that folder, publishes it. Any failure
// before that rename leaves the previous manifest and the folder it names as they were (the
// servers delete what they wrote); after it, the previous save's folder goes.
void ClientImpl::save(const std::string& dir) {
  std::lock_guard<std::mutex> g(mu_);
  const std::string folder = fresh_folder_name();
  auto op = start_all(Op::kSave, "", dir + "/" + folder, fmt::format("save to {}", dir));
  run_staged(*op);
  nlohmann::json tables = nlohmann::json::object();
  for (auto& c : op->calls) {
    std::vector<std::pair<std::string, TableConfig>> saved;
    if (std::string why = decode_saved_tables(reply_text(*c), &saved); !why.empty()) {
      end_staged(Op::kDiscard, op->what);
      throw malformed(*c, why);
    }
    for (auto& [name, config] : saved) tables[name] = config_to_json(config);
  }
  nlohmann::json manifest{
      {"format", "cohort-ps-1"}, {"servers", roles_.num_servers}, {"shards", folder}, {"tables", tables}};
  const std::string path = dir + "/manifest.json", tmp = path + ".tmp";
  const std::string previous = shards_folder_of(path);
  // The servers wrote their shards into `dir` on their hosts; this worker writes the manifest into
  // its own view of it, so a save needs one filesystem that all of them see.
  if (std::string why = io::replace_file(path, tmp, manifest.dump(2) + "\n"); !why.empty()) {
    end_staged(Op::kDiscard, op->what);
    throw InvalidArgument(fmt::format("save: {} (the servers wrote their shards to {}/{} on their hosts: the "
                                      "saving worker and every server must see one filesystem there)",
                                      why, dir, folder));
  }
  end_staged(Op::kCommit, op->what);  // the servers keep their files
  if (!previous.empty() && previous != folder) {
    std::error_code ec;
    std::filesystem::remove_all(dir + "/" + previous, ec);
    if (ec)
      log::warn("parameter-server worker {}: save to {}: cannot remove the previous save's folder {}: {}", worker_,
                dir, previous, ec.message());
  }
}

// "shards-<16 hex digits>": a folder no other save, of this job or another, picks.
std::string ClientImpl::fresh_folder_name() {
  std::random_device rd;
  const uint64_t r = (uint64_t(rd()) << 32) ^ rd();
  return fmt::format("shards-{:016x}", r);
}

// The folder the manifest at `path` names, "" when there is none (no manifest, a manifest of
// before folders, or one that is not a valid manifest: nothing to remove then).
std::string ClientImpl::shards_folder_of(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec || size > kMaxJsonBytes) return "";
  Manifest m;
  if (!parse_manifest(read_small_file(path), &m).empty()) return "";
  return m.shards;
}

std::string ClientImpl::read_small_file(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  std::string text;
  if (!fd) return text;
  char chunk[65536];
  for (;;) {
    const ssize_t k = ::read(fd.get(), chunk, sizeof chunk);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0 || text.size() + size_t(k) > kMaxJsonBytes) return text;
    text.append(chunk, size_t(k));
  }
}

void ClientImpl::load(const std::string& dir) {
  std::lock_guard<std::mutex> g(mu_);
  auto op = start_all(Op::kLoad, "", dir, fmt::format("load from {}", dir));
  run_staged(*op);
  end_staged(Op::kCommit, op->what);
  tables_.clear();  // re-learned on next use
  attached_.clear();  // the servers replaced their tables (other workers see them retired)
}

// A staged save or load: where any server refused, every server drops what it staged, and the
// first refusal (server order) is thrown.
void ClientImpl::run_staged(Operation& op) {
  try {
    run_locked(op);
  } catch (const InvalidArgument&) {
    end_staged(Op::kDiscard, op.what);
    throw;
  }
}

void ClientImpl::end_staged(Op kind, const std::string& what) {
  auto op = start_all(kind, "", {}, fmt::format("{} of {}", op_name(kind), what));
  run_locked(*op);
}

}  // namespace cohort::ps::client_internal
