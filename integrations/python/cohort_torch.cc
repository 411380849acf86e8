// cohort_torch: cohort's collectives as a torch.distributed backend.
//
//   import cohort_torch                       # registers backend "cohort"
//   torch.distributed.init_process_group(backend="cohort")
//
// One translation unit on purpose: everything here includes the torch headers, which cost
// most of the build time.
//
// Design (docs/pytorch.md has the user-facing part):
// - The creator torch calls, creator(store, rank, size, timeout), wraps torch's c10d::Store in a
//   cohort::Store adapter and builds a cohort::Communicator on it.
// - torch 1.x subclasses c10d::ProcessGroup; torch 2.x subclasses c10d::Backend (registered
//   with devices=["cpu", "cuda"]). The two share every method signature used here, so the class body
//   is the same; only the base class and the registration call differ (TORCH_VERSION_MAJOR).
// - CUDA tensors (torch 2.x): handed to torch's own NCCL backend, built over the same store, or,
//   without NCCL, staged through host memory (route_cuda). "cpu:cohort,cuda:nccl" is the documented
//   form: torch then sends CUDA tensors to NCCL itself. Debian's torch 1.13 has no CUDA: a CUDA
//   tensor there is refused in one line (check_tensor).
// - Every operation is validated on the calling thread (bad dtype, device, shape: RuntimeError at
//   once), then queued to one worker thread per process group that runs the blocking
//   communicator call. One thread keeps operations in the order they were issued, which the
//   communicator requires (same order on every rank), and lets DDP overlap backward with
//   communication. The Work handle completes (and its Future with the output tensors) when the
//   worker is done; failures complete it with the communicator's exception, which Python sees
//   as RuntimeError carrying cohort's message.
// - Non-contiguous tensors are staged through a contiguous copy and copied back.
// - A tensor allreduced again and again (DDP's gradient buckets) moves into memory the peers map
//   (SharedStorage below), so that its allreduce reads their data in place instead of staging it.

#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <pybind11/chrono.h>
#include <pybind11/eval.h>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>
#include <atomic>
#include <tuple>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "comm/launch_env.h"
#include "comm/pmix.h"
#include "comm/settings.h"
#include "common/env.h"
#include "common/socket.h"
#include "cohort/store.h"
#include "cohort/types.h"

namespace py = pybind11;

namespace cohort_torch {

#if TORCH_VERSION_MAJOR >= 2
using BaseGroup = c10d::Backend;
#else
using BaseGroup = c10d::ProcessGroup;
#endif

using Millis = std::chrono::milliseconds;

// First line of each collective of the backend: CUDA tensors leave the CPU path here (torch 2.x;
// torch 1.x from Debian has no CUDA, and check_tensor refuses non-CPU tensors in one line).
#if TORCH_VERSION_MAJOR >= 2
#define COHORT_ROUTE_CUDA(type, all, outputs, call)                                                  \
  if (auto routed_ = route_cuda(                                                                      \
          type, all, outputs, [&](BaseGroup& nccl_) { return nccl_.call; }, [&] { return this->call; })) \
  return *routed_
#else
#define COHORT_ROUTE_CUDA(type, all, outputs, call)
#endif

// ---------------------------------------------------------------------------------------------
// cohort::Store on top of torch's c10d::Store (TCPStore under env:// and torchrun, PrefixStore
// around it for each group, FileStore/HashStore when the user passes one).
// ---------------------------------------------------------------------------------------------
class C10dStoreAdapter : public cohort::Store {
 public:
  explicit C10dStoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

  void set(const std::string& key, const std::string& value) override {
    guarded("set", key, [&] { store_->set(key, to_bytes(value)); });
  }

  std::string get(const std::string& key) override {
    // Wait with cohort's own deadline first, so the timeout is the one cohort was given and the
    // error names the key; c10d's get would use the store's timeout.
    wait({key}, timeout());
    std::string out;
    guarded("get", key, [&] { out = to_string(store_->get(key)); });
    return out;
  }

  int64_t add(const std::string& key, int64_t delta) override {
    int64_t out = 0;
    guarded("add", key, [&] { out = store_->add(key, delta); });
    return out;
  }

  std::string compare_set(const std::string& key, const std::string& expected,
                          const std::string& desired) override {
    if (!compare_set_unsupported_.load()) {
      try {
        return to_string(store_->compareSet(key, to_bytes(expected), to_bytes(desired)));
      } catch (const c10::Error& e) {
        // c10d::Store's default compareSet is "Not implemented" (HashStore in torch 1.x);
        // fall back to a lock built from add().
        if (std::string(e.what()).find("Not implemented") == std::string::npos) {
          rethrow_as_cohort("compare_set", key, e);
        }
        compare_set_unsupported_ = true;
      } catch (const std::exception& e) {
        rethrow_as_cohort("compare_set", key, e);
      }
    }
    return compare_set_with_lock(key, expected, desired);
  }

  bool remove(const std::string& key) override {
    bool out = false;
    guarded("remove", key, [&] { out = store_->deleteKey(key); });
    return out;
  }

  int64_t num_keys() override {
    int64_t out = 0;
    guarded("num_keys", "", [&] { out = store_->getNumKeys(); });
    return out;
  }

  bool check(const std::vector<std::string>& keys) override {
    bool out = false;
    guarded("check", join(keys), [&] { out = store_->check(keys); });
    return out;
  }

  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    guarded("wait", join(keys), [&] { store_->wait(keys, timeout); });
  }

  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    // c10d::Store in torch 1.x has no multiGet: one wait for all keys, then one get each.
    wait(keys, timeout());
    std::vector<std::string> out;
    out.reserve(keys.size());
    for (const auto& key : keys) {
      guarded("get", key, [&] { out.push_back(to_string(store_->get(key))); });
    }
    return out;
  }

  void multi_set(const std::vector<std::string>& keys,
                 const std::vector<std::string>& values) override {
    if (keys.size() != values.size()) {
      throw cohort::InvalidArgument(fmt::format("store multi_set: {} keys but {} values",
                                                keys.size(), values.size()));
    }
    for (size_t i = 0; i < keys.size(); ++i) set(keys[i], values[i]);
  }

 private:
  static std::vector<uint8_t> to_bytes(const std::string& s) {
    return std::vector<uint8_t>(s.begin(), s.end());
  }
  static std::string to_string(const std::vector<uint8_t>& v) {
    return std::string(v.begin(), v.end());
  }
  static std::string join(const std::vector<std::string>& keys) {
    std::string out;
    for (const auto& k : keys) {
      if (!out.empty()) out += ", ";
      out += k;
    }
    return out;
  }

  // torch throws c10::Error (or c10::DistStoreError) with "Timeout" in the message when a wait
  // expires, and a socket error when the store server is gone; map them to cohort's hierarchy.
  [[noreturn]] static void rethrow_as_cohort(const char* op, const std::string& key,
                                             const std::exception& e) {
    std::string what = e.what();
    // c10::Error::what() carries a C++ backtrace after the first line; keep the message only.
    if (auto nl = what.find('\n'); nl != std::string::npos) what.resize(nl);
    std::string msg = fmt::format("torch store {} '{}' failed: {}", op, key, what);
    if (what.find("imeout") != std::string::npos || what.find("timed out") != std::string::npos) {
      throw cohort::TimeoutError(msg);
    }
    throw cohort::PeerLostError(msg);
  }

  // Runs one c10d call, translating torch's exceptions into cohort's.
  template <typename Fn>
  static void guarded(const char* op, const std::string& key, Fn&& fn) {
    try {
      fn();
    } catch (const cohort::Error&) {
      throw;
    } catch (const std::exception& e) {
      rethrow_as_cohort(op, key, e);
    }
  }

  // compare_set for stores without compareSet: a spin lock on "<key>/cohort_cas_lock" built from
  // add() (the first to reach 1 owns it), bounded by the store timeout.
  std::string compare_set_with_lock(const std::string& key, const std::string& expected,
                                    const std::string& desired) {
    const std::string lock = key + "/cohort_cas_lock";
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    while (add(lock, 1) != 1) {
      add(lock, -1);
      if (std::chrono::steady_clock::now() > deadline) {
        throw cohort::TimeoutError(fmt::format(
            "torch store compare_set '{}': lock '{}' not acquired within {} ms", key, lock,
            timeout().count()));
      }
      std::this_thread::sleep_for(Millis(1));
    }
    std::string current;
    try {
      bool exists = check({key});
      if (exists) guarded("get", key, [&] { current = to_string(store_->get(key)); });
      if ((!exists && expected.empty()) || (exists && current == expected)) {
        set(key, desired);
        current = desired;
      }
    } catch (...) {
      add(lock, -1);
      throw;
    }
    add(lock, -1);
    return current;
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::atomic<bool> compare_set_unsupported_{false};
};

// ---------------------------------------------------------------------------------------------
// Type and operator mapping.
// ---------------------------------------------------------------------------------------------
cohort::DataType to_cohort_dtype(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kChar: return cohort::DataType::kInt8;
    case at::kByte: return cohort::DataType::kUInt8;
    case at::kInt: return cohort::DataType::kInt32;
    case at::kLong: return cohort::DataType::kInt64;
    case at::kHalf: return cohort::DataType::kFloat16;
    case at::kBFloat16: return cohort::DataType::kBFloat16;
    case at::kFloat: return cohort::DataType::kFloat32;
    case at::kDouble: return cohort::DataType::kFloat64;
    default: break;
  }
  TORCH_CHECK(false, "cohort backend: ", op, " does not support dtype ", t.scalar_type(),
              "; supported: int8, uint8, int32, int64, float16, bfloat16, float32, float64");
}

