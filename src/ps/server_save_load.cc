// The parameter server's save and load (server_impl.h; docs/parameter-server.md: "Save and load").
//
// Both are staged, so that they are all or nothing across the servers: a save writes each shard
// into a folder of its own that no manifest names yet (the worker picks a fresh one per save), a
// load reads and checks every file into new tables beside the old ones. The worker then tells
// every server to commit (keep the files, or swap the tables in) or, where any server refused, to
// discard what it staged (delete the files). A worker has at most one save or load staged.
//
// Any error of a save or load (a full disk, a row lock held past the timeout, memory that cannot
// be had) is the requesting worker's: stage_save and stage_load throw them all as
// InvalidArgument, and this server serves on.
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "common/fd.h"
#include "common/io.h"
#include "ps/config_json.h"
#include "ps/decode.h"
#include "ps/server_impl.h"
#include "ps/sharding.h"

namespace cohort::ps::server_internal {

std::string Server::shard_path(const std::string& dir, const std::string& table, int k, int n) {
  return fmt::format("{}/{}.shard-{}-of-{}", dir, table, k, n);
}

// Every server writes into the same folder: the last one to leave it empty removes it.
void Server::remove_files(const Staged& st) {
  for (const auto& f : st.files) ::unlink(f.c_str());
  if (!st.folder.empty()) ::rmdir(st.folder.c_str());
}

void Server::discard(int w) {
  auto it = staged_.find(w);
  if (it == staged_.end()) return;
  remove_files(it->second);
  staged_.erase(it);
}

// Nothing here can fail: a save's files are in place already (the worker's manifest names them),
// a load's tables are swapped in.
void Server::commit(int w) {
  auto it = staged_.find(w);
  if (it == staged_.end()) throw InvalidArgument("commit: this worker has no save or load staged on this server");
  Staged st = std::move(it->second);
  staged_.erase(it);
  for (auto& [name, shard] : st.tables) tables_[name] = std::move(shard);  // the old shards retire
}

// Writes every table's shard into `folder` (a fresh one, named by no manifest yet); returns
// {table: config} of them.
std::string Server::stage_save(int w, const std::string& folder) {
  discard(w);
  Staged st;
  std::string path = folder;
  try {
    std::error_code ec;
    if (!std::filesystem::create_directories(folder, ec) && ec)
      throw InvalidArgument(fmt::format("save: {}: cannot create the directory: {}", folder, ec.message()));
    st.folder = folder;
    nlohmann::json saved = nlohmann::json::object();
    for (auto& [name, t] : tables_) {
      path = shard_path(folder, name, index_, roles_.num_servers);
      st.files.push_back(path);
      write_shard(path, *t);
      saved[name] = config_to_json(t->config());
    }
    staged_[w] = std::move(st);
    return saved.dump();
  } catch (const InvalidArgument&) {
    abandon(w, st);
    throw;
  } catch (const std::bad_alloc&) {
    abandon(w, st);
    throw InvalidArgument(fmt::format("save: {}: out of memory", path));
  } catch (const std::exception& e) {  // a row lock held past the timeout, the table's memory
    abandon(w, st);
    throw InvalidArgument(fmt::format("save: {}: {}", path, e.what()));
  }
}

// A save this server could not write: its own files go now, but not the folder, which the other
// servers may still be writing into (removing it would fail them too, and their error could reach
// the worker before this one's); the worker's discard, which every server gets once all answered,
// removes it.
void Server::abandon(int w, Staged& st) {
  for (const auto& f : st.files) ::unlink(f.c_str());
  Staged folder_only;
  folder_only.folder = st.folder;
  staged_[w] = std::move(folder_only);
}

// A shard file: a JSON header line, then one record per row (id u64, values f32 x dim, optimizer
// state f32 x state_floats). Workers on this host may create rows while the shard is read
// (for_each visits the rows that existed when it began), so the header's row count is the number
// of records written: 20 spaces at first, filled in at the end (JSON allows the blanks).
void Server::write_shard(const std::string& tmp, TableShard& t) {
  auto fail = [&](const char* what) {
    throw InvalidArgument(fmt::format("save: {}: cannot {}: {}", tmp, what, std::strerror(errno)));
  };
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd) fail("create it");
  const nlohmann::json head{{"table", t.name()}, {"config", config_to_json(t.config())}, {"server", index_},
                            {"servers", roles_.num_servers}, {"state_floats", state_floats(t.config())}};
  std::string line = head.dump();
  line.pop_back();  // its closing brace: "rows" comes last
  line += ",\"rows\":";
  const size_t rows_at = line.size();
  line += std::string(20, ' ') + "}\n";
  constexpr size_t kChunk = 1 << 20;
  std::vector<char> buf(line.begin(), line.end());
  buf.reserve(kChunk + line.size());
  auto flush = [&] {
    if (!io::write_all(fd.get(), buf.data(), buf.size())) fail("write it");
    buf.clear();
  };
  const size_t d = t.dim(), sf = state_floats(t.config());
  uint64_t rows = 0;
  t.for_each([&](uint64_t id, const float* values, const float* state) {
    const char* p = reinterpret_cast<const char*>(&id);
    buf.insert(buf.end(), p, p + 8);
    buf.insert(buf.end(), reinterpret_cast<const char*>(values), reinterpret_cast<const char*>(values + d));
    buf.insert(buf.end(), reinterpret_cast<const char*>(state), reinterpret_cast<const char*>(state + sf));
    ++rows;
    if (buf.size() >= kChunk) flush();
  });
  flush();
  const std::string count = fmt::format("{:<20}", rows);
  if (::pwrite(fd.get(), count.data(), count.size(), off_t(rows_at)) != ssize_t(count.size())) fail("write it");
  if (::fsync(fd.get()) != 0) fail("sync it");
}

