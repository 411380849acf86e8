#include "collectives/shm/group.h"

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

constexpr size_t kPage = 4096;
constexpr size_t kLine = 64;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

size_t controls_bytes(int local_size) { return round_up(static_cast<size_t>(local_size) * sizeof(RankControl), kPage); }

// Slice q of a chunk of `count` elements split among `parts` ranks, on cache-line boundaries.
struct Slices {
  size_t per;  // elements per slice (the last one may be shorter or empty)
  size_t count;
  Slices(size_t count_, int parts, size_t elem) : count(count_) {
    size_t align = std::max<size_t>(1, kLine / elem);
    per = round_up((count + static_cast<size_t>(parts) - 1) / static_cast<size_t>(parts), align);
  }
  size_t begin(int q) const { return std::min(count, per * static_cast<size_t>(q)); }
  size_t length(int q) const { return std::min(count, per * static_cast<size_t>(q + 1)) - begin(q); }
};

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + bn && y < x + an;
}

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
  o.single_copy_bytes = kSingleCopyBytes.get();
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
  const unsigned entry = static_cast<unsigned>((calls_ - 1) & 1u);
  // A shareable call's ranks may pass different memory and ask differently: its tag and request bit
  // are tallied, and the rest of the signature is compared.
  auto compared = [this](CallSignature c) {
    if (tally_.enabled) {
      c.reserved = 0;
      c.flags = static_cast<uint8_t>(c.flags & ~kCallWantsShared);
    }
    return c;
  };
  const CallSignature ours = compared(active_);
  tally_.same_shared_range = active_.reserved != 0;
  tally_.all_want_shared = (active_.flags & kCallWantsShared) != 0;
  // Every peer has posted at least the step after which it published this entry, and cannot publish
  // into it again before this rank posts once more (it would need this rank's next post first).
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    const CallSignature published = sync_.control(q).call[entry];
    tally_.same_shared_range = tally_.same_shared_range && published.reserved == active_.reserved;
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

template <typename Body>
void Group::guarded(const char* what, Body&& body, uint32_t shared_tag, bool tally, uint8_t group_flags) {
  if (!failure_.empty()) throw AbortedError("shm group failed earlier: " + failure_);
  try {
    // Publish this call's signature before its first post (the peers read it after seeing that post).
    active_ = call_;
    active_.reserved = shared_tag;
    active_.flags = static_cast<uint8_t>(active_.flags | group_flags);
    tally_ = Tally{tally, false, false};
    sync_.control(rank_).call[calls_ & 1u] = active_;
    ++calls_;
    compare_pending_ = size_ > 1;
    body();
    if (compare_pending_) {
      // The call moved no data (zero bytes) and so had no round: run one anyway, so that its signature
      // is compared and no peer runs more than one call ahead (the two signature entries rely on it).
      next_parity();
      sync_.post();
      wait_all(what);
    }
  } catch (const InvalidArgument&) {
    throw;
  } catch (const std::exception& e) {
    failure_ = e.what();
    sync_.mark_failed();
    throw;
  }
}

void Group::barrier() {
  guarded("barrier", [&] {
    next_parity();
    sync_.post();
    wait_all("barrier");
  });
}

void Group::allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op) {
  if (!op_supported(dtype, op))
    throw InvalidArgument(fmt::format("allreduce: op {} is not defined for dtype {}", reduce_op_name(op),
                                      dtype_name(dtype)));
  const size_t bytes = count * dtype_size(dtype);
  std::shared_ptr<SharedRegion> shared;
  size_t offset = 0;
  if (size_ > 1 && in == out && bytes > options_.small_bytes) shared = find_shared(out, bytes, &offset);
  guarded(
      "allreduce",
      [&] {
        if (size_ == 1) {
          if (in != out && bytes) std::memmove(out, in, bytes);  // 0 bytes may come with null pointers
          return;
        }
        if (shared) {
          allreduce_shared(*shared, offset, count, dtype, op);
        } else if (bytes <= options_.small_bytes && inline_for(bytes)) {
          allreduce_inline(in, out, count, dtype, op);
        } else if (bytes <= options_.small_bytes) {
          allreduce_small(in, out, count, dtype, op);
        } else {
          const auto start = std::chrono::steady_clock::now();
          allreduce_large(in, out, count, dtype, op);
          if (bytes >= chunk_.bytes) after_large_allreduce(bytes, std::chrono::steady_clock::now() - start);
        }
      },
      shared ? shared_tag(shared->id, offset) : 0);
}

