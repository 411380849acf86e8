// libFuzzer target: the memfd handoff's one hello (src/common/handoff_wire.cc), which every handoff
// parses from whoever connects to its abstract socket or answers on it (the collectives' segment, the
// shm transport's rings, a parameter server's tables: handoff::parse_hello), and where a ring lies in
// the memfd a peer handed over (handoff::slot_offset). An abstract socket has no permissions: any
// process of the host may send these. The input's first byte picks the function; then the receiver's
// situation, then the bytes sent.
// Invariants checked beyond "no crash, no sanitizer report":
//  - an accepted hello has the receiver's scope, this version, at most kMaxFds descriptors and no
//    size for one it does not attach;
//  - an offset that is given lies after the head, on a slot boundary, with the whole slot inside
//    the memfd's claimed size;
//  - refusals are one line.
#include <cstdint>
#include <cstring>
#include <string>

#include "common/handoff_wire.h"

using namespace cohort;

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
  const uint8_t which = data[0] % 2;
  const uint8_t* p = data + 1;
  size_t n = size - 1;
  if (which == 0) {
    const uint64_t scope = take<uint64_t>(p, n);
    handoff::Hello h{};
    const std::string why = handoff::parse_hello(p, n, scope, &h);
    if (why.empty()) {
      check(n == sizeof h && h.magic == handoff::kHelloMagic && h.version == handoff::kHelloVersion);
      check(h.scope == scope && h.fds <= handoff::kMaxFds && h.reserved == 0);
      for (size_t i = h.fds; i < handoff::kMaxFds; ++i) check(h.sizes[i] == 0);
    } else {
      check(why.find('\n') == std::string::npos);
    }
  } else {
    const uint64_t slot = take<uint64_t>(p, n);
    const uint64_t bytes = take<uint64_t>(p, n);
    const uint64_t stride = take<uint64_t>(p, n);
    const uint16_t head = take<uint16_t>(p, n);
    if (auto offset = handoff::slot_offset(slot, bytes, stride, head)) {
      check(stride > 0 && *offset >= head && (*offset - head) % stride == 0 && (*offset - head) / stride == slot);
      check(*offset <= bytes && bytes - *offset >= stride);
    }
  }
  return 0;
}
