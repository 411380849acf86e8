#pragma once
// ThreadCommunicator: an in-process TEST DOUBLE of cohort::Communicator for ranks-as-threads.
// It exists so the data-parallel engine can be tested without the real transport: contributions
// are exchanged through shared memory under a mutex, every operation checks that all ranks issued
// the same op/count/dtype (MismatchError otherwise), and every wait has a deadline.
// Async operations run in call order on a per-rank progress thread, like the real communicator.
// Only what the training code uses is provided (allreduce, broadcast, allgather, reduce_scatter,
// barrier and their async forms, with the in-place forms of include/cohort/communicator.h: send ==
// recv); the rest throw cohort::Error saying so.

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "common/half.h"

namespace cohort::test {

class ThreadGroup {
 public:
  explicit ThreadGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(30))
      : size_(size), timeout_(timeout), slots_(static_cast<size_t>(size)) {}
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Deposits this rank's bytes; returns every rank's contribution once all have arrived.
  std::shared_ptr<const std::vector<std::string>> exchange(int rank, std::string mine) {
    std::unique_lock<std::mutex> lock(mutex_);
    slots_[static_cast<size_t>(rank)] = std::move(mine);
    const uint64_t my_generation = generation_;
    if (++arrived_ == size_) {
      result_ = std::make_shared<const std::vector<std::string>>(std::move(slots_));
      slots_.assign(static_cast<size_t>(size_), {});
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return result_;
    }
    if (!changed_.wait_for(lock, timeout_, [&] { return generation_ != my_generation; }))
      throw TimeoutError("ThreadCommunicator: rank " + std::to_string(rank) + " timed out waiting for the other ranks");
    return result_;
  }

 private:
  int size_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::string> slots_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::shared_ptr<const std::vector<std::string>> result_;
};