void Group::allreduce_small(const void* in, void* out, size_t count, DataType dtype, ReduceOp op) {
  const size_t bytes = count * dtype_size(dtype);
  const unsigned p = next_parity();
  if (bytes) std::memcpy(slot(rank_, p), in, bytes);  // a 0-element call may pass null (found by UBSan)
  sync_.post();
  wait_all("allreduce");
  kernels::reduce_to(out, slot(0, p), slot(1, p), count, dtype, op);
  for (int q = 2; q < size_; ++q) kernels::reduce_into(out, slot(q, p), count, dtype, op);
  if (op == ReduceOp::kAvg) kernels::finish_average(out, count, dtype, size_);
}

void Group::allreduce_large(const void* in_v, void* out_v, size_t count, DataType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const char* in = static_cast<const char*>(in_v);
  char* out = static_cast<char*>(out_v);
  const size_t chunk_elems = chunk_.bytes / es;
  for (size_t off = 0; off < count; off += chunk_elems) {
    const size_t c = std::min(chunk_elems, count - off);
    const Slices sl(c, size_, es);
    const unsigned p = next_parity();
    char* mine = slot(rank_, p);
    // Phase 1: stage the slices the peers own.
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && sl.length(q) > 0)
        write_slot(mine + sl.begin(q) * es, in + (off + sl.begin(q)) * es, sl.length(q) * es);
    sync_.post();
    wait_all("allreduce");
    // Phase 2: reduce my slice into my slot (rank order), reading my input and the peers' slots.
    const size_t b = sl.begin(rank_), n = sl.length(rank_);
    if (n > 0) {
      auto source = [&](int q) -> const char* {
        return q == rank_ ? in + (off + b) * es : slot(q, p) + b * es;
      };
      // Cached: reduce in the slot, where the peers read it from this cache, then copy to the output.
      // Streaming: reduce in the output and stream the result to the slot. In place, the output is my
      // input: ranks 0 and 1 may overwrite it (reduce_to reads both inputs first), a higher rank's
      // input is read after the first step, so it accumulates aside.
      const bool streaming = slot_copy() == SlotCopy::kStreaming;
      char* acc = mine + b * es;
      if (streaming) {
        acc = out + (off + b) * es;
        if (rank_ >= 2 && in == out) {
          if (aside_.size() < n * es) aside_.resize(n * es);
          acc = aside_.data();
        }
      }
      kernels::reduce_to(acc, source(0), source(1), n, dtype, op);
      for (int q = 2; q < size_; ++q) kernels::reduce_into(acc, source(q), n, dtype, op);
      if (op == ReduceOp::kAvg) kernels::finish_average(acc, n, dtype, size_);
      if (streaming) copy::copy_streaming(mine + b * es, acc, n * es);
      if (acc != out + (off + b) * es) std::memcpy(out + (off + b) * es, acc, n * es);
    }
    sync_.post();
    wait_all("allreduce");
    // Phase 3: collect the other slices' results from their owners' slots.
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && sl.length(q) > 0)
        std::memcpy(out + (off + sl.begin(q)) * es, slot(q, p) + sl.begin(q) * es, sl.length(q) * es);
  }
}

std::shared_ptr<void> Group::allreduce_shareable(void* buf, size_t count, DataType dtype, ReduceOp op,
                                                bool want_shared) {
  if (!op_supported(dtype, op))
    throw InvalidArgument(fmt::format("allreduce: op {} is not defined for dtype {}", reduce_op_name(op),
                                      dtype_name(dtype)));
  const size_t bytes = count * dtype_size(dtype);
  // Equal on every rank (the count and dtype are compared): only such calls can run in place, so only
  // they ask for memory.
  const bool large = size_ > 1 && bytes > options_.small_bytes;
  std::shared_ptr<SharedRegion> shared;
  size_t offset = 0;
  if (large) shared = find_shared(buf, bytes, &offset);
  std::shared_ptr<void> memory;
  guarded(
      "allreduce",
      [&] {
        if (size_ == 1) return;
        if (!large) return allreduce_small(buf, buf, count, dtype, op);
        // The in-place path's first round, on every rank: afterwards every buffer holds its
        // contribution, and the signatures (compared and tallied here) say which path all ranks take.
        sync_.post();
        wait_all("allreduce");
        if (shared && tally_.same_shared_range) return reduce_shared(*shared, offset, count, dtype, op);
        const auto start = std::chrono::steady_clock::now();
        allreduce_large(buf, buf, count, dtype, op);
        if (bytes >= chunk_.bytes) after_large_allreduce(bytes, std::chrono::steady_clock::now() - start);
        if (tally_.all_want_shared) memory = allocate_shared(bytes);
      },
      shared ? shared_tag(shared->id, offset) : 0, /*tally=*/true, want_shared && large ? kCallWantsShared : 0);
  return memory;
}

