// CommunicatorImpl (communicator_impl.h): running operations. Every operation goes through
// execute_locked, in call order; asynchronous ones queue for the progress thread, which a waiting
// caller may help; waits drive the transports with a deadline and say who is slow; the first failure
// aborts the communicator and is rethrown, explained, to every later call. docs/thread_model.md.
#include <sched.h>
#include <time.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <set>

#include <fmt/core.h>

#include "cohort/error.h"
#include "comm/communicator_impl.h"
#include "comm/communicator_internal.h"
#include "common/log.h"
#include "common/strings.h"

namespace cohort::comm {

thread_local bool t_progress_thread = false;

namespace {

// CLOCK_MONOTONIC_COARSE: the base of steady_clock (CLOCK_MONOTONIC) as of the last timer tick.
Deadline::Clock::time_point coarse_now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return Deadline::Clock::time_point(std::chrono::duration_cast<Deadline::Clock::duration>(
      std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec)));
}
// How far coarse_now() may lag the true time: its resolution (one tick, 1-4 ms).
Deadline::Clock::duration coarse_tick() {
  static const Deadline::Clock::duration tick = [] {
    timespec r{0, 4000000};
    clock_getres(CLOCK_MONOTONIC_COARSE, &r);
    return std::chrono::duration_cast<Deadline::Clock::duration>(std::chrono::seconds(r.tv_sec) +
                                                                 std::chrono::nanoseconds(r.tv_nsec));
  }();
  return tick;
}

// Rethrows `e` as the same cohort error type with `prefix` in front of its message.
std::exception_ptr with_prefix(std::exception_ptr e, const std::string& prefix) {
  try {
    std::rethrow_exception(e);
  } catch (const AbortedError& x) {
    return std::make_exception_ptr(AbortedError(x.what()));
  } catch (const TimeoutError& x) {
    return std::make_exception_ptr(TimeoutError(prefix + x.what()));
  } catch (const PeerLostError& x) {
    return std::make_exception_ptr(PeerLostError(prefix + x.what()));
  } catch (const MismatchError& x) {
    return std::make_exception_ptr(MismatchError(prefix + x.what()));
  } catch (const Error& x) {
    return std::make_exception_ptr(Error(prefix + x.what()));
  } catch (const std::exception& x) {
    return std::make_exception_ptr(Error(prefix + x.what()));
  }
}