cohort::ReduceOp to_cohort_op(const c10d::ReduceOp& op, cohort::DataType dtype,
                              const char* what) {
  cohort::ReduceOp out;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: out = cohort::ReduceOp::kSum; break;
    case c10d::ReduceOp::PRODUCT: out = cohort::ReduceOp::kProd; break;
    case c10d::ReduceOp::MIN: out = cohort::ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: out = cohort::ReduceOp::kMax; break;
    case c10d::ReduceOp::AVG: out = cohort::ReduceOp::kAvg; break;
    default:
      TORCH_CHECK(false, "cohort backend: ", what, " does not support reduce op ",
                  static_cast<int>(op.op_),
                  " (BAND/BOR/BXOR/PREMUL_SUM); supported: SUM, PRODUCT, MIN, MAX, AVG");
  }
  TORCH_CHECK(cohort::op_supported(dtype, out), "cohort backend: ", what,
              ": ReduceOp.AVG needs a floating-point tensor, got ", cohort::dtype_name(dtype));
  return out;
}

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.defined(), "cohort backend: ", op, ": undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), "cohort backend: ", op,
              " supports CPU tensors only, got a tensor on ", t.device());
  TORCH_CHECK(t.layout() == at::kStrided, "cohort backend: ", op,
              " supports dense (strided) tensors only, got layout ", t.layout());
}

void check_single(const std::vector<at::Tensor>& tensors, const char* op) {
  TORCH_CHECK(tensors.size() == 1, "cohort backend: ", op,
              " takes exactly one tensor per rank, got ", tensors.size());
  check_tensor(tensors[0], op);
}

void check_same_type(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "cohort backend: ", op,
              ": tensors must share one dtype, got ", a.scalar_type(), " and ", b.scalar_type());
}

// The tensor a collective reads or writes: the user's tensor when it is contiguous, else a
// contiguous copy that is copied back (for outputs) when the operation is done.
struct Staged {
  at::Tensor user;
  at::Tensor buf;
  explicit Staged(const at::Tensor& t) : user(t), buf(t.is_contiguous() ? t : t.contiguous()) {}
  void* data() const { return buf.data_ptr(); }
  size_t count() const { return static_cast<size_t>(buf.numel()); }
  void copy_back() const {
    if (!buf.is_same(user)) user.copy_(buf);
  }
};

// One contiguous buffer holding `tensors` back to back (flattened).
at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

// A tensor's elements as a flat byte tensor (a contiguous copy when it is not contiguous).
at::Tensor as_bytes(const at::Tensor& t) {
  at::Tensor c = t.contiguous().reshape({-1});
  return c.numel() == 0 ? at::empty({0}, at::kByte) : c.view(at::kByte);
}

// Writes `bytes` (t.numel() * t.element_size() of them) into t's elements.
void as_bytes_view(const at::Tensor& t, const at::Tensor& bytes) {
  if (t.numel() == 0) return;
  t.copy_(bytes.view(t.scalar_type()).view(t.sizes()));
}

