// libFuzzer target: the checks of the shared-memory hand-off messages (src/transport/shm/handoff_wire.cc):
// the segment hello local rank 0 reads from whoever connects to its abstract socket
// (handoff_wire::check_segment_hello), the point-to-point hello of the shm transport
// (handoff_wire::check_p2p_hello), and where a peer's ring lies in the memfd it handed over
// (handoff_wire::p2p_ring_offset). An abstract socket has no permissions: any process of the host may send
// these. The input's first byte picks the message; then the receiver's situation, then the bytes sent.
// Invariants checked beyond "no crash, no sanitizer report":
//  - an accepted segment hello names a local rank in [1, local size) and the receiver's sizes;
//  - an accepted point-to-point hello has the receiver's scope and ring size;
//  - a ring offset that is given lies after the doorbell, on a ring boundary, with the whole ring
//    inside the memfd's claimed size;
//  - refusals are one line.
#include <cstdint>
#include <cstring>
#include <string>

#include "transport/shm/handoff_wire.h"

using namespace cohort::shm;

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

template <typename T>
T take(const uint8_t*& p, size_t& n) {
  T v{};
  if (n >= sizeof v) {
    std::memcpy(&v, p, sizeof v);
    p += sizeof v;
    n -= sizeof v;
  }
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t which = data[0] % 3;
  const uint8_t* p = data + 1;
  size_t n = size - 1;
  if (which == 0) {
    const int32_t local_size = take<int32_t>(p, n);
    const uint64_t bytes = take<uint64_t>(p, n);
    handoff_wire::SegmentHello h{};
    const std::string why = handoff_wire::check_segment_hello(p, n, local_size, bytes, &h);
    if (why.empty()) {
      check(n == sizeof h && local_size > 1);
      check(h.local_rank >= 1 && h.local_rank < uint32_t(local_size) && h.local_size == uint32_t(local_size));
      check(h.bytes == bytes && h.magic == handoff_wire::kSegmentHelloMagic);
    } else {
      check(why.find('\n') == std::string::npos);
    }
  } else if (which == 1) {
    const uint64_t scope = take<uint64_t>(p, n);
    const uint64_t ring_bytes = take<uint64_t>(p, n);
    handoff_wire::P2pHello h{};
    const std::string why = handoff_wire::check_p2p_hello(p, n, scope, ring_bytes, &h);
    if (why.empty()) {
      check(n == sizeof h && h.scope == scope && h.ring_bytes == ring_bytes && h.magic == handoff_wire::kP2pHelloMagic);
    } else {
      check(why.find('\n') == std::string::npos);
    }
  } else {
    const uint64_t slot = take<uint64_t>(p, n);
    const uint64_t map_bytes = take<uint64_t>(p, n);
    const uint64_t stride = take<uint64_t>(p, n);
    const uint16_t line = take<uint16_t>(p, n);
    if (auto offset = handoff_wire::p2p_ring_offset(slot, map_bytes, stride, line)) {
      check(stride > 0 && *offset >= line && (*offset - line) % stride == 0 && (*offset - line) / stride == slot);
      check(*offset <= map_bytes && map_bytes - *offset >= stride);
    }
  }
  return 0;
}
