// monitored_barrier for the PyTorch backend (ProcessGroupCohort::monitoredBarrier): rank 0 hears
// from every rank and names the ones it did not hear from in time, with gloo's wording.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cohort/error.h"
#include "cohort_torch_group.h"

namespace cohort_torch {
namespace {

// Polls `works` (each test() moves the transports along) until all ended or `deadline`. True when all
// ended without an error.
bool finish_by(const std::vector<std::shared_ptr<cohort::Work>>& works,
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

// ": <what failed>" when one of `works` ended with an error (a lost peer, an aborted communicator),
// "" when they only did not end in time.
std::string cause_of(const std::vector<std::shared_ptr<cohort::Work>>& works) {
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

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

}  // namespace

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
void ProcessGroupCohort::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
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

// Keeps a barrier's buffers for as long as the communicator may still write into them (a late
// arrival, a send still queued): until this group is destroyed. Finished ones are dropped.
void ProcessGroupCohort::keep(std::shared_ptr<MonitoredBarrierState> state) {
  std::lock_guard<std::mutex> lock(mu_);
  std::erase_if(kept_barriers_, [](const auto& b) {
    return std::all_of(b->works.begin(), b->works.end(), [](const auto& w) { return w->test(); });
  });
  kept_barriers_.push_back(std::move(state));
}

}  // namespace cohort_torch