// Copies consecutive slices of `flat` into `tensors` (the inverse of flatten).
void unflatten_into(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  int64_t offset = 0;
  for (const auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

// ---------------------------------------------------------------------------------------------
// Work: completed by the worker thread; its Future carries the output tensors (what DDP and its
// communication hooks wait on).
// ---------------------------------------------------------------------------------------------
class CohortWork : public c10d::Work {
 public:
  CohortWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs, int source_rank = -1)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        source_rank_(source_rank),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  int sourceRank() const override { return source_rank_.load(); }
  // A receive from any source learns its sender when it runs (before complete()).
  void set_source_rank(int rank) { source_rank_.store(rank); }

  // A send or receive posted to the communicator (send_async/recv_async): wait() drives it to its end
  // on the waiting thread, instead of sleeping until the worker thread's next look at it.
  void set_p2p(std::shared_ptr<cohort::Work> p2p, std::function<void()> on_success) {
    p2p_ = std::move(p2p);
    on_success_ = std::move(on_success);
  }
  bool wait(std::chrono::milliseconds timeout) override {
    if (p2p_ && !isCompleted()) {
      try {
        p2p_->wait(timeout == kNoTimeout ? Millis(0) : timeout);
      } catch (...) {
      }
      end_p2p();
    }
    return c10d::Work::wait(timeout);  // returns at once, or after the worker thread ended it
  }
  // The worker thread's look at a posted send or receive: completes this Work when it has ended.
  bool poll_p2p() {
    if (!p2p_ || isCompleted()) return true;
    if (!p2p_->test()) return false;
    end_p2p();
    return true;
  }

  // Completes the Work. Once per Work: the worker thread and a waiter may both get here for a send or
  // receive, and only the first completes it (and runs its copy back).
  void complete(std::exception_ptr error) {
    if (completing_.exchange(true)) return;
    completed(error);
  }

 private:
  // A send or receive that ended: its copy back, then the Work's completion.
  void end_p2p() {
    if (completing_.exchange(true)) return;
    std::exception_ptr error = p2p_->exception();
    if (!error && on_success_) {
      try {
        on_success_();
      } catch (...) {
        error = std::current_exception();
      }
    }
    completed(error);
  }
  void completed(std::exception_ptr error) {
    finish(error);  // sets completed_/exception_ and wakes wait()
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
  }

 private:
  std::vector<at::Tensor> outputs_;
  std::atomic<int> source_rank_;
  std::atomic<bool> completing_{false};
  std::shared_ptr<cohort::Work> p2p_;  // set before the Work is handed out, then read only
  std::function<void()> on_success_;   // a staged receive's copy back
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// ---------------------------------------------------------------------------------------------
// SharedStorage: allreduce on memory the peers map.
//
// cohort's intra-host allreduce stages a buffer through shared slots because a peer cannot read the
// caller's memory; memory from Communicator::allocate_shared it can read, so an in-place allreduce
// there moves about half the bytes (docs/algorithms-shm.md). DDP allreduces the same bucket tensors
// every step, and an unmodified script cannot allocate them itself, so the backend moves a tensor's
// storage there once it has seen that storage in an earlier large allreduce: the contents are copied
// and the storage's data pointer is swapped (every view of it follows, as with share_memory_()).
// Only storages from torch's CPU allocator move (never memory torch borrowed, e.g. from numpy), only
// when the tensor is all of its storage, and only up to kMaxBytes: the old memory is kept until the
// storage dies, because a raw pointer taken before the move (t.numpy(), a C++ data_ptr()) must stay
// valid (it just no longer sees new results).
//
// Every rank must take the same path (the in-place one reads and writes the peers' memory) and move
// together (allocation is collective), yet each rank knows only its own tensor. No collective of its
// own decides it: every allreduce goes through Communicator::allreduce_shareable, whose ranks see in
// the call's own signature whether all of them passed the same range of one shared allocation (then
// in place; otherwise staged) and whether all of them asked to move (then the call ends with the
// allocation, and every rank moves its storage there). A rank asks when its tensor is a whole storage
// it has seen before, or one that already moved (so that ranks whose moved storages no longer line up
// move again, together). So each allreduce of the user is one operation of the communicator: its
// number in errors, `cohort trace` and `--stats` is the user's count. COHORT_TORCH_SHARE_STORAGE=0
// turns it off (plain allreduces, nothing moves).
class SharedStorage {
 public:
  static constexpr size_t kMinBytes = size_t{256} << 10;
  // DDP's buckets are 25 MiB (bucket_cap_mb); larger tensors stage rather than keep a second copy.
  static constexpr size_t kMaxBytes = size_t{64} << 20;

  explicit SharedStorage(cohort::Communicator& comm) : comm_(comm) {
    enabled_ = cohort::comm::torch_share_storage() && comm.size() > 1 && comm.local_size() == comm.size() &&
               comm.options().transport != "tcp";
  }

  // The allreduce of `buf`, a contiguous tensor, in place: the user's own (`users`), or a staging copy,
  // which never moves. Runs on the worker thread. Every dense allreduce of the group comes here,
  // whatever its size: the ranks' calls must all be shareable ones, or all plain ones.
  void allreduce(const at::Tensor& buf, bool users, cohort::DataType dtype, cohort::ReduceOp op) {
    const size_t count = static_cast<size_t>(buf.numel());
    if (!enabled_) return comm_.allreduce(buf.data_ptr(), buf.data_ptr(), count, dtype, op);
    c10::StorageImpl* storage = buf.storage().unsafeGetStorageImpl();
    const c10::DataPtr& data = storage->data_ptr();
    const bool shared = data.get_deleter() == &release;
    // A whole storage: then its size is count * element size on every rank (both are compared), so
    // the ranks' allocations agree, and each moved tensor sits at the start of its part.
    const bool whole = buf.storage_offset() == 0 && storage->nbytes() == buf.nbytes();
    const bool movable = users && whole && buf.nbytes() >= kMinBytes &&
                         (shared || (data.get_deleter() == c10::GetCPUAllocator()->raw_deleter() &&
                                     storage->nbytes() <= kMaxBytes));
    const auto seen = seen_.find(storage);
    const bool seen_before = seen != seen_.end() && !seen->second.expired();
    std::shared_ptr<void> memory =
        comm_.allreduce_shareable(buf.data_ptr(), count, dtype, op, movable && (shared || seen_before));
    if (memory) return move(storage, std::move(memory));
    if (!movable || shared) return;
    if (seen_.size() >= 256) std::erase_if(seen_, [](const auto& entry) { return entry.second.expired(); });
    if (seen_.size() >= 4096) seen_.clear();  // live tensors forgotten here only move one call later
    seen_.insert_or_assign(storage, buf.storage().getWeakStorageImpl());
  }

 private:
  // What a moved storage's DataPtr owns: the shared memory, and the memory it had before.
  struct Moved {
    std::shared_ptr<void> shared;
    c10::DataPtr before;
  };
  static void release(void* context) { delete static_cast<Moved*>(context); }

  // Moves `storage` into `memory` (its size, from allreduce_shareable), after the call that gave it.
  void move(c10::StorageImpl* storage, std::shared_ptr<void> memory) {
    std::memcpy(memory.get(), storage->data_ptr().get(), storage->nbytes());
    void* target = memory.get();
    auto* moved = new Moved{std::move(memory), c10::DataPtr()};
    // Views read the storage's pointer on every access, so they follow; the old memory goes into the
    // new owner instead of being freed (see the class comment).
    moved->before = storage->set_data_ptr(c10::DataPtr(target, moved, &release, c10::Device(c10::kCPU)));
  }

  cohort::Communicator& comm_;
  bool enabled_ = false;
  // Storages seen in a large allreduce. The weak reference keeps a dead StorageImpl's shell allocated,
  // so a new storage can never take its address and be mistaken for one seen before.
  std::map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> seen_;
};

// ---------------------------------------------------------------------------------------------
// The process group (torch 1.x) / backend (torch 2.x).
// ---------------------------------------------------------------------------------------------
class ProcessGroupCohort : public BaseGroup {
 public:
  // `cuda_backend`: torch's own NCCL backend over the same store, for CUDA tensors (torch 2.x with
  // CUDA and NCCL; null otherwise, and CUDA tensors are staged through host memory).
  ProcessGroupCohort(std::shared_ptr<cohort::Communicator> comm, int rank, int size,
                     c10::intrusive_ptr<BaseGroup> cuda_backend = {}, std::string cuda_note = "")
      : BaseGroup(rank, size),
        comm_(std::move(comm)),
        shared_storage_(*comm_),
        cuda_backend_(std::move(cuda_backend)),
        cuda_note_(std::move(cuda_note)) {
    worker_ = std::thread([this] { worker_loop(); });
    watchdog_ = std::thread([this] { watchdog_loop(); });
  }

  ~ProcessGroupCohort() override {
    bool pending = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      pending = !queue_.empty() || busy_ || !in_flight_.empty();
    }
    // Operations still queued or running would otherwise wait for peers that may never come;
    // abort them so the destructor is bounded.
    if (pending) comm_->abort("process group destroyed with operations still pending");
    cv_.notify_all();
    cv_watch_.notify_all();
    // The watchdog only waits on mu_/cv_watch_ and returns once stopping_ is set and no operation
    // runs; the worker finishes the queue first (or fails it after the abort above).
    struct JoinWatchdog {
      ProcessGroupCohort* g;
      ~JoinWatchdog() {
        if (!g->watchdog_.joinable()) return;
        g->cv_watch_.notify_all();
        g->watchdog_.join();
      }
    } join_watchdog{this};
    if (!worker_.joinable()) return;
    // The last reference usually goes away in Python, with the GIL held, while the worker may be
    // completing a Future whose Python callbacks need the GIL: let go of it while joining.
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release no_gil;
      worker_.join();
    } else {
      worker_.join();
    }
  }

  const std::string getBackendName() const override { return "cohort"; }

  // Sequence numbers: torch's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL; torch 2.x wraps any
  // backend in it) checks before each collective that every rank is at the same one, by this number.
  // As gloo: every rank starts at 0 and counts the collectives it issues (point-to-point operations,
  // which the two ends need not issue alike, are not counted).
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return collectives_issued_.load(); }

  // ---- reductions ----
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::ALLREDUCE, Args().list(tensors), Args().list(tensors), allreduce(tensors, opts));
    if (tensors.size() == 1 && tensors[0].defined() && tensors[0].layout() == at::kSparse)
      return sparse_allreduce(tensors[0], opts);
    check_single(tensors, "allreduce");
    const auto dtype = to_cohort_dtype(tensors[0], "allreduce");
    const auto op = to_cohort_op(opts.reduceOp, dtype, "allreduce");
    Staged t(tensors[0]);
    return enqueue(opts.timeout, c10d::OpType::ALLREDUCE, tensors, [this, t, dtype, op] {
      if (t.count() == 0) return;
      // A staged copy (a non-contiguous tensor) goes the same way: a peer's tensor may be contiguous.
      shared_storage_.allreduce(t.buf, t.buf.is_same(t.user), dtype, op);
      t.copy_back();
    });
  }

  // allreduce of a sparse COO tensor (SUM), as gloo does it: every rank's indices and values are
  // gathered (allgatherv), and each rank's tensor becomes their coalesced sum. The ranks' tensors must
  // agree in sizes and sparse/dense dimensions; their numbers of entries may differ.
  c10::intrusive_ptr<c10d::Work> sparse_allreduce(const at::Tensor& tensor, const c10d::AllreduceOptions& opts) {
    TORCH_CHECK(tensor.device().is_cpu(), "cohort backend: allreduce of a sparse tensor on ", tensor.device(),
                ": only CPU sparse tensors are supported");
    TORCH_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, "cohort backend: allreduce of a sparse tensor supports ",
                "ReduceOp.SUM only");
    TORCH_CHECK(tensor.dim() <= kSparseMaxDims, "cohort backend: allreduce of a sparse tensor supports up to ",
                kSparseMaxDims, " dimensions, got ", tensor.dim());
    const auto dtype = to_cohort_dtype(tensor, "allreduce (sparse)");
    at::Tensor user = tensor;
    return enqueue(opts.timeout, c10d::OpType::ALLREDUCE, {tensor}, [this, user, dtype] {
      const at::Tensor input = user.coalesce();
      const int64_t sparse_dim = input.sparse_dim();
      const at::Tensor indices = input._indices().t().contiguous();  // [nnz, sparse_dim]
      const at::Tensor values = input._values().contiguous();        // [nnz, dense sizes...]
      const int64_t nnz = input._nnz();
      // Metadata, the same on every rank but the count: nnz, sparse_dim, dim, sizes.
      std::vector<int64_t> meta(3 + kSparseMaxDims, -1), all(meta.size() * size_);
      meta[0] = nnz;
      meta[1] = sparse_dim;
      meta[2] = input.dim();
      for (int64_t d = 0; d < input.dim(); ++d) meta[3 + d] = input.size(d);
      comm_->allgather(meta.data(), all.data(), meta.size(), cohort::DataType::kInt64);
      std::vector<size_t> entries(size_);
      int64_t total = 0;
      for (int r = 0; r < size_; ++r) {
        const int64_t* theirs = &all[r * meta.size()];
        TORCH_CHECK(std::equal(meta.begin() + 1, meta.end(), theirs + 1), "cohort backend: allreduce of a sparse ",
                    "tensor: rank ", r, "'s tensor differs in sizes or sparse dimensions from rank ", rank_, "'s");
        entries[r] = static_cast<size_t>(theirs[0]);
        total += theirs[0];
      }
      int64_t value_row = 1;  // elements of one entry's value (the dense dimensions)
      for (int64_t d = 1; d < values.dim(); ++d) value_row *= values.size(d);
      std::vector<int64_t> value_shape = values.sizes().vec();
      value_shape[0] = total;
      at::Tensor all_indices = at::empty({total, sparse_dim}, indices.options());
      at::Tensor all_values = at::empty(value_shape, values.options());
      std::vector<size_t> index_counts, value_counts;
      for (size_t e : entries) {
        index_counts.push_back(e * static_cast<size_t>(sparse_dim));
        value_counts.push_back(e * static_cast<size_t>(value_row));
      }
      comm_->allgatherv(indices.data_ptr(), nnz * sparse_dim, all_indices.data_ptr(), index_counts,
                        cohort::DataType::kInt64);
      comm_->allgatherv(values.data_ptr(), nnz * value_row, all_values.data_ptr(), value_counts, dtype);
      user.copy_(at::sparse_coo_tensor(all_indices.t(), all_values, input.sizes()).coalesce());
    });
  }
  static constexpr int64_t kSparseMaxDims = 13;

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::ALLREDUCE_COALESCED, Args().list(tensors), Args().list(tensors),
                      allreduce_coalesced(tensors, opts));
    TORCH_CHECK(!tensors.empty(), "cohort backend: allreduce_coalesced needs at least one tensor");
    for (const auto& t : tensors) {
      check_tensor(t, "allreduce_coalesced");
      check_same_type(t, tensors[0], "allreduce_coalesced");
    }
    const auto dtype = to_cohort_dtype(tensors[0], "allreduce_coalesced");
    const auto op = to_cohort_op(opts.reduceOp, dtype, "allreduce_coalesced");
    std::vector<at::Tensor> outputs = tensors;
    return enqueue(opts.timeout, c10d::OpType::ALLREDUCE_COALESCED, tensors, [this, outputs, dtype, op] {
      at::Tensor flat = flatten(outputs);
      if (flat.numel() == 0) return;
      comm_->allreduce(flat.data_ptr(), flat.data_ptr(), flat.numel(), dtype, op);
      unflatten_into(flat, outputs);
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::REDUCE, Args().list(tensors), Args().list(tensors), reduce(tensors, opts));
    check_single(tensors, "reduce");
    check_root(opts.rootRank, "reduce");
    TORCH_CHECK(opts.rootTensor == 0, "cohort backend: reduce: rootTensor must be 0");
    const auto dtype = to_cohort_dtype(tensors[0], "reduce");
    const auto op = to_cohort_op(opts.reduceOp, dtype, "reduce");
    const int root = static_cast<int>(opts.rootRank);
    Staged t(tensors[0]);
    return enqueue(opts.timeout, c10d::OpType::REDUCE, tensors, [this, t, dtype, op, root] {
      if (t.count() == 0) return;
      comm_->reduce(t.data(), t.data(), t.count(), dtype, op, root);
      if (rank_ == root) t.copy_back();
    });
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::REDUCE_SCATTER, Args().list(outputs).lists(inputs), Args().list(outputs),
                      reduce_scatter(outputs, inputs, opts));
    check_single(outputs, "reduce_scatter");
    TORCH_CHECK(inputs.size() == 1, "cohort backend: reduce_scatter takes one input list");
    check_list(inputs[0], outputs[0], "reduce_scatter");
    const auto dtype = to_cohort_dtype(outputs[0], "reduce_scatter");
    const auto op = to_cohort_op(opts.reduceOp, dtype, "reduce_scatter");
    std::vector<at::Tensor> in = inputs[0];
    Staged out(outputs[0]);
    return enqueue(opts.timeout, c10d::OpType::REDUCE_SCATTER, outputs, [this, in, out, dtype, op] {
      at::Tensor send = flatten(in);
      comm_->reduce_scatter(send.data_ptr(), out.data(), out.count(), dtype, op);
      out.copy_back();
    });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::_REDUCE_SCATTER_BASE, Args().one(output).one(input), Args().one(output),
                      _reduce_scatter_base(output, input, opts));
    check_tensor(output, "reduce_scatter_tensor");
    check_tensor(input, "reduce_scatter_tensor");
    check_same_type(output, input, "reduce_scatter_tensor");
    TORCH_CHECK(input.numel() == output.numel() * size_, "cohort backend: reduce_scatter_tensor: ",
                "input must hold world_size (", size_, ") x output's ", output.numel(),
                " elements, got ", input.numel());
    const auto dtype = to_cohort_dtype(output, "reduce_scatter_tensor");
    const auto op = to_cohort_op(opts.reduceOp, dtype, "reduce_scatter_tensor");
    Staged in(input), out(output);
    return enqueue(opts.timeout, c10d::OpType::_REDUCE_SCATTER_BASE, {output}, [this, in, out, dtype, op] {
      comm_->reduce_scatter(in.data(), out.data(), out.count(), dtype, op);
      out.copy_back();
    });
  }

  // ---- data movement ----
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::BROADCAST, Args().list(tensors), Args().list(tensors), broadcast(tensors, opts));
    check_single(tensors, "broadcast");
    check_root(opts.rootRank, "broadcast");
    TORCH_CHECK(opts.rootTensor == 0, "cohort backend: broadcast: rootTensor must be 0");
    const auto dtype = to_cohort_dtype(tensors[0], "broadcast");
    const int root = static_cast<int>(opts.rootRank);
    Staged t(tensors[0]);
    return enqueue(opts.timeout, c10d::OpType::BROADCAST, tensors, [this, t, dtype, root] {
      if (t.count() == 0) return;
      comm_->broadcast(t.data(), t.count(), dtype, root);
      t.copy_back();
    });
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::ALLGATHER, Args().lists(outputs).list(inputs), Args().lists(outputs),
                      allgather(outputs, inputs, opts));
    check_single(inputs, "allgather");
    TORCH_CHECK(outputs.size() == 1, "cohort backend: allgather takes one output list");
    check_list(outputs[0], inputs[0], "allgather");
    const auto dtype = to_cohort_dtype(inputs[0], "allgather");
    Staged in(inputs[0]);
    std::vector<at::Tensor> out = outputs[0];
    return enqueue(opts.timeout, c10d::OpType::ALLGATHER, out, [this, in, out, dtype] {
      at::Tensor recv = at::empty({static_cast<int64_t>(in.count()) * size_}, in.buf.options());
      comm_->allgather(in.data(), recv.data_ptr(), in.count(), dtype);
      unflatten_into(recv, out);
    });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::_ALLGATHER_BASE, Args().one(output).one(input), Args().one(output),
                      _allgather_base(output, input, opts));
    check_tensor(output, "all_gather_into_tensor");
    check_tensor(input, "all_gather_into_tensor");
    check_same_type(output, input, "all_gather_into_tensor");
    TORCH_CHECK(output.numel() == input.numel() * size_,
                "cohort backend: all_gather_into_tensor: output must hold world_size (", size_,
                ") x input's ", input.numel(), " elements, got ", output.numel());
    const auto dtype = to_cohort_dtype(input, "all_gather_into_tensor");
    Staged in(input), out(output);
    return enqueue(opts.timeout, c10d::OpType::_ALLGATHER_BASE, {output}, [this, in, out, dtype] {
      comm_->allgather(in.data(), out.data(), in.count(), dtype);
      out.copy_back();
    });
  }

  // all_gather_coalesced: several tensors at once, of any shapes and dtypes (each rank's list alike).
  // They travel as one allgather of their bytes; output_lists[r][i] receives rank r's inputs[i].
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& output_lists,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::ALLGATHER_COALESCED, Args().lists(output_lists).list(inputs),
                      Args().lists(output_lists), allgather_coalesced(output_lists, inputs, opts));
    TORCH_CHECK(static_cast<int>(output_lists.size()) == size_, "cohort backend: all_gather_coalesced: ",
                "output_tensor_lists must hold world_size (", size_, ") lists, got ", output_lists.size());
    for (const auto& t : inputs) check_tensor(t, "all_gather_coalesced");
    for (size_t r = 0; r < output_lists.size(); ++r) {
      TORCH_CHECK(output_lists[r].size() == inputs.size(), "cohort backend: all_gather_coalesced: output list ", r,
                  " holds ", output_lists[r].size(), " tensors, the input list ", inputs.size());
      for (size_t i = 0; i < inputs.size(); ++i) {
        const at::Tensor& out = output_lists[r][i];
        check_tensor(out, "all_gather_coalesced");
        check_same_type(out, inputs[i], "all_gather_coalesced");
        TORCH_CHECK(out.sizes() == inputs[i].sizes(), "cohort backend: all_gather_coalesced: output ", r, "[", i,
                    "] has shape ", out.sizes(), ", its input ", inputs[i].sizes());
      }
    }
    std::vector<at::Tensor> in = inputs, out;
    for (const auto& list : output_lists) out.insert(out.end(), list.begin(), list.end());
    return enqueue(opts.timeout, c10d::OpType::ALLGATHER_COALESCED, out, [this, in, out] {
      std::vector<at::Tensor> bytes;
      for (const auto& t : in) bytes.push_back(as_bytes(t));
      at::Tensor send = bytes.empty() ? at::empty({0}, at::kByte) : at::cat(bytes);
      const int64_t n = send.numel();
      if (n == 0) return;
      at::Tensor recv = at::empty({n * size_}, at::kByte);
      comm_->allgather(send.data_ptr(), recv.data_ptr(), static_cast<size_t>(n), cohort::DataType::kUInt8);
      int64_t offset = 0;
      for (const auto& t : out) {
        const int64_t len = t.numel() * static_cast<int64_t>(t.element_size());
        as_bytes_view(t, recv.narrow(0, offset, len));
        offset += len;
      }
    });
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::GATHER, Args().lists(outputs).list(inputs), Args().lists(outputs),
                      gather(outputs, inputs, opts));
    check_single(inputs, "gather");
    check_root(opts.rootRank, "gather");
    const int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> out;
    if (rank_ == root) {
      TORCH_CHECK(outputs.size() == 1, "cohort backend: gather: the root takes one output list");
      check_list(outputs[0], inputs[0], "gather");
      out = outputs[0];
    } else {
      TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()),
                  "cohort backend: gather: only the root (rank ", root, ") passes outputs");
    }
    const auto dtype = to_cohort_dtype(inputs[0], "gather");
    Staged in(inputs[0]);
    return enqueue(opts.timeout, c10d::OpType::GATHER, out, [this, in, out, dtype, root] {
      at::Tensor recv;
      if (rank_ == root) {
        recv = at::empty({static_cast<int64_t>(in.count()) * size_}, in.buf.options());
      }
      comm_->gather(in.data(), recv.defined() ? recv.data_ptr() : nullptr, in.count(), dtype,
                    root);
      if (rank_ == root) unflatten_into(recv, out);
    });
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::SCATTER, Args().list(outputs).lists(inputs), Args().list(outputs),
                      scatter(outputs, inputs, opts));
    check_single(outputs, "scatter");
    check_root(opts.rootRank, "scatter");
    const int root = static_cast<int>(opts.rootRank);
    std::vector<at::Tensor> in;
    if (rank_ == root) {
      TORCH_CHECK(inputs.size() == 1, "cohort backend: scatter: the root takes one input list");
      check_list(inputs[0], outputs[0], "scatter");
      in = inputs[0];
    } else {
      TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()),
                  "cohort backend: scatter: only the root (rank ", root, ") passes inputs");
    }
    const auto dtype = to_cohort_dtype(outputs[0], "scatter");
    Staged out(outputs[0]);
    return enqueue(opts.timeout, c10d::OpType::SCATTER, outputs, [this, in, out, dtype, root] {
      at::Tensor send;
      if (rank_ == root) send = flatten(in);
      comm_->scatter(send.defined() ? send.data_ptr() : nullptr, out.data(), out.count(), dtype,
                     root);
      out.copy_back();
    });
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::ALLTOALL_BASE, Args().one(output).one(input), Args().one(output),
                      alltoall_base(output, input, output_splits, input_splits, opts));
    check_tensor(output, "all_to_all_single");
    check_tensor(input, "all_to_all_single");
    check_same_type(output, input, "all_to_all_single");
    const auto dtype = to_cohort_dtype(input, "all_to_all_single");
    Staged in(input), out(output);
    if (output_splits.empty() && input_splits.empty()) {
      TORCH_CHECK(input.numel() == output.numel() && input.numel() % size_ == 0,
                  "cohort backend: all_to_all_single without splits needs input and output of ",
                  "equal size divisible by world_size (", size_, "), got ", input.numel(), " and ",
                  output.numel());
      return enqueue(opts.timeout, c10d::OpType::ALLTOALL_BASE, {output}, [this, in, out, dtype] {
        comm_->alltoall(in.data(), out.data(), in.count() / size_, dtype);
        out.copy_back();
      });
    }
    auto send_counts = split_counts(input, input_splits, "input");
    auto recv_counts = split_counts(output, output_splits, "output");
    return enqueue(opts.timeout, c10d::OpType::ALLTOALL_BASE, {output},
                   [this, in, out, dtype, send_counts, recv_counts] {
                     comm_->alltoallv(in.data(), send_counts, displacements(send_counts),
                                      out.data(), recv_counts, displacements(recv_counts), dtype);
                     out.copy_back();
                   });
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override {
    COHORT_ROUTE_CUDA(c10d::OpType::ALLTOALL, Args().list(outputs).list(inputs), Args().list(outputs),
                      alltoall(outputs, inputs, opts));
    TORCH_CHECK(static_cast<int>(inputs.size()) == size_ &&
                    static_cast<int>(outputs.size()) == size_,
                "cohort backend: all_to_all takes world_size (", size_,
                ") input and output tensors, got ", inputs.size(), " and ", outputs.size());
    std::vector<size_t> send_counts, recv_counts;
    for (int r = 0; r < size_; ++r) {
      check_tensor(inputs[r], "all_to_all");
      check_tensor(outputs[r], "all_to_all");
      check_same_type(inputs[r], inputs[0], "all_to_all");
      check_same_type(outputs[r], inputs[0], "all_to_all");
      send_counts.push_back(inputs[r].numel());
      recv_counts.push_back(outputs[r].numel());
    }
    const auto dtype = to_cohort_dtype(inputs[0], "all_to_all");
    std::vector<at::Tensor> in = inputs, out = outputs;
    return enqueue(opts.timeout, c10d::OpType::ALLTOALL, outputs,
                   [this, in, out, dtype, send_counts, recv_counts] {
                     at::Tensor send = flatten(in);
                     size_t total = 0;
                     for (auto c : recv_counts) total += c;
                     at::Tensor recv = at::empty({static_cast<int64_t>(total)}, send.options());
                     comm_->alltoallv(send.data_ptr(), send_counts, displacements(send_counts),
                                      recv.data_ptr(), recv_counts, displacements(recv_counts),
                                      dtype);
                     unflatten_into(recv, out);
                   });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return enqueue(opts.timeout, c10d::OpType::BARRIER, {}, [this] { comm_->barrier(); });
  }

  // ---- point to point ----
  // Sends and receives are posted to the communicator at once, on the calling thread, in call order
  // (which is what matches the messages of a (peer, tag) stream), and run beside the queued
  // collectives: a rank may post a receive, then a send, and wait for both, as with gloo. A Work's
  // wait() drives its transfer; the worker thread completes the ones nobody waits on.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override {
    COHORT_ROUTE_CUDA(c10d::OpType::SEND, Args().list(tensors), Args(), send(tensors, dst, tag));
    check_single(tensors, "send");
    check_peer(dst, "send");
    const auto dtype = to_cohort_dtype(tensors[0], "send");
    Staged t(tensors[0]);
    return post_p2p(c10d::OpType::SEND, tensors, -1, [&] {
      return comm_->send_async(t.data(), t.count(), dtype, dst, static_cast<uint32_t>(tag));
    }, [t] {});
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override {
    COHORT_ROUTE_CUDA(c10d::OpType::RECV, Args().list(tensors), Args().list(tensors), recv(tensors, src, tag));
    check_single(tensors, "recv");
    check_peer(src, "recv");
    const auto dtype = to_cohort_dtype(tensors[0], "recv");
    Staged t(tensors[0]);
    return post_p2p(c10d::OpType::RECV, tensors, src, [&] {
      return comm_->recv_async(t.data(), t.count(), dtype, src, static_cast<uint32_t>(tag));
    }, [t] { t.copy_back(); });
  }

  // monitored_barrier: rank 0 hears from every rank within `opts.timeout` and names the ones it did
  // not hear from (the first, or all with wait_all_ranks), then releases them; the others tell rank 0
  // they arrived and wait for its release. Blocking, on the calling thread, beside queued collectives
  // (as gloo's), with point-to-point messages under a tag of its own. The messages' wording is gloo's,
  // which torch's own tests and users' scripts match. torch's front end calls this only for gloo: the
  // wrapper installed at import (install_monitored_barrier) lets it reach cohort groups too. A failed
  // barrier leaves the communicator usable; its late messages land in buffers kept for them.
  //
  // Every barrier is one message each way between rank 0 and every other rank, failed or not: the
  // messages match by their order under one tag, so a barrier where rank 0 sent nothing would leave
  // each other rank's posted receive to take the next barrier's release, and every later barrier
  // would wait for a message that never comes. So rank 0 always answers every rank, with its verdict
  // (MonitoredBarrierState): the ranks it failed then fail as well, as with gloo, the late ones as
  // soon as they arrive.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    std::optional<py::gil_scoped_release> no_gil;
    if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
    using Clock = std::chrono::steady_clock;
    const Millis timeout = opts.timeout;
    const auto start = Clock::now();
    const auto deadline = start + timeout;
    auto state = std::make_shared<MonitoredBarrierState>(size_);
    auto elapsed_ms = [&] { return std::chrono::duration_cast<Millis>(Clock::now() - start).count(); };
    try {
      if (rank_ != 0) {
        state->works.push_back(comm_->send_async(&state->tokens[0], 1, cohort::DataType::kInt64, 0, kMonitoredBarrierTag));
        state->works.push_back(comm_->recv_async(&state->tokens[1], 1, cohort::DataType::kInt64, 0, kMonitoredBarrierTag));
        if (!finish_by(state->works, deadline)) {
          keep(state);
          TORCH_CHECK(false, "Rank ", rank_, " successfully reached monitoredBarrier, but received errors while waiting ",
                      "for send/recv from rank 0 within ", timeout.count(), " ms", cause_of(state->works),
                      ". Please check rank 0 logs for faulty rank.");
        }
        if (const int64_t verdict = state->tokens[1]; verdict != kBarrierPassed) {
          TORCH_CHECK(false, "Rank ", rank_, " successfully reached monitoredBarrier, but received errors while waiting ",
                      "for send/recv from rank 0: rank 0 failed this barrier (",
                      verdict > 0 ? "rank " + std::to_string(verdict) + " did not pass it in time"
                                  : std::string("it timed out or met an error"),
                      "). Please check rank 0 logs for faulty rank.");
        }
        return;
      }
      for (int r = 1; r < size_; ++r)
        state->works.push_back(comm_->recv_async(&state->tokens[r], 1, cohort::DataType::kInt64, r, kMonitoredBarrierTag));
      // Sends `verdict` to every other rank (finished with the communicator's later progress where a
      // rank is late or gone) and keeps the barrier's buffers.
      auto answer_all = [&](int64_t verdict) {
        state->verdict = verdict;
        for (int r = 1; r < size_; ++r)
          state->works.push_back(comm_->send_async(&state->verdict, 1, cohort::DataType::kInt64, r, kMonitoredBarrierTag));
        keep(state);
      };
      std::vector<int> failed;
      std::vector<int> processed;
      for (int r = 1; r < size_; ++r) {
        if (Clock::now() >= deadline && !wait_all_ranks) {
          answer_all(r);
          TORCH_CHECK(false, "Rank 0 timed out in monitoredBarrier after ", elapsed_ms(), " ms.",
                      processed.empty() ? "" : " Successfully processed ranks: " + join_ranks(processed));
        }
        std::vector<std::shared_ptr<cohort::Work>> one{state->works[r - 1]};
        if (finish_by(one, deadline)) {
          processed.push_back(r);
          continue;
        }
        if (!wait_all_ranks) {
          answer_all(r);
          TORCH_CHECK(false, "[Rank 0]: Rank ", r, " failed to pass monitoredBarrier in ", timeout.count(), " ms",
                      cause_of(one));
        }
        failed.push_back(r);
      }
      if (!failed.empty()) {
        answer_all(failed.front());
        TORCH_CHECK(false, "[Rank 0]: Ranks ", join_ranks(failed), " failed to pass monitoredBarrier in ", timeout.count(),
                    " ms");
      }
      const size_t first_release = state->works.size();
      answer_all(kBarrierPassed);
      // A released rank that has gone since is its own problem, not this barrier's: the sends are left
      // to finish with the communicator's next progress.
      const std::vector<std::shared_ptr<cohort::Work>> releases(state->works.begin() + long(first_release),
                                                                state->works.end());
      finish_by(releases, Clock::now() + timeout);
    } catch (const cohort::Error& e) {
      keep(state);
      TORCH_CHECK(false, "cohort backend: monitored_barrier on rank ", rank_, ": ", e.what());
    }
  }

  // recv() without src: the next message with `tag` from whichever rank's comes first; the Work's
  // _source_rank() names it (cohort::Communicator::recv_any).
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    COHORT_ROUTE_CUDA(c10d::OpType::RECVANYSOURCE, Args().list(tensors), Args().list(tensors),
                      recvAnysource(tensors, tag));
    check_single(tensors, "recv");
    const auto dtype = to_cohort_dtype(tensors[0], "recv");
    Staged t(tensors[0]);
    return enqueue_run(c10d::kUnsetTimeout, c10d::OpType::RECVANYSOURCE, tensors, [this, t, dtype, tag](CohortWork& work) {
      work.set_source_rank(comm_->recv_any(t.data(), t.count(), dtype, static_cast<uint32_t>(tag)));
      t.copy_back();
    });
  }

 private:
  void check_root(int64_t root, const char* op) const {
    TORCH_CHECK(root >= 0 && root < size_, "cohort backend: ", op, ": root rank ", root,
                " is outside the group of ", size_, " ranks");
  }
  void check_peer(int peer, const char* op) const {
    TORCH_CHECK(peer >= 0 && peer < size_ && peer != rank_, "cohort backend: ", op,
                ": peer rank ", peer, " must be another rank of the group of ", size_);
  }
  // A list of world_size tensors, each with the same dtype and number of elements as `like`.
  void check_list(const std::vector<at::Tensor>& list, const at::Tensor& like,
                  const char* op) const {
    TORCH_CHECK(static_cast<int>(list.size()) == size_, "cohort backend: ", op,
                ": the tensor list must hold world_size (", size_, ") tensors, got ", list.size());
    for (const auto& t : list) {
      check_tensor(t, op);
      check_same_type(t, like, op);
      TORCH_CHECK(t.numel() == like.numel(), "cohort backend: ", op,
                  ": every tensor in the list must have ", like.numel(), " elements, got ",
                  t.numel());
    }
  }
  // Element counts per rank from torch's split sizes along dimension 0 (empty = equal split).
  std::vector<size_t> split_counts(const at::Tensor& t, const std::vector<int64_t>& splits,
                                   const char* which) const {
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const int64_t row_elems = rows == 0 ? 0 : t.numel() / rows;
    std::vector<size_t> counts;
    if (splits.empty()) {
      TORCH_CHECK(rows % size_ == 0, "cohort backend: all_to_all_single: ", which,
                  " dimension 0 (", rows, ") is not divisible by world_size (", size_, ")");
      counts.assign(size_, static_cast<size_t>(rows / size_ * row_elems));
      return counts;
    }
    TORCH_CHECK(static_cast<int>(splits.size()) == size_, "cohort backend: all_to_all_single: ",
                which, "_split_sizes must have world_size (", size_, ") entries, got ",
                splits.size());
    int64_t total = 0;
    for (auto s : splits) {
      TORCH_CHECK(s >= 0, "cohort backend: all_to_all_single: negative split size ", s);
      total += s;
      counts.push_back(static_cast<size_t>(s * row_elems));
    }
    TORCH_CHECK(total == rows, "cohort backend: all_to_all_single: ", which,
                "_split_sizes sum to ", total, " but dimension 0 is ", rows);
    return counts;
  }
  static std::vector<size_t> displacements(const std::vector<size_t>& counts) {
    std::vector<size_t> displs(counts.size(), 0);
    for (size_t i = 1; i < counts.size(); ++i) displs[i] = displs[i - 1] + counts[i - 1];
    return displs;
  }

  // ---- CUDA tensors (torch 2.x; see route_cuda) ----
  // The tensors of one call, by reference: route_cuda may swap them for host copies and back.
  struct Args {
    std::vector<at::Tensor*> tensors;
    Args& one(at::Tensor& t) {
      tensors.push_back(&t);
      return *this;
    }
    Args& list(std::vector<at::Tensor>& l) {
      for (auto& t : l) tensors.push_back(&t);
      return *this;
    }
    Args& lists(std::vector<std::vector<at::Tensor>>& ls) {
      for (auto& l : ls) list(l);
      return *this;
    }
    bool any_cuda() const {
      return std::any_of(tensors.begin(), tensors.end(), [](const at::Tensor* t) { return t->defined() && t->is_cuda(); });
    }
  };

  // CUDA tensors go to torch's NCCL backend when there is one (it orders them on CUDA streams like
  // ProcessGroupNCCL does for any script); otherwise they are staged: copied to the host, run through
  // cohort's collectives, copied back, and the returned Work is already complete. nullopt for a call
  // without CUDA tensors (the CPU path runs). Whether a call was routed is not read from the Work it
  // returns: a backend may hand back no Work for an operation it had nothing to do for, and such a
  // call must not fall through to the CPU path with CUDA tensors.
  template <typename Delegate, typename OnHost>
  std::optional<c10::intrusive_ptr<c10d::Work>> route_cuda(c10d::OpType type, Args all, Args outputs,
                                                           Delegate&& delegate, OnHost&& on_host) {
    if (!all.any_cuda()) return std::nullopt;
    if (cuda_backend_) {
      c10::intrusive_ptr<c10d::Work> work = delegate(*cuda_backend_);
      if (work) return work;
      std::vector<at::Tensor> results;
      for (at::Tensor* out : outputs.tensors) results.push_back(*out);
      auto done = c10::make_intrusive<CohortWork>(rank_, type, std::move(results));
      done->complete(nullptr);
      return done;
    }
    if (!warned_staging_.exchange(true))
      TORCH_WARN("cohort backend: CUDA tensors are copied to host memory for each collective (", cuda_note_,
                 "); pass backend=\"cpu:cohort,cuda:nccl\" where torch has NCCL");
    std::vector<at::Tensor> originals;
    for (at::Tensor* t : all.tensors) {
      originals.push_back(*t);
      if (t->defined() && t->is_cuda()) *t = t->to(at::kCPU).contiguous();
    }
    struct Restore {
      Args& all;
      std::vector<at::Tensor>& originals;
      ~Restore() {
        for (size_t i = 0; i < all.tensors.size(); ++i) *all.tensors[i] = originals[i];
      }
    } restore{all, originals};
    auto work = on_host();
    work->wait();
    std::vector<at::Tensor> results;
    for (at::Tensor* out : outputs.tensors) {
      for (size_t i = 0; i < all.tensors.size(); ++i) {
        if (all.tensors[i] != out) continue;
        if (originals[i].defined() && originals[i].is_cuda()) originals[i].copy_(*out);
        results.push_back(originals[i]);
      }
    }
    auto done = c10::make_intrusive<CohortWork>(rank_, type, std::move(results));
    done->complete(nullptr);
    return done;
  }

  // Posts a send or receive (`post` returns the communicator's Work) and hands out a torch Work that
  // completes with it; `on_success` runs first (a staged receive's copy back; it also keeps the staged
  // tensors alive until the transfer ends).
  template <typename Post>
  c10::intrusive_ptr<c10d::Work> post_p2p(c10d::OpType type, std::vector<at::Tensor> outputs, int source_rank,
                                          Post&& post, std::function<void()> on_success) {
    release_finished();
    auto work = c10::make_intrusive<CohortWork>(rank_, type, std::move(outputs), source_rank);
    std::shared_ptr<cohort::Work> p2p;
    {
      // Posting waits for the drive lock, which a collective running on the worker thread holds: let
      // go of the GIL meanwhile, the worker may need it to complete that collective's Future.
      std::optional<py::gil_scoped_release> no_gil;
      if (Py_IsInitialized() && PyGILState_Check()) no_gil.emplace();
      {
        std::lock_guard<std::mutex> lock(mu_);
        TORCH_CHECK(!stopping_, "cohort backend: the process group is being destroyed");
      }
      try {
        p2p = post();
      } catch (const cohort::Error& e) {
        TORCH_CHECK(false, "cohort backend: ", c10d::opTypeToString(type), ": ", e.what());
      }
    }
    work->set_p2p(std::move(p2p), std::move(on_success));
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.push_back(work);
    }
    cv_.notify_one();
    return work;
  }

  // monitored_barrier's messages: a tag no script is likely to use (torch's tags are ints; this is
  // INT32_MIN + 0x4D42, "MB").
  static constexpr uint32_t kMonitoredBarrierTag = 0x80004D42u;
  // Rank 0's answer to the others: kBarrierPassed, or the barrier failed: the first rank it did not
  // hear from in time (> 0), or -1 where it failed otherwise (an error of the communicator).
  static constexpr int64_t kBarrierPassed = 0;
  struct MonitoredBarrierState {
    explicit MonitoredBarrierState(int size) : tokens(static_cast<size_t>(size), 0) {}
    std::vector<int64_t> tokens;  // what arrives: rank 0 from rank r in tokens[r]; rank r's verdict in tokens[1]
    int64_t verdict = kBarrierPassed;  // rank 0: what it sends every other rank
    std::vector<std::shared_ptr<cohort::Work>> works;
  };
  // Polls `works` (each test() moves the transports along) until all ended or `deadline`. True when all
  // ended without an error.
  static bool finish_by(const std::vector<std::shared_ptr<cohort::Work>>& works,
                        std::chrono::steady_clock::time_point deadline) {
    auto pause = std::chrono::microseconds(20);
    for (;;) {
      bool all = true;
      for (const auto& w : works) all = w->test() && all;
      if (all) {
        for (const auto& w : works)
          if (w->exception()) return false;
        return true;
      }
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
    }
  }
  // Keeps a barrier's buffers for as long as the communicator may still write into them (a late
  // arrival, a send still queued): until this group is destroyed. Finished ones are dropped.
  void keep(std::shared_ptr<MonitoredBarrierState> state) {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(kept_barriers_, [](const auto& b) {
      return std::all_of(b->works.begin(), b->works.end(), [](const auto& w) { return w->test(); });
    });
    kept_barriers_.push_back(std::move(state));
  }
  // ": <what failed>" when one of `works` ended with an error (a lost peer, an aborted communicator),
  // "" when they only did not end in time.
  static std::string cause_of(const std::vector<std::shared_ptr<cohort::Work>>& works) {
    for (const auto& w : works) {
      if (!w->test() || !w->exception()) continue;
      try {
        std::rethrow_exception(w->exception());
      } catch (const std::exception& e) {
        return std::string(" (") + e.what() + ")";
      }
    }
    return "";
  }
  static std::string join_ranks(const std::vector<int>& ranks) {
    std::string out;
    for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  }

  struct Pending {
    c10::intrusive_ptr<CohortWork> work;
    std::function<void(CohortWork&)> run;
    c10d::OpType type = c10d::OpType::UNKNOWN;
    Millis timeout{-1};  // the operation's own timeout (opts.timeout); negative: the group's
  };

  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                         std::function<void()> run, int source_rank = -1) {
    return enqueue(c10d::kUnsetTimeout, type, std::move(outputs), std::move(run), source_rank);
  }
  c10::intrusive_ptr<c10d::Work> enqueue(Millis timeout, c10d::OpType type, std::vector<at::Tensor> outputs,
                                         std::function<void()> run, int source_rank = -1) {
    return enqueue_run(timeout, type, std::move(outputs), [run = std::move(run)](CohortWork&) { run(); }, source_rank);
  }
  // The same, for an operation that fills in its Work as it runs (the sender of a recv from any source).
  c10::intrusive_ptr<c10d::Work> enqueue_run(Millis timeout, c10d::OpType type, std::vector<at::Tensor> outputs,
                                             std::function<void(CohortWork&)> run, int source_rank = -1) {
    release_finished();
    auto work = c10::make_intrusive<CohortWork>(rank_, type, std::move(outputs), source_rank);
    {
      std::lock_guard<std::mutex> lock(mu_);
      TORCH_CHECK(!stopping_, "cohort backend: the process group is being destroyed");
      queue_.push_back(Pending{work, std::move(run), type, timeout});
    }
    if (type != c10d::OpType::RECVANYSOURCE) collectives_issued_.fetch_add(1);
    cv_.notify_one();
    return work;
  }

  // Per-operation timeouts (`opts.timeout`, e.g. dist.barrier(timeout=...) on torch 2.x or
  // monitored_barrier): the communicator's deadline is the group's; a shorter one for a single
  // operation is kept by this watchdog. When it passes, the communicator is aborted, as NCCL's
  // watchdog does: the operation (and every later one) fails with a message naming the operation
  // and the timeout, and the ranks it waited for are named by the peers' own errors.
  void watchdog_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (stopping_ && !busy_) return;
      if (!busy_ || !running_deadline_) {
        cv_watch_.wait(lock);
        continue;
      }
      const uint64_t op = running_seq_;
      const auto deadline = *running_deadline_;
      if (cv_watch_.wait_until(lock, deadline, [&] { return running_seq_ != op || !busy_; })) continue;
      const std::string what = fmt::format(
          "cohort backend: {} (operation #{} of this process group) did not finish within its timeout of {} ms",
          c10d::opTypeToString(running_type_), op, running_timeout_.count());
      running_deadline_.reset();
      lock.unlock();
      comm_->abort(what);
      lock.lock();
    }
  }

  size_t in_flight_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return in_flight_.size();
  }

  // Completes the sends and receives in flight that have ended. Returns whether any remain.
  bool poll_in_flight() {
    std::vector<c10::intrusive_ptr<CohortWork>> flying;
    {
      std::lock_guard<std::mutex> lock(mu_);
      flying.swap(in_flight_);
    }
    std::vector<c10::intrusive_ptr<CohortWork>> left;
    for (auto& w : flying)
      if (!w->poll_p2p()) left.push_back(std::move(w));
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.insert(in_flight_.begin(), left.begin(), left.end());
    // The completed ones: freed by a caller's thread, as the collectives' (release_finished).
    for (auto& w : flying)
      if (w) finished_.push_back(std::move(w));
    return !in_flight_.empty();
  }

  void worker_loop() {
    // While sends or receives are in flight and nothing is queued, the worker looks at them every
    // `look` (from 50 us, doubling to 1 ms while nothing ends), so that one nobody waits on still ends.
    auto look = std::chrono::microseconds(50);
    for (;;) {
      Pending next;
      bool flying = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        flying = !in_flight_.empty();
      }
      if (flying) {
        const size_t before = in_flight_count();
        flying = poll_in_flight();
        look = in_flight_count() < before ? std::chrono::microseconds(50)
                                          : std::min<std::chrono::microseconds>(look * 2, std::chrono::milliseconds(1));
      }
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (flying && queue_.empty() && !stopping_) {
          cv_.wait_for(lock, look);
          continue;
        }
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty() || !in_flight_.empty(); });
        if (queue_.empty() && !in_flight_.empty() && !stopping_) continue;
        if (queue_.empty()) {
          if (in_flight_.empty()) return;  // stopping and drained
          // Stopping with sends or receives in flight: the destructor aborted the communicator, so
          // each ends (failed) at the next look, at the top of the loop.
          cv_.wait_for(lock, look);
          continue;
        }
        next = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
        ++running_seq_;
        running_type_ = next.type;
        running_timeout_ = next.timeout;
        running_deadline_.reset();
        if (next.timeout.count() >= 0) running_deadline_ = std::chrono::steady_clock::now() + next.timeout;
      }
      if (next.timeout.count() >= 0) cv_watch_.notify_all();
      std::exception_ptr error;
      try {
        next.run(*next.work);
      } catch (...) {
        error = std::current_exception();
      }
      next.run = nullptr;  // drop captured tensors before waking waiters
      next.work->complete(error);
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
      if (running_deadline_) cv_watch_.notify_all();
      running_deadline_.reset();
      finished_.push_back(std::move(next.work));  // released by a caller's thread (release_finished)
    }
  }

  // Drops the Works the worker thread completed, on the calling thread (one that issues operations).
  //
  // Why not on the worker: once a Work completes, its waiter may drop its own references (to the
  // Work and to the tensors it holds) before the worker drops its one. The worker's reference is then
  // the last: a tensor whose Python object Python let go of while C++ still held it is kept alive by
  // its TensorImpl, and freeing it takes the GIL. A caller that busy-waits on the next operation with
  // the GIL held (Horovod's `while not hvd.poll(h): pass`) then keeps the worker from starting that
  // operation until Python's switch interval hands the GIL over, on every rank at every such call:
  // across hosts that was a 100x slower operation under load and a stall of many seconds (a lost rank
  // for the launcher) on a quiet machine (issue 48). The worker therefore never frees a Work: the
  // next operation issued (or the group's destruction) does, on a thread that may take the GIL.
  void release_finished() {
    std::vector<c10::intrusive_ptr<CohortWork>> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done.swap(finished_);
    }
  }  // `done` is freed here, outside mu_

  // Declared before comm_ so that it is destroyed after it: the communicator may write into these.
  std::vector<std::shared_ptr<MonitoredBarrierState>> kept_barriers_;
  std::shared_ptr<cohort::Communicator> comm_;
  SharedStorage shared_storage_;  // used by the worker thread only
  c10::intrusive_ptr<BaseGroup> cuda_backend_;  // torch's NCCL backend for CUDA tensors, or null
  std::string cuda_note_;                       // why CUDA tensors are staged (no NCCL backend)
  std::atomic<bool> warned_staging_{false};     // the staging warning is given once per group
  std::atomic<uint64_t> collectives_issued_{0};  // getSequenceNumberForGroup()
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  std::vector<c10::intrusive_ptr<CohortWork>> in_flight_;  // posted sends and receives not yet completed
  std::vector<c10::intrusive_ptr<CohortWork>> finished_;   // completed, not yet freed (release_finished)
  bool busy_ = false;
  bool stopping_ = false;
  std::thread worker_;
  // Watchdog state (under mu_): the running operation and its own deadline, if it has one.
  std::condition_variable cv_watch_;
  uint64_t running_seq_ = 0;
  c10d::OpType running_type_ = c10d::OpType::UNKNOWN;
  Millis running_timeout_{-1};
  std::optional<std::chrono::steady_clock::time_point> running_deadline_;
  std::thread watchdog_;
};