// Reads and checks dir/manifest.json and every shard it names into new tables, kept until commit.
// Every error is the loading worker's (InvalidArgument); what was staged is dropped.
void Server::stage_load(int w, const std::string& dir) {
  discard(w);
  const std::string path = dir + "/manifest.json";
  std::string text;
  if (std::string why = read_manifest(path, &text); !why.empty())
    throw InvalidArgument(fmt::format("load: {}: {}", path, why));
  Manifest m;
  if (std::string why = parse_manifest(text, &m); !why.empty())
    throw InvalidArgument(fmt::format("load: {}: {}", path, why));
  // A save names its shards' folder; a manifest of before that keeps them beside it.
  const std::string shards = m.shards.empty() ? dir : dir + "/" + m.shards;
  Staged st;
  std::string table;
  try {
    for (auto& [name, c] : m.tables) {
      table = name;
      st.tables[name] = load_table(shards, name, c, m.servers);
    }
  } catch (const InvalidArgument&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw InvalidArgument(fmt::format("load: {}: table '{}': out of memory", dir, table));
  } catch (const std::exception& e) {  // the new table's memory (memfd, mmap, growing it)
    throw InvalidArgument(fmt::format("load: {}: table '{}': {}", dir, table, e.what()));
  }
  staged_[w] = std::move(st);
}

std::string Server::read_manifest(const std::string& path, std::string* text) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd)
    return fmt::format("cannot open it: {} (was the directory written by save? every server reads it, so it must "
                       "be on a filesystem they all see)",
                       std::strerror(errno));
  char chunk[65536];
  for (;;) {
    const ssize_t k = ::read(fd.get(), chunk, sizeof chunk);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return fmt::format("cannot read it: {}", std::strerror(errno));
    if (k == 0) return "";
    text->append(chunk, size_t(k));
    if (text->size() > kMaxJsonBytes) return fmt::format("larger than {} bytes", kMaxJsonBytes);
  }
}

