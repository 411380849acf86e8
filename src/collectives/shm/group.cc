// shm::Group itself: the options and their environment settings, creation over a memfd segment, the
// choices made once at creation (wait policy, chunk, slot copy), the slots, the per-call signature
// check, and the barrier. The collectives live in the files beside it, one idea each.
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
namespace {

static const env::BytesSetting kSlotBytes("COHORT_SHM_SLOT_BYTES", 1 << 20,
                                          "shared-memory staging slot per local rank (two each); pipeline chunk");
static const env::BytesSetting kSmallBytes("COHORT_SHM_SMALL_BYTES", 16 << 10,
                                           "intra-host allreduce up to this size reduces everything on every rank");
static const env::SecondsSetting kSpin("COHORT_SHM_SPIN", 0.002,
                                       "how long an intra-host wait polls (pure spin for 1 us, then spin with "
                                       "sched_yield) before sleeping on a futex");
static const env::BytesSetting kChunkBytes("COHORT_SHM_CHUNK_BYTES", 0,
                                           "intra-host pipeline chunk (at most the slot); 0: an eighth of the CPUs' L2 "
                                           "cache, at least 64 KiB");
static const env::StringSetting kCopy("COHORT_SHM_COPY", "auto",
                                      "how intra-host collectives write their staging slots: auto (the link probe "
                                      "measures both and picks), cached (memcpy) or streaming (non-temporal stores)");

static const env::BoolSetting kSingleCopy("COHORT_SHM_SINGLE_COPY", true,
                                          "intra-host collectives that move data (and reduce_scatter) copy once, "
                                          "straight between the ranks' buffers (process_vm_readv), where the kernel "
                                          "allows it");
static const env::BytesSetting kSingleCopyBytes("COHORT_SHM_SINGLE_COPY_BYTES", 1 << 20,
                                                "single copy from this many bytes per call (a rank's whole result)");
static const env::BytesSetting kStreamingBytes("COHORT_SHM_STREAMING_BYTES", 4 << 20,
                                               "single-copy collectives copy this many bytes or more with "
                                               "non-temporal stores (0: never)");

}  // namespace
GroupOptions GroupOptions::from_env(int local_size) {
  GroupOptions o;
  o.slot_bytes = std::max<size_t>(round_up(kSlotBytes.get(), kPage), kPage);
  o.small_bytes = std::min<size_t>(kSmallBytes.get(), o.slot_bytes);
  o.spin = std::chrono::nanoseconds(static_cast<int64_t>(kSpin.get() * 1e9));
  o.chunk_bytes = kChunkBytes.get();
  o.slot_copy = kCopy.get();
  o.single_copy = kSingleCopy.get();
  o.inline_small = inline_small_from_env();
  o.early_root = early_root_from_env();
  o.claim_lines = claim_lines_from_env();
  o.single_copy_bytes = kSingleCopyBytes.get();
  o.streaming_bytes = kStreamingBytes.get();
  if (o.slot_copy != "auto" && o.slot_copy != "cached" && o.slot_copy != "streaming")
    throw ConfigError(fmt::format("COHORT_SHM_COPY={}: expected auto, cached or streaming", o.slot_copy));
  return o;
}

size_t l2_cache_bytes() {
  const int cpu = sched_getcpu();
  if (cpu >= 0) {
    // index2 is the unified L2 on x86 and arm64 alike; "2048K".
    if (FILE* f = std::fopen(fmt::format("/sys/devices/system/cpu/cpu{}/cache/index2/size", cpu).c_str(), "r")) {
      unsigned long kib = 0;
      char unit = 0;
      const int got = std::fscanf(f, "%lu%c", &kib, &unit);
      std::fclose(f);
      if (got >= 1 && kib > 0) return unit == 'M' ? kib << 20 : kib << 10;
    }
  }
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return l2 > 0 ? static_cast<size_t>(l2) : 0;
}

