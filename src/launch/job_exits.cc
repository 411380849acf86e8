// What the ranks learn when one of this node's workers' processes ends (docs/launcher.md, "When a
// rank's process ends"; the record's format is comm/peer_exits.h). A rank waiting for that worker to
// join, or whose operation failed because its channel to it closed, cannot tell an exit with code 0
// from a peer that is merely slow, nor say after which operation it went: the launcher that reaped it
// can, and publishes it in the job's store, where the ranks read it within a second.

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cohort/error.h"
#include "collectives/op_kind.h"
#include "comm/launch_env.h"
#include "common/log.h"
#include "launch/job_internal.h"
#include "launch/parsers.h"

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

void RankExits::open(int attempt, bool distributed, std::shared_ptr<Store> job_store, const StoreServer* server,
                     const std::string& token, const std::string& store_addr) {
  exit_attempt_ = attempt;
  published_exits_.clear();
  exit_store_failed_ = false;
  distributed_ = distributed;
  store_addr_ = store_addr;
  if (distributed_) {
    exit_store_ = std::move(job_store);  // short calls (kStoreCallTimeout) once joined
    return;
  }
  exit_store_.reset();
  if (!server) return;
  if (!local_exit_client_) {
    StoreClientOptions co;
    co.host = "127.0.0.1";
    co.port = server->port();
    co.token = token;
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

void RankExits::publish(const Worker& w) {
  // A store that failed once is not waited for again: the main loop must not sit in store calls while
  // workers end. A Ray job's processes have no communicator of cohort's to tell.
  if (!exit_store_ || exit_store_failed_ || plan_.ray.enabled) return;
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

namespace {

// The newest numbered collective in `ring` (of communicator `comm`, or of any when comm is 0).
std::optional<trace::OpRecord> last_collective(const trace::Ring& ring, uint32_t comm) {
  if (!ring.valid()) return std::nullopt;
  const trace::RankSnapshot snap = ring.snapshot();
  for (auto it = snap.entries.rbegin(); it != snap.entries.rend(); ++it)
    if (it->seq != 0 && (comm == 0 || it->comm == comm)) return *it;
  return std::nullopt;
}

std::string op_name(const trace::OpRecord& r) { return fmt::format("{} #{}", coll::op_kind_name(r.kind), r.seq); }

}  // namespace

std::string RankExits::early_exit_cause(const Worker& failed, const std::vector<Worker>& workers) {
  // A parameter-server job's messages name ranks of a role's world: not mapped back here.
  if (plan_.ps_servers > 0) return "";
  // The peer that `failed` reports gone: in the communicator's words when it read the launcher's record
  // (comm/peer_exits.h), else in the transports' (a communicator built on another store, as the PyTorch
  // backend's is on torch's, reads no records: "shm: rank 1 (host) (pid 9) exited during allreduce",
  // "lost rank 1 (host): ...", "rank 1 (host) left ...").
  for (const auto& line : failed.sink->stderr_tail()) {
    const int rank = rank_reported_gone(line).value_or(-1);  // launch/parsers.h: the forms it reads
    if (rank < 0 || rank >= plan_.world_size || rank == failed.rank) continue;
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
    // What it did last and what the reporting rank waited in, from their flight recorders: this node's
    // workers' rings, else the record's operation numbers (another node's worker).
    const Worker* gone = nullptr;
    for (const auto& w : workers)
      if (w.rank == rank) gone = &w;
    std::string last = fmt::format("after {:.2f} s", record->seconds);
    std::optional<trace::OpRecord> gone_op = gone ? last_collective(gone->ring, 0) : std::nullopt;
    if (gone_op) {
      last = fmt::format("{} {}", gone_op->state == trace::OpState::kDone ? "after" : "during", op_name(*gone_op));
    } else if (!record->ops.empty()) {
      const auto& op = record->ops.front();
      last = fmt::format("{} operation #{}", op.state == trace::OpState::kDone ? "after" : "during", op.seq);
    }
    std::string waited = "while the other ranks still needed it";
    if (auto wait_op = last_collective(failed.ring, gone_op ? gone_op->comm : 0);
        wait_op && wait_op->state != trace::OpState::kDone)
      waited = fmt::format("while {} waited for it in {}", plan_.process_name(failed.rank), op_name(*wait_op));
    return fmt::format("{} on {} (pid {}) exited with code 0 {} {}; then ", plan_.process_name(rank), record->host,
                       record->pid, last, waited);
  }
  return "";
}

}  // namespace cohort::launch::job_detail
