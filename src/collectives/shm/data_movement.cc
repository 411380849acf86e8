// reduce_scatter, allgather and broadcast: each picks the single-copy path (single_copy.cc) from
// COHORT_SHM_SINGLE_COPY_BYTES on, and otherwise stages through the slots chunk by chunk (two copies,
// both ranks' cores busy, one wait per chunk).
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
      uint64_t header[kBufferWords];
      publish(header, copy_own ? in : own, bytes);
      single_copy_call("allgather", header, kBufferWords, [&](unsigned p) {
        for (int k = 1; k < size_; ++k) {  // staggered, so that the ranks do not all read rank 0 first
          const int q = (rank_ + k) % size_;
          pull(q, out + static_cast<size_t>(q) * bytes, peer_buffer(header_of(q, p)), 0, bytes, "allgather");
        }
        if (copy_own) copy_block(own, in, bytes);
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

size_t Group::broadcast_root_share(size_t bytes, int ranks) {
  // Whole pages, so that the root and a receiver do not both have the kernel pin the page where the
  // receiver's part ends.
  return bytes / static_cast<size_t>(std::max(ranks, 1)) / kPage * kPage;
}

void Group::broadcast(void* data_v, size_t bytes, int root) {
  if (root < 0 || root >= size_)
    throw InvalidArgument(fmt::format("broadcast: root {} is not a local rank in [0, {})", root, size_));
  // An inline broadcast's root need not wait for its receivers (broadcast_inline); guarded() then
  // confirms only the rounds whose lines this call reuses.
  next_call_early_root_ = root == rank_ && early_root_for(bytes);
  guarded("broadcast", [&] {
    char* data = static_cast<char*>(data_v);
    if (size_ == 1) return;
    if (inline_for(bytes) && !single_copy_for(bytes)) return broadcast_inline(data, bytes, root);
    if (single_copy_for(bytes)) {
      // Every receiver needs all `bytes`; if the receivers copied alone, the root's core would sit idle
      // for the whole call. So the root writes the tail of every receiver's buffer (process_vm_writev)
      // while each receiver reads the head (process_vm_readv): (P-1) shares for the root, bytes - share
      // for each receiver, equal at share = bytes/P. The head and tail are disjoint, so the two copies
      // into one buffer never touch the same bytes, and the second round ends both. Where the ranks
      // share cores there is no idle root core, and the receivers copy it all (broadcast_splits).
      const size_t share = broadcast_splits() ? broadcast_root_share(bytes, size_) : 0;
      uint64_t header[kBufferWords];
      publish(header, data, bytes);
      single_copy_call("broadcast", header, kBufferWords, [&](unsigned p) {
        if (rank_ != root) {
          pull(root, data, peer_buffer(header_of(root, p)), 0, bytes - share, "broadcast");
          return;
        }
        for (int k = 1; k < size_ && share > 0; ++k) {  // staggered, as allgather's reads
          const int q = (rank_ + k) % size_;
          push(q, peer_buffer(header_of(q, p)), bytes - share, data + (bytes - share), share, "broadcast");
        }
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

}  // namespace cohort::shm
