#pragma once
// The one message of the memfd handoff (common/handoff.h) and the checks of what a peer sent, as pure
// functions (fuzzed by fuzz/shm_handoff_fuzz.cc). Any process of the host may send these bytes: every
// field is checked, unsigned, before anything is sized or indexed with it (docs/security.md).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace cohort::handoff {

inline constexpr uint32_t kHelloMagic = 0x4f464843;  // "CHFO" on the wire (little-endian)
// Raised whenever a field's layout or meaning changes: a peer of another version is refused, not misread.
inline constexpr uint16_t kHelloVersion = 1;
// The most descriptors one hello carries (a parameter server's table: header, rows, index).
inline constexpr uint16_t kMaxFds = 3;

// Sent by each side of a handoff, with its descriptors attached (SCM_RIGHTS). What a role and the two
// values mean is the user's: the segment (role: local rank; values: local size, segment bytes), the
// rings (role: rank; values: ring bytes, the receiver's ring slot), a table (role: server index).
struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t fds;             // descriptors attached, at most kMaxFds
  uint64_t scope;           // what the handoff belongs to (scope_of a name both ends agreed on)
  uint32_t role;            // who the sender says it is, in that scope
  uint32_t reserved;        // 0
  uint64_t sizes[kMaxFds];  // bytes descriptor i holds at least (memory the receiver maps); 0: not checked
  uint64_t values[2];
};
static_assert(sizeof(Hello) == 64, "handoff hello layout");

// A hello from `role` of `scope` with the user's two values, versioned, nothing attached yet.
Hello make_hello(uint64_t scope, uint32_t role, uint64_t value0 = 0, uint64_t value1 = 0);

// Checks the `n` bytes a peer sent against the hello of `scope`: "" when they are one (its size,
// magic, version and scope; at most kMaxFds descriptors; no size for a descriptor it does not
// attach), else why not, in one line. `*out` gets the hello whenever `n` is a hello's size.
std::string parse_hello(const void* data, size_t n, uint64_t scope, Hello* out);

// FNV-1a of `text`: the scope of a handoff whose two ends agreed on a name (not a secret: the
// processes are told apart by their credentials, the scope only keeps handoffs from mixing).
uint64_t scope_of(std::string_view text);

// Where, in a memfd of `bytes` bytes laid out as `head` bytes then slots of `stride` bytes, slot
// `slot` starts: nullopt when that slot does not lie wholly inside (computed without overflow,
// whatever the peer sent).
std::optional<size_t> slot_offset(uint64_t slot, uint64_t bytes, size_t stride, size_t head);

}  // namespace cohort::handoff