#if TORCH_VERSION_MAJOR >= 2
// For CUDA tensors, torch's own NCCL backend over the same store (keys under "cohort_nccl/"), when
// this torch has CUDA, sees a GPU and was built with NCCL. Building it talks to nobody: NCCL's
// communicator is made at the first CUDA collective, by every rank alike. Otherwise: null, and why.
// NCCL needs a GPU of its own per rank: when this host's ranks outnumber its GPUs (two ranks on a
// one-GPU machine), CUDA tensors are staged instead.
std::pair<c10::intrusive_ptr<BaseGroup>, std::string> make_cuda_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                                        int rank, int size, int local_size,
                                                                        Millis timeout) {
  py::gil_scoped_acquire gil;
  try {
    py::module_ torch_cuda = py::module_::import("torch.cuda");
    py::module_ dist = py::module_::import("torch.distributed");
    if (!torch_cuda.attr("is_available")().cast<bool>()) return {{}, "this torch sees no GPU"};
    if (!dist.attr("is_nccl_available")().cast<bool>()) return {{}, "this torch was built without NCCL"};
    const int gpus = torch_cuda.attr("device_count")().cast<int>();
    if (local_size > gpus)
      return {{}, fmt::format("{} ranks on this host share {} GPU{}; NCCL needs one per rank", local_size, gpus,
                              gpus == 1 ? "" : "s")};
    py::object prefixed = dist.attr("PrefixStore")("cohort_nccl/", py::cast(store));
    py::object nccl_class = dist.attr("ProcessGroupNCCL");
    py::object options = nccl_class.attr("Options")();
    options.attr("_timeout") = timeout;
    py::object backend = nccl_class(prefixed, rank, size, options);
    return {backend.cast<c10::intrusive_ptr<BaseGroup>>(), ""};
  } catch (const std::exception& e) {
    // A broken CUDA set-up must not break CPU training: CUDA tensors are staged, with the reason.
    return {{}, std::string("torch's NCCL backend could not be made: ") + e.what()};
  }
}
#endif

