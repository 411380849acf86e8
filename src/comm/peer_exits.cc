#include "comm/peer_exits.h"

#include <signal.h>
#include <string.h>
#include <sys/wait.h>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

namespace cohort::comm {

std::string exit_key(int rank) { return "exit/" + std::to_string(rank); }

ExitRecord make_exit_record(int rank, const std::string& host, int pid, int status, double seconds,
                            const trace::RankSnapshot* ring, size_t max_comms) {
  ExitRecord r;
  r.rank = rank;
  r.host = host;
  r.pid = pid;
  r.seconds = seconds;
  if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  } else {
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
  }
  if (ring && ring->started) {
    r.recorded = true;
    r.complete = ring->total <= ring->entries.size();
    // Newest first: the first entry seen for a communicator is its last collective (point-to-point
    // entries carry no sequence number).
    for (auto it = ring->entries.rbegin(); it != ring->entries.rend() && r.ops.size() < max_comms; ++it) {
      if (it->seq == 0) continue;
      bool known = false;
      for (const auto& o : r.ops) known = known || o.comm == it->comm;
      if (!known) r.ops.push_back({it->comm, it->seq, it->state});
    }
    // Communicators beyond max_comms are unknown, as if the ring had wrapped.
    if (r.ops.size() >= max_comms) r.complete = false;
  }
  return r;
}

std::string to_json(const ExitRecord& r) {
  nlohmann::json j = {{"rank", r.rank},   {"host", r.host},         {"pid", r.pid},
                      {"code", r.code},   {"signal", r.signal},     {"seconds", r.seconds},
                      {"recorded", r.recorded}, {"complete", r.complete}};
  nlohmann::json ops = nlohmann::json::array();
  for (const auto& o : r.ops) ops.push_back({o.comm, o.seq, int(o.state)});
  j["ops"] = std::move(ops);
  return j.dump();
}

ExitRecord exit_record_from_json(const std::string& text) {
  auto j = nlohmann::json::parse(text);
  ExitRecord r;
  r.rank = j.at("rank").get<int>();
  r.host = j.at("host").get<std::string>();
  r.pid = j.at("pid").get<int>();
  r.code = j.at("code").get<int>();
  r.signal = j.at("signal").get<int>();
  r.seconds = j.at("seconds").get<double>();
  r.recorded = j.at("recorded").get<bool>();
  r.complete = j.at("complete").get<bool>();
  for (const auto& o : j.at("ops"))
    r.ops.push_back({o.at(0).get<uint32_t>(), o.at(1).get<uint64_t>(), trace::OpState(o.at(2).get<int>())});
  return r;
}

std::string exit_text(const ExitRecord& r) {
  if (r.signal == 0) return fmt::format("exited (code {})", r.code);
  const char* abbrev = sigabbrev_np(r.signal);
  return abbrev ? fmt::format("exited (killed by SIG{})", abbrev)
                : fmt::format("exited (killed by signal {})", r.signal);
}

std::string exit_point(const ExitRecord& r, uint32_t comm, uint64_t current) {
  for (const auto& o : r.ops) {
    if (o.comm != comm) continue;
    switch (o.state) {
      case trace::OpState::kDone: return fmt::format("before operation #{}", o.seq + 1);
      case trace::OpState::kFailed: return fmt::format("after its operation #{} failed", o.seq);
      default: return fmt::format("during operation #{}", o.seq);
    }
  }
  if (r.recorded && r.complete) return "before operation #1";
  return fmt::format("before or during operation #{}", current);
}

}  // namespace cohort::comm