void Group::allreduce_shared(const SharedRegion& region, size_t offset, size_t count, DataType dtype, ReduceOp op) {
  // Round 1: every rank's buffer holds its contribution (and the signatures are compared).
  sync_.post();
  wait_all("allreduce");
  reduce_shared(region, offset, count, dtype, op);
}

void Group::reduce_shared(const SharedRegion& region, size_t offset, size_t count, DataType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const Slices sl(count, size_, es);
  auto at = [&](int q, size_t element) { return region.part(q) + offset + element * es; };
  // Reduce my slice from every rank's buffer, in rank order, a piece small enough to stay in this
  // core's cache at a time, and write each piece's result into every peer's buffer while it is hot.
  // Peers touch other slices only, and no rank changes its buffer before the second round.
  const size_t b = sl.begin(rank_), n = sl.length(rank_);
  const size_t piece = std::max<size_t>(kLine, (size_t{64} << 10) / es);
  // Ranks 0 and 1 accumulate in their own buffer (reduce_to may write over one of its inputs); a
  // higher rank's own contribution is read after that first step, so it accumulates aside.
  if (rank_ >= 2 && aside_.size() < piece * es) aside_.resize(piece * es);
  for (size_t i = 0; i < n; i += piece) {
    const size_t m = std::min(piece, n - i);
    char* acc = rank_ < 2 ? at(rank_, b + i) : aside_.data();
    kernels::reduce_to(acc, at(0, b + i), at(1, b + i), m, dtype, op);
    for (int q = 2; q < size_; ++q) kernels::reduce_into(acc, at(q, b + i), m, dtype, op);
    if (op == ReduceOp::kAvg) kernels::finish_average(acc, m, dtype, size_);
    for (int q = 0; q < size_; ++q)
      if (acc != at(q, b + i)) std::memcpy(at(q, b + i), acc, m * es);
  }
  // Round 2: every slice is final in every buffer; no peer reads or writes mine after this.
  sync_.post();
  wait_all("allreduce");
  ++shared_allreduces_;
}

bool Group::allreduce_update(float* grads, float* params, size_t count, ReduceOp op, const ParameterUpdate& update) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    throw InvalidArgument(fmt::format("allreduce_update: op {} (sum or avg only)", reduce_op_name(op)));
  const size_t es = sizeof(float), bytes = count * es;
  size_t grads_offset = 0, params_offset = 0;
  std::shared_ptr<SharedRegion> g, w;
  if (size_ > 1 && count > 0) {
    g = find_shared(grads, bytes, &grads_offset);
    w = find_shared(params, bytes, &params_offset);
  }
  if (size_ > 1 && (!g || !w)) return false;
  // Both ranges in the signature: a peer that passes other ranges (or ordinary memory) mismatches.
  const uint32_t tag =
      g ? ((shared_tag(g->id, grads_offset) * 0x01000193u) ^ shared_tag(w->id, params_offset)) | 1u : 0;
  guarded(
      "allreduce",
      [&] {
        if (size_ == 1) {
          if (count > 0) update(0, count, grads, params);
          return;
        }
        auto grad_at = [&](int q, size_t i) {
          return reinterpret_cast<const float*>(g->part(q) + grads_offset) + i;
        };
        auto param_at = [&](int q, size_t i) { return reinterpret_cast<float*>(w->part(q) + params_offset) + i; };
        // Round 1: every rank's gradients are final, and no rank reads its parameters until round 2
        // (peers write into them in between).
        sync_.post();
        wait_all("allreduce");
        // My slice, a piece at a time: the reduced gradients stay in this core's cache for the update,
        // and the updated piece for the copies into the peers' parameters.
        const Slices sl(count, size_, es);
        const size_t b = sl.begin(rank_), n = sl.length(rank_);
        const size_t piece = (size_t{32} << 10) / es;
        if (aside_.size() < piece * es) aside_.resize(piece * es);
        float* reduced = reinterpret_cast<float*>(aside_.data());
        for (size_t i = 0; i < n; i += piece) {
          const size_t m = std::min(piece, n - i);
          kernels::reduce_to(reduced, grad_at(0, b + i), grad_at(1, b + i), m, DataType::kFloat32, op);
          for (int q = 2; q < size_; ++q) kernels::reduce_into(reduced, grad_at(q, b + i), m, DataType::kFloat32, op);
          if (op == ReduceOp::kAvg) kernels::finish_average(reduced, m, DataType::kFloat32, size_);
          float* mine = param_at(rank_, b + i);
          update(b + i, m, reduced, mine);
          for (int q = 0; q < size_; ++q)
            if (q != rank_) std::memcpy(param_at(q, b + i), mine, m * es);
        }
        // Round 2: every slice of every rank's parameters is updated; nobody touches a peer's after it.
        sync_.post();
        wait_all("allreduce");
        ++fused_updates_;
      },
      tag);
  return true;
}

