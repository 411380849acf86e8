// CommunicatorImpl (communicator_impl.h): point to point. Not collective, so no sequence number:
// each (peer, tag) stream is matched in order. Receives from any source, and the asynchronous
// handles of sends and receives.
#include <algorithm>

#include "comm/shm_path.h"
#include "common/strings.h"
#include <fmt/core.h>

#include "cohort/error.h"
#include "comm/communicator_impl.h"
#include "comm/communicator_internal.h"

namespace cohort::comm {

namespace algo = cohort::comm::shm_path;

// ------------------------------------------------------------------------------------------------
// Point to point: not collective, so no sequence number; (peer, tag) streams are matched in order.

void CommunicatorImpl::send(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  if (peer < 0 || peer >= size_) throw InvalidArgument(fmt::format("send: peer {} out of range [0, {})", peer, size_));
  validate_buffer(buf, count, "send");
  OpDesc d{OpKind::kSendRecv, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype), peer};
  run_blocking(d, [&] {
    transport::Transport* t = route(peer);
    uint32_t index = p2p_send_index_[(uint64_t(uint32_t(peer)) << 32) | tag]++;
    transport::Envelope env{(uint64_t(comm_id_) << 32) | kP2PSeq, (uint64_t(tag) << 32) | index, op_sig_};
    transport::RequestId tid = t->isend(peer, env, buf, count * dtype_size(dtype));
    pending_.push_back({next_id_, tid, t, peer});
    wait(next_id_++);
  });
}

void CommunicatorImpl::recv(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  if (peer < 0 || peer >= size_) throw InvalidArgument(fmt::format("recv: peer {} out of range [0, {})", peer, size_));
  validate_buffer(buf, count, "recv");
  OpDesc d{OpKind::kSendRecv, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype), peer};
  run_blocking(d, [&] {
    transport::Transport* t = route(peer);
    uint32_t index = p2p_recv_index_[(uint64_t(uint32_t(peer)) << 32) | tag]++;
    transport::Envelope env{(uint64_t(comm_id_) << 32) | kP2PSeq, (uint64_t(tag) << 32) | index, op_sig_};
    transport::RequestId tid = t->irecv(peer, env, buf, count * dtype_size(dtype));
    pending_.push_back({next_id_, tid, t, peer});
    wait(next_id_++);
  });
}

int CommunicatorImpl::recv_any(void* buf, size_t count, DataType dtype, uint32_t tag) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_buffer(buf, count, "recv");
  if (size_ == 1) throw InvalidArgument("recv from any source: this rank is alone in its group, no rank can send to it");
  OpDesc d{OpKind::kSendRecv, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype), -1};
  int source = -1;
  run_blocking(d, [&] {
    // The next message of each peer's (peer, tag) stream is the one this receive may take. Whichever
    // has begun to arrive is taken, asking the peers round-robin from the one after the last taken, so
    // that a chatty low rank cannot starve the others. Nothing is posted until one has arrived:
    // a receive posted on every peer would take one message from each.
    auto envelope = [&](int peer) {
      uint32_t index = p2p_recv_index_[(uint64_t(uint32_t(peer)) << 32) | tag];
      return transport::Envelope{(uint64_t(comm_id_) << 32) | kP2PSeq, (uint64_t(tag) << 32) | index, op_sig_};
    };
    auto first_arrived = [&] {
      for (int i = 0; i < size_; ++i) {
        int peer = (any_source_next_ + i) % size_;
        if (peer != rank_ && route(peer)->arrived(peer, envelope(peer))) return peer;
      }
      return -1;
    };
    any_source_tag_ = tag;
    struct Clear {
      std::optional<uint32_t>& tag;
      ~Clear() { tag.reset(); }
    } clear{any_source_tag_};
    source = first_arrived();
    if (source < 0) {
      for (auto& t : transports_) t->poll(0);
      source = first_arrived();
    }
    if (source < 0) drive_until([&] { return (source = first_arrived()) >= 0; });
    any_source_tag_.reset();
    any_source_next_ = (source + 1) % size_;
    op_.peer = source;
    transport::Transport* t = route(source);
    transport::Envelope env = envelope(source);
    ++p2p_recv_index_[(uint64_t(uint32_t(source)) << 32) | tag];
    transport::RequestId tid = t->irecv(source, env, buf, count * dtype_size(dtype));
    pending_.push_back({next_id_, tid, t, source});
    wait(next_id_++);
  });
  return source;
}

// Non-blocking point to point. The request is posted to the transport at once, under the drive lock;
// it then completes whenever the transports are driven (by any operation's wait, by test()'s poll, by
// its own wait). Its state is read under the Work's own mutex and written under the drive lock.
class P2PWork final : public Work {
 public:
  P2PWork(std::weak_ptr<CommunicatorImpl> comm, bool is_send, OpDesc desc, transport::Transport* t,
          transport::RequestId tid, Deadline::Clock::time_point deadline)
      : is_send(is_send), desc(desc), transport(t), tid(tid), deadline(deadline), comm_(std::move(comm)) {}