// Rethrows `e` as the same cohort error type with its message passed through `rename`.
template <typename F>
std::exception_ptr renamed(std::exception_ptr e, F rename) {
  try {
    std::rethrow_exception(e);
  } catch (const AbortedError& x) {
    return std::make_exception_ptr(AbortedError(rename(x.what())));
  } catch (const TimeoutError& x) {
    return std::make_exception_ptr(TimeoutError(rename(x.what())));
  } catch (const PeerLostError& x) {
    return std::make_exception_ptr(PeerLostError(rename(x.what())));
  } catch (const MismatchError& x) {
    return std::make_exception_ptr(MismatchError(rename(x.what())));
  } catch (const std::exception& x) {
    return std::make_exception_ptr(Error(rename(x.what())));
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Work

class WorkImpl final : public Work {
 public:
  // `help` runs queued operations on the calling thread when no other thread is driving (see wait()).
  WorkImpl(std::chrono::milliseconds default_timeout, std::function<void()> help)
      : default_timeout_(default_timeout), help_(std::move(help)) {}
  void complete(std::exception_ptr e) {
    std::lock_guard<std::mutex> g(m_);
    done_ = true;
    error_ = e;
    cv_.notify_all();
  }
  void wait(std::chrono::milliseconds timeout) override {
    if (timeout.count() <= 0) timeout = default_timeout_;
    const auto until = std::chrono::steady_clock::now() + timeout;
    // Not started yet and the progress thread is idle (or not woken yet): run it here rather than
    // hand it over and sleep. On a busy core (a DDP rank whose compute thread shares its core with
    // the progress thread) that saves two thread switches per operation and a thread competing for
    // the core. The communicator outlives every unfinished Work (its destructor drains the queue), and
    // a finished one never gets here.
    if (!test() && help_) help_();
    std::unique_lock<std::mutex> lk(m_);
    if (!cv_.wait_until(lk, until, [&] { return done_; })) {
      throw TimeoutError(fmt::format("asynchronous operation did not finish within {}", seconds_text(timeout)));
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool test() override {
    std::lock_guard<std::mutex> g(m_);
    return done_;
  }
  std::exception_ptr exception() override {
    std::lock_guard<std::mutex> g(m_);
    return error_;
  }

 private:
  std::chrono::milliseconds default_timeout_;
  std::function<void()> help_;
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// ------------------------------------------------------------------------------------------------
// Running operations

void CommunicatorImpl::check_usable() const {
  if (failed_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(fail_mutex_);
    throw AbortedError(fmt::format("communicator failed earlier: {}", root_cause_));
  }
}

namespace {
// How a failure notice classifies `e` (the peers rethrow it as the same class).
transport::Transport::ErrorClass error_class(std::exception_ptr e) {
  using EC = transport::Transport::ErrorClass;
  try {
    std::rethrow_exception(e);
  } catch (const TimeoutError&) {
    return EC::kTimeout;
  } catch (const PeerLostError&) {
    return EC::kPeerLost;
  } catch (const MismatchError&) {
    return EC::kMismatch;
  } catch (...) {
  }
  return EC::kOther;
}
}  // namespace

void CommunicatorImpl::fail_and_throw(std::exception_ptr error) {
  error = explain_exit(error);
  std::string prefix = op_.kind == OpKind::kSendRecv
                           ? fmt::format("{} on rank {} ({}): ", op_kind_name(op_.kind), rank_, host_of(rank_))
                           : fmt::format("{} #{} ({}) on rank {} ({}): ", op_kind_name(op_.kind), seq_,
                                         format_bytes(op_.bytes), rank_, host_of(rank_));
  std::exception_ptr e = with_prefix(error, prefix);
  if (!world_ranks_.empty()) e = renamed(e, [this](const std::string& m) { return in_world_ranks(m); });
  std::string message;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    message = x.what();
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> g(fail_mutex_);
    if (!failed_.load()) {
      root_cause_ = message;
      failed_.store(true, std::memory_order_release);
      first = true;
    }
  }
  if (first) recorder_.dump_on_failure(message);
  // The root cause is passed on to every peer that did not tell it to this rank, also when it came
  // in a peer's notice: once this rank exits, a peer that heard nothing else would see only its
  // closed connections and name this rank instead of the one that died (each rank passes it on once).
  if (first) {
    for (auto& t : transports_) t->notify_peers(error_class(e), message);
  }
  for (auto& t : transports_) t->fail(std::make_exception_ptr(AbortedError("communicator failed: " + root_cause_)));
  // The cross-host communicator's peers (the same local rank on the other hosts) may be blocked in
  // it: they hear of this failure through it, not as "rank N left" once this process exits.
  if (cross_host_) static_cast<CommunicatorImpl&>(*cross_host_).fail_from_parent(message, error_class(e));
  std::rethrow_exception(e);
}

void CommunicatorImpl::fail_from_parent(const std::string& message, transport::Transport::ErrorClass cls) {
  {
    std::lock_guard<std::mutex> g(fail_mutex_);
    if (failed_.load()) return;  // it failed first (the parent's failure came from here)
    root_cause_ = message;
    failed_.store(true, std::memory_order_release);
  }
  for (auto& t : transports_) t->notify_peers(cls, message);
  for (auto& t : transports_) t->fail(std::make_exception_ptr(AbortedError("communicator failed: " + message)));
}

void CommunicatorImpl::execute_locked(const OpDesc& desc, const Body& body) {
  check_usable();
  op_ = desc;
  if (desc.kind != OpKind::kSendRecv) {
    do ++seq_;
    while (wire_seq() == 0 || wire_seq() == kP2PSeq);
  }
  op_sig_ = desc.signature();
  // The start feeds the deadline and slow warnings (seconds away) and, unless the timeline or live
  // stats time operations, only the flight recorder's age of a running operation: there the coarse
  // clock (the last timer tick, 7 ns against 24 ns for a counter read, bench/comm_call_bench.cc) will
  // do. It lags by at most one tick, which the deadline adds back so that it is never early.
  Deadline::Clock::duration slack{0};
  if (recorder_.timing()) {
    op_start_ = Deadline::Clock::now();
  } else {
    op_start_ = coarse_now();
    slack = coarse_tick();
  }
  op_deadline_ = Deadline(op_start_ + slack + options_.timeout);
  next_warning_ = op_start_ + slack + options_.slow_warning;
  warning_interval_ = options_.slow_warning;
  // Only the transports' algorithms use these; clearing an empty unordered_map still writes its buckets
  // (18 ns of a 0.45 us 8-byte allreduce on one host, bench/comm_call_bench.cc).
  if (!send_index_.empty()) send_index_.clear();
  if (!recv_index_.empty()) recv_index_.clear();
  pending_.clear();
  trace::OpBegin rec{comm_id_, desc.kind == OpKind::kSendRecv ? 0 : seq_, desc.kind, uint8_t(desc.dtype),
                     uint8_t(desc.redop), desc.kind == OpKind::kSendRecv ? desc.peer : coll::is_rooted(desc.kind) ? desc.root : -1,
                     desc.count, desc.bytes, desc.queued_ns,
                     std::chrono::duration_cast<std::chrono::nanoseconds>(op_start_.time_since_epoch()).count()};
  trace::Recorder::Handle recorded = recorder_.op_begin(rec);
  try {
    body();
    recorder_.op_end(recorded, rec, true, timeline_run_);
  } catch (const InvalidArgument&) {
    recorder_.op_end(recorded, rec, false, timeline_run_);
    throw;
  } catch (...) {
    recorder_.op_end(recorded, rec, false, timeline_run_);
    fail_and_throw(std::current_exception());
  }
}

void CommunicatorImpl::drain_queue_locked() {
  for (;;) {
    std::shared_ptr<WorkImpl> work;
    std::pair<OpDesc, Body> job;
    {
      std::lock_guard<std::mutex> g(queue_mutex_);
      if (queue_.empty()) return;
      work = std::move(queue_.front().first);
      job = std::move(queue_.front().second);
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_relaxed);
    }
    try {
      execute_locked(job.first, job.second);
      work->complete(nullptr);
    } catch (...) {
      work->complete(std::current_exception());
    }
  }
}

void CommunicatorImpl::run_blocking(const OpDesc& desc, const Body& body) {
  std::lock_guard<std::mutex> g(drive_);
  // Earlier asynchronous operations first (call order). Most blocking calls find none: one load, not
  // the queue's lock (bench/comm_call_bench.cc).
  if (queued_.load(std::memory_order_acquire) != 0) drain_queue_locked();
  execute_locked(desc, body);
}

std::shared_ptr<Work> CommunicatorImpl::run_async(OpDesc desc, Body body) {
  check_usable();
  if (recorder_.timing()) desc.queued_ns = trace::monotonic_ns();
  auto work = std::make_shared<WorkImpl>(options_.timeout, [this] {
    std::unique_lock<std::mutex> g(drive_, std::try_to_lock);
    if (g.owns_lock()) drain_queue_locked();
  });
  {
    std::lock_guard<std::mutex> g(queue_mutex_);
    queue_.emplace_back(work, std::make_pair(desc, std::move(body)));
    queued_.fetch_add(1, std::memory_order_release);
    if (!progress_.joinable()) progress_ = std::thread([this] { progress_thread_main(); });
  }
  queue_cv_.notify_one();
  return work;
}

void CommunicatorImpl::progress_thread_main() {
  t_progress_thread = true;
  // Its shm waits yield even where every rank has a core of its own: the caller's compute threads
  // run on that core too (shm::PeerSync::set_thread_always_yields).
  shm::PeerSync::set_thread_always_yields(true);
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(queue_mutex_);
      queue_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty()) return;
    }
    std::lock_guard<std::mutex> g(drive_);
    drain_queue_locked();
  }
}

