#pragma once
// Shared-memory point-to-point transport ("shm"): same semantics as TCP (envelope matching on
// (peer, tag, sub), exact receive sizes, signature compare -> MismatchError, first error sticks,
// failure notices), for peers on the same host (equal HostIdentity::shm_key()).
//
// Why this design:
// - One single-producer single-consumer byte ring per ordered pair of ranks. The ring s->r lives
//   in a memfd that the *receiver* r creates (one memfd per rank holds the rings of its shm peers
//   only; the hello tells each sender which slot is its own). A ring is a byte stream, exactly
//   like a TCP connection: a 48-byte message header (tag, sub, signature, total size) followed by
//   the payload. So messages larger than the ring simply stream through it, and the receive side
//   reuses TCP's proven structure: a posted receive gets the payload copied straight from the ring
//   into the user buffer (one copy on each side: sender -> ring, ring -> user); a message that
//   arrives first is buffered whole ("unexpected") and copied once more when its receive comes.
//   The receiver always drains its rings into unexpected buffers, so two large sends crossing
//   never deadlock.
// - Nothing ever has a name in /dev/shm or any file system: the memfds are anonymous and are
//   handed over with SCM_RIGHTS on an *abstract* Unix socket (SOCK_SEQPACKET) named in the
//   descriptor. The memory goes away with the last process that maps it, however the job ends.
// - That socket stays open for the life of the transport and is the control channel: it carries
//   failure notices (notify_peers) and a goodbye on orderly destruction, and the kernel closes it
//   when the peer process dies (SIGKILL included). So a dead peer is seen by poll(2) as a hang-up
//   within one sleep slice; unlike a pidfd this also works for peers that are threads of the same
//   process (the conformance suite runs ranks as threads).
// - Wake-ups: each rank has an eventfd (passed with its memfd) and a `sleeping` word in its
//   memfd. poll() makes progress without system calls (the communicator spins on poll(0)); before
//   it sleeps it sets `sleeping`, re-checks its rings, then sleeps in poll(2) on its eventfd and
//   its peers' sockets. A peer that moved a ring index (data written, or space freed) writes the
//   eventfd only when `sleeping` is set (seq_cst on both sides: no lost wake-up).
// - Selection: descriptor() = "shm;<shm_key>;<socket name>"; can_reach() accepts equal shm keys.
//   It is registered above tcp, so same-host peers use it and the others use TCP.

#include <memory>

#include "transport/transport.h"

namespace cohort::transport {

std::unique_ptr<Transport> make_shm_transport(const TransportOptions& options);

}  // namespace cohort::transport
