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
    copied_.pulled += static_cast<uint64_t>(n);
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
    copied_.pushed += static_cast<uint64_t>(n);
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
