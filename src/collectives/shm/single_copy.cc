// The single-copy path: the check at creation that every rank may read every peer's memory, the
// process_vm_readv/writev transfers between the ranks' own buffers, and the collectives that only take
// this path (reduce_scatter's, alltoallv, allgatherv, gather, scatter).
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
constexpr uint64_t kSingleCopyOk = 0, kSingleCopyOff = 1, kSingleCopySlotTooSmall = 2, kSingleCopyReadFailed = 3;
}  // namespace

void Group::choose_single_copy() {
  peer_pids_.assign(static_cast<size_t>(size_), 0);
  peer_pids_[static_cast<size_t>(rank_)] = ::getpid();
  if (size_ == 1) {
    single_copy_why_ = "one local rank";
    return;
  }
  // The largest header a single-copy call publishes (alltoallv's: a buffer, P counts, P offsets).
  const size_t header_bytes = (kBufferWords + 2 * static_cast<size_t>(size_)) * sizeof(uint64_t);
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
        "single copy (process_vm_readv between every pair of local ranks, checked at start; loads and stores "
        "where a peer's buffer is allocate_shared memory; {}) for allgather(v), alltoall(v), gather, scatter, "
        "broadcast and reduce_scatter from {} KiB",
        options_.streaming_bytes ? fmt::format("streaming stores from {} KiB", options_.streaming_bytes >> 10)
                                 : std::string("no streaming stores"),
        options_.single_copy_bytes >> 10);
}

void Group::kernel_pull(int q, void* local, uint64_t remote, size_t bytes, const char* what) {
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
    copied_.pulled += static_cast<uint64_t>(n);
  }
}

void Group::kernel_push(int q, uint64_t remote, const void* local, size_t bytes, const char* what) {
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
    copied_.pushed += static_cast<uint64_t>(n);
  }
}

namespace {
// A shared locator: (allocation id + 1) in the top 24 bits, the offset in the publisher's part below.
constexpr unsigned kLocatorOffsetBits = 40;
constexpr uint64_t kLocatorOffsetMask = (uint64_t{1} << kLocatorOffsetBits) - 1;
}  // namespace

void Group::publish(uint64_t* words, const void* data, size_t bytes) {
  words[0] = reinterpret_cast<uint64_t>(data);
  words[1] = 0;
  size_t offset = 0;
  if (!data || bytes == 0) return;
  if (auto region = find_shared(data, bytes, &offset);
      region && offset <= kLocatorOffsetMask && region->id + uint64_t{1} < (uint64_t{1} << (64 - kLocatorOffsetBits)))
    words[1] = ((uint64_t{region->id} + 1) << kLocatorOffsetBits) | offset;
}

std::shared_ptr<Group::SharedRegion> Group::shared_by_id(uint32_t id) {
  std::lock_guard<std::mutex> lock(shared_mutex_);
  for (const auto& w : shared_)
    if (auto region = w.lock(); region && region->id == id) return region;
  return nullptr;
}

const char* Group::mapped(int q, PeerBuffer remote, uint64_t offset, size_t bytes, std::shared_ptr<SharedRegion>* hold,
                          const char* what) {
  if (remote.locator == 0) return nullptr;
  const auto id = static_cast<uint32_t>((remote.locator >> kLocatorOffsetBits) - 1);
  const uint64_t at = remote.locator & kLocatorOffsetMask;
  auto region = shared_by_id(id);
  if (!region) return nullptr;  // this rank has dropped that allocation: the kernel copies instead
  // The peer's word is not trusted to stay inside its part: a range past it would read or write
  // another rank's part, or past the segment.
  if (at > region->per_rank || offset > region->per_rank - at || bytes > region->per_rank - at - offset)
    throw Error(fmt::format("shm {}: {} published a buffer at offset {} of shared allocation {} whose {} bytes "
                            "from offset {} lie beyond that allocation's {} bytes per rank",
                            what, sync_.peer_name(q), at, id, bytes, offset, region->per_rank));
  const char* p = region->part(q) + at + offset;
  *hold = std::move(region);
  return p;
}

void Group::copy_block(void* dst, const void* src, size_t bytes) const {
  if (bytes == 0 || dst == src) return;
  if (options_.streaming_bytes && bytes >= options_.streaming_bytes && !overlaps(dst, bytes, src, bytes))
    copy::copy_streaming(dst, src, bytes);
  else
    std::memmove(dst, src, bytes);
}

void Group::pull(int q, void* local, PeerBuffer remote, uint64_t offset, size_t bytes, const char* what) {
  std::shared_ptr<SharedRegion> hold;
  if (const char* from = mapped(q, remote, offset, bytes, &hold, what)) {
    copy_block(local, from, bytes);
    copied_.pulled += bytes, copied_.mapped += bytes;
    return;
  }
  kernel_pull(q, local, remote.address + offset, bytes, what);
}

