// Observability of this node's workers (docs/observability.md): each worker's flight recorder ring
// (created here, handed over by descriptor), the inspector thread (stall warnings, live stats), the
// dumps and diagnosis when an attempt fails, and the merged timeline when the job ends.
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/deadline.h"
#include "common/log.h"
#include "common/private_files.h"
#include "common/strings.h"
#include "store/tcp_store.h"
#include "launch/inspector.h"
#include "launch/job_internal.h"
#include "trace/diagnose.h"
#include "trace/dump.h"
#include "trace/timeline.h"

namespace cohort::launch::job_detail {

// Short: a tick's calls are small, and stopping the inspector waits for the one in flight (a store
// that stopped answering is given up on for good after one of them).
constexpr Millis kInspectorStoreTimeout{500};

namespace {

// "2025-03-14 09:26" in this host's time zone: when a kept trace folder may go.
std::string local_time_text(std::chrono::system_clock::time_point t) {
  const time_t seconds = std::chrono::system_clock::to_time_t(t);
  struct tm local;
  char text[32];
  if (!localtime_r(&seconds, &local) || strftime(text, sizeof text, "%Y-%m-%d %H:%M", &local) == 0) return "?";
  return text;
}

}  // namespace

std::string Job::timeline_rank_dir() const { return plan_.trace_dir + "/timeline"; }

void Job::prepare_trace(Worker& w, const NodePlan& node, std::vector<std::pair<std::string, std::string>>& vars) {
  bool timeline = !plan_.timeline_path.empty();
  if (plan_.flight_recorder > 0 || plan_.stats) {
    // With the recorder off but live stats on, a small ring still carries the counters.
    uint32_t capacity = plan_.flight_recorder > 0 ? uint32_t(plan_.flight_recorder) : 64;
    w.ring = trace::Ring::create(capacity, w.rank, plan_.world_size, node.host, plan_.stats);
    // The worker inherits the descriptor across exec (the child clears close-on-exec on it).
    vars.emplace_back("COHORT_FLIGHT_RECORDER_FD", std::to_string(w.ring.fd()));
  }
  if (timeline) {
    std::error_code ec;
    std::filesystem::create_directories(timeline_rank_dir(), ec);
    if (ec) throw ConfigError(fmt::format("--timeline: cannot create {}: {}", timeline_rank_dir(), ec.message()));
    std::string file = fmt::format("{}/rank{}.timeline", timeline_rank_dir(), w.rank);
    std::filesystem::remove(file, ec);  // an earlier attempt's
    vars.emplace_back("COHORT_TIMELINE_RANK_FILE", file);
  }
}

void Job::start_inspector(int attempt) {
  std::vector<InspectedRank> ranks;
  for (const auto& w : workers_)
    if (w.ring.valid() && w.pid > 0) ranks.push_back({w.rank, w.pid, &w.ring});
  InspectorSharing sharing;
  if (distributed_ && plan_.nnodes > 1 && plan_.flight_recorder > 0) {
    // The inspector thread talks to the store on a connection of its own (clients are not shared
    // between threads), under this attempt's prefix, with a short deadline: its calls are small, and
    // the end of an attempt joins the thread, which must not sit in a call to a store cut off from
    // this node.
    try {
      StoreClientOptions co = store_.client_options;
      co.timeout = kInspectorStoreTimeout;
      auto base = make_prefix_store(connect_tcp_store(co), "cohort/launch/" + plan_.job_id);
      sharing = {make_prefix_store(base, fmt::format("attempt/{}", attempt)), plan_.this_node, plan_.nnodes,
                 plan_.host_store, {}};
      // Its workers first, then its parameter servers, which record nothing.
      for (const auto& n : plan_.nodes) {
        std::vector<int> workers = n.processes();
        workers.resize(static_cast<size_t>(n.nproc - n.nservers));  // its workers come first, then its servers
        sharing.nodes.push_back({n.node_rank, n.host, std::move(workers)});
      }
    } catch (const std::exception& e) {
      log::warn("stall inspector: no store connection ({}); it covers this node's ranks only", e.what());
    }
  }
  if (ranks.empty() && !(sharing.store && sharing.head)) return;
  double stall = plan_.flight_recorder > 0 ? plan_.stall_warn_s : 0;
  inspector_ = std::make_unique<Inspector>(std::move(ranks), plan_.world_size, stall, plan_.stats, 2,
                                           [](const std::string& line) { say(line); }, std::move(sharing));
}

void Job::stop_inspector() {
  // The rings outlive the workers: the last figures and the summary (--stats) are read after they ended.
  if (inspector_) inspector_->finish(final_snapshots(), trace::monotonic_ns());
  inspector_.reset();
}

std::vector<trace::RankSnapshot> Job::final_snapshots() const {
  std::vector<trace::RankSnapshot> snaps;
  for (const auto& w : workers_) {
    if (!w.ring.valid()) continue;
    trace::RankSnapshot s = w.ring.snapshot();
    s.process_state = w.running ? "running" : describe_status(w.status);
    snaps.push_back(std::move(s));
  }
  return snaps;
}

void Job::publish_final_trace() {
  // Several nodes: the head's diagnosis needs this node's rings. Published before this node counts
  // itself exited, so the head (which waits for that) finds it.
  if (plan_.flight_recorder <= 0 || !distributed_ || plan_.nnodes <= 1 || !store_.attempt || control_.head_lost())
    return;
  if (end_ && (end_->kind == "lost" || end_->kind == "store")) return;  // the store is unreachable: a publish would only wait out its deadline
  auto snaps = final_snapshots();
  if (snaps.empty()) return;
  try {
    store_.attempt->set(node_final_trace_key(plan_.this_node), publish_snapshots(snaps, 64));
  } catch (const std::exception& e) {
    log::warn("flight recorder: could not publish this node's rings to the store: {}", e.what());
  }
}

void Job::record_failure(int attempt) {
  diagnosis_.clear();
  if (plan_.flight_recorder <= 0) return;
  auto snaps = final_snapshots();
  bool whole_job = !distributed_ || plan_.nnodes <= 1;
  if (!whole_job && plan_.host_store && store_.attempt) {
    // The head gathers the other nodes' rings (published as they stopped; a node that never joined
    // or lost the store has none).
    // One deadline for the whole gather, not one per node: nodes that never publish must not add up.
    int64_t now = trace::monotonic_ns();
    Deadline gather = Deadline::after(std::chrono::seconds(2));
    int found = 0;
    for (const auto& node : plan_.nodes) {
      if (node.node_rank == plan_.this_node) continue;
      // An elastic job's gone member never publishes: waiting for it would delay the next generation.
      if (elastic_ && elastic_->node_gone(node.node_rank)) {
        diagnosis_.push_back(fmt::format("node {} ({}) is gone: no flight recorder from it", node.node_rank, node.host));
        continue;
      }
      try {
        // A node that never joined this attempt has no rings to publish: waiting for them would hold
        // an interrupted or failed job's end for the whole gather.
        if (!plan_.elastic && !store_.attempt->check({node_key(node.node_rank)})) {
          diagnosis_.push_back(fmt::format("node {} never joined: no flight recorder from it", node.node_rank));
          continue;
        }
        auto key = node_final_trace_key(node.node_rank);
        store_.attempt->wait({key}, std::max(gather.remaining(), Millis(1)));
        for (auto& s : adopt_snapshots(store_.attempt->get(key), now)) snaps.push_back(std::move(s));
        ++found;
      } catch (const std::exception&) {
        diagnosis_.push_back(fmt::format("node {} ({}) published no flight recorder", node.node_rank, node.host));
      }
    }
    whole_job = found == int(plan_.nodes.size()) - (plan_.node(plan_.this_node) ? 1 : 0);
  }
  // A job that failed before any rank communicated (a bad program, an import error) has nothing to say.
  bool recorded = std::any_of(snaps.begin(), snaps.end(), [](const auto& s) { return s.total > 0; });
  if (!recorded) {
    diagnosis_.clear();
    return;
  }
  std::sort(snaps.begin(), snaps.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
  std::string dir = attempt == 0 ? plan_.trace_dir : fmt::format("{}/attempt{}", plan_.trace_dir, attempt);
  try {
    if (!trace_folder_.refused().empty()) throw Error(trace_folder_.refused());
    std::filesystem::create_directories(dir);
    for (const auto& s : snaps) trace::write_dump(fmt::format("{}/rank{}.json", dir, s.rank), s);
  } catch (const std::exception& e) {
    diagnosis_.push_back(fmt::format("flight recorder dumps not written to {}: {}", dir, e.what()));
    dir.clear();
  }
  for (auto& line : trace::diagnose(snaps)) diagnosis_.push_back(std::move(line));
  if (!dir.empty())
    diagnosis_.push_back(fmt::format("dumps of {} in {} (`cohort trace show {}`)",
                                     whole_job ? "every rank" : "this node's ranks", dir, dir));
}

void Job::merge_timeline() {
  if (plan_.timeline_path.empty() || !plan_.node(plan_.this_node)) return;
  auto files = trace::timeline_rank_files(timeline_rank_dir());
  std::vector<std::string> usable;
  std::vector<int> missing;
  for (const auto& w : workers_) {
    std::string f = fmt::format("{}/rank{}.timeline", timeline_rank_dir(), w.rank);
    std::error_code ec;
    if (std::filesystem::file_size(f, ec) > 0 && !ec) usable.push_back(f);
    else missing.push_back(w.rank);
  }
  if (usable.empty()) {
    say(fmt::format("--timeline: no rank wrote a timeline (a rank writes it when it exits normally); nothing "
                    "written to {}",
                    plan_.timeline_path));
    return;
  }
  try {
    std::string tmp = plan_.timeline_path + ".tmp";
    trace::MergeSummary merged;
    {
      // Created afresh (a link planted at the name is not written through), then renamed over the path.
      auto out = files::ostream_of(files::create_new(tmp));
      merged = trace::merge_timelines(usable, *out);
      if (!out->flush()) throw Error(fmt::format("cannot write {}", tmp));
    }
    std::filesystem::rename(tmp, plan_.timeline_path);
    std::string note = missing.empty() ? "" : fmt::format(" (no timeline from rank(s) {}: killed before exit?)",
                                                          str::format_ranges(missing));
    if (!merged.truncated_ranks.empty())
      note += fmt::format(" (rank(s) {} reached COHORT_TIMELINE_MAX_EVENTS: later events dropped)",
                          str::format_ranges(merged.truncated_ranks));
    say(fmt::format("timeline of {} rank(s), {} events, written to {}{}", usable.size(), merged.events,
                    plan_.timeline_path, note));
    for (const auto& f : usable) std::filesystem::remove(f);
    std::error_code ec;
    std::filesystem::remove(timeline_rank_dir(), ec);  // only when empty
    std::filesystem::remove(plan_.trace_dir, ec);
  } catch (const std::exception& e) {
    say(fmt::format("--timeline: {}", e.what()));
  }
}

void TraceFolder::open() {
  if (!plan_.trace_dir_default) return;  // the user's folder: cohort neither removes it nor its neighbours
  const std::string parent = std::filesystem::path(plan_.trace_dir).parent_path().string();
  // Nothing is ever written there without the flight recorder or the timeline: the parent is then
  // neither made nor, when it is not this user's own, complained about.
  const bool writes = plan_.flight_recorder > 0 || !plan_.timeline_path.empty();
  const auto keep = std::chrono::days(trace_keep_days());  // a bad setting ends the start (ConfigError)
  try {
    // Only inside a folder of this user's own: another user's could hold anything under the names
    // the pruning removes.
    if (files::ensure_private_dir(parent, writes))
      prune_trace_dirs(parent, keep, std::chrono::system_clock::now());
    if (!writes) return;
    claim_ = std::make_unique<TraceDirClaim>(plan_.trace_dir, plan_.job_id);
  } catch (const Error& e) {
    if (!writes) return;
    refused_ = e.what();
    // The timeline's rank files have nowhere else to go: the job does not start. The flight recorder's
    // dumps are only written after a failure: the job runs, and a failure's diagnosis says they were not.
    if (!plan_.timeline_path.empty())
      throw ConfigError(fmt::format("--timeline: {} (--trace-dir DIR or COHORT_TRACE_DIR chooses another folder "
                                    "for the rank files)",
                                    e.what()));
    log::warn("{}: a failure's flight recorder dumps will not be written (--trace-dir DIR or COHORT_TRACE_DIR "
              "chooses another folder)",
              e.what());
  }
}

void TraceFolder::close(int code, bool print) {
  if (!claim_) return;
  bool kept = claim_->release(code != 0);
  claim_.reset();
  if (!kept || !print) return;
  const int64_t days = trace_keep_days();
  say(days == 0 ? fmt::format("trace folder kept: {} (the files the failed job left there) until the next job "
                              "starts (COHORT_TRACE_KEEP_DAYS=0)",
                              plan_.trace_dir)
                : fmt::format("trace folder kept: {} (the files the failed job left there) for {} day{}: a job "
                              "that starts after {} removes it (COHORT_TRACE_KEEP_DAYS)",
                              plan_.trace_dir, days, days == 1 ? "" : "s",
                              local_time_text(std::chrono::system_clock::now() + std::chrono::days(days))));
}

}  // namespace cohort::launch::job_detail
