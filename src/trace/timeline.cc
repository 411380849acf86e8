#include "trace/timeline.h"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <queue>
#include <ostream>
#include <regex>

#include <fmt/core.h>

#include "cohort/error.h"
#include "cohort/types.h"
#include "common/env.h"
#include "common/private_files.h"

namespace cohort::trace {
namespace {

// The record layout's version: 2 has 64-bit sequence numbers (1: 32-bit, 88-byte records).
constexpr const char* kTimelineMagic = "COHORT-TIMELINE-2";

// Events a track may be out of time order by, in the file (see merge_timelines).
constexpr size_t kReorderWindow = 4096;


const env::IntSetting kMaxEvents(
    "COHORT_TIMELINE_MAX_EVENTS", 1000000,
    "events each rank records into the timeline at most (96 bytes each, kept in memory until the rank "
    "exits); later ones are dropped and the merged trace says which ranks were cut");

int64_t realtime_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::string replace_rank(std::string path, int rank) {
  auto at = path.find("{rank}");
  if (at != std::string::npos) path.replace(at, 6, std::to_string(rank < 0 ? int(getpid()) : rank));
  return path;
}

}  // namespace

TimelineWriter::TimelineWriter(std::string path)
    : path_(std::move(path)), max_events_(uint64_t(std::max<int64_t>(0, kMaxEvents.get()))) {}

void TimelineWriter::set_identity(int rank, int world, const std::string& host) {
  std::lock_guard<std::mutex> g(mutex_);
  rank_ = rank;
  world_ = world;
  host_ = host;
}

void TimelineWriter::add_locked(const TimelineRecord& r) {
  if (recorded_ >= max_events_) {
    ++dropped_;
    return;
  }
  ++recorded_;
  if (blocks_.empty() || used_ == kBlockRecords) {
    blocks_.push_back(std::make_unique_for_overwrite<Block>());
    used_ = 0;
  }
  blocks_.back()->records[used_++] = r;
}

void TimelineWriter::add_op(const OpRecord& op, uint32_t repeat, uint64_t last_seq) {
  TimelineRecord r{};
  r.repeat = repeat;
  r.last_seq = repeat > 1 ? last_seq : op.seq;
  r.type = TimelineRecord::kOp;
  r.kind = op.kind;
  r.dtype = op.dtype;
  r.redop = op.redop;
  r.state = op.state;
  r.seq = op.seq;
  r.comm = op.comm;
  r.peer = op.peer;
  r.count = op.count;
  r.bytes = op.bytes;
  r.t_queued = op.t_queued;
  r.t0 = op.t_start;
  r.t1 = op.t_end;
  std::lock_guard<std::mutex> g(mutex_);
  add_locked(r);
}

void TimelineWriter::add_span(const char* name, int index, int64_t t0, int64_t t1) {
  TimelineRecord r{};
  r.type = TimelineRecord::kSpan;
  r.peer = index;
  r.t0 = t0;
  r.t1 = std::max(t0, t1);
  std::snprintf(r.name, sizeof r.name, "%s", name);
  std::lock_guard<std::mutex> g(mutex_);
  add_locked(r);
}

void TimelineWriter::add_instant(const char* name, int index, int64_t t) {
  TimelineRecord r{};
  r.type = TimelineRecord::kInstant;
  r.peer = index;
  r.t0 = r.t1 = t;
  std::snprintf(r.name, sizeof r.name, "%s", name);
  std::lock_guard<std::mutex> g(mutex_);
  add_locked(r);
}

void TimelineWriter::flush() {
  std::lock_guard<std::mutex> g(mutex_);
  flush_locked();
}

void TimelineWriter::flush_locked() {
  bool note = dropped_ > 0 && !truncation_noted_;
  if (blocks_.empty() && header_written_ && !note) return;
  std::string path = replace_rank(path_, rank_);
  // The first flush creates the file afresh, later ones append to that file: a link planted at the name
  // (the rank files go to a trace folder) is never written through.
  auto stream = files::ostream_of(header_written_ ? files::open_append(path) : files::create_new(path));
  std::ostream& out = *stream;
  if (!header_written_) {
    // The clock anchor: a realtime reading bracketed by two monotonic ones.
    int64_t m0 = monotonic_ns(), real = realtime_ns(), m1 = monotonic_ns();
    nlohmann::json h = {{"rank", rank_},   {"world", world_},          {"host", host_},
                        {"pid", getpid()}, {"mono_ns", (m0 + m1) / 2}, {"real_ns", real},
                        {"anchor_err_ns", (m1 - m0 + 1) / 2}};
    out << kTimelineMagic << '\n' << h.dump() << '\n';
    header_written_ = true;
  }
  if (note) {
    TimelineRecord r{};
    r.type = TimelineRecord::kTruncated;
    r.bytes = dropped_;  // counted until this flush (the exit's, as a rule)
    out.write(reinterpret_cast<const char*>(&r), sizeof r);
    truncation_noted_ = true;
  }
  for (size_t b = 0; b < blocks_.size(); ++b) {
    size_t n = b + 1 == blocks_.size() ? used_ : kBlockRecords;
    out.write(reinterpret_cast<const char*>(blocks_[b]->records), std::streamsize(n * sizeof(TimelineRecord)));
  }
  blocks_.clear();
  used_ = 0;
  out.flush();
  if (!out) throw Error(fmt::format("writing the timeline to {} failed", path));
}

std::vector<std::string> timeline_rank_files(const std::string& dir) {
  std::vector<std::pair<int, std::string>> found;
  std::regex name("rank([0-9]+)\\.timeline");
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::smatch m;
    std::string file = entry.path().filename().string();
    if (std::regex_match(file, m, name)) found.emplace_back(std::stoi(m[1]), entry.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

namespace {

// A rank file opened past its two header lines; the JSON line is returned in `header`.
std::ifstream open_rank_file(const std::string& file, nlohmann::json& header) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read the timeline file {}", file));
  std::string magic, line;
  if (!std::getline(in, magic)) throw Error(fmt::format("cannot read the timeline file {}", file));
  if (magic != kTimelineMagic && magic.rfind("COHORT-TIMELINE-", 0) == 0)
    throw Error(fmt::format("{}: a timeline rank file of another cohort version ({}; this one reads {})", file,
                            magic.substr(0, 40), kTimelineMagic));
  if (magic != kTimelineMagic)
    throw Error(fmt::format("{}: not a cohort timeline rank file (expected the line {})", file, kTimelineMagic));
  try {
    if (!std::getline(in, line)) throw Error("");
    header = nlohmann::json::parse(line);
  } catch (const std::exception& e) {
    throw Error(fmt::format("{}:2: expected the rank's JSON line ({})", file, e.what()));
  }
  if (!header.contains("mono_ns") || !header.contains("real_ns"))
    throw Error(fmt::format("{}:2: expected the clock anchor (mono_ns, real_ns)", file));
  return in;
}

bool read_record(std::ifstream& in, TimelineRecord& r) {
  return bool(in.read(reinterpret_cast<char*>(&r), sizeof r));
}

std::string record_name(const TimelineRecord& r) {
  std::string name(r.name, strnlen(r.name, sizeof r.name));
  return r.peer >= 0 ? fmt::format("{} {}", name, r.peer) : name;
}

}  // namespace

MergeSummary merge_timelines(const std::vector<std::string>& rank_files, std::ostream& out) {
  // Pass 1: each rank's anchor, and the earliest event on the realtime axis (the trace's zero).
  // Memory stays bounded: events are read a line at a time in both passes, and written as read.
  // Within a track, a rank writes events in start order (one communicator runs one operation at a
  // time; the training spans follow each other), so the output needs no sort.
  struct Rank {
    nlohmann::json header;
    int64_t offset = 0;  // realtime - monotonic
  };
  std::vector<Rank> ranks;
  MergeSummary summary;
  int64_t origin = INT64_MAX;
  int64_t worst_anchor = 0;
  for (const auto& file : rank_files) {
    Rank r;
    std::ifstream in = open_rank_file(file, r.header);
    r.offset = r.header["real_ns"].get<int64_t>() - r.header["mono_ns"].get<int64_t>();
    worst_anchor = std::max(worst_anchor, r.header.value("anchor_err_ns", int64_t(0)));
    TimelineRecord rec;
    while (read_record(in, rec))
      if (rec.type != TimelineRecord::kTruncated) origin = std::min(origin, rec.t0 + r.offset);
    ranks.push_back(std::move(r));
  }
  if (origin == INT64_MAX) origin = 0;

  // Pass 2: the events, converted and written as they are read, through a small reorder window per
  // track: a span is written when it ends, after the instants and operations that happened inside it,
  // so a track's file order is only nearly its time order.
  out << "{\"traceEvents\":[\n";
  bool first = true;
  auto write = [&](const std::string& text) {
    out << (first ? "" : ",\n") << text;
    first = false;
  };
  using Pending = std::pair<double, std::string>;  // (ts, event text), earliest on top
  std::map<int, std::priority_queue<Pending, std::vector<Pending>, std::greater<Pending>>> window;
  auto emit = [&](const nlohmann::json& e) {
    if (e["ph"] == "M") return write(e.dump());
    auto& q = window[e["tid"].get<int>()];
    q.emplace(e["ts"].get<double>(), e.dump());
    if (q.size() > kReorderWindow) {
      write(q.top().second);
      q.pop();
    }
  };
  auto drain = [&] {
    for (auto& [tid, q] : window)
      for (; !q.empty(); q.pop()) write(q.top().second);
    window.clear();
  };
  for (size_t f = 0; f < rank_files.size(); ++f) {
    const Rank& r = ranks[f];
    int pid = r.header.value("rank", -1);
    if (pid < 0) pid = r.header.value("pid", 0);
    emit({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"tid", 0},
          {"args", {{"name", fmt::format("rank {} ({})", pid, r.header.value("host", "?"))}}}});
    emit({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"tid", 0}, {"args", {{"sort_index", pid}}}});
    emit({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", kTrainingTrackId}, {"args", {{"name", "training"}}}});
    std::map<uint32_t, int> tracks;  // communicator -> track, numbered in order of first use
    nlohmann::json header;
    std::ifstream in = open_rank_file(rank_files[f], header);
    TimelineRecord rec;
    while (read_record(in, rec)) {
      if (rec.type == TimelineRecord::kTruncated) {
        summary.truncated_ranks.push_back(pid);
        continue;
      }
      double ts = double(rec.t0 + r.offset - origin) / 1000.0;
      double dur = rec.t1 > rec.t0 ? double(rec.t1 - rec.t0) / 1000.0 : 0.0;
      ++summary.events;
      if (rec.type == TimelineRecord::kOp) {
        auto [it, fresh] = tracks.emplace(rec.comm, int(tracks.size()) + 1);
        if (fresh)
          emit({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", it->second},
                {"args", {{"name", fmt::format("communicator {:08x}", rec.comm)}}}});
        std::string op = coll::op_kind_name(rec.kind);
        nlohmann::json args = {{"seq", rec.seq}, {"bytes", rec.bytes}, {"count", rec.count},
                               {"ok", rec.state == OpState::kDone}};
        std::string name = op;
        if (rec.repeat > 1) {
          // A run of identical short operations (trace::OpRun): one slice, its mean in the args.
          name = fmt::format("{} x{}", op, rec.repeat);
          args["repeat"] = rec.repeat;
          args["last_seq"] = rec.last_seq;
          args["mean_us"] = dur / rec.repeat;
        }
        if (rec.dtype < kNumDataTypes) args["dtype"] = dtype_name(DataType(rec.dtype));
        if ((rec.kind == coll::OpKind::kAllreduce || rec.kind == coll::OpKind::kReduce ||
             rec.kind == coll::OpKind::kReduceScatter) && rec.redop < kNumReduceOps)
          args["redop"] = reduce_op_name(ReduceOp(rec.redop));
        if (rec.peer >= 0) args["peer"] = rec.peer;
        if (rec.t_queued > 0) args["queued_us"] = double(rec.t0 - rec.t_queued) / 1000.0;
        emit({{"ph", "X"}, {"name", name}, {"cat", op == "send/recv" ? "p2p" : "collective"}, {"pid", pid},
              {"tid", it->second}, {"ts", ts}, {"dur", dur}, {"args", args}});
      } else if (rec.type == TimelineRecord::kSpan) {
        emit({{"ph", "X"}, {"name", record_name(rec)}, {"cat", "ddp"}, {"pid", pid}, {"tid", kTrainingTrackId},
              {"ts", ts}, {"dur", dur}});
      } else {
        emit({{"ph", "i"}, {"name", record_name(rec)}, {"cat", "ddp"}, {"pid", pid}, {"tid", kTrainingTrackId},
              {"ts", ts}, {"s", "t"}});
      }
    }
    drain();
  }
  summary.ranks = int(rank_files.size());
  nlohmann::json other = {{"producer", "cohort"},
                          {"clock", "CLOCK_MONOTONIC per rank, aligned through CLOCK_REALTIME anchors"},
                          {"anchor_error_us", double(worst_anchor) / 1000.0},
                          {"ranks", summary.ranks},
                          {"truncated_ranks", summary.truncated_ranks}};
  out << "\n],\"displayTimeUnit\":\"ns\",\"otherData\":" << other.dump() << "}\n";
  if (!out) throw Error("writing the merged timeline failed");
  return summary;
}

}  // namespace cohort::trace
