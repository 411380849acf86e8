#pragma once
// Where a training step's time goes, per rank and per phase (zero_grad, forward, backward, the
// optimizer's step): the wall time, the CPU time of the thread that runs the step, the CPU time of the
// whole process (the rest is its other threads: the communicator's progress thread, intra-op
// threads), minor page faults, involuntary context switches and which CPU the step ran on. Issue 51's
// swing: a 2-rank BERT-mini run is either fast or slow, and a slow run's ranks spend more CPU on the
// same steps; this says in which phase, and whether the core itself was slower at the time.
//
// The core is measured with two fixed probes after each step, outside the phases: a multiply-add loop
// that touches no memory (its CPU time moves only with the core's own speed: its clock, or a
// hyperthread sibling on the host that a guest's vCPU shares) and a read of a 16 MiB buffer, four
// times the L2 of this guest's cores (its time moves with the last-level cache and memory, which
// other guests share). A slow run whose probes are slow too is the machine; a slow run whose probes
// are not is the process's own (its memory's placement, its threads, its waits).
//
// Opt-in (`--trace-phases N` of the examples): the probes cost about 2 % of a BERT-mini step.
#include <sched.h>
#include <sys/resource.h>
#include <time.h>

#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace cohort::examples {

class PhaseTimes {
 public:
  // `phases`: the names, in the order a step runs them. `warmup`: steps left out of the summary.
  PhaseTimes(std::vector<std::string> phases, int64_t warmup)
      : names_(std::move(phases)),
        warmup_(warmup),
        sums_(names_.size()),
        this_step_(names_.size()),
        probe_buffer_(kProbeBytes / sizeof(double)) {
    // Written, so that every page is resident before the first probe (a fresh page reads the zero page).
    for (size_t i = 0; i < probe_buffer_.size(); ++i) probe_buffer_[i] = static_cast<double>(i & 1023);
  }

  // At the start of a step, before its first phase.
  void begin_step() {
    mark_ = now();
    for (Sum& p : this_step_) p = Sum{};
  }
  // At the end of phase `i` of the current step. `wait_seconds`: the communication wait the phase
  // contained, as the wrapper counted it (0 where none).
  void end_phase(size_t i, double wait_seconds = 0) {
    const Sample s = now();
    this_step_[i].add(mark_, s, wait_seconds);
    mark_ = s;
  }
  // After the step's last phase: runs the probes (outside the phases) and prints the step's line (its
  // phases' thread CPU in ms, the CPU it ended on, the probes), so that a run that changes pace midway
  // shows where.
  void end_step(int rank) {
    if (counting()) {
      const double fma = probe_core(), read = probe_memory();
      probe_fma_ms_ += fma;
      probe_read_ms_ += read;
      ++counted_;
      std::string line = fmt::format("rank {} phases step {} on cpu {}: thread cpu ms", rank, step_, mark_.cpu);
      for (size_t i = 0; i < names_.size(); ++i) {
        line += fmt::format(" {} {:.1f}", names_[i], this_step_[i].thread_ms);
        sums_[i].merge(this_step_[i]);
      }
      fmt::print("{} | probes fma {:.2f} ms, 16 MiB read {:.2f} ms\n", line, fma, read);
    }
    ++step_;
  }

  // One line per rank: per step of the summary's window, each phase's wall / thread CPU / process
  // CPU in ms, the waits, faults, switches and CPU changes, and the probes.
  std::string summary(int rank) const {
    if (counted_ == 0) return fmt::format("rank {} phases: no step after the first {} (warm-up)", rank, warmup_);
    const double n = static_cast<double>(counted_);
    std::string out = fmt::format("rank {} phases, ms per step over steps {}-{} (wall / thread cpu / process cpu):", rank,
                                  warmup_, warmup_ + counted_ - 1);
    Sum total;
    for (size_t i = 0; i < names_.size(); ++i) {
      const Sum& p = sums_[i];
      out += fmt::format(" {} {:.1f} / {:.1f} / {:.1f}", names_[i], p.wall_ms / n, p.thread_ms / n, p.process_ms / n);
      if (p.wait_ms > 0) out += fmt::format(" (of which waiting for peers {:.1f})", p.wait_ms / n);
      out += ",";
      total.merge(p);
    }
    out += fmt::format(" step {:.1f} / {:.1f} / {:.1f}; per step {:.0f} minor faults, {:.1f} involuntary switches, "
                       "{:.2f} CPU changes; probes fma {:.2f} ms, 16 MiB read {:.2f} ms",
                       total.wall_ms / n, total.thread_ms / n, total.process_ms / n, total.faults / n,
                       total.involuntary / n, total.cpu_changes / n, probe_fma_ms_ / n, probe_read_ms_ / n);
    return out;
  }