void Group::reduce_scatter(const void* in_v, void* out_v, size_t count, DataType dtype, ReduceOp op) {
  if (!op_supported(dtype, op))
    throw InvalidArgument(fmt::format("reduce_scatter: op {} is not defined for dtype {}", reduce_op_name(op),
                                      dtype_name(dtype)));
  guarded("reduce_scatter", [&] {
    const size_t es = dtype_size(dtype);
    const char* in = static_cast<const char*>(in_v);
    char* out = static_cast<char*>(out_v);
    const size_t block_bytes = count * es;
    if (size_ == 1) {
      if (in != out) std::memmove(out, in, block_bytes);
      return;
    }
    if (single_copy_for(block_bytes * static_cast<size_t>(size_)))
      return reduce_scatter_single(in, out, count, dtype, op);
    // If the output overlaps the input, our own block is staged too, so that reducing into `out`
    // never overwrites input still to be read.
    const bool stage_own = overlaps(in, block_bytes * static_cast<size_t>(size_), out, block_bytes);
    const size_t chunk_elems = std::max<size_t>(1, chunk_.bytes / es / static_cast<size_t>(size_));
    for (size_t off = 0; off < count; off += chunk_elems) {
      const size_t c = std::min(chunk_elems, count - off);
      const unsigned p = next_parity();
      char* mine = slot(rank_, p);
      // Slot layout for this round: block q's chunk at q * chunk_elems.
      for (int q = 0; q < size_; ++q)
        if (q != rank_ || stage_own)
          write_slot(mine + static_cast<size_t>(q) * chunk_elems * es,
                     in + (static_cast<size_t>(q) * count + off) * es, c * es);
      sync_.post();
      wait_all("reduce_scatter");
      auto source = [&](int q) -> const char* {
        if (q == rank_ && !stage_own) return in + (static_cast<size_t>(rank_) * count + off) * es;
        return slot(q, p) + static_cast<size_t>(rank_) * chunk_elems * es;
      };
      char* acc = out + off * es;
      kernels::reduce_to(acc, source(0), source(1), c, dtype, op);
      for (int q = 2; q < size_; ++q) kernels::reduce_into(acc, source(q), c, dtype, op);
      if (op == ReduceOp::kAvg) kernels::finish_average(acc, c, dtype, size_);
    }
  });
}