// A timeout as Python prints a datetime.timedelta ("0:00:05", "0:00:00.300000", "1 day, 2:00:00"), so
// that an error quotes it as the user wrote it.
std::string timedelta_text(Millis t) {
  const int64_t ms = t.count();
  const int64_t days = ms / 86400000, h = ms / 3600000 % 24, m = ms / 60000 % 60, s = ms / 1000 % 60, frac = ms % 1000;
  std::string text = fmt::format("{}:{:02}:{:02}", h, m, s);
  if (frac != 0) text += fmt::format(".{:06}", frac * 1000);
  if (days != 0) text = fmt::format("{} day{}, {}", days, days == 1 ? "" : "s", text);
  return text;
}

// The key prefix of a group's communicator, the same on its ranks and new for every group this job
// makes. A communicator's id (in the flight recorder, `cohort trace`, the launcher's diagnosis and the
// wire's tags) is the hash of its prefix; with one prefix for all, every torch group of a process was
// one communicator there, so after a group was destroyed and another made (a second hvd.init(), a
// rebuild after an error) the launcher compared the new group's operation #1 with the old one's and
// reported a "mismatch at operation #1" that never happened. torch gives each group a store of its
// own but no name for it here (the creator receives store, rank, size, timeout): rank 0 draws one.
std::string group_store_prefix(cohort::Store& group_store, int rank) {
  constexpr const char* kKey = "cohort_group_id";
  if (rank == 0) {
    std::random_device random;
    const std::string id = fmt::format("{:08x}{:08x}", random(), random());
    group_store.set(kKey, id);
    return "comm-" + id;
  }
  return "comm-" + group_store.get(kKey);  // waits for rank 0, within the group's timeout
}