 private:
  static constexpr size_t kProbeBytes = size_t{16} << 20;
  struct Sample {
    double wall_ms, thread_ms, process_ms;
    int64_t faults, involuntary;
    int cpu;
  };
  struct Sum {
    double wall_ms = 0, thread_ms = 0, process_ms = 0, wait_ms = 0, faults = 0, involuntary = 0, cpu_changes = 0;
    void add(const Sample& a, const Sample& b, double wait_seconds) {
      wall_ms += b.wall_ms - a.wall_ms;
      thread_ms += b.thread_ms - a.thread_ms;
      process_ms += b.process_ms - a.process_ms;
      wait_ms += wait_seconds * 1e3;
      faults += static_cast<double>(b.faults - a.faults);
      involuntary += static_cast<double>(b.involuntary - a.involuntary);
      cpu_changes += a.cpu != b.cpu ? 1 : 0;
    }
    void merge(const Sum& o) {
      wall_ms += o.wall_ms, thread_ms += o.thread_ms, process_ms += o.process_ms, wait_ms += o.wait_ms;
      faults += o.faults, involuntary += o.involuntary, cpu_changes += o.cpu_changes;
    }
  };

  bool counting() const { return step_ >= warmup_; }

  static double clock_ms(clockid_t id) {
    timespec ts{};
    clock_gettime(id, &ts);
    return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
  }
  static Sample now() {
    rusage u{};
    getrusage(RUSAGE_THREAD, &u);  // this thread's faults and switches: the step's own
    return {clock_ms(CLOCK_MONOTONIC), clock_ms(CLOCK_THREAD_CPUTIME_ID), clock_ms(CLOCK_PROCESS_CPUTIME_ID),
            u.ru_minflt, u.ru_nivcsw, sched_getcpu()};
  }

  // 8 independent multiply-add chains, 2^18 rounds: about 1 ms of arithmetic on one core, no memory.
  static double probe_core() {
    const double t0 = clock_ms(CLOCK_THREAD_CPUTIME_ID);
    double acc[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    for (int i = 0; i < (1 << 18); ++i)
      for (double& a : acc) a = a * 0.999999 + 1e-7;
    volatile double sink = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    (void)sink;
    return clock_ms(CLOCK_THREAD_CPUTIME_ID) - t0;
  }
  // One double of every 64-byte line, in 4 independent sums: the loads, not the adds, set the pace.
  double probe_memory() const {
    const double t0 = clock_ms(CLOCK_THREAD_CPUTIME_ID);
    double sum[4] = {0, 0, 0, 0};
    for (size_t i = 0; i + 32 <= probe_buffer_.size(); i += 32)
      sum[0] += probe_buffer_[i], sum[1] += probe_buffer_[i + 8], sum[2] += probe_buffer_[i + 16],
          sum[3] += probe_buffer_[i + 24];
    volatile double sink = sum[0] + sum[1] + sum[2] + sum[3];
    (void)sink;
    return clock_ms(CLOCK_THREAD_CPUTIME_ID) - t0;
  }

  std::vector<std::string> names_;
  int64_t warmup_;
  std::vector<Sum> sums_;       // over the counted steps
  std::vector<Sum> this_step_;  // the current step's
  std::vector<double> probe_buffer_;
  Sample mark_{};
  int64_t step_ = 0, counted_ = 0;
  double probe_fma_ms_ = 0, probe_read_ms_ = 0;
};

}  // namespace cohort::examples