void Group::allgather(const void* in_v, void* out_v, size_t bytes) {
  guarded("allgather", [&] {
    const char* in = static_cast<const char*>(in_v);
    char* out = static_cast<char*>(out_v);
    char* own = out + static_cast<size_t>(rank_) * bytes;
    // In place (in == out, include/cohort/communicator.h): the contribution is already at `own`.
    const bool copy_own = in != out && in != own;
    // Inline below 992 B per rank, unless single copy was asked for from a size this small.
    if (inline_for(bytes) && !single_copy_for(bytes * static_cast<size_t>(size_))) return allgather_inline(in, out, bytes);
    if (size_ > 1 && single_copy_for(bytes * static_cast<size_t>(size_))) {
      // The peers read my contribution where it is (my input, or my block of the output in place), and I
      // copy it into my block after the first round: no copy stands between a rank's arrival and the
      // round, where on a loaded host the other rank's time slices would add up with it.
      const uint64_t header[1] = {reinterpret_cast<uint64_t>(copy_own ? in : own)};
      single_copy_call("allgather", header, 1, [&](unsigned p) {
        for (int k = 1; k < size_; ++k) {  // staggered, so that the ranks do not all read rank 0 first
          const int q = (rank_ + k) % size_;
          pull(q, out + static_cast<size_t>(q) * bytes, header_of(q, p)[0], bytes, "allgather");
        }
        if (copy_own) std::memmove(own, in, bytes);
      });
      return;
    }
    if (copy_own) std::memmove(own, in, bytes);
    if (size_ == 1) return;
    for (size_t off = 0; off < bytes; off += chunk_.bytes) {
      const size_t c = std::min(chunk_.bytes, bytes - off);
      const unsigned p = next_parity();
      write_slot(slot(rank_, p), own + off, c);
      sync_.post();
      wait_all("allgather");
      for (int q = 0; q < size_; ++q)
        if (q != rank_) std::memcpy(out + static_cast<size_t>(q) * bytes + off, slot(q, p), c);
    }
  });
}

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

void Group::broadcast(void* data_v, size_t bytes, int root) {
  if (root < 0 || root >= size_)
    throw InvalidArgument(fmt::format("broadcast: root {} is not a local rank in [0, {})", root, size_));
  guarded("broadcast", [&] {
    char* data = static_cast<char*>(data_v);
    if (size_ == 1) return;
    if (inline_for(bytes) && !single_copy_for(bytes)) return broadcast_inline(data, bytes, root);
    if (single_copy_for(bytes)) {
      const uint64_t header[1] = {reinterpret_cast<uint64_t>(data)};
      single_copy_call("broadcast", header, 1, [&](unsigned p) {
        if (rank_ != root) pull(root, data, header_of(root, p)[0], bytes, "broadcast");
      });
      return;
    }
    for (size_t off = 0; off < bytes; off += chunk_.bytes) {
      const size_t c = std::min(chunk_.bytes, bytes - off);
      const unsigned p = next_parity();
      if (rank_ == root) write_slot(slot(root, p), data + off, c);
      sync_.post();
      // Everyone waits for everyone (not only for the root): a rank that writes its slot in the next
      // round relies on all peers having posted this one, i.e. having finished reading the round before.
      wait_all("broadcast");
      if (rank_ != root) std::memcpy(data + off, slot(root, p), c);
    }
  });
}

// ---- Single copy ----

namespace {
constexpr uint64_t kSingleCopyOk = 0, kSingleCopyOff = 1, kSingleCopySlotTooSmall = 2, kSingleCopyReadFailed = 3;
}  // namespace