class ThreadCommunicator : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadGroup> group, int rank) : group_(std::move(group)), rank_(rank) {
    options_.timeout = group_->timeout();
    worker_ = std::thread([this] { progress_loop(); });
  }
  ~ThreadCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    worker_.join();
  }

  // Builds `world` communicators sharing one group (index = rank).
  static std::vector<std::shared_ptr<Communicator>> make_world(int world) {
    auto group = std::make_shared<ThreadGroup>(world);
    std::vector<std::shared_ptr<Communicator>> comms;
    for (int r = 0; r < world; ++r) comms.push_back(std::make_shared<ThreadCommunicator>(group, r));
    return comms;
  }

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  int local_rank() const override { return rank_; }
  int local_size() const override { return group_->size(); }
  std::string host_of(int) const override { return "localhost"; }
  const CommOptions& options() const override { return options_; }

  void allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) override {
    allreduce_async(send, recv, count, dtype, op)->wait();
  }
  void broadcast(void* buf, size_t count, DataType dtype, int root) override {
    broadcast_async(buf, count, dtype, root)->wait();
  }
  void allgather(const void* send, void* recv, size_t count, DataType dtype) override {
    allgather_async(send, recv, count, dtype)->wait();
  }
  void barrier() override { barrier_async()->wait(); }

  std::shared_ptr<Work> allreduce_async(const void* send, void* recv, size_t count, DataType dtype,
                                        ReduceOp op) override {
    return enqueue([=, this] {
      const size_t bytes = count * dtype_size(dtype);
      auto all = exchange("allreduce", count, dtype, std::string(static_cast<const char*>(send), bytes));
      std::vector<double> acc(count, 0.0);
      for (const auto& contribution : *all) {
        const char* p = contribution.data() + kHeader;
        for (size_t i = 0; i < count; ++i) {
          double v = load(p, i, dtype);
          if (op == ReduceOp::kSum || op == ReduceOp::kAvg) acc[i] += v;
          else if (op == ReduceOp::kMax) acc[i] = (&contribution == &all->front()) ? v : std::max(acc[i], v);
          else if (op == ReduceOp::kMin) acc[i] = (&contribution == &all->front()) ? v : std::min(acc[i], v);
          else throw Error("ThreadCommunicator: reduce op not provided");
        }
      }
      for (size_t i = 0; i < count; ++i) {
        if (op == ReduceOp::kAvg) acc[i] /= size();
        store(recv, i, dtype, acc[i]);
      }
    });
  }
  std::shared_ptr<Work> broadcast_async(void* buf, size_t count, DataType dtype, int root) override {
    return enqueue([=, this] {
      const size_t bytes = count * dtype_size(dtype);
      std::string mine = rank_ == root ? std::string(static_cast<const char*>(buf), bytes) : std::string(bytes, '\0');
      auto all = exchange("broadcast", count, dtype, std::move(mine));
      std::memcpy(buf, (*all)[static_cast<size_t>(root)].data() + kHeader, bytes);
    });
  }
  std::shared_ptr<Work> allgather_async(const void* send, void* recv, size_t count, DataType dtype) override {
    return enqueue([=, this] {
      const size_t bytes = count * dtype_size(dtype);
      // In place: this rank's contribution is already at its place in recv.
      const char* mine = send == recv ? static_cast<const char*>(recv) + static_cast<size_t>(rank_) * bytes
                                      : static_cast<const char*>(send);
      auto all = exchange("allgather", count, dtype, std::string(mine, bytes));
      for (int r = 0; r < size(); ++r)
        std::memcpy(static_cast<char*>(recv) + r * bytes, (*all)[static_cast<size_t>(r)].data() + kHeader, bytes);
    });
  }
  std::shared_ptr<Work> barrier_async() override {
    return enqueue([this] { exchange("barrier", 0, DataType::kUInt8, {}); });
  }

  // Not used by the training engine; the real communicator provides them.
  void reduce(const void*, void*, size_t, DataType, ReduceOp, int) override { missing("reduce"); }
  void allgatherv(const void*, size_t, void*, const std::vector<size_t>&, DataType) override { missing("allgatherv"); }
  void gather(const void*, void*, size_t, DataType, int) override { missing("gather"); }
  void scatter(const void*, void*, size_t, DataType, int) override { missing("scatter"); }
  void reduce_scatter(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) override {
    reduce_scatter_async(send, recv, count, dtype, op)->wait();
  }
  void alltoall(const void*, void*, size_t, DataType) override { missing("alltoall"); }
  void alltoallv(const void*, const std::vector<size_t>&, const std::vector<size_t>&, void*, const std::vector<size_t>&,
                 const std::vector<size_t>&, DataType) override { missing("alltoallv"); }
  void send(const void*, size_t, DataType, int, uint32_t) override { missing("send"); }
  void recv(void*, size_t, DataType, int, uint32_t) override { missing("recv"); }
  int recv_any(void*, size_t, DataType, uint32_t) override { missing("recv_any"); }
  std::shared_ptr<Work> send_async(const void*, size_t, DataType, int, uint32_t) override { missing("send_async"); }
  std::shared_ptr<Work> recv_async(void*, size_t, DataType, int, uint32_t) override { missing("recv_async"); }
  // Sum or average only. In place (send == recv): the input is recv's size() * count elements and the
  // result goes to its first count.
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t count, DataType dtype,
                                             ReduceOp op) override {
    if (op != ReduceOp::kSum && op != ReduceOp::kAvg) missing("reduce_scatter with an op other than sum or avg");
    return enqueue([=, this] {
      const size_t bytes = count * dtype_size(dtype) * static_cast<size_t>(size());
      auto all = exchange("reduce_scatter", count, dtype, std::string(static_cast<const char*>(send), bytes));
      std::vector<double> acc(count, 0.0);
      for (const auto& contribution : *all)
        for (size_t i = 0; i < count; ++i)
          acc[i] += load(contribution.data() + kHeader, static_cast<size_t>(rank_) * count + i, dtype);
      for (size_t i = 0; i < count; ++i) store(recv, i, dtype, op == ReduceOp::kAvg ? acc[i] / size() : acc[i]);
    });
  }
  std::shared_ptr<Communicator> split(int, int) override { missing("split"); }
  std::shared_ptr<Communicator> subgroup(const std::vector<int>&) override { missing("subgroup"); }
  void abort(const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = reason;
  }

  // Number of operations issued so far (tests check the order and count of allreduces).
  int64_t operations() const { return operations_; }

  // Ordinary memory, as the base gives, but remembered: tests check that GradientSync puts its buckets
  // in allocate_shared memory (on one host that is what lets the peers reduce them in place).
  std::shared_ptr<void> allocate_shared(size_t bytes) override {
    auto memory = Communicator::allocate_shared(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    allocations_.push_back({memory, bytes});
    size_t alive = 0;
    for (const auto& [m, size] : allocations_)
      if (!m.expired()) alive += size;
    peak_shared_bytes_ = std::max(peak_shared_bytes_, alive);
    return memory;
  }
  // The most allocate_shared memory this rank held at once (counted at each allocation).
  size_t peak_shared_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return peak_shared_bytes_;
  }
  // Whether [p, p + bytes) lies in memory allocate_shared returned that is still alive (a freed
  // allocation's address may come back from the heap).
  bool from_allocate_shared(const void* p, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    const char* c = static_cast<const char*>(p);
    for (const auto& [memory, size] : allocations_) {
      auto alive = memory.lock();
      const char* base = static_cast<const char*>(alive.get());
      if (alive && c >= base && c + bytes <= base + size) return true;
    }
    return false;
  }

 private:
  static constexpr size_t kHeader = 32;

  class FutureWork : public Work {
   public:
    explicit FutureWork(std::shared_future<void> f, std::chrono::milliseconds timeout) : f_(std::move(f)), timeout_(timeout) {}
    void wait(std::chrono::milliseconds timeout) override {
      auto limit = timeout.count() > 0 ? timeout : timeout_;
      if (f_.wait_for(limit) != std::future_status::ready) throw TimeoutError("ThreadCommunicator: operation timed out");
      f_.get();
    }
    bool test() override { return f_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
    std::exception_ptr exception() override {
      if (!test()) return nullptr;
      try {
        f_.get();
      } catch (...) {
        return std::current_exception();
      }
      return nullptr;
    }

   private:
    std::shared_future<void> f_;
    std::chrono::milliseconds timeout_;
  };

  [[noreturn]] static void missing(const char* what) {
    throw Error(std::string("ThreadCommunicator (test double): ") + what + " is not provided");
  }

  std::shared_ptr<const std::vector<std::string>> exchange(const char* op, size_t count, DataType dtype, std::string payload) {
    char header[kHeader] = {};
    std::snprintf(header, sizeof header, "%s %zu %d", op, count, static_cast<int>(dtype));
    std::string mine(header, kHeader);
    mine += payload;
    auto all = group_->exchange(rank_, std::move(mine));
    for (int r = 0; r < size(); ++r) {
      if ((*all)[static_cast<size_t>(r)].compare(0, kHeader, std::string(header, kHeader)) != 0)
        throw MismatchError("ThreadCommunicator: rank " + std::to_string(rank_) + " issued '" + header + "' but rank " +
                            std::to_string(r) + " issued '" + (*all)[static_cast<size_t>(r)].substr(0, kHeader).c_str() + "'");
    }
    return all;
  }

  static double load(const char* p, size_t i, DataType t) {
    switch (t) {
      case DataType::kFloat32: { float v; std::memcpy(&v, p + 4 * i, 4); return v; }
      case DataType::kFloat64: { double v; std::memcpy(&v, p + 8 * i, 8); return v; }
      case DataType::kInt64: { int64_t v; std::memcpy(&v, p + 8 * i, 8); return static_cast<double>(v); }
      case DataType::kInt32: { int32_t v; std::memcpy(&v, p + 4 * i, 4); return v; }
      case DataType::kFloat16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return half_to_float(v); }
      case DataType::kBFloat16: { uint16_t v; std::memcpy(&v, p + 2 * i, 2); return bf16_to_float(v); }
      default: missing("this dtype in allreduce");
    }
  }
  static void store(void* out, size_t i, DataType t, double v) {
    char* p = static_cast<char*>(out);
    switch (t) {
      case DataType::kFloat32: { float f = static_cast<float>(v); std::memcpy(p + 4 * i, &f, 4); return; }
      case DataType::kFloat64: std::memcpy(p + 8 * i, &v, 8); return;
      case DataType::kInt64: { int64_t x = static_cast<int64_t>(v); std::memcpy(p + 8 * i, &x, 8); return; }
      case DataType::kInt32: { int32_t x = static_cast<int32_t>(v); std::memcpy(p + 4 * i, &x, 4); return; }
      case DataType::kFloat16: { uint16_t h = float_to_half(static_cast<float>(v)); std::memcpy(p + 2 * i, &h, 2); return; }
      case DataType::kBFloat16: { uint16_t h = float_to_bf16(static_cast<float>(v)); std::memcpy(p + 2 * i, &h, 2); return; }
      default: missing("this dtype in allreduce");
    }
  }

  std::shared_ptr<Work> enqueue(std::function<void()> op) {
    auto task = std::make_shared<std::packaged_task<void()>>([this, op = std::move(op)] {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!aborted_.empty()) throw AbortedError(aborted_);
      }
      op();
    });
    std::shared_future<void> f = task->get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back([task] { (*task)(); });
      ++operations_;
    }
    wake_.notify_all();
    return std::make_shared<FutureWork>(f, options_.timeout);
  }

  void progress_loop() {
    for (;;) {
      std::function<void()> next;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        next = std::move(queue_.front());
        queue_.pop_front();
      }
      next();
    }
  }

  std::shared_ptr<ThreadGroup> group_;
  int rank_;
  CommOptions options_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::string aborted_;
  int64_t operations_ = 0;
  std::vector<std::pair<std::weak_ptr<void>, size_t>> allocations_;
  size_t peak_shared_bytes_ = 0;
  std::thread worker_;
};

}  // namespace cohort::test
