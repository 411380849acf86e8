// The intra-host shared-memory group under the communicator's error semantics (comm/shm_path.h):
// the same MismatchError, AbortedError, TimeoutError and slow-rank warnings as the transports give,
// with the same wording, naming ranks by their communicator rank and host.
#include <fmt/format.h>

#include <algorithm>

#include "cohort/error.h"
#include "collectives/shm/group.h"
#include "comm/communicator_impl.h"
#include "common/strings.h"

namespace cohort::comm {
namespace {

transport::Signature to_transport(const shm::CallSignature& c) {
  transport::Signature s;
  s.op = c.kind;
  s.dtype = c.dtype;
  s.redop = c.op;
  s.flags = c.flags;
  s.root = c.root;
  s.count = c.count;
  return s;
}

// While the group waits, the poll of the transports (which carry the peers' failure notices) runs at
// most this often; the fast path never gets that far.
constexpr auto kNoticePoll = std::chrono::milliseconds(10);

}  // namespace

shm::CallSignature CommunicatorImpl::shm_call() const {
  shm::CallSignature c;
  c.seq = wire_seq();
  c.kind = op_sig_.op;
  c.dtype = op_sig_.dtype;
  c.op = op_sig_.redop;
  c.flags = op_sig_.flags;
  c.root = op_sig_.root;
  c.count = op_sig_.count;
  return c;
}

void CommunicatorImpl::install_shm_semantics(shm::Group& group, std::vector<int> members) {
  // members[local rank] = communicator rank
  group.set_peer_namer([this, members](int local) { return peer_text(members[size_t(local)]); });
  group.set_mismatch_formatter([this, members](int local, const shm::CallSignature& theirs,
                                               const shm::CallSignature& ours) {
    std::string mine = theirs.seq == ours.seq ? "" : fmt::format(" as operation #{}", full_seq(ours.seq));
    // Same call, different memory: one rank reduced a range of an allocate_shared buffer, the other
    // another range or ordinary memory.
    if (theirs.reserved != ours.reserved) mine += " (not on the same range of one allocate_shared buffer)";
    return fmt::format("mismatched calls: rank {} ({}) called {} as operation #{} but rank {} called {}{}",
                       members[size_t(local)], host_of(members[size_t(local)]), describe_signature(to_transport(theirs)),
                       full_seq(theirs.seq), rank_, describe_signature(to_transport(ours)), mine);
  });
  group.set_watch([this, g = &group, members](int) {
    if (abort_requested_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(fail_mutex_);
      throw AbortedError(fmt::format("aborted: {}", abort_reason_));
    }
    const auto now = Deadline::Clock::now();
    if (now - op_start_ >= kNoticePoll && now >= shm_next_notice_poll_) {
      // A peer that failed in an operation over the transports tells us there, not in the group.
      shm_next_notice_poll_ = now + kNoticePoll;
      for (auto& t : transports_) {
        t->poll(0);
        // A peer that posted its last step may exit at once: if everyone has arrived by now, this
        // wait is over and the exit was not a failure of it.
        if (std::exception_ptr e = t->error(); e && !g->lagging().empty()) std::rethrow_exception(e);
      }
    }
    if (now < next_warning_ && now < op_deadline_.at()) return;
    // warn_slow / throw_timeout describe the ranks this wait is for through waiting_for_text().
    struct Scope {
      CommunicatorImpl* c;
      ~Scope() { c->shm_waiting_.clear(); }
    } scope{this};
    for (int local : g->lagging()) {
      shm::CallSignature last = g->last_call_of(local);
      shm_waiting_.push_back({members[size_t(local)], last.seq != 0, full_seq(last.seq), to_transport(last)});
    }
    if (now >= op_deadline_.at()) throw_timeout();
    warn_slow(now - op_start_);
    warning_interval_ *= 2;
    next_warning_ = now + warning_interval_;
  });
}

std::string CommunicatorImpl::shm_waiting_text() const {
  std::vector<int> list;
  std::vector<std::string> parts;
  for (const ShmLagging& l : shm_waiting_) {
    list.push_back(l.rank);
    if (parts.size() >= 8) continue;
    std::string last = l.seen ? fmt::format("last seen in operation #{} {}", l.seq, describe_signature(l.signature))
                              : "no operation from it yet";
    parts.push_back(fmt::format("{}: {}", peer_text(l.rank), last));
  }
  if (list.size() > 8) parts.push_back(fmt::format("and {} more", list.size() - 8));
  for (int& r : list) r = world_rank(r);  // the details are renamed with the whole message
  std::sort(list.begin(), list.end());
  return fmt::format("rank(s) {} [{}]", str::format_ranges(list), str::join(parts, "; "));
}

}  // namespace cohort::comm
