// What the ranks learn when one of this node's workers' processes ends (docs/launcher.md, "When a
// rank's process ends"; the record's format is comm/peer_exits.h). A rank waiting for that worker to
// join, or whose operation failed because its channel to it closed, cannot tell an exit with code 0
// from a peer that is merely slow, nor say after which operation it went: the launcher that reaped it
// can, and publishes it in the job's store, where the ranks read it within a second.
#include <regex>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cohort/error.h"
#include "comm/launch_env.h"
#include "common/log.h"
#include "launch/job_internal.h"

namespace cohort::launch::job_detail {

namespace {

// The prefix of the world communicator `rank` of the plan belongs to (comm/launch_env.cc: a
// parameter-server job's servers meet under their own), and its rank there.
std::pair<std::string, int> world_of(const Plan& plan, int attempt, int rank) {
  std::string prefix = comm::job_comm_prefix(plan.job_id, std::to_string(attempt));
  if (plan.ps_servers == 0) return {prefix, rank};
  const ProcessRole role = plan.role_of(rank);
  return {role.server ? prefix + "/servers" : prefix, role.index};
}

}  // namespace

void Job::open_exit_store(int attempt) {
  exit_attempt_ = attempt;
  published_exits_.clear();
  exit_store_failed_ = false;
  if (distributed_) {
    exit_store_ = base_client_;  // short calls (kStoreCallTimeout) once joined
    return;
  }
  exit_store_.reset();
  if (!server_) return;
  if (!local_exit_client_) {
    StoreClientOptions co;
    co.host = "127.0.0.1";
    co.port = server_->port();
    co.token = ctx_.token;
    co.timeout = kStoreCallTimeout;
    co.reply_grace = kStoreReplyGrace;
    try {
      local_exit_client_ = connect_tcp_store(co);
    } catch (const Error& e) {
      log::warn("the ranks will not learn of each other's exits from the launcher: {}", e.what());
      return;
    }
  }
  exit_store_ = local_exit_client_;
}

void Job::publish_exit(const Worker& w) {
  // Exits while the job stops are the stop's own doing, and a store that failed once is not waited for
  // again: the main loop must not sit in store calls while workers end.
  // A Ray job's processes have no communicator of cohort's to tell.
  if (!exit_store_ || exit_store_failed_ || stopping_ || head_lost_ || plan_.ray.enabled) return;
  const auto [prefix, rank] = world_of(plan_, exit_attempt_, w.rank);
  trace::RankSnapshot ring;
  if (w.ring.valid()) ring = w.ring.snapshot();
  const double seconds = std::chrono::duration<double>(w.ended - w.started).count();
  comm::ExitRecord record = comm::make_exit_record(rank, plan_.node(plan_.this_node)->host, w.pid, w.status, seconds,
                                                   w.ring.valid() ? &ring : nullptr);
  const std::string key = prefix + "/" + comm::exit_key(rank);
  published_exits_[key] = record;
  try {
    const std::string text = comm::to_json(record);
    exit_store_->set(key, text);
    exit_store_->add(prefix + "/" + comm::kExitCountKey, 1);
    // In place of its entry in the world communicator when it never published one: the ranks waiting
    // for it to join wake at once (a set entry is left alone).
    exit_store_->compare_set(prefix + "/peer/" + std::to_string(rank), "",
                             nlohmann::json{{"exited", nlohmann::json::parse(text)}}.dump());
  } catch (const std::exception& e) {
    exit_store_failed_ = true;
    log::warn("could not tell the other ranks that {} ended (the job's store at {}): {}",
              plan_.process_name(w.rank), store_addr_, e.what());
  }
}

std::string Job::early_exit_cause(const Worker& failed) {
  // A parameter-server job's messages name ranks of a role's world: not mapped back here.
  if (plan_.ps_servers > 0) return "";
  // The communicator's words for a peer whose end its launcher published (comm/peer_exits.h).
  static const std::regex kExited(R"(\brank (\d+) (?:\(job rank (\d+)\) )?exited \(code 0\))");
  for (const auto& line : failed.sink->stderr_tail()) {
    std::smatch m;
    if (!std::regex_search(line, m, kExited)) continue;
    const int rank = std::stoi(m[2].matched ? m[2].str() : m[1].str());
    const std::string key = world_of(plan_, exit_attempt_, rank).first + "/" + comm::exit_key(rank);
    std::optional<comm::ExitRecord> record;
    if (auto it = published_exits_.find(key); it != published_exits_.end()) {
      record = it->second;
    } else if (distributed_ && exit_store_ && !exit_store_failed_) {
      try {  // another node's worker
        if (exit_store_->check({key})) record = comm::exit_record_from_json(exit_store_->get(key));
      } catch (const std::exception&) {
      }
    }
    if (!record || record->code != 0 || record->signal != 0) return "";
    return fmt::format(
        "{} on {} (pid {}) exited with code 0 after {:.2f} s while the other ranks still needed it; then ",
        plan_.process_name(rank), record->host, record->pid, record->seconds);
  }
  return "";
}

}  // namespace cohort::launch::job_detail
