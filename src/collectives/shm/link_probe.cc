// The link probe: the ranks' CPUs, the cache-line round trip and the copy speeds that choose how the
// slots are written, measured at creation and again when large allreduces run far below their speed.
#include "collectives/shm/group.h"
#include "collectives/shm/group_internal.h"

#include <sched.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cohort/error.h"
#include "collectives/reduce_kernels.h"
#include "common/affinity.h"
#include "common/copy.h"
#include "common/env.h"
#include "common/log.h"

namespace cohort::shm {

std::vector<LinkProbe> Group::probe() {
  std::vector<LinkProbe> all;
  guarded("probe", [&] { all = measure_link(); });
  return all;
}

std::vector<LinkProbe> Group::measure_link() {
  std::vector<LinkProbe> all(static_cast<size_t>(size_));
  LinkProbe mine;
  mine.cpu = sched_getcpu();
  const size_t bytes = std::min<size_t>(options_.slot_bytes, 256 << 10);
  mine.probe_bytes = static_cast<uint32_t>(bytes);
  if (size_ == 1) {
    all[0] = mine;
    std::lock_guard<std::mutex> lock(link_mutex_);
    link_line_ = fmt::format("{}; slots: {}", describe(all), choose_slot_copy(all, options_.slot_copy).why);
    return all;
  }
  using Clock = std::chrono::steady_clock;
  auto gbps = [bytes](Clock::time_point since) {
    return double(bytes) / std::chrono::duration<double>(Clock::now() - since).count() / 1e9;
  };
  std::vector<char> sink(bytes, 1);    // touched, so page faults are not timed
  std::vector<char> source(bytes, 2);  // what a writer copies into its slot, in its cache
  auto round = [&] {
    next_parity();
    sync_.post();
    wait_all("probe");
  };
  round();  // absorbs the ranks' different arrival times
  const auto start = Clock::now();
  // The median round: one descheduled round (another process on this CPU) says nothing of the link.
  constexpr int kRounds = 31;
  std::vector<double> rounds(kRounds);
  for (auto& r : rounds) {
    const auto t = Clock::now();
    round();
    r = std::chrono::duration<double>(Clock::now() - t).count();
  }
  std::nth_element(rounds.begin(), rounds.begin() + kRounds / 2, rounds.end());
  mine.round_ns = static_cast<float>(rounds[kRounds / 2] * 1e9);
  // Each rank in turn writes its slot, one way and then the other; the others copy it out.
  double own = 0, cached_write = 0, cached_read = 0, streaming_write = 0, streaming_read = 0;
  for (int rep = 0; rep < 2; ++rep) {
    for (SlotCopy way : {SlotCopy::kCached, SlotCopy::kStreaming}) {
      for (int w = 0; w < size_; ++w) {
        const unsigned p = next_parity();
        if (rank_ == w) {
          source[0] = static_cast<char>(rep * size_ + w + 1);
          const auto t = Clock::now();
          if (way == SlotCopy::kCached) copy::copy_cached(slot(w, p), source.data(), bytes);
          else copy::copy_streaming(slot(w, p), source.data(), bytes);
          (way == SlotCopy::kCached ? cached_write : streaming_write) =
              std::max(way == SlotCopy::kCached ? cached_write : streaming_write, gbps(t));
          if (way == SlotCopy::kCached) {  // fresh lines in this core's cache: copying them back is the own figure
            const auto t2 = Clock::now();
            std::memcpy(sink.data(), slot(w, p), bytes);
            own = std::max(own, gbps(t2));
          }
        }
        sync_.post();
        wait_all("probe");
        if (rank_ != w) {  // cached: the lines are in rank w's cache; streaming: in memory
          const auto t = Clock::now();
          std::memcpy(sink.data(), slot(w, p), bytes);
          double& best = way == SlotCopy::kCached ? cached_read : streaming_read;
          best = std::max(best, gbps(t));
        }
      }
    }
  }
  mine.peer_copy_gbps = static_cast<float>(cached_read);
  mine.own_copy_gbps = static_cast<float>(own);
  mine.cached_write_gbps = static_cast<float>(cached_write);
  mine.streaming_write_gbps = static_cast<float>(streaming_write);
  mine.streaming_read_gbps = static_cast<float>(streaming_read);
  mine.probe_us = static_cast<float>(std::chrono::duration<double>(Clock::now() - start).count() * 1e6);
  // Every rank's figures to every rank (the slot protocol of any round: write mine, post, wait, read).
  const unsigned p = next_parity();
  std::memcpy(slot(rank_, p), &mine, sizeof mine);
  sync_.post();
  wait_all("probe");
  for (int q = 0; q < size_; ++q) std::memcpy(&all[static_cast<size_t>(q)], slot(q, p), sizeof(LinkProbe));
  // Every rank has the same figures, so every rank makes the same choice.
  const SlotCopyChoice choice = choose_slot_copy(all, options_.slot_copy);
  slot_copy_ = choice.copy;
  std::string line = fmt::format("{}; slots: {}; chunk {} KiB ({})", describe(all), choice.why, chunk_.bytes >> 10,
                                 chunk_.why);
  if (const uint32_t again = reprobes_.load()) line += fmt::format("; probed again {} time(s) after slow allreduces", again);
  std::lock_guard<std::mutex> lock(link_mutex_);
  link_line_ = std::move(line);
  return all;
}

void Group::after_large_allreduce(size_t bytes, std::chrono::steady_clock::duration took) {
  const double rate = double(bytes) / std::max(1e-9, std::chrono::duration<double>(took).count()) / 1e9;
  if (fastest_gbps_ > 0 && rate * options_.slow_factor < fastest_gbps_) slow_seen_ = true;
  fastest_gbps_ = std::max(fastest_gbps_, rate);
  if (recheck_every_ == 0 || ++large_allreduces_ % recheck_every_ != 0) return;
  // Every rank counts the same large allreduces, so all of them are here together: one round in which
  // each says whether it saw a slow one. A descheduled rank alone can be slow, so one mark is enough.
  const unsigned p = next_parity();
  const uint8_t mark = slow_seen_ ? 1 : 0;
  std::memcpy(slot(rank_, p), &mark, 1);
  sync_.post();
  wait_all("allreduce");
  bool any = false;
  for (int q = 0; q < size_; ++q) any = any || *slot(q, p) != 0;
  slow_seen_ = false;
  if (!any) return;
  const SlotCopy before = slot_copy();
  reprobes_.fetch_add(1);
  measure_link();
  fastest_gbps_ = 0;  // the link may have changed for good: measure what is fast from now on
  // A probe that changed nothing was a false alarm (a loaded host makes ops slow without the link
  // changing): check half as often next time, so that the probes stay a small part of the time.
  if (slot_copy() == before) recheck_every_ = std::min<uint64_t>(recheck_every_ * 2, 1024);
  log::info("shm group: an allreduce ran under 1/{} of the fastest one seen; probed the link again: slots {} -> {} ({})",
            options_.slow_factor, slot_copy_name(before), slot_copy_name(slot_copy()), link_line());
}

std::string Group::describe(const std::vector<LinkProbe>& probes) {
  if (probes.empty()) return "no link probe";
  std::vector<std::string> cpus;
  double round_ns = 0, peer = 0, own = 0, took_us = 0;
  for (const auto& p : probes) {
    cpus.push_back(p.cpu < 0 ? std::string("?") : std::to_string(p.cpu));
    round_ns = std::max<double>(round_ns, p.round_ns);
    took_us = std::max<double>(took_us, p.probe_us);
    peer += p.peer_copy_gbps;
    own += p.own_copy_gbps;
  }
  const double n = double(probes.size());
  if (probes.size() == 1) return fmt::format("one local rank (CPU {}): no link", cpus[0]);
  return fmt::format(
      "local ranks on CPUs {}; round trip {:.2f} us; copying {} KiB another rank just wrote: {:.1f} GB/s, "
      "its own: {:.1f} GB/s (ratio {:.2f}; means over ranks); probe {:.2f} ms",
      fmt::join(cpus, ","), round_ns / 1e3, probes.front().probe_bytes >> 10, peer / n, own / n,
      own > 0 ? peer / own : 0.0, took_us / 1e3);
}

}  // namespace cohort::shm
