#pragma once
// The messages of the shared-memory hand-offs, over abstract Unix sockets between the processes of one
// host, and the checks of what a peer sent, as pure functions (fuzzed by fuzz/shm_handoff_fuzz.cc):
//  * the segment hello (segment.cc): a local rank asks local rank 0 for the group's segment, which
//    answers with the segment's size and its memfd attached;
//  * the point-to-point hello (shm_transport.cc): two ranks exchange their memfds and eventfds, and
//    each says which ring of its memfd the other writes.
// An abstract socket has no permissions: the process at the other end is checked first
// (common/handoff.h), and then every field it sent, before it sizes or indexes anything
// (docs/security.md, "Shared memory on one host").

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace cohort::shm::handoff_wire {

inline constexpr uint32_t kSegmentHelloMagic = 0x53484d31;  // "SHM1"

struct SegmentHello {
  uint32_t magic;
  uint32_t local_rank;
  uint32_t local_size;
  uint32_t reserved;
  uint64_t bytes;  // the segment size the asking rank expects
};
static_assert(sizeof(SegmentHello) == 24, "segment hello layout");

// Checks the `n` bytes a local rank sent local rank 0 of a group of `local_size` ranks and a segment of
// `bytes` bytes: empty when they are a hello of another local rank (1 <= local_rank < local_size) with
// the same local size and segment size, else why not (one line). `*out` gets the hello whenever `n` is
// a hello's size. (Whether that local rank was served already is the caller's to check.)
std::string check_segment_hello(const void* data, size_t n, int local_size, uint64_t bytes, SegmentHello* out);

inline constexpr uint32_t kP2pHelloMagic = 0x50534843;  // "CHSP"

struct P2pHello {
  uint32_t magic;
  uint32_t rank;
  uint64_t scope;
  uint64_t map_bytes;   // the size of the sender's memfd
  uint64_t ring_bytes;  // the size of each of its rings
  uint64_t your_slot;   // index of the ring the receiver of this hello writes into, in the sender's memfd
};
static_assert(sizeof(P2pHello) == 40, "shm point-to-point hello layout");

// Checks the `n` bytes of a point-to-point hello against this transport's scope hash and ring size:
// empty when they match, else why not. (The rank is the caller's to check: an acceptor takes lower
// ranks, a dialer expects the rank it dialed.) `*out` gets the hello whenever `n` is a hello's size.
std::string check_p2p_hello(const void* data, size_t n, uint64_t scope, uint64_t ring_bytes, P2pHello* out);

// Where, in a peer's memfd of `map_bytes` bytes laid out as a `line`-byte doorbell then rings of
// `stride` bytes, ring `slot` starts: nullopt when that ring does not lie wholly inside (computed
// without overflow, whatever the peer sent).
std::optional<size_t> p2p_ring_offset(uint64_t slot, uint64_t map_bytes, size_t stride, size_t line);

}  // namespace cohort::shm::handoff_wire
