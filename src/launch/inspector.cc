#include "launch/inspector.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <chrono>
#include <sstream>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "common/env.h"
#include "common/proc_stat.h"
#include "common/socket.h"
#include "common/strings.h"
#include "trace/diagnose.h"
#include "trace/dump.h"

namespace cohort::launch {
namespace {

// Declared here so that `cohort env` lists it; the plan reads it from the launcher's
// environment (launch/plan.cc), which tests can inject.
const env::SecondsSetting kStallWarn(
    "COHORT_STALL_WARN_S", 60.0,
    "cohort run warns once when some ranks have waited this long in an operation that others have not "
    "entered (0: off)");

// Bus bandwidth factor of nccl-tests: bytes each rank must move per byte of the operation.
double bus_factor(coll::OpKind k, int n) {
  if (n <= 1) return 0;
  switch (k) {
    case coll::OpKind::kAllreduce: return 2.0 * (n - 1) / n;
    case coll::OpKind::kAllgather:
    case coll::OpKind::kAllgatherv:
    case coll::OpKind::kReduceScatter:
    case coll::OpKind::kAlltoall:
    case coll::OpKind::kAlltoallv: return double(n - 1) / n;
    case coll::OpKind::kBarrier: return 0;
    default: return 1;
  }
}

}  // namespace

std::string node_trace_key(int node) { return "trace/node/" + std::to_string(node); }
std::string node_final_trace_key(int node) { return "trace/final/" + std::to_string(node); }

std::string publish_snapshots(const std::vector<trace::RankSnapshot>& snaps, size_t entries) {
  nlohmann::json all = nlohmann::json::array();
  for (auto s : snaps) {
    if (s.entries.size() > entries) s.entries.erase(s.entries.begin(), s.entries.end() - long(entries));
    all.push_back(trace::to_json(s));
  }
  return all.dump();
}

std::vector<trace::RankSnapshot> adopt_snapshots(const std::string& text, int64_t read_at) {
  std::vector<trace::RankSnapshot> out;
  for (const auto& j : nlohmann::json::parse(text)) {
    trace::RankSnapshot s = trace::snapshot_from_json(j);
    int64_t shift = read_at - s.taken_at;
    for (auto& e : s.entries) {
      for (int64_t* t : {&e.t_queued, &e.t_start, &e.t_end})
        if (*t > 0) *t += shift;
    }
    s.taken_at = read_at;
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<trace::RankSnapshot> RemoteSnapshots::adopt(int node, const std::optional<std::string>& text,
                                                        int64_t now) {
  if (!text) {
    std::vector<trace::RankSnapshot> out;
    for (const auto& n : nodes_) {
      if (n.node != node) continue;
      for (int r : n.ranks) {
        trace::RankSnapshot s;
        s.rank = r;
        s.world = world_;
        s.host = n.host;
        s.taken_at = since_;
        s.unreported = true;
        out.push_back(std::move(s));
      }
    }
    return out;
  }
  // A node that publishes changes its value every tick (the snapshot's time is in it).
  Seen& seen = seen_[node];
  if (seen.text != *text) seen = {*text, now};
  return adopt_snapshots(*text, seen.first_read);
}

std::string process_state(pid_t pid) {
  const auto stat = read_proc_stat(pid);
  if (!stat) return "exited";
  switch (stat->state) {
    case 'T': return "stopped (SIGSTOP)";
    case 't': return "stopped by a debugger";
    case 'Z': return "exited (not yet reaped)";
    case 'D': return "in uninterruptible sleep (disk or kernel wait)";
    default: return "running";
  }
}

Inspector::Inspector(std::vector<InspectedRank> ranks, int world, double stall_warn_s, bool stats, int stats_fd,
                     Say say, InspectorSharing sharing)
    : ranks_(std::move(ranks)),
      world_(world),
      stall_warn_s_(stall_warn_s),
      stats_(stats),
      stats_fd_(stats_fd),
      stats_tty_(isatty(stats_fd) == 1),
      say_(std::move(say)),
      sharing_(std::move(sharing)) {
  first_time_ = last_time_ = trace::monotonic_ns();
  remote_ = RemoteSnapshots(sharing_.nodes, world_, first_time_);
  for (const auto& r : ranks_) last_counters_[r.rank] = {}, bus_bytes_[r.rank] = 0;
  // Ticks: once a second, or faster for a short stall threshold (tests use 1 s or less).
  if (stall_warn_s_ > 0 && stall_warn_s_ < 2) tick_ = std::chrono::milliseconds(int64_t(stall_warn_s_ * 250) + 1);
  // Several nodes: a node that is not the head publishes its ranks for the head's inspection (at the
  // same pace) and warns about nothing itself.
  if (sharing_.nnodes > 1 && !sharing_.head) stall_warn_s_ = 0;
  if (sharing_.nnodes > 1) stale_s_ = 3 * std::chrono::duration<double>(tick_).count() + 1;
  bool publishing = sharing_.store && sharing_.nnodes > 1 && !ranks_.empty();
  if (stall_warn_s > 0 || stats_ || publishing) thread_ = std::thread([this] { run(); });
}

Inspector::~Inspector() { stop_thread(); }

void Inspector::stop_thread() {
  {
    std::lock_guard<std::mutex> g(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Inspector::run() {
  std::unique_lock<std::mutex> g(mutex_);
  while (!cv_.wait_for(g, tick_, [this] { return stop_; })) {
    g.unlock();
    inspect(trace::monotonic_ns());
    g.lock();
  }
}

std::vector<trace::RankSnapshot> Inspector::snapshots() const {
  std::vector<trace::RankSnapshot> out;
  for (const auto& r : ranks_) {
    trace::RankSnapshot s = r.ring->snapshot();
    s.process_state = process_state(r.pid);
    out.push_back(std::move(s));
  }
  return out;
}

void Inspector::inspect(int64_t now) {
  auto snaps = snapshots();
  if (stats_) print_stats(snaps, now);
  if (sharing_.store && sharing_.nnodes > 1) {
    // Recent operations are enough to compare sequence numbers; 16 keep the value small.
    try {
      if (!snaps.empty()) sharing_.store->set(node_trace_key(sharing_.node), publish_snapshots(snaps, 16));
      if (!sharing_.head) return;
      for (int n = 0; n < sharing_.nnodes; ++n) {
        if (n == sharing_.node) continue;
        std::optional<std::string> text;
        if (sharing_.store->check({node_trace_key(n)})) text = sharing_.store->get(node_trace_key(n));
        for (auto& s : remote_.adopt(n, text, now)) snaps.push_back(std::move(s));
      }
    } catch (const std::exception&) {
      return;  // the store is gone or slow: the supervision loop reports that; skip this tick
    }
  }
  if (stall_warn_s_ > 0) {
    if (auto m = trace::find_mismatch(snaps); m && warned_mismatches_.insert({m->comm, m->a.seq}).second)
      say_(fmt::format("error: {}", m->text()));
    if (auto st = trace::find_stall(snaps, now, stall_warn_s_, stale_s_);
        st && warned_stalls_.insert({st->comm, st->op.seq}).second)
      say_(fmt::format("warning: {} (COHORT_STALL_WARN_S={:g}; the job goes on until the communicators' deadline, "
                       "COHORT_TIMEOUT)",
                       st->text(), stall_warn_s_));
  }
}

double Inspector::interval_bus_bytes(const trace::RankSnapshot& s, const trace::CounterSnapshot& prev) const {
  // The interval's bytes weighed by the kinds of the operations in the ring (the ring holds the last
  // ones, not necessarily all of the interval's).
  double weighted = 0, plain = 0;
  for (const auto& e : s.entries)
    if (e.state == trace::OpState::kDone) weighted += double(e.bytes) * bus_factor(e.kind, world_), plain += double(e.bytes);
  return plain > 0 ? double(s.counters.bytes - prev.bytes) * weighted / plain : 0;
}

bool Inspector::fits_screen(int lines) const {
  winsize ws{};
  // A table taller than the screen cannot be reached by moving the cursor up: it is printed anew.
  return ioctl(stats_fd_, TIOCGWINSZ, &ws) != 0 || ws.ws_row == 0 || lines < int(ws.ws_row);
}

void Inspector::print_stats(const std::vector<trace::RankSnapshot>& snaps, int64_t now) {
  double dt = double(now - last_time_) / 1e9;
  if (dt <= 0) return;
  std::vector<nlohmann::json> rows;
  for (const auto& s : snaps) {
    const auto& c = s.counters;
    const auto& p = last_counters_[s.rank];
    double bus_bytes = interval_bus_bytes(s, p);
    bus_bytes_[s.rank] += bus_bytes;
    double steps = double(c.steps - p.steps);
    double step_ns = double(c.step_ns - p.step_ns);
    nlohmann::json row = {{"t", double(now - first_time_) / 1e9},
                          {"rank", s.rank},
                          {"host", s.host},
                          {"ops_per_s", double(c.ops - p.ops) / dt},
                          {"bytes_per_s", double(c.bytes - p.bytes) / dt},
                          {"busbw_GBps", bus_bytes / dt / 1e9},
                          {"comm_share", double(c.op_ns - p.op_ns) / (dt * 1e9)},
                          {"steps_per_s", steps / dt},
                          {"ddp_wait_share", step_ns > 0 ? double(c.wait_ns - p.wait_ns) / step_ns : 0.0},
                          {"state", s.process_state}};
    rows.push_back(std::move(row));
    last_counters_[s.rank] = c;
  }
  last_time_ = now;
  if (rows.empty()) return;
  std::string out;
  if (!stats_tty_) {
    for (auto& r : rows) out += nlohmann::json{{"cohort_stats", r}}.dump() + "\n";
    console::write(stats_fd_, out);
  } else {
    out += fmt::format("cohort stats, {:.1f} s\n", rows[0]["t"].get<double>());
    out += fmt::format("{:>5} {:<16} {:>9} {:>11} {:>11} {:>7} {:>8} {:>9}\n", "rank", "host", "ops/s", "MB/s",
                       "busbw GB/s", "comm %", "steps/s", "DDP wait%");
    for (auto& r : rows)
      out += fmt::format("{:>5} {:<16.16} {:>9.0f} {:>11.1f} {:>11.2f} {:>7.1f} {:>8.1f} {:>9.1f}\n",
                         r["rank"].get<int>(), r["host"].get<std::string>(), r["ops_per_s"].get<double>(),
                         r["bytes_per_s"].get<double>() / 1e6, r["busbw_GBps"].get<double>(),
                         100 * r["comm_share"].get<double>(), r["steps_per_s"].get<double>(),
                         100 * r["ddp_wait_share"].get<double>());
    // Refreshed in place while it is the last thing on the terminal; below what was printed since
    // otherwise (moving up over a worker's lines would erase them).
    table_ = console::write_block(stats_fd_, table_, out, fits_screen(table_.lines));
  }
  stats_printed_ = true;
}

void Inspector::finish(const std::vector<trace::RankSnapshot>& final_snaps, int64_t now) {
  stop_thread();
  if (finished_ || !stats_) return;
  finished_ = true;
  // A job shorter than a tick has printed nothing yet: its table covers the whole attempt.
  if (!stats_printed_) print_stats(final_snaps, now);
  print_summary(final_snaps, now);
}

void Inspector::print_summary(const std::vector<trace::RankSnapshot>& snaps, int64_t now) {
  if (snaps.empty()) return;
  double seconds = double(now - first_time_) / 1e9;
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& s : snaps) {
    const auto& c = s.counters;
    // The part after the last tick (print_stats took the rest).
    double bus_bytes = bus_bytes_[s.rank] + interval_bus_bytes(s, last_counters_[s.rank]);
    ranks.push_back({{"rank", s.rank},
                     {"host", s.host},
                     {"ops", c.ops},
                     {"bytes", c.bytes},
                     {"comm_s", double(c.op_ns) / 1e9},
                     {"comm_share", seconds > 0 ? double(c.op_ns) / (seconds * 1e9) : 0.0},
                     // While communicating: bus bytes over the time inside operations (bytes per ns = GB/s).
                     {"busbw_GBps", c.op_ns > 0 ? bus_bytes / double(c.op_ns) : 0.0},
                     {"steps", c.steps},
                     {"ddp_wait_share", c.step_ns > 0 ? double(c.wait_ns) / double(c.step_ns) : 0.0},
                     {"state", s.process_state}});
  }
  std::string out;
  if (!stats_tty_) {
    out = nlohmann::json{{"cohort_stats_summary", {{"seconds", seconds}, {"ranks", ranks}}}}.dump() + "\n";
    console::write(stats_fd_, out);
    return;
  }
  out += fmt::format("cohort stats summary, {:.1f} s\n", seconds);
  out += fmt::format("{:>5} {:<16} {:>10} {:>11} {:>8} {:>7} {:>11} {:>7} {:>9}  {}\n", "rank", "host", "ops", "data",
                     "comm s", "comm %", "busbw GB/s", "steps", "DDP wait%", "end");
  for (const auto& r : ranks)
    out += fmt::format("{:>5} {:<16.16} {:>10} {:>11} {:>8.2f} {:>7.1f} {:>11.2f} {:>7} {:>9.1f}  {}\n",
                       r["rank"].get<int>(), r["host"].get<std::string>(), r["ops"].get<uint64_t>(),
                       str::format_bytes(r["bytes"].get<uint64_t>()), r["comm_s"].get<double>(),
                       100 * r["comm_share"].get<double>(), r["busbw_GBps"].get<double>(),
                       r["steps"].get<uint64_t>(), 100 * r["ddp_wait_share"].get<double>(),
                       r["state"].get<std::string>());
  // Below the live table, which stays: the summary never replaces it.
  table_ = console::write_block(stats_fd_, table_, out, false);
}

}  // namespace cohort::launch