// torch calls creator(store, rank, size, timeout) from init_process_group / new_group.
c10::intrusive_ptr<ProcessGroupCohort> create_process_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, Millis timeout) {
  auto adapter = std::make_shared<C10dStoreAdapter>(store);
  adapter->set_timeout(timeout);
  cohort::CommOptions options;
  options.timeout = timeout;
  // The creator cannot tell a timeout the script gave from torch's default (30 minutes): both arrive here.
  options.timeout_source = timeout == std::chrono::minutes(30)
                               ? fmt::format("timeout={} of init_process_group or new_group, torch's default",
                                             timedelta_text(timeout))
                               : fmt::format("timeout={} given to init_process_group or new_group",
                                             timedelta_text(timeout));
  std::shared_ptr<cohort::Communicator> comm;
  try {
    options.store_prefix = group_store_prefix(*adapter, rank);
    comm = cohort::Communicator::create(adapter, rank, size, options);
  } catch (const cohort::Error& e) {
    throw std::runtime_error(fmt::format("cohort backend: building the communicator for rank {} "
                                         "of {} failed: {}",
                                         rank, size, e.what()));
  }
  c10::intrusive_ptr<BaseGroup> cuda_backend;
  std::string cuda_note;
#if TORCH_VERSION_MAJOR >= 2
  std::tie(cuda_backend, cuda_note) = make_cuda_backend(store, rank, size, comm->local_size(), timeout);
#endif
  return c10::make_intrusive<ProcessGroupCohort>(std::move(comm), rank, size, std::move(cuda_backend),
                                                 std::move(cuda_note));
}

}  // namespace cohort_torch

