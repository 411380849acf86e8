#include "common/handoff_wire.h"

#include <cstring>

#include <fmt/core.h>

namespace cohort::handoff {

Hello make_hello(uint64_t scope, uint32_t role, uint64_t value0, uint64_t value1) {
  Hello h{};
  h.magic = kHelloMagic;
  h.version = kHelloVersion;
  h.scope = scope;
  h.role = role;
  h.values[0] = value0;
  h.values[1] = value1;
  return h;
}

std::string parse_hello(const void* data, size_t n, uint64_t scope, Hello* out) {
  if (n != sizeof(Hello)) return fmt::format("a hello of {} bytes (expected {})", n, sizeof(Hello));
  Hello h;
  std::memcpy(&h, data, sizeof h);
  *out = h;
  if (h.magic != kHelloMagic) return fmt::format("not a cohort handoff hello (magic {:#x})", h.magic);
  if (h.version != kHelloVersion)
    return fmt::format("a hello of version {} (this process speaks version {})", h.version, kHelloVersion);
  if (h.scope != scope) return fmt::format("a hello of another job or handoff (scope {:#x})", h.scope);
  if (h.fds > kMaxFds) return fmt::format("a hello that attaches {} descriptors (at most {})", h.fds, kMaxFds);
  for (uint16_t i = h.fds; i < kMaxFds; ++i)
    if (h.sizes[i] != 0) return fmt::format("a hello that sizes descriptor {} of the {} it attaches", i, h.fds);
  if (h.reserved != 0) return fmt::format("a hello with reserved field {:#x}", h.reserved);
  return {};
}

uint64_t scope_of(std::string_view text) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

std::optional<size_t> slot_offset(uint64_t slot, uint64_t bytes, size_t stride, size_t head) {
  if (stride == 0 || bytes < head) return std::nullopt;
  // Slots that fit after the head: `slot` must be one of them.
  const uint64_t slots = (bytes - head) / stride;
  if (slot >= slots) return std::nullopt;
  return static_cast<size_t>(head + slot * stride);
}

}  // namespace cohort::handoff