void Group::choose_single_copy() {
  peer_pids_.assign(static_cast<size_t>(size_), 0);
  peer_pids_[static_cast<size_t>(rank_)] = ::getpid();
  if (size_ == 1) {
    single_copy_why_ = "one local rank";
    return;
  }
  // The largest header a single-copy call publishes (alltoallv's: an address, P counts, P offsets).
  const size_t header_bytes = (1 + 2 * static_cast<size_t>(size_)) * sizeof(uint64_t);
  uint64_t verdict = !options_.single_copy                   ? kSingleCopyOff
                     : header_bytes > options_.slot_bytes ? kSingleCopySlotTooSmall
                                                             : kSingleCopyOk;
  // Round 1: my pid and the address and value of a word of my (private) memory.
  const uint64_t word =
      0xC0C0'0000'0000'0000ull ^ (static_cast<uint64_t>(::getpid()) << 8) ^ static_cast<uint64_t>(rank_);
  unsigned p = next_parity();
  const uint64_t mine[3] = {static_cast<uint64_t>(::getpid()), reinterpret_cast<uint64_t>(&word), word};
  std::memcpy(slot(rank_, p), mine, sizeof mine);
  sync_.post();
  wait_all("the group's start");
  uint64_t failed_peer = 0, failed_errno = 0;
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    const uint64_t* theirs = header_of(q, p);
    peer_pids_[static_cast<size_t>(q)] = static_cast<int>(theirs[0]);
    if (verdict != kSingleCopyOk) continue;
    uint64_t got = 0;
    iovec local{&got, sizeof got}, remote{reinterpret_cast<void*>(theirs[1]), sizeof got};
    const ssize_t n = ::process_vm_readv(static_cast<pid_t>(theirs[0]), &local, 1, &remote, 1, 0);
    if (n != static_cast<ssize_t>(sizeof got) || got != theirs[2]) {
      verdict = kSingleCopyReadFailed;
      failed_peer = static_cast<uint64_t>(q);
      failed_errno = n < 0 ? static_cast<uint64_t>(errno) : 0;
    }
  }
  // Round 2: every rank's verdict; single copy only if every rank can read every peer. (My word stays
  // alive until here, when every peer has read it.)
  p = next_parity();
  const uint64_t said[3] = {verdict, failed_peer, failed_errno};
  std::memcpy(slot(rank_, p), said, sizeof said);
  sync_.post();
  wait_all("the group's start");
  single_copy_ = true;
  for (int q = 0; q < size_ && single_copy_; ++q) {
    const uint64_t* v = header_of(q, p);
    if (v[0] == kSingleCopyOk) continue;
    single_copy_ = false;
    if (v[0] == kSingleCopyOff) single_copy_why_ = "off (COHORT_SHM_SINGLE_COPY=0)";
    else if (v[0] == kSingleCopySlotTooSmall)
      single_copy_why_ = fmt::format("off (the slot, {} B, cannot hold an alltoallv's addresses for {} ranks)",
                                     options_.slot_bytes, size_);
    else
      single_copy_why_ = fmt::format(
          "off (local rank {} could not read local rank {}'s memory with process_vm_readv: {}; the kernel's "
          "ptrace rules (kernel.yama.ptrace_scope, a container's seccomp filter) decide)",
          q, v[1], v[2] ? std::strerror(static_cast<int>(v[2])) : "it read the wrong value");
  }
  if (single_copy_)
    single_copy_why_ = fmt::format(
        "single copy (process_vm_readv between every pair of local ranks, checked at start) for allgather(v), "
        "alltoall(v), gather, scatter, broadcast and reduce_scatter from {} KiB",
        options_.single_copy_bytes >> 10);
}

template <typename Copies>
void Group::single_copy_call(const char* what, const uint64_t* header, size_t words, Copies&& copies) {
  // Round 1: my addresses are in my slot and my buffers hold what the peers copy (the signatures are
  // compared here too). The slot of this parity is written again two rounds later, after round 2,
  // when every peer has read my header.
  const unsigned p = next_parity();
  std::memcpy(slot(rank_, p), header, words * sizeof(uint64_t));
  sync_.post();
  wait_all(what);
  copies(p);
  // Round 2: every peer has finished copying from and into my buffers; the caller may reuse them.
  next_parity();
  sync_.post();
  wait_all(what);
  ++single_copies_;
}

void Group::pull(int q, void* local, uint64_t remote, size_t bytes, const char* what) {
  char* to = static_cast<char*>(local);
  while (bytes > 0) {
    iovec l{to, bytes}, r{reinterpret_cast<void*>(remote), bytes};
    const ssize_t n = ::process_vm_readv(peer_pids_[static_cast<size_t>(q)], &l, 1, &r, 1, 0);
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      const std::string text =
          fmt::format("shm {}: {} could not read {} bytes from {} (pid {}) with process_vm_readv: {}", what,
                      sync_.peer_name(rank_), bytes, sync_.peer_name(q), peer_pids_[static_cast<size_t>(q)],
                      std::strerror(err));
      if (err == ESRCH) throw PeerLostError(text);
      throw Error(text);
    }
    to += n, remote += static_cast<uint64_t>(n), bytes -= static_cast<size_t>(n);
  }
}

void Group::push(int q, uint64_t remote, const void* local, size_t bytes, const char* what) {
  const char* from = static_cast<const char*>(local);
  while (bytes > 0) {
    iovec l{const_cast<char*>(from), bytes}, r{reinterpret_cast<void*>(remote), bytes};
    const ssize_t n = ::process_vm_writev(peer_pids_[static_cast<size_t>(q)], &l, 1, &r, 1, 0);
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      const std::string text =
          fmt::format("shm {}: {} could not write {} bytes into {} (pid {}) with process_vm_writev: {}", what,
                      sync_.peer_name(rank_), bytes, sync_.peer_name(q), peer_pids_[static_cast<size_t>(q)],
                      std::strerror(err));
      if (err == ESRCH) throw PeerLostError(text);
      throw Error(text);
    }
    from += n, remote += static_cast<uint64_t>(n), bytes -= static_cast<size_t>(n);
  }
}