ChunkChoice choose_chunk(size_t smallest_l2, size_t setting, size_t slot_bytes) {
  if (setting > 0) {
    const size_t bytes = std::clamp<size_t>(round_up(setting, kLine), kLine, slot_bytes);
    return {bytes, fmt::format("COHORT_SHM_CHUNK_BYTES={}", setting)};
  }
  if (smallest_l2 == 0) return {slot_bytes, "the slot (L2 size unknown)"};
  // A round touches, per rank, the chunk of its input, its own slot and the peers' slices: at an eighth
  // of the L2 that stays in it with room to spare. On this guest's 2 MiB L2 (2026-11-25, docs/perf-shm.md)
  // 256-512 KiB chunks ran fastest, 1 MiB 8 % slower at 1 GiB and 2-4 MiB 20 % slower at every size.
  size_t bytes = size_t{64} << 10;
  while (bytes * 2 <= smallest_l2 / 8) bytes *= 2;
  bytes = std::min(bytes, slot_bytes);
  return {bytes, fmt::format("an eighth of the smallest L2 of the ranks' CPUs, {} KiB", smallest_l2 >> 10)};
}

const char* slot_copy_name(SlotCopy copy) { return copy == SlotCopy::kStreaming ? "streaming" : "cached"; }

SlotCopyChoice choose_slot_copy(const std::vector<LinkProbe>& probes, const std::string& setting) {
  if (setting == "cached") return {SlotCopy::kCached, "cached (COHORT_SHM_COPY=cached)"};
  if (setting == "streaming") return {SlotCopy::kStreaming, "streaming (COHORT_SHM_COPY=streaming)"};
  double cw = 0, cr = 0, sw = 0, sr = 0;
  size_t n = 0;
  for (const auto& p : probes) {
    if (p.cached_write_gbps <= 0 || p.peer_copy_gbps <= 0 || p.streaming_write_gbps <= 0 ||
        p.streaming_read_gbps <= 0)
      continue;  // a rank with no figures (alone, or an older peer): not counted
    cw += p.cached_write_gbps, cr += p.peer_copy_gbps, sw += p.streaming_write_gbps, sr += p.streaming_read_gbps;
    ++n;
  }
  if (n == 0) return {SlotCopy::kCached, "cached (no probe figures)"};
  cw /= double(n), cr /= double(n), sw /= double(n), sr /= double(n);
  // Nanoseconds per KiB through a slot: written once by its owner, read by a peer.
  const double cached = 1024 / cw + 1024 / cr, streaming = 1024 / sw + 1024 / sr;
  const bool stream = streaming < 0.8 * cached;
  return {stream ? SlotCopy::kStreaming : SlotCopy::kCached,
          fmt::format("{} (per KiB through a slot: cached {:.0f} ns = write {:.1f} + read {:.1f} GB/s, streaming {:.0f} "
                      "ns = write {:.1f} + read {:.1f} GB/s)",
                      stream ? "streaming" : "cached", cached, cw, cr, streaming, sw, sr)};
}

std::unique_ptr<Group> Group::create(Store& store, int local_rank, int local_size, const std::string& key_prefix,
                                     std::chrono::milliseconds timeout, std::vector<int> pids) {
  if (local_size < 1 || local_rank < 0 || local_rank >= local_size)
    throw InvalidArgument(fmt::format("shm::Group: local rank {} is not in [0, {})", local_rank, local_size));
  std::string address = local_size == 1 ? std::string("unused") : rendezvous_address(store, key_prefix, local_rank);
  return create_at(address, local_rank, local_size, timeout, GroupOptions::from_env(local_size), std::move(pids));
}

size_t Group::segment_bytes(int local_size, const GroupOptions& options) {
  return controls_bytes(local_size) + static_cast<size_t>(local_size) * 2 * options.slot_bytes +
         InlineLines::area_bytes(local_size);
}

std::unique_ptr<Group> Group::create_at(const std::string& address, int local_rank, int local_size,
                                        std::chrono::milliseconds timeout, const GroupOptions& options,
                                        std::vector<int> pids) {
  if (local_size < 1 || local_rank < 0 || local_rank >= local_size)
    throw InvalidArgument(fmt::format("shm::Group: local rank {} is not in [0, {})", local_rank, local_size));
  if (pids.empty()) pids.assign(static_cast<size_t>(local_size), 0);
  Segment segment = Segment::establish(address, local_rank, local_size, segment_bytes(local_size, options),
                                       Deadline::after(timeout), SegmentRange{}, &pids);
  auto group = std::make_unique<Group>(std::move(segment), local_rank, local_size, timeout, options);
  group->address_ = address;
  group->pids_ = std::move(pids);
  group->sync_.start();
  group->choose_wait_policy();
  group->choose_chunk_size();
  group->choose_single_copy();
  return group;
}

