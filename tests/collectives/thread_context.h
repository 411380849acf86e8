#pragma once
// ThreadContext: an in-process coll::Context for testing the algorithms with ranks as threads.
//
// Messages are matched per (source, destination, slot) in posting order, like the real
// communicator. Matching is rendezvous: bytes are copied when both the send and the receive have
// been posted, and a send completes only then. An algorithm that waits for a send before the peer
// can post the matching receive therefore deadlocks here (and is caught by the wait deadline)
// instead of passing by luck of transport buffering. A size mismatch fails both sides. New scratch
// memory is filled with a pattern so algorithms cannot rely on its contents.

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <fmt/core.h>

#include "cohort/error.h"
#include "collectives/context.h"

namespace cohort::test {

class ThreadWorld {
 public:
  explicit ThreadWorld(int size, std::chrono::milliseconds deadline = std::chrono::seconds(20))
      : size_(size), deadline_(deadline) {}
  int size() const { return size_; }

  struct Request {
    bool done = false;
    std::string error;
    bool is_send = false;
    int src = 0, dst = 0;
    uint32_t slot = 0;
    const void* sdata = nullptr;
    void* rdata = nullptr;
    size_t bytes = 0;
  };
  using Key = std::tuple<int, int, uint32_t>;

  std::shared_ptr<Request> post(bool is_send, int src, int dst, uint32_t slot, const void* sdata, void* rdata,
                                size_t bytes) {
    auto req = std::make_shared<Request>();
    req->is_send = is_send;
    req->src = src;
    req->dst = dst;
    req->slot = slot;
    req->sdata = sdata;
    req->rdata = rdata;
    req->bytes = bytes;
    std::lock_guard<std::mutex> g(mu_);
    ++messages_;
    auto& box = boxes_[Key{src, dst, slot}];
    auto& other = is_send ? box.recvs : box.sends;
    auto& mine = is_send ? box.sends : box.recvs;
    if (!other.empty()) {
      auto peer = other.front();
      other.pop_front();
      auto& s = is_send ? req : peer;
      auto& r = is_send ? peer : req;
      if (s->bytes != r->bytes) {
        std::string msg = fmt::format("size mismatch on {}->{} slot {}: send {} B, receive {} B", src, dst, slot,
                                      s->bytes, r->bytes);
        s->error = r->error = msg;
      } else if (s->bytes) {
        std::memcpy(r->rdata, s->sdata, s->bytes);
      }
      s->done = r->done = true;
      cv_.notify_all();
    } else {
      mine.push_back(req);
    }
    return req;
  }

  void wait(const std::shared_ptr<Request>& req, int rank) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!cv_.wait_for(lk, deadline_, [&] { return req->done; })) {
      throw TimeoutError(fmt::format("{} {}->{} slot {} ({} B) never matched",
                                     req->is_send ? "send" : "receive", req->src, req->dst, req->slot, req->bytes));
    }
    if (!req->error.empty()) throw MismatchError(req->error);
  }

  // True when every posted message was matched (no stray sends or receives left behind).
  bool drained() {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [k, box] : boxes_) {
      if (!box.sends.empty() || !box.recvs.empty()) return false;
    }
    return true;
  }
  size_t messages() {
    std::lock_guard<std::mutex> g(mu_);
    return messages_;
  }

 private:
  struct Box {
    std::deque<std::shared_ptr<Request>> sends, recvs;
  };
  int size_;
  std::chrono::milliseconds deadline_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Box> boxes_;
  size_t messages_ = 0;
};

class ThreadContext final : public coll::Context {
 public:
  ThreadContext(ThreadWorld& world, int rank) : world_(world), rank_(rank) {}
  ~ThreadContext() override = default;
  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }

  coll::RequestId isend(int peer, const void* data, size_t bytes, uint32_t slot) override {
    check_peer(peer);
    return add(world_.post(true, rank_, peer, slot, data, nullptr, bytes));
  }
  coll::RequestId irecv(int peer, void* data, size_t bytes, uint32_t slot) override {
    check_peer(peer);
    return add(world_.post(false, peer, rank_, slot, nullptr, data, bytes));
  }
  void wait(coll::RequestId id) override {
    auto it = requests_.find(id);
    if (it == requests_.end()) throw std::logic_error(fmt::format("rank {}: wait on unknown request {}", rank_, id));
    auto req = it->second;
    requests_.erase(it);
    world_.wait(req, rank_);
  }
  void* scratch(size_t bytes, int index) override {
    if (index < 0 || index > 7) throw std::logic_error(fmt::format("scratch index {} out of range", index));
    auto& buf = scratch_[static_cast<size_t>(index)];
    if (buf.size() < bytes) buf.assign(bytes, static_cast<char>(0xA5));
    return buf.data();
  }
  size_t outstanding() const { return requests_.size(); }

 private:
  void check_peer(int peer) const {
    if (peer < 0 || peer >= world_.size() || peer == rank_) {
      throw std::logic_error(fmt::format("rank {}: bad peer {}", rank_, peer));
    }
  }
  coll::RequestId add(std::shared_ptr<ThreadWorld::Request> req) {
    coll::RequestId id = next_++;
    requests_.emplace(id, std::move(req));
    return id;
  }
  ThreadWorld& world_;
  int rank_;
  coll::RequestId next_ = 1;
  std::unordered_map<coll::RequestId, std::shared_ptr<ThreadWorld::Request>> requests_;
  std::vector<char> scratch_[8];
};

}  // namespace cohort::test