  void wait(std::chrono::milliseconds timeout) override {
    if (!finished()) {
      if (auto comm = comm_.lock()) {
        comm->p2p_wait(*this, timeout);
      } else {
        gone();
      }
    }
    if (auto e = exception()) std::rethrow_exception(e);
  }
  bool test() override {
    if (finished()) return true;
    if (auto comm = comm_.lock()) {
      comm->p2p_test(*this);
    } else {
      gone();
    }
    return finished();
  }
  std::exception_ptr exception() override {
    std::lock_guard<std::mutex> g(m_);
    return error_;
  }
  bool finished() {
    std::lock_guard<std::mutex> g(m_);
    return done_;
  }
  void finish(std::exception_ptr error) {
    std::lock_guard<std::mutex> g(m_);
    done_ = true;
    error_ = error;
  }

  // Set when posted; used under the communicator's drive lock.
  const bool is_send;
  const OpDesc desc;
  transport::Transport* const transport;
  const transport::RequestId tid;
  const Deadline::Clock::time_point deadline;

 private:
  void gone() {
    finish(std::make_exception_ptr(AbortedError(fmt::format(
        "{} rank {}: the communicator was destroyed before it completed", is_send ? "send to" : "recv from", desc.peer))));
  }
  std::weak_ptr<CommunicatorImpl> comm_;
  std::mutex m_;
  bool done_ = false;
  std::exception_ptr error_;
};

std::shared_ptr<Work> CommunicatorImpl::post_p2p(bool is_send, void* buf, size_t count, DataType dtype, int peer,
                                                 uint32_t tag) {
  const char* what = is_send ? "send" : "recv";
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  if (peer < 0 || peer >= size_) throw InvalidArgument(fmt::format("{}: peer {} out of range [0, {})", what, peer, size_));
  validate_buffer(buf, count, what);
  OpDesc d{OpKind::kSendRecv, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype), peer};
  std::lock_guard<std::mutex> g(drive_);
  check_usable();
  transport::Transport* t = route(peer);
  auto& indices = is_send ? p2p_send_index_ : p2p_recv_index_;
  uint32_t index = indices[(uint64_t(uint32_t(peer)) << 32) | tag]++;
  // The signature blocking send/recv give their messages, so that the two forms match each other.
  transport::Envelope env{(uint64_t(comm_id_) << 32) | kP2PSeq, (uint64_t(tag) << 32) | index, d.signature()};
  transport::RequestId tid = is_send ? t->isend(peer, env, buf, count * dtype_size(dtype))
                                     : t->irecv(peer, env, buf, count * dtype_size(dtype));
  return std::make_shared<P2PWork>(weak_from_this(), is_send, d, t, tid, Deadline::Clock::now() + options_.timeout);
}

std::shared_ptr<Work> CommunicatorImpl::send_async(const void* buf, size_t count, DataType dtype, int peer,
                                                   uint32_t tag) {
  return post_p2p(true, const_cast<void*>(buf), count, dtype, peer, tag);
}

std::shared_ptr<Work> CommunicatorImpl::recv_async(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  return post_p2p(false, buf, count, dtype, peer, tag);
}

void CommunicatorImpl::p2p_test(P2PWork& work) {
  std::unique_lock<std::mutex> g(drive_, std::try_to_lock);
  if (!g.owns_lock() || work.finished()) return;  // another thread drives (and will move the bytes)
  if (failed_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> f(fail_mutex_);
    return work.finish(std::make_exception_ptr(AbortedError(fmt::format("communicator failed earlier: {}", root_cause_))));
  }
  try {
    for (auto& t : transports_) t->poll(0);
    if (work.transport->test(work.tid)) return work.finish(nullptr);
  } catch (...) {
    return work.finish(std::current_exception());
  }
  if (Deadline::Clock::now() < work.deadline) return;
  // Past its deadline: fail the communicator as a blocking receive's timeout does (its buffer may be
  // released once the Work fails, so the transport must forget the request), naming the peer.
  const OpDesc& d = work.desc;
  try {
    execute_locked(d, [&] {
      pending_.push_back({next_id_++, work.tid, work.transport, d.peer});
      throw_timeout();
    });
  } catch (...) {
    work.finish(std::current_exception());
  }
}

void CommunicatorImpl::p2p_wait(P2PWork& work, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> g(drive_);
  if (work.finished()) return;
  const OpDesc& d = work.desc;
  try {
    execute_locked(d, [&] {
      // The deadline counts from the post; a shorter one given to wait() applies too.
      auto until = work.deadline;
      if (timeout.count() > 0) until = std::min(until, Deadline::Clock::now() + timeout);
      op_deadline_ = Deadline(until);
      pending_.push_back({next_id_, work.tid, work.transport, d.peer});
      wait(next_id_++);
    });
    work.finish(nullptr);
  } catch (...) {
    work.finish(std::current_exception());
  }
}

}  // namespace cohort::comm