void Group::choose_wait_policy() {
  std::vector<std::vector<int>> sets(static_cast<size_t>(size_));
  sets[static_cast<size_t>(rank_)] = affinity::allowed_cpus();
  if (size_ > 1) {
    // One round: every rank's CPU list ([count][cpus...], int32) through its slot.
    const size_t most = options_.slot_bytes / sizeof(int32_t) - 1;
    std::vector<int32_t> mine;
    for (int c : sets[static_cast<size_t>(rank_)])
      if (mine.size() < most) mine.push_back(c);
    const unsigned p = next_parity();
    const int32_t n = static_cast<int32_t>(mine.size());
    std::memcpy(slot(rank_, p), &n, sizeof n);
    if (n) std::memcpy(slot(rank_, p) + sizeof n, mine.data(), mine.size() * sizeof(int32_t));
    sync_.post();
    sync_.wait_all("the group's start");
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      int32_t k = 0;
      std::memcpy(&k, slot(q, p), sizeof k);
      auto& set = sets[static_cast<size_t>(q)];
      set.resize(static_cast<size_t>(std::clamp<int32_t>(k, 0, static_cast<int32_t>(most))));
      if (!set.empty()) std::memcpy(set.data(), slot(q, p) + sizeof k, set.size() * sizeof(int32_t));
    }
  }
  const affinity::YieldChoice choice = affinity::choose_yield(sets);
  sync_.set_yield(choice.yield);
  wait_policy_ = choice.why;
  // Every rank computes this from the same lists, so all agree (the broadcast's split relies on it).
  std::vector<int> all;
  for (const auto& set : sets) all.insert(all.end(), set.begin(), set.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  cpus_for_every_rank_ = all.size() >= static_cast<size_t>(size_);
}

void Group::choose_chunk_size() {
  uint64_t smallest = l2_cache_bytes();
  if (size_ > 1) {
    const unsigned p = next_parity();
    std::memcpy(slot(rank_, p), &smallest, sizeof smallest);
    sync_.post();
    sync_.wait_all("the group's start");
    for (int q = 0; q < size_; ++q) {
      uint64_t theirs = 0;
      std::memcpy(&theirs, slot(q, p), sizeof theirs);
      if (theirs == 0 || smallest == 0) smallest = 0;  // one unknown: no rule for all
      else smallest = std::min(smallest, theirs);
    }
  }
  chunk_ = choose_chunk(static_cast<size_t>(smallest), options_.chunk_bytes, options_.slot_bytes);
}

Group::Group(Segment segment, int local_rank, int local_size, std::chrono::milliseconds timeout,
             const GroupOptions& options)
    : segment_(std::move(segment)),
      rank_(local_rank),
      size_(local_size),
      options_(options),
      sync_(static_cast<RankControl*>(segment_.data()), local_rank, local_size, timeout, options.spin),
      timeout_(timeout) {
  inline_ = InlineLines(static_cast<char*>(segment_.data()) + segment_bytes(local_size, options) -
                            InlineLines::area_bytes(local_size),
                        local_rank);
  // Until a probe has measured the link, "auto" means cached: right wherever cores share a cache.
  slot_copy_ = options.slot_copy == "streaming" ? SlotCopy::kStreaming : SlotCopy::kCached;
  recheck_every_ = options.recheck_every;
}

void Group::write_slot(char* dst, const void* src, size_t bytes) const {
  if (slot_copy() == SlotCopy::kStreaming) copy::copy_streaming(dst, src, bytes);
  else copy::copy_cached(dst, src, bytes);
}

std::string Group::link_line() const {
  std::lock_guard<std::mutex> lock(link_mutex_);
  return link_line_;
}

uint32_t Group::shared_tag(uint32_t allocation, size_t offset) {
  uint64_t x = (uint64_t{allocation} << 40) ^ static_cast<uint64_t>(offset);
  x *= 0x9E3779B97F4A7C15ull;  // spreads both into the high half
  return static_cast<uint32_t>(x >> 32) | 1u;
}