// ------------------------------------------------------------------------------------------------
// coll::Context

coll::RequestId CommunicatorImpl::isend(int peer, const void* data, size_t bytes, uint32_t slot) {
  transport::Transport* t = route(peer);
  uint32_t index = send_index_[(uint64_t(uint32_t(peer)) << 32) | slot]++;
  transport::Envelope env{(uint64_t(comm_id_) << 32) | wire_seq(), (uint64_t(slot) << 32) | index, op_sig_};
  transport::RequestId tid = t->isend(peer, env, data, bytes);
  pending_.push_back({next_id_, tid, t, peer});
  return next_id_++;
}

coll::RequestId CommunicatorImpl::irecv(int peer, void* data, size_t bytes, uint32_t slot) {
  transport::Transport* t = route(peer);
  uint32_t index = recv_index_[(uint64_t(uint32_t(peer)) << 32) | slot]++;
  transport::Envelope env{(uint64_t(comm_id_) << 32) | wire_seq(), (uint64_t(slot) << 32) | index, op_sig_};
  transport::RequestId tid = t->irecv(peer, env, data, bytes);
  pending_.push_back({next_id_, tid, t, peer});
  return next_id_++;
}

void* CommunicatorImpl::scratch(size_t bytes, int index) {
  if (index < 0) throw std::logic_error("negative scratch index");
  if (scratch_.size() <= size_t(index)) {
    scratch_.resize(size_t(index) + 1);
    scratch_size_.resize(size_t(index) + 1, 0);
  }
  if (scratch_size_[size_t(index)] < bytes || !scratch_[size_t(index)]) {
    scratch_[size_t(index)].reset(new char[std::max<size_t>(bytes, 64)]);
    scratch_size_[size_t(index)] = std::max<size_t>(bytes, 64);
  }
  return scratch_[size_t(index)].get();
}