void Group::push(int q, PeerBuffer remote, uint64_t offset, const void* local, size_t bytes, const char* what) {
  std::shared_ptr<SharedRegion> hold;
  if (const char* to = mapped(q, remote, offset, bytes, &hold, what)) {
    copy_block(const_cast<char*>(to), local, bytes);
    copied_.pushed += bytes, copied_.mapped += bytes;
    return;
  }
  kernel_push(q, remote.address + offset, local, bytes, what);
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
  uint64_t header[kBufferWords];
  publish(header, in, block * static_cast<size_t>(size_));
  single_copy_call("reduce_scatter", header, kBufferWords, [&](unsigned p) {
    char* theirs = reduce_pieces_.data();              // peer q's piece at slot q (q < me) or q - 1
    char* acc_piece = theirs + peers * piece * es;     // the accumulator when it must not be `out`
    // A peer's input in allocate_shared memory this rank maps is read where it lies: no piece copied in.
    // (Members, sized once: no allocation per call; the holds are dropped when the call ends.)
    std::vector<std::shared_ptr<SharedRegion>>& holds = reduce_holds_;
    std::vector<const char*>& direct = reduce_direct_;
    holds.assign(static_cast<size_t>(size_), nullptr);
    direct.assign(static_cast<size_t>(size_), nullptr);
    struct DropHolds {
      std::vector<std::shared_ptr<SharedRegion>>& holds;
      ~DropHolds() { holds.assign(holds.size(), nullptr); }
    } drop{holds};
    for (int q = 0; q < size_; ++q)
      if (q != rank_)
        direct[static_cast<size_t>(q)] = mapped(q, peer_buffer(header_of(q, p)), me * block, block,
                                                &holds[static_cast<size_t>(q)], "reduce_scatter");
    for (size_t off = 0; off < count; off += piece) {
      const size_t c = std::min(piece, count - off);
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        if (direct[static_cast<size_t>(q)]) {
          copied_.pulled += c * es, copied_.mapped += c * es;
          continue;
        }
        const size_t at = static_cast<size_t>(q < rank_ ? q : q - 1) * piece * es;
        kernel_pull(q, theirs + at, header_of(q, p)[0] + me * block + off * es, c * es, "reduce_scatter");
      }
      auto source = [&](int q) -> const char* {
        if (q == rank_) return own + off * es;
        if (const char* d = direct[static_cast<size_t>(q)]) return d + off * es;
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
      if (recv_counts[me]) copy_block(recv + recv_displs[me] * elem, send + send_displs[me] * elem, recv_counts[me] * elem);
    };
    if (size_ == 1) return own_block();
    // Header: my input's address, then what I send to each rank (counts, then offsets, in elements).
    std::vector<uint64_t> header(kBufferWords + 2 * P);
    size_t extent = 0;
    for (size_t q = 0; q < P; ++q)
      if (send_counts[q]) extent = std::max(extent, (send_displs[q] + send_counts[q]) * elem);
    publish(header.data(), send, extent);
    uint64_t* counts = header.data() + kBufferWords;
    for (size_t q = 0; q < P; ++q) counts[q] = send_counts[q], counts[P + q] = send_displs[q];
    single_copy_call("alltoallv", header.data(), header.size(), [&](unsigned p) {
      for (int k = 1; k < size_; ++k) {
        const int q = (rank_ + k) % size_;
        const uint64_t* theirs = header_of(q, p);
        const uint64_t count = theirs[kBufferWords + me], offset = theirs[kBufferWords + P + me];
        if (count != recv_counts[q])
          throw MismatchError(fmt::format("alltoallv: {} sends {} elements to {}, which expects {} from it",
                                          sync_.peer_name(q), count, sync_.peer_name(rank_), recv_counts[q]));
        if (count) pull(q, recv + recv_displs[q] * elem, peer_buffer(theirs), offset * elem, count * elem, "alltoallv");
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
    uint64_t header[kBufferWords + 1];
    publish(header, copy_own ? send : own, send_count * elem);
    header[kBufferWords] = send_count;
    single_copy_call("allgatherv", header, kBufferWords + 1, [&](unsigned p) {
      for (int k = 1; k < size_; ++k) {
        const int q = (rank_ + k) % size_;
        const uint64_t* theirs = header_of(q, p);
        const uint64_t count = theirs[kBufferWords];
        if (count != recv_counts[q])
          throw MismatchError(fmt::format("allgatherv: {} contributes {} elements, but {} expects {} from it",
                                          sync_.peer_name(q), count, sync_.peer_name(rank_), recv_counts[q]));
        if (count) pull(q, recv + displs[static_cast<size_t>(q)] * elem, peer_buffer(theirs), 0, count * elem, "allgatherv");
      }
      if (copy_own) copy_block(own, send, send_count * elem);
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
    uint64_t header[kBufferWords];
    publish(header, rank_ == root ? recv : nullptr, bytes * static_cast<size_t>(size_));
    single_copy_call("gather", header, kBufferWords, [&](unsigned p) {
      if (rank_ != root && bytes) push(root, peer_buffer(header_of(root, p)), mine, send, bytes, "gather");
      if (copy_own) copy_block(recv + mine, send, bytes);  // the root's, while the others write theirs
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
    uint64_t header[kBufferWords];
    publish(header, rank_ == root ? send : nullptr, bytes * static_cast<size_t>(size_));
    single_copy_call("scatter", header, kBufferWords, [&](unsigned p) {
      if (rank_ != root && bytes) pull(root, recv, peer_buffer(header_of(root, p)), mine, bytes, "scatter");
      if (copy_own) copy_block(recv, send + mine, bytes);
    });
  });
}

}  // namespace cohort::shm
