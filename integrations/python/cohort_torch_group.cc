// ProcessGroupCohort's life and engine: construction and the bounded destructor, the queue every
// operation goes through, the worker thread that runs it, the watchdog that keeps an operation's own
// timeout; and create_process_group, the creator torch calls, which builds the communicator over
// torch's store.

#include "cohort_torch_group.h"

#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "cohort_torch_cuda.h"
#include "cohort_torch_store.h"

namespace cohort_torch {

// `cuda_backend`: torch's own NCCL backend over the same store, for CUDA tensors (torch 2.x with
// CUDA and NCCL; null otherwise, and CUDA tensors are staged through host memory).
ProcessGroupCohort::ProcessGroupCohort(std::shared_ptr<cohort::Communicator> comm, int rank, int size,
                                       c10::intrusive_ptr<BaseGroup> cuda_backend, std::string cuda_note)
    : BaseGroup(rank, size),
      comm_(std::move(comm)),
      shared_storage_(*comm_),
      cuda_backend_(std::move(cuda_backend)),
      cuda_note_(std::move(cuda_note)) {
  worker_ = std::thread([this] { worker_loop(); });
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

ProcessGroupCohort::~ProcessGroupCohort() {
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

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                           std::function<void()> run, int source_rank) {
  return enqueue(c10d::kUnsetTimeout, type, std::move(outputs), std::move(run), source_rank);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::enqueue(Millis timeout, c10d::OpType type,
                                                           std::vector<at::Tensor> outputs, std::function<void()> run,
                                                           int source_rank) {
  return enqueue_run(timeout, type, std::move(outputs), [run = std::move(run)](CohortWork&) { run(); }, source_rank);
}

// The same, for an operation that fills in its Work as it runs (the sender of a recv from any source).
c10::intrusive_ptr<c10d::Work> ProcessGroupCohort::enqueue_run(Millis timeout, c10d::OpType type,
                                                               std::vector<at::Tensor> outputs,
                                                               std::function<void(CohortWork&)> run, int source_rank) {
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
void ProcessGroupCohort::watchdog_loop() {
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

size_t ProcessGroupCohort::in_flight_count() {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_.size();
}

// Completes the sends and receives in flight that have ended. Returns whether any remain.
bool ProcessGroupCohort::poll_in_flight() {
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
void ProcessGroupCohort::release_finished() {
  std::vector<c10::intrusive_ptr<CohortWork>> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    done.swap(finished_);
  }
}  // `done` is freed here, outside mu_

void ProcessGroupCohort::worker_loop() {
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
  auto adapter = make_store_adapter(store);
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
