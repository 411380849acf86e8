// CommunicatorImpl (communicator_impl.h): the records of ranks' ends that the launcher publishes
// (comm/peer_exits.h), read while joining and when a peer is lost, so that an error names the rank
// that ended and how, not only the channel that broke. docs/errors.md, "Failure timing".
#include <nlohmann/json.hpp>

#include "common/log.h"
#include <fmt/core.h>

#include "cohort/error.h"
#include "comm/communicator_impl.h"
#include "comm/communicator_internal.h"

namespace cohort::comm {

// ------------------------------------------------------------------------------------------------
// Exits the launcher published (comm/peer_exits.h)

std::optional<ExitRecord> CommunicatorImpl::read_exit(int rank, std::chrono::milliseconds wait) {
  if (!exits_) return std::nullopt;
  const std::string key = exit_key(exit_rank(rank));
  try {
    if (wait.count() > 0) {
      try {
        exits_->store->wait({key}, wait);
      } catch (const TimeoutError&) {
        return std::nullopt;
      }
    } else if (!exits_->store->check({key})) {
      return std::nullopt;
    }
    return exit_record_from_json(exits_->store->get(key));
  } catch (const std::exception& e) {
    // Only an explanation: without it the error or wait goes on as it would without a launcher.
    log::debug("communicator '{}': no exit record of rank {}: {}", prefix_, rank, e.what());
    return std::nullopt;
  }
}

void CommunicatorImpl::check_exits_while_joining(int64_t& seen, Deadline::Clock::time_point start) {
  int64_t count = 0;
  try {
    count = exits_->store->add(kExitCountKey, 0);
  } catch (const std::exception& e) {
    log::debug("communicator '{}': cannot read the launcher's count of exits: {}", prefix_, e.what());
    return;
  }
  if (count <= seen) return;
  seen = count;
  // Somebody's process ended (once per new exit, not per wait step): is it one we wait for?
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || store_->check({"peer/" + std::to_string(r)})) continue;
    if (std::optional<ExitRecord> gone = read_exit(r, std::chrono::milliseconds(0)))
      throw_exited_before_joining(r, *gone, start);
  }
}

void CommunicatorImpl::throw_exited_before_joining(int r, const ExitRecord& gone, Deadline::Clock::time_point start) {
  int joined = 0;  // the others as the store has them now (a failure path: one check each)
  for (int q = 0; q < size_; ++q) {
    if (q == r) continue;
    try {
      joined += store_->check({"peer/" + std::to_string(q)});
    } catch (const std::exception&) {
    }
  }
  throw PeerLostError(fmt::format(
      "rank {}{} {} before joining communicator '{}' (it ran {:.1f} s on {} as pid {}; its launcher saw it end); "
      "{} of {} ranks joined after {}",
      world_rank(r), exits_ && exit_rank(r) != world_rank(r) ? fmt::format(" (job rank {})", exit_rank(r)) : "",
      exit_text(gone), prefix_, gone.seconds, gone.host, gone.pid, joined, size_,
      seconds_text(Deadline::Clock::now() - start)));
}

std::exception_ptr CommunicatorImpl::explain_exit(std::exception_ptr error) {
  if (!exits_) return error;
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const PeerLostError& e) {
    message = e.what();
  } catch (...) {
    return error;
  }
  // Only a peer that is gone, as the transports and the shm group say it, naming it first: "lost rank N
  // (host): ...", "rank N (host) left ...", "shm: rank N (host) (pid P) exited during ...". A peer's
  // notice ("rank N (host) failed: ...") was explained by the rank that sent it, a child communicator's
  // error by the child; a peer that failed may well live on (no record would come).
  const bool gone_peer = message.find("lost rank ") != std::string::npos ||
                         message.find(") left ") != std::string::npos ||
                         message.find(") exited during ") != std::string::npos;
  if (!gone_peer || message.find(") failed: ") != std::string::npos ||
      message.find(" exited (code ") != std::string::npos || message.find(" exited (killed by ") != std::string::npos)
    return error;
  const auto mentions = str::rank_mentions(message);
  if (mentions.empty()) return error;
  const long peer = mentions.front().rank;
  if (peer < 0 || peer >= size_ || peer == rank_) return error;
  const bool same_host = size_t(peer) < topology_.identity.size() &&
                         topology_.identity[size_t(peer)].shm_key() == topology_.identity[size_t(rank_)].shm_key();
  std::optional<ExitRecord> gone = read_exit(int(peer), same_host ? kExitRecordWait : kRemoteExitRecordWait);
  if (!gone) return error;
  return std::make_exception_ptr(PeerLostError(fmt::format(
      "rank {}{} {} {}: {}", world_rank(int(peer)),
      exit_rank(int(peer)) != world_rank(int(peer)) ? fmt::format(" (job rank {})", exit_rank(int(peer))) : "",
      exit_text(*gone), exit_point(*gone, comm_id_, seq_), message)));
}
}  // namespace cohort::comm
