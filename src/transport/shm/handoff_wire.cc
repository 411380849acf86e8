#include "transport/shm/handoff_wire.h"

#include <cstring>

#include <fmt/core.h>

namespace cohort::shm::handoff_wire {

std::string check_segment_hello(const void* data, size_t n, int local_size, uint64_t bytes, SegmentHello* out) {
  if (n != sizeof(SegmentHello)) return fmt::format("a hello of {} bytes (expected {})", n, sizeof(SegmentHello));
  SegmentHello h;
  std::memcpy(&h, data, sizeof h);
  *out = h;
  if (h.magic != kSegmentHelloMagic) return fmt::format("not a cohort segment hello (magic {:#x})", h.magic);
  // Unsigned comparisons: a local rank read as a negative int would index local rank 0's tables.
  if (local_size <= 0 || h.local_size != static_cast<uint32_t>(local_size) || h.local_rank == 0 ||
      h.local_rank >= static_cast<uint32_t>(local_size) || h.bytes != bytes)
    return fmt::format("local rank {} joined with local size {} and {} bytes; local rank 0 has local size {} and {} "
                       "bytes",
                       h.local_rank, h.local_size, h.bytes, local_size, bytes);
  return {};
}

std::string check_p2p_hello(const void* data, size_t n, uint64_t scope, uint64_t ring_bytes, P2pHello* out) {
  if (n != sizeof(P2pHello)) return fmt::format("a hello of {} bytes (expected {})", n, sizeof(P2pHello));
  P2pHello h;
  std::memcpy(&h, data, sizeof h);
  *out = h;
  if (h.magic != kP2pHelloMagic) return fmt::format("not a cohort shm hello (magic {:#x})", h.magic);
  if (h.scope != scope) return fmt::format("a hello of another job or communicator (scope {:#x})", h.scope);
  if (h.ring_bytes != ring_bytes)
    return fmt::format("rings of {} bytes (this rank has rings of {} bytes)", h.ring_bytes, ring_bytes);
  return {};
}

std::optional<size_t> p2p_ring_offset(uint64_t slot, uint64_t map_bytes, size_t stride, size_t line) {
  if (stride == 0 || map_bytes < line) return std::nullopt;
  // Rings that fit after the doorbell: the slot must be one of them.
  const uint64_t rings = (map_bytes - line) / stride;
  if (slot >= rings) return std::nullopt;
  return static_cast<size_t>(line + slot * stride);
}

}  // namespace cohort::shm::handoff_wire