// Every saved shard of one table, keeping the rows this server owns under the current server count.
// Every record is checked: a file holds exactly the rows its header counts, each in the shard the
// file is for, each id once.
std::unique_ptr<TableShard> Server::load_table(const std::string& dir, const std::string& name,
                                               const TableConfig& c, int saved_servers) {
  auto shard = make_shard(name, c);
  const size_t d = c.dim, sf = state_floats(c);
  const size_t record = 8 + (d + sf) * 4;
  std::vector<char> rec(record);
  std::vector<float> values(d), state(sf);
  std::vector<bool> seen(c.dense ? shard->held_rows() : 0);  // dense rows exist from the start
  for (int k = 0; k < saved_servers; ++k) {
    const std::string path = shard_path(dir, name, k, saved_servers);
    auto bad = [&](const std::string& what) { return InvalidArgument(fmt::format("load: {}: {}", path, what)); };
    std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rbe"), &std::fclose);
    if (!f) throw bad(fmt::format("cannot open it: {}", std::strerror(errno)));
    constexpr size_t kMaxHeader = 65536;
    std::string line;
    int ch = 0;
    while (line.size() <= kMaxHeader && (ch = std::getc(f.get())) != EOF && ch != '\n') line += char(ch);
    if (ch != '\n')
      throw bad(ch == EOF ? std::string("ends within its header line")
                          : fmt::format("no header line within its first {} bytes", kMaxHeader));
    ShardFileHeader h;
    if (std::string why = parse_shard_header(line, &h); !why.empty()) throw bad(why);
    if (h.table != name) throw bad(fmt::format("its header names table '{}'", h.table));
    if (h.server != k || h.servers != saved_servers)
      throw bad(fmt::format("its header says shard {} of {}", h.server, h.servers));
    const nlohmann::json in_file = config_to_json(h.config), in_manifest = config_to_json(c);
    for (auto& [key, v] : in_file.items())
      if (v != in_manifest.at(key))
        throw bad(fmt::format("its header's configuration differs from the manifest's: {} {} (manifest: {})", key,
                              v.dump(), in_manifest.at(key).dump()));
    if (h.state_floats != sf)
      throw bad(fmt::format("its header says {} optimizer-state floats per row, the configuration {}",
                            h.state_floats, sf));
    for (uint64_t r = 0; r < h.rows; ++r) {
      if (std::fread(rec.data(), 1, record, f.get()) != record)
        throw bad(fmt::format("ends after {} of the {} rows its header counts{}", r, h.rows,
                              std::ferror(f.get()) ? fmt::format(" ({})", std::strerror(errno)) : ""));
      uint64_t id = 0;
      std::memcpy(&id, rec.data(), 8);
      if (c.dense && id >= c.rows)
        throw bad(fmt::format("row {}: id {} is outside the dense table's {} rows", r, id, c.rows));
      const int saved_owner = c.dense ? shard_of_row(id, c.rows, saved_servers) : shard_of_id(id, saved_servers);
      if (saved_owner != k) throw bad(fmt::format("row {}: id {} belongs in shard {}, not in this one", r, id, saved_owner));
      const int owner = c.dense ? shard_of_row(id, c.rows, roles_.num_servers) : shard_of_id(id, roles_.num_servers);
      if (owner != index_) continue;
      std::memcpy(values.data(), rec.data() + 8, d * 4);
      if (sf) std::memcpy(state.data(), rec.data() + 8 + d * 4, sf * 4);
      // A second record of one id (a damaged file) is found by its owner only: in a sparse shard
      // the row then exists already, in a dense one it was put before.
      bool again = false;
      if (c.dense) {
        auto slot = seen[id - shard->first_row()];
        again = slot;
        slot = true;
        shard->put(id, values.data(), state.data());
      } else {
        const uint64_t before = shard->rows();
        shard->put(id, values.data(), state.data());
        again = shard->rows() == before;
      }
      if (again) throw bad(fmt::format("row {}: id {} comes a second time", r, id));
    }
    if (std::getc(f.get()) != EOF) throw bad(fmt::format("holds more than the {} rows its header counts", h.rows));
  }
  return shard;
}

}  // namespace cohort::ps::server_internal