std::shared_ptr<void> Group::allocate_shared(size_t bytes) {
  const size_t per_rank = round_up(std::max<size_t>(bytes, 1), kPage);
  const uint32_t id = shared_allocations_++;
  // Its own segment, at a name every local rank derives from the group's (no store round trip).
  // Each rank faults in only its own part: the others' pages it maps as a collective first reads them
  // (some never: a reduce-scatter reads only its shard of each). Populated whole by every rank, each
  // rank's RSS showed all N parts (ZeRO stage 1 on BERT-base: 870 MB of the peer's buckets per rank);
  // and each part's pages are now first touched, so placed, by the rank that uses them most.
  std::vector<int> pids = pids_;  // a copy: allocations may run on several threads
  Segment segment = Segment::establish(fmt::format("{}/shared-{}", address_, id), rank_, size_,
                                       per_rank * static_cast<size_t>(size_), Deadline::after(timeout_),
                                       SegmentRange{per_rank * static_cast<size_t>(rank_), per_rank}, &pids);
  auto region = std::make_shared<SharedRegion>(SharedRegion{std::move(segment), per_rank, id});
  {
    std::lock_guard<std::mutex> lock(shared_mutex_);
    std::erase_if(shared_, [](const std::weak_ptr<SharedRegion>& w) { return w.expired(); });
    shared_.push_back(region);
  }
  return std::shared_ptr<void>(region, region->part(rank_));  // aliasing: the caller's handle owns the segment
}

std::shared_ptr<Group::SharedRegion> Group::find_shared(const void* data, size_t bytes, size_t* offset) {
  std::lock_guard<std::mutex> lock(shared_mutex_);
  for (const auto& w : shared_) {
    auto region = w.lock();
    if (!region) continue;
    const char* mine = region->part(rank_);
    const char* p = static_cast<const char*>(data);
    if (p >= mine && p + bytes <= mine + region->per_rank) {
      *offset = static_cast<size_t>(p - mine);
      return region;
    }
  }
  return nullptr;
}

char* Group::slot(int rank, unsigned parity) const {
  return static_cast<char*>(segment_.data()) + controls_bytes(size_) +
         (static_cast<size_t>(rank) * 2 + parity) * options_.slot_bytes;
}

CallSignature Group::last_call_of(int q) const {
  const RankControl& c = sync_.control(q);
  // The entry of the peer's latest call: its calls alternate entries, and the latest has the higher seq
  // (equal seqs: both entries belong to one communicator operation, either is right).
  const CallSignature& a = c.call[0];
  const CallSignature& b = c.call[1];
  return static_cast<int32_t>(a.seq - b.seq) >= 0 ? a : b;
}

void Group::wait_all(const char* what) {
  sync_.wait_all(what);
  if (compare_pending_) check_calls();
}

void Group::check_calls() {
  compare_pending_ = false;
  compare_calls(static_cast<unsigned>((calls_ - 1) & 1u), active_);
}

void Group::leave_unconfirmed() {
  unconfirmed_[(unconfirmed_first_ + unconfirmed_count_) % InlineLines::kDepth] = Unconfirmed{round_, active_};
  ++unconfirmed_count_;
  compare_pending_ = false;  // compared in confirm_arrivals
  ++early_roots_;
}

void Group::compare_calls(unsigned entry, const CallSignature& active) {
  // A shareable call's ranks may pass different memory and ask differently: its tag and request bit
  // are tallied, and the rest of the signature is compared.
  auto compared = [this](CallSignature c) {
    if (tally_.enabled) {
      c.reserved = 0;
      c.flags = static_cast<uint8_t>(c.flags & ~kCallWantsShared);
    }
    return c;
  };
  const CallSignature ours = compared(active);
  tally_.same_shared_range = active.reserved != 0;
  tally_.all_want_shared = (active.flags & kCallWantsShared) != 0;
  // Every peer has posted at least the step after which it published this entry, and cannot publish
  // into it again before this rank posts once more (it would need this rank's next post first).
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    const CallSignature published = sync_.control(q).call[entry];
    tally_.same_shared_range = tally_.same_shared_range && published.reserved == active.reserved;
    tally_.all_want_shared = tally_.all_want_shared && (published.flags & kCallWantsShared) != 0;
    const CallSignature theirs = compared(published);
    if (!(theirs == ours)) {
      std::string text = mismatch_formatter_
                             ? mismatch_formatter_(q, theirs, ours)
                             : fmt::format("mismatched calls: local rank {} called op {} (count {}, seq {}) but local "
                                           "rank {} called op {} (count {}, seq {})",
                                           q, theirs.kind, theirs.count, theirs.seq, rank_, ours.kind,
                                           ours.count, ours.seq);
      if (theirs.reserved != ours.reserved)
        text += " (the ranks did not pass the same range of one allocate_shared buffer)";
      throw MismatchError(text);
    }
  }
}

void Group::barrier() {
  guarded("barrier", [&] {
    next_parity();
    sync_.post();
    wait_all("barrier");
  });
}

}  // namespace cohort::shm