PYBIND11_MODULE(cohort_torch, m) {
  using cohort_torch::BaseGroup;
  using cohort_torch::ProcessGroupCohort;
  m.doc() = "cohort collectives as a torch.distributed backend; importing registers \"cohort\"";

  // torch's pybind classes (Store, ProcessGroup/Backend) must be registered before ours.
  py::module_ dist = py::module_::import("torch.distributed");

  py::class_<ProcessGroupCohort, BaseGroup, c10::intrusive_ptr<ProcessGroupCohort>>(
      m, "ProcessGroupCohort")
      .def(py::init(&cohort_torch::create_process_group), py::arg("store"), py::arg("rank"),
           py::arg("size"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>());

  m.def("create_process_group", &cohort_torch::create_process_group, py::arg("store"),
        py::arg("rank"), py::arg("size"), py::arg("timeout"),
        py::call_guard<py::gil_scoped_release>(),
        "The creator registered with torch.distributed.Backend.register_backend.");
  // Under mpirun or srun --mpi=pmix, which set no MASTER_ADDR: where rank 0 will host torch's store
  // (host, port), agreed through the job's PMIx server as cohort's own store's address is
  // (comm/pmix.h; docs/launcher.md, "Without cohort run"). Rank 0 picks a free port and publishes it;
  // every rank gets it. cohort.horovod.torch calls it from hvd.init() (docs/horovod.md, "Under mpirun").
  m.def(
      "pmix_master_address",
      [](double timeout_s) {
        auto e = cohort::comm::resolve_launch_env([](const std::string& n) { return cohort::env::get_raw(n); });
        if (!e.pmix)
          throw cohort::ConfigError("no PMIx launcher named in the environment (PMIX_NAMESPACE and PMIX_RANK unset, "
                                    "or MASTER_ADDR set)");
        auto pick_port = [] {
          auto fd = cohort::net::listen_tcp("", 0, 1, false);
          return static_cast<uint16_t>(cohort::net::local_address(fd.get()).port());
        };
        cohort::comm::pmix::exchange_store_address(
            e, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)), pick_port);
        return std::make_pair(e.store_host, static_cast<int>(e.store_port));
      },
      py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>());
  m.attr("BACKEND_NAME") = "cohort";
  m.attr("TORCH_VERSION_MAJOR_BUILT") = TORCH_VERSION_MAJOR;

  // Two Python-side fixes of torch's front end for a third-party backend, each for cohort groups only:
  // torch.distributed.monitored_barrier refuses every backend but gloo before it reaches the process
  // group (distributed_c10d.py, torch 1.13 and 2.x), though ProcessGroupCohort implements
  // monitoredBarrier; and DDP's logging data names a torch 2.x custom backend "custom".
  py::exec(R"(
def _install_monitored_barrier():
    import functools
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    original = c10d.monitored_barrier
    if getattr(original, "_cohort_wrapper", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group=c10d.GroupMember.WORLD, timeout=None, wait_all_ranks=False):
        if c10d._rank_not_in_group(group) or c10d.get_backend(group) != "cohort":
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = c10d.default_pg_timeout
        group_to_use = c10d._get_default_group() if group is None else group
        return group_to_use.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._cohort_wrapper = True
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier

_install_monitored_barrier()

# torch 2.x: a process group of a third-party backend is a ProcessGroup whose backend type is CUSTOM,
# whose getBackendName() is "custom"; DDP's logging data (model._get_ddp_logging_data(), which users
# and torch's own suite read) then names the backend "custom". For cohort groups it says "cohort", the
# name dist.get_backend() gives; every other group's data is unchanged.
def _install_ddp_backend_name():
    import functools
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    original = DistributedDataParallel._get_ddp_logging_data
    if getattr(original, "_cohort_wrapper", False):
        return

    @functools.wraps(original)
    def _get_ddp_logging_data(self):
        data = original(self)
        if data.get("backend_name") == "custom" and dist.get_backend(self.process_group) == "cohort":
            data["backend_name"] = "cohort"
        return data

    _get_ddp_logging_data._cohort_wrapper = True
    DistributedDataParallel._get_ddp_logging_data = _get_ddp_logging_data

_install_ddp_backend_name()
)", m.attr("__dict__"));

  py::object backend = dist.attr("Backend");
  // A second import (or a reload) must not register twice: torch asserts on duplicates.
  if (!py::hasattr(backend, "COHORT")) {
#if TORCH_VERSION_MAJOR >= 2
    // CPU and CUDA: CUDA tensors go on to torch's NCCL backend (or are staged), so plain
    // backend="cohort" works for a GPU script; "cpu:cohort,cuda:nccl" gives CUDA to NCCL directly.
    backend.attr("register_backend")("cohort", m.attr("create_process_group"),
                                     py::arg("devices") = std::vector<std::string>{"cpu", "cuda"});
#else
    backend.attr("register_backend")("cohort", m.attr("create_process_group"));
#endif
  }
}

