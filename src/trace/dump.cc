#include "trace/dump.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <fmt/core.h>

#include "cohort/error.h"
#include "cohort/types.h"
#include "common/private_files.h"

namespace cohort::trace {
namespace {

// 2: sequence numbers are 64-bit (a reader of format 1 would cut them to 32 bits).
constexpr const char* kDumpFormat = "cohort flight recorder 2";

OpState state_from_name(const std::string& s) {
  for (auto st : {OpState::kEmpty, OpState::kQueued, OpState::kRunning, OpState::kDone, OpState::kFailed})
    if (s == op_state_name(st)) return st;
  throw Error(fmt::format("unknown operation state '{}'", s));
}

coll::OpKind kind_from_name(const std::string& s) {
  for (int k = 0; k <= int(coll::kLastOpKind); ++k)
    if (s == coll::op_kind_name(coll::OpKind(k))) return coll::OpKind(k);
  throw Error(fmt::format("unknown operation '{}'", s));
}

}  // namespace

nlohmann::json to_json(const RankSnapshot& s) {
  nlohmann::json ops = nlohmann::json::array();
  for (const auto& r : s.entries) {
    ops.push_back({{"index", r.index},      {"op", coll::op_kind_name(r.kind)}, {"comm", r.comm},
                   {"seq", r.seq},          {"peer", r.peer},                   {"dtype", r.dtype},
                   {"redop", r.redop},      {"count", r.count},                 {"bytes", r.bytes},
                   {"state", op_state_name(r.state)}, {"t_queued", r.t_queued}, {"t_start", r.t_start},
                   {"t_end", r.t_end},      {"what", describe(r)}});
  }
  const auto& c = s.counters;
  return {{"format", kDumpFormat},
          {"rank", s.rank},
          {"world", s.world},
          {"host", s.host},
          {"pid", s.pid},
          {"started", s.started},
          {"process_state", s.process_state},
          {"taken_at", s.taken_at},
          {"total", s.total},
          {"counters",
           {{"ops", c.ops}, {"bytes", c.bytes}, {"op_ns", c.op_ns}, {"steps", c.steps}, {"step_ns", c.step_ns},
            {"wait_ns", c.wait_ns}}},
          {"ops", ops}};
}

RankSnapshot snapshot_from_json(const nlohmann::json& j) {
  try {
    const std::string format = j.is_object() ? j.value("format", "") : "";
    // Format 1 differs only in holding 32-bit sequence numbers: it reads as it is.
    if (format != kDumpFormat && format != "cohort flight recorder 1") {
      if (format.rfind("cohort flight recorder ", 0) == 0)
        throw Error(fmt::format("a flight recorder dump of another cohort version (\"format\": \"{}\"; this one "
                                "reads \"cohort flight recorder 1\" and \"{}\")",
                                format.substr(0, 40), kDumpFormat));
      throw Error(fmt::format("not a cohort flight recorder dump (no \"format\": \"{}\")", kDumpFormat));
    }
    RankSnapshot s;
    s.rank = j.at("rank").get<int>();
    s.world = j.at("world").get<int>();
    s.host = j.at("host").get<std::string>();
    s.pid = j.at("pid").get<int>();
    s.started = j.at("started").get<bool>();
    s.process_state = j.at("process_state").get<std::string>();
    s.taken_at = j.at("taken_at").get<int64_t>();
    s.total = j.at("total").get<uint64_t>();
    const auto& c = j.at("counters");
    s.counters = {c.at("ops").get<uint64_t>(),   c.at("bytes").get<uint64_t>(),   c.at("op_ns").get<uint64_t>(),
                  c.at("steps").get<uint64_t>(), c.at("step_ns").get<uint64_t>(), c.at("wait_ns").get<uint64_t>()};
    for (const auto& o : j.at("ops")) {
      OpRecord r;
      r.index = o.at("index").get<uint64_t>();
      r.kind = kind_from_name(o.at("op").get<std::string>());
      r.comm = o.at("comm").get<uint32_t>();
      r.seq = o.at("seq").get<uint64_t>();
      r.peer = o.at("peer").get<int32_t>();
      r.dtype = o.at("dtype").get<uint8_t>();
      r.redop = o.at("redop").get<uint8_t>();
      r.count = o.at("count").get<uint64_t>();
      r.bytes = o.at("bytes").get<uint64_t>();
      r.state = state_from_name(o.at("state").get<std::string>());
      r.t_queued = o.at("t_queued").get<int64_t>();
      r.t_start = o.at("t_start").get<int64_t>();
      r.t_end = o.at("t_end").get<int64_t>();
      s.entries.push_back(r);
    }
    return s;
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("malformed flight recorder dump: {}", e.what()));
  }
}

void write_dump(const std::string& path, const RankSnapshot& s) {
  std::string tmp = fmt::format("{}.tmp.{}", path, getpid());
  {
    // A new file (never one planted at the name, nor a link's target), renamed over `path` (a rename
    // replaces a link there, it does not follow it).
    auto out = files::ostream_of(files::create_new(tmp));
    *out << to_json(s).dump(1) << '\n';
    if (!out->flush()) throw Error(fmt::format("cannot write {}", tmp));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw Error(fmt::format("cannot rename {} to {}: {}", tmp, path, ec.message()));
}

RankSnapshot read_dump(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("cannot read {}", path));
  std::stringstream text;
  text << in.rdbuf();
  try {
    return snapshot_from_json(nlohmann::json::parse(text.str()));
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: not JSON ({})", path, e.what()));
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", path, e.what()));
  }
}

std::vector<RankSnapshot> read_dump_dir(const std::string& dir) {
  std::vector<RankSnapshot> out;
  std::regex name("rank[0-9]+\\.json");
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec))
    if (std::regex_match(entry.path().filename().string(), name)) out.push_back(read_dump(entry.path().string()));
  if (ec) throw Error(fmt::format("cannot list {}: {}", dir, ec.message()));
  if (out.empty()) throw Error(fmt::format("{}: no flight recorder dumps (rank<N>.json) in it", dir));
  std::sort(out.begin(), out.end(), [](const RankSnapshot& a, const RankSnapshot& b) { return a.rank < b.rank; });
  return out;
}

}  // namespace cohort::trace