void Group::reduce_scatter_single(const char* in, char* out, size_t count, DataType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype), block = count * es, me = static_cast<size_t>(rank_);
  const char* own = in + me * block;
  // The peers read block q of my input while I write my output: an output on my own block is safe (no
  // peer reads it, and each piece of it is read before it is written); any other overlap (in == out,
  // the result in block 0) is reduced aside and copied in once every peer has finished reading.
  const bool on_own = out == own;
  const bool deferred = !on_own && overlaps(in, block * static_cast<size_t>(size_), out, block);
  // Pieces small enough that the peers' pieces and the accumulator stay in this core's cache.
  const size_t piece = std::max<size_t>(1, chunk_.bytes / es / static_cast<size_t>(size_));
  const size_t peers = static_cast<size_t>(size_ - 1);
  if (reduce_pieces_.size() < (peers + 1) * piece * es) reduce_pieces_.resize((peers + 1) * piece * es);
  if (deferred && alltoall_aside_.size() < block) alltoall_aside_.resize(block);
  char* result = deferred ? alltoall_aside_.data() : out;
  const uint64_t header[1] = {reinterpret_cast<uint64_t>(in)};
  single_copy_call("reduce_scatter", header, 1, [&](unsigned p) {
    char* theirs = reduce_pieces_.data();              // peer q's piece at slot q (q < me) or q - 1
    char* acc_piece = theirs + peers * piece * es;     // the accumulator when it must not be `out`
    for (size_t off = 0; off < count; off += piece) {
      const size_t c = std::min(piece, count - off);
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        const size_t at = static_cast<size_t>(q < rank_ ? q : q - 1) * piece * es;
        pull(q, theirs + at, header_of(q, p)[0] + me * block + off * es, c * es, "reduce_scatter");
      }
      auto source = [&](int q) -> const char* {
        if (q == rank_) return own + off * es;
        return theirs + static_cast<size_t>(q < rank_ ? q : q - 1) * piece * es;
      };
      // Rank order, as every other path (the same bits on every rank and path). reduce_to may write
      // over one of its inputs; on my own block a later rank's input would be overwritten before it is
      // read, so that case accumulates aside.
      char* acc = on_own && rank_ >= 2 ? acc_piece : result + off * es;
      kernels::reduce_to(acc, source(0), source(1), c, dtype, op);
      for (int q = 2; q < size_; ++q) kernels::reduce_into(acc, source(q), c, dtype, op);
      if (op == ReduceOp::kAvg) kernels::finish_average(acc, c, dtype, size_);
      if (acc != result + off * es) std::memcpy(result + off * es, acc, c * es);
    }
  });
  if (deferred) std::memcpy(out, result, block);
}

void Group::alltoallv(const void* send_v, const size_t* send_counts, const size_t* send_displs, void* recv_v,
                      const size_t* recv_counts, const size_t* recv_displs, size_t elem) {
  guarded("alltoallv", [&] {
    const char* send = static_cast<const char*>(send_v);
    char* recv = static_cast<char*>(recv_v);
    const size_t P = static_cast<size_t>(size_), me = static_cast<size_t>(rank_);
    if (send == recv) {
      // In place: the peers would read blocks this rank is overwriting; they read a copy instead.
      size_t extent = 0;
      for (size_t q = 0; q < P; ++q)
        if (send_counts[q]) extent = std::max(extent, (send_displs[q] + send_counts[q]) * elem);
      if (alltoall_aside_.size() < extent) alltoall_aside_.resize(extent);
      if (extent) std::memcpy(alltoall_aside_.data(), send, extent);
      send = alltoall_aside_.data();
    }
    auto own_block = [&] {
      if (recv_counts[me])
        std::memcpy(recv + recv_displs[me] * elem, send + send_displs[me] * elem, recv_counts[me] * elem);
    };
    if (size_ == 1) return own_block();
    // Header: my input's address, then what I send to each rank (counts, then offsets, in elements).
    std::vector<uint64_t> header(1 + 2 * P);
    header[0] = reinterpret_cast<uint64_t>(send);
    for (size_t q = 0; q < P; ++q) header[1 + q] = send_counts[q], header[1 + P + q] = send_displs[q];
    single_copy_call("alltoallv", header.data(), header.size(), [&](unsigned p) {
      for (int k = 1; k < size_; ++k) {
        const int q = (rank_ + k) % size_;
        const uint64_t* theirs = header_of(q, p);
        const uint64_t count = theirs[1 + me], offset = theirs[1 + P + me];
        if (count != recv_counts[q])
          throw MismatchError(fmt::format("alltoallv: {} sends {} elements to {}, which expects {} from it",
                                          sync_.peer_name(q), count, sync_.peer_name(rank_), recv_counts[q]));
        if (count) pull(q, recv + recv_displs[q] * elem, theirs[0] + offset * elem, count * elem, "alltoallv");
      }
      own_block();  // after the first round, as allgather's
    });
  });
}

