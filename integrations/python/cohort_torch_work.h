// Work: the handle every operation of the backend returns. Completed by the worker thread (or, for a
// send or receive, by whoever waits on it first); its Future carries the output tensors (what DDP and
// its communication hooks wait on).
#pragma once

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

#include "cohort/communicator.h"
#include "cohort_torch_common.h"

namespace cohort_torch {

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

}  // namespace cohort_torch
