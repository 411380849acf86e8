#include "collectives/shm/group.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cohort/error.h"
#include "collectives/reduce_kernels.h"
#include "common/affinity.h"
#include "common/env.h"

namespace cohort::shm {
namespace {

static const env::BytesSetting kSlotBytes("COHORT_SHM_SLOT_BYTES", 1 << 20,
                                          "shared-memory staging slot per local rank (two each); pipeline chunk");
static const env::BytesSetting kSmallBytes("COHORT_SHM_SMALL_BYTES", 16 << 10,
                                           "intra-host allreduce up to this size reduces everything on every rank");
static const env::SecondsSetting kSpin("COHORT_SHM_SPIN", 0.002,
                                       "how long an intra-host wait polls (pure spin for 1 us, then spin with "
                                       "sched_yield) before sleeping on a futex");

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
  return o;
}

std::unique_ptr<Group> Group::create(Store& store, int local_rank, int local_size, const std::string& key_prefix,
                                     std::chrono::milliseconds timeout) {
  if (local_size < 1 || local_rank < 0 || local_rank >= local_size)
    throw InvalidArgument(fmt::format("shm::Group: local rank {} is not in [0, {})", local_rank, local_size));
  std::string address = local_size == 1 ? std::string("unused") : rendezvous_address(store, key_prefix, local_rank);
  return create_at(address, local_rank, local_size, timeout, GroupOptions::from_env(local_size));
}

std::unique_ptr<Group> Group::create_at(const std::string& address, int local_rank, int local_size,
                                        std::chrono::milliseconds timeout, const GroupOptions& options) {
  if (local_size < 1 || local_rank < 0 || local_rank >= local_size)
    throw InvalidArgument(fmt::format("shm::Group: local rank {} is not in [0, {})", local_rank, local_size));
  const size_t bytes = controls_bytes(local_size) + static_cast<size_t>(local_size) * 2 * options.slot_bytes;
  Segment segment = Segment::establish(address, local_rank, local_size, bytes, Deadline::after(timeout));
  auto group = std::make_unique<Group>(std::move(segment), local_rank, local_size, timeout, options);
  group->address_ = address;
  group->sync_.start();
  group->choose_wait_policy();
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

Group::Group(Segment segment, int local_rank, int local_size, std::chrono::milliseconds timeout,
             const GroupOptions& options)
    : segment_(std::move(segment)),
      rank_(local_rank),
      size_(local_size),
      options_(options),
      sync_(static_cast<RankControl*>(segment_.data()), local_rank, local_size, timeout, options.spin),
      timeout_(timeout) {}

uint32_t Group::shared_tag(uint32_t allocation, size_t offset) {
  uint64_t x = (uint64_t{allocation} << 40) ^ static_cast<uint64_t>(offset);
  x *= 0x9E3779B97F4A7C15ull;  // spreads both into the high half
  return static_cast<uint32_t>(x >> 32) | 1u;
}

std::shared_ptr<void> Group::allocate_shared(size_t bytes) {
  const size_t per_rank = round_up(std::max<size_t>(bytes, 1), kPage);
  const uint32_t id = shared_allocations_++;
  // Its own segment, at a name every local rank derives from the group's (no store round trip).
  Segment segment = Segment::establish(fmt::format("{}/shared-{}", address_, id), rank_, size_,
                                       per_rank * static_cast<size_t>(size_), Deadline::after(timeout_));
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
  // Every peer has posted at least the step after which it published this entry, and cannot publish
  // into it again before this rank posts once more (it would need this rank's next post first).
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    const CallSignature theirs = sync_.control(q).call[entry];
    if (!(theirs == active_)) {
      std::string text = mismatch_formatter_
                             ? mismatch_formatter_(q, theirs, active_)
                             : fmt::format("mismatched calls: local rank {} called op {} (count {}, seq {}) but local "
                                           "rank {} called op {} (count {}, seq {})",
                                           q, theirs.kind, theirs.count, theirs.seq, rank_, active_.kind,
                                           active_.count, active_.seq);
      if (theirs.reserved != active_.reserved)
        text += " (the ranks did not pass the same range of one allocate_shared buffer)";
      throw MismatchError(text);
    }
  }
}

template <typename Body>
void Group::guarded(const char* what, Body&& body, uint32_t shared_tag) {
  if (!failure_.empty()) throw AbortedError("shm group failed earlier: " + failure_);
  try {
    // Publish this call's signature before its first post (the peers read it after seeing that post).
    active_ = call_;
    active_.reserved = shared_tag;
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
        if (shared) allreduce_shared(*shared, offset, count, dtype, op);
        else if (bytes <= options_.small_bytes) allreduce_small(in, out, count, dtype, op);
        else allreduce_large(in, out, count, dtype, op);
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
  const size_t chunk_elems = options_.slot_bytes / es;
  for (size_t off = 0; off < count; off += chunk_elems) {
    const size_t c = std::min(chunk_elems, count - off);
    const Slices sl(c, size_, es);
    const unsigned p = next_parity();
    char* mine = slot(rank_, p);
    // Phase 1: stage the slices the peers own.
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && sl.length(q) > 0)
        std::memcpy(mine + sl.begin(q) * es, in + (off + sl.begin(q)) * es, sl.length(q) * es);
    sync_.post();
    wait_all("allreduce");
    // Phase 2: reduce my slice into my slot (rank order), reading my input and the peers' slots.
    const size_t b = sl.begin(rank_), n = sl.length(rank_);
    if (n > 0) {
      auto source = [&](int q) -> const char* {
        return q == rank_ ? in + (off + b) * es : slot(q, p) + b * es;
      };
      char* acc = mine + b * es;
      kernels::reduce_to(acc, source(0), source(1), n, dtype, op);
      for (int q = 2; q < size_; ++q) kernels::reduce_into(acc, source(q), n, dtype, op);
      if (op == ReduceOp::kAvg) kernels::finish_average(acc, n, dtype, size_);
      std::memcpy(out + (off + b) * es, acc, n * es);
    }
    sync_.post();
    wait_all("allreduce");
    // Phase 3: collect the other slices' results from their owners' slots.
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && sl.length(q) > 0)
        std::memcpy(out + (off + sl.begin(q)) * es, slot(q, p) + sl.begin(q) * es, sl.length(q) * es);
  }
}