void CommunicatorImpl::wait(coll::RequestId id) {
  auto it = std::find_if(pending_.begin(), pending_.end(), [&](const Pending& p) { return p.id == id; });
  if (it == pending_.end()) throw std::logic_error("coll::Context::wait on an unknown or completed request");
  Pending p = *it;
  auto finish = [&] {
    auto pos = std::find_if(pending_.begin(), pending_.end(), [&](const Pending& q) { return q.id == p.id; });
    if (pos != pending_.end()) pending_.erase(pos);
  };
  if (p.transport->test(p.tid)) return finish();
  drive_until([&] { return p.transport->test(p.tid); });
  finish();
}

// Drives every transport until done() (each request's completion, or a message's arrival), under the
// operation's deadline, abort and slow warnings. done() is asked after each round of polls.
std::string CommunicatorImpl::waiting_for_text() {
  if (!shm_waiting_.empty()) return shm_waiting_text();
  if (any_source_tag_) {
    std::vector<int> others;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) others.push_back(world_rank(r));
    return fmt::format("a message with tag {} from any of rank(s) {} (recv from any source)", *any_source_tag_,
                       str::format_ranges(others));
  }
  std::set<int> peers;
  for (const auto& p : pending_)
    if (!p.transport->peek(p.tid)) peers.insert(p.peer);
  std::vector<std::string> parts;
  std::vector<int> list(peers.begin(), peers.end());
  for (int peer : list) {
    if (parts.size() >= 8) {
      parts.push_back(fmt::format("and {} more", list.size() - 8));
      break;
    }
    auto seen = route(peer)->last_seen(peer);
    std::string last = "no message from it yet";
    if (seen.seen) {
      uint32_t s = uint32_t(seen.tag);
      last = s == kP2PSeq ? fmt::format("last message was point-to-point ({})", describe_signature(seen.signature))
                          : fmt::format("last seen in operation #{} {}", full_seq(s), describe_signature(seen.signature));
    }
    parts.push_back(fmt::format("{}: {}", peer_text(peer), last));
  }
  std::vector<int> named;  // the list in world ranks; the details are renamed with the whole message
  for (int peer : list) named.push_back(world_rank(peer));
  std::sort(named.begin(), named.end());
  return fmt::format("rank(s) {} [{}]", str::format_ranges(named), str::join(parts, "; "));
}

void CommunicatorImpl::warn_slow(std::chrono::nanoseconds waited) {
  std::string mine = op_.kind == OpKind::kSendRecv
                         ? fmt::format("{} ({})", op_kind_name(op_.kind), format_bytes(op_.bytes))
                         : fmt::format("operation #{} {} ({})", seq_, describe_signature(op_sig_), format_bytes(op_.bytes));
  std::string waiting = waiting_for_text();
  // Reports of the ranks we wait for, published only by ranks that are themselves slow.
  std::string reports;
  try {
    store_->set("status/" + std::to_string(rank_),
                fmt::format("waiting {} in {} for {}", seconds_text(waited), mine, waiting));
    std::set<int> peers;
    for (const auto& p : pending_)
      if (!p.transport->peek(p.tid)) peers.insert(p.peer);
    int shown = 0;
    for (int peer : peers) {
      if (++shown > 4) break;
      std::string key = "status/" + std::to_string(peer);
      if (store_->check({key})) reports += fmt::format("; rank {} reports: {}", peer, store_->get(key));
    }
  } catch (const std::exception& e) {
    reports = fmt::format("; (store unavailable for status reports: {})", e.what());
  }
  log::warn("{} has waited {} for {}{}", mine, seconds_text(waited), waiting, reports);
}

void CommunicatorImpl::throw_timeout() {
  // "its timeout (...)": torch's suite and scripts look for " timeout " or " Timed out " in a timeout's
  // message (gloo's "Timed out waiting 1000ms for ...").
  throw TimeoutError(fmt::format("timed out after {}, its timeout ({}), waiting for {}", seconds_text(options_.timeout),
                                 timeout_source(), waiting_for_text()));
}

std::string CommunicatorImpl::timeout_source() const {
  return options_.timeout_source.empty() ? "COHORT_TIMEOUT" : options_.timeout_source;
}

}  // namespace cohort::comm