void Group::allgatherv(const void* send_v, size_t send_count, void* recv_v, const size_t* recv_counts, size_t elem) {
  guarded("allgatherv", [&] {
    const char* send = static_cast<const char*>(send_v);
    char* recv = static_cast<char*>(recv_v);
    std::vector<size_t> displs(static_cast<size_t>(size_));
    size_t total = 0;
    for (int q = 0; q < size_; ++q) displs[static_cast<size_t>(q)] = total, total += recv_counts[q];
    char* own = recv + displs[static_cast<size_t>(rank_)] * elem;
    const bool copy_own = send != recv && send != own && send_count;
    if (size_ == 1) {
      if (copy_own) std::memmove(own, send, send_count * elem);
      return;
    }
    // As allgather: the peers read my contribution where it is; I copy it into place after round 1.
    const uint64_t header[2] = {reinterpret_cast<uint64_t>(copy_own ? send : own), send_count};
    single_copy_call("allgatherv", header, 2, [&](unsigned p) {
      for (int k = 1; k < size_; ++k) {
        const int q = (rank_ + k) % size_;
        const uint64_t* theirs = header_of(q, p);
        if (theirs[1] != recv_counts[q])
          throw MismatchError(fmt::format("allgatherv: {} contributes {} elements, but {} expects {} from it",
                                          sync_.peer_name(q), theirs[1], sync_.peer_name(rank_), recv_counts[q]));
        if (theirs[1]) pull(q, recv + displs[static_cast<size_t>(q)] * elem, theirs[0], theirs[1] * elem, "allgatherv");
      }
      if (copy_own) std::memmove(own, send, send_count * elem);
    });
  });
}

void Group::gather(const void* send_v, void* recv_v, size_t bytes, int root) {
  if (root < 0 || root >= size_)
    throw InvalidArgument(fmt::format("gather: root {} is not a local rank in [0, {})", root, size_));
  guarded("gather", [&] {
    const char* send = static_cast<const char*>(send_v);
    char* recv = static_cast<char*>(recv_v);
    const size_t mine = static_cast<size_t>(rank_) * bytes;
    const bool copy_own = rank_ == root && send != recv && bytes;
    if (size_ == 1) {
      if (copy_own) std::memcpy(recv + mine, send, bytes);
      return;
    }
    // The root publishes its output; every other rank writes its block there itself (the writes run on
    // all ranks at once instead of one after the other on the root).
    const uint64_t header[1] = {reinterpret_cast<uint64_t>(rank_ == root ? recv : nullptr)};
    single_copy_call("gather", header, 1, [&](unsigned p) {
      if (rank_ != root && bytes) push(root, header_of(root, p)[0] + mine, send, bytes, "gather");
      if (copy_own) std::memcpy(recv + mine, send, bytes);  // the root's, while the others write theirs
    });
  });
}

void Group::scatter(const void* send_v, void* recv_v, size_t bytes, int root) {
  if (root < 0 || root >= size_)
    throw InvalidArgument(fmt::format("scatter: root {} is not a local rank in [0, {})", root, size_));
  guarded("scatter", [&] {
    const char* send = static_cast<const char*>(send_v);
    char* recv = static_cast<char*>(recv_v);
    const size_t mine = static_cast<size_t>(rank_) * bytes;
    const bool copy_own = rank_ == root && send != recv && bytes;
    if (size_ == 1) {
      if (copy_own) std::memcpy(recv, send + mine, bytes);
      return;
    }
    const uint64_t header[1] = {reinterpret_cast<uint64_t>(rank_ == root ? send : nullptr)};
    single_copy_call("scatter", header, 1, [&](unsigned p) {
      if (rank_ != root && bytes) pull(root, recv, header_of(root, p)[0] + mine, bytes, "scatter");
      if (copy_own) std::memcpy(recv, send + mine, bytes);
    });
  });
}

}  // namespace cohort::shm