void Group::allreduce_shared(const SharedRegion& region, size_t offset, size_t count, DataType dtype, ReduceOp op) {
  const size_t es = dtype_size(dtype);
  const Slices sl(count, size_, es);
  auto at = [&](int q, size_t element) { return region.part(q) + offset + element * es; };
  // Round 1: every rank's buffer holds its contribution (and the signatures are compared).
  sync_.post();
  wait_all("allreduce");
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
    // If the output overlaps the input, our own block is staged too, so that reducing into `out`
    // never overwrites input still to be read.
    const bool stage_own = overlaps(in, block_bytes * static_cast<size_t>(size_), out, block_bytes);
    const size_t chunk_elems = options_.slot_bytes / es / static_cast<size_t>(size_);
    for (size_t off = 0; off < count; off += chunk_elems) {
      const size_t c = std::min(chunk_elems, count - off);
      const unsigned p = next_parity();
      char* mine = slot(rank_, p);
      // Slot layout for this round: block q's chunk at q * chunk_elems.
      for (int q = 0; q < size_; ++q)
        if (q != rank_ || stage_own)
          std::memcpy(mine + static_cast<size_t>(q) * chunk_elems * es,
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
    if (in != own) std::memmove(own, in, bytes);
    if (size_ == 1) return;
    for (size_t off = 0; off < bytes; off += options_.slot_bytes) {
      const size_t c = std::min(options_.slot_bytes, bytes - off);
      const unsigned p = next_parity();
      std::memcpy(slot(rank_, p), own + off, c);
      sync_.post();
      wait_all("allgather");
      for (int q = 0; q < size_; ++q)
        if (q != rank_) std::memcpy(out + static_cast<size_t>(q) * bytes + off, slot(q, p), c);
    }
  });
}

std::vector<LinkProbe> Group::probe() {
  std::vector<LinkProbe> all(static_cast<size_t>(size_));
  guarded("probe", [&] {
    LinkProbe mine;
    mine.cpu = sched_getcpu();
    const size_t bytes = std::min<size_t>(options_.slot_bytes, 256 << 10);
    mine.probe_bytes = static_cast<uint32_t>(bytes);
    if (size_ == 1) {
      all[0] = mine;
      return;
    }
    using Clock = std::chrono::steady_clock;
    auto seconds = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
    std::vector<char> sink(bytes, 1);  // touched, so page faults are not timed
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
      r = seconds(Clock::now() - t);
    }
    std::nth_element(rounds.begin(), rounds.begin() + kRounds / 2, rounds.end());
    mine.round_ns = static_cast<float>(rounds[kRounds / 2] * 1e9);
    double best_peer = 0, best_own = 0;
    for (int rep = 0; rep < 2; ++rep) {
      for (int w = 0; w < size_; ++w) {
        const unsigned p = next_parity();
        if (rank_ == w) {
          // Fresh lines in this core's cache, modified; copying them back is the own-cache figure.
          std::memset(slot(w, p), rep * size_ + w + 1, bytes);
          const auto t = Clock::now();
          std::memcpy(sink.data(), slot(w, p), bytes);
          best_own = std::max(best_own, double(bytes) / seconds(Clock::now() - t) / 1e9);
        }
        sync_.post();
        wait_all("probe");
        if (rank_ != w) {  // the lines are in rank w's cache: this copy pulls them across
          const auto t = Clock::now();
          std::memcpy(sink.data(), slot(w, p), bytes);
          best_peer = std::max(best_peer, double(bytes) / seconds(Clock::now() - t) / 1e9);
        }
      }
    }
    mine.peer_copy_gbps = static_cast<float>(best_peer);
    mine.own_copy_gbps = static_cast<float>(best_own);
    mine.probe_us = static_cast<float>(seconds(Clock::now() - start) * 1e6);
    // Every rank's figures to every rank (the slot protocol of any round: write mine, post, wait, read).
    const unsigned p = next_parity();
    std::memcpy(slot(rank_, p), &mine, sizeof mine);
    sync_.post();
    wait_all("probe");
    for (int q = 0; q < size_; ++q) std::memcpy(&all[static_cast<size_t>(q)], slot(q, p), sizeof(LinkProbe));
  });
  return all;
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
    for (size_t off = 0; off < bytes; off += options_.slot_bytes) {
      const size_t c = std::min(options_.slot_bytes, bytes - off);
      const unsigned p = next_parity();
      if (rank_ == root) std::memcpy(slot(root, p), data + off, c);
      sync_.post();
      // Everyone waits for everyone (not only for the root): a rank that writes its slot in the next
      // round relies on all peers having posted this one, i.e. having finished reading the round before.
      wait_all("broadcast");
      if (rank_ != root) std::memcpy(data + off, slot(root, p), c);
    }
  });
}

}  // namespace cohort::shm
