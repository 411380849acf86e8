#pragma once
// Checks on a handoff of memory between processes of one host: the shared-memory collectives'
// segment, the shm transport's rings and the parameter server's tables all pass memfds over abstract
// Unix sockets, and all three check the other end and the memory with these functions.
//
// Why: an abstract Unix socket has no owner and no permissions, and /proc/net/unix lists its name to
// every user of the host, so any process there can connect to one, or answer on one. A name or a
// hello proves nothing. What the kernel vouches for is the credentials of the process at the other
// end (SO_PEERCRED: the process that called connect(), or the one that called listen() for the
// socket that connect() returned), recorded when the connection was made. A handoff goes on only
// with the process it expects: one of this process's effective uid whose pid is the one that rank
// published in the job's store. And a memfd is mapped only once fstat(2) has shown that it holds
// every byte the mapping will touch: a smaller one kills this process with SIGBUS at the first touch
// past its end.

#include <cstdint>
#include <string>

namespace cohort::handoff {

// The process at the other end of a connected Unix socket, as the kernel recorded it.
struct Credentials {
  int pid = 0;
  uint32_t uid = 0;
  uint32_t gid = 0;
};

// SO_PEERCRED of `sock`. Throws Error when the kernel cannot say (not a Unix socket).
Credentials peer_of(int sock);

// Why `peer` may not take part, in words for a log line; "" when it may: it runs as this process's
// effective uid and, when `expected_pid` > 0, it is that process. `whom` names what it was expected to
// be ("rank 3", "local rank 0"). expected_pid 0 checks the uid only (a caller that agreed the socket's
// name out of band, with no store to publish pids in).
std::string refusal(const Credentials& peer, int expected_pid, const std::string& whom);

// Why the memory behind descriptor `fd` cannot be mapped `bytes` long, in words; "" when it can (it
// holds at least `bytes` bytes). `what` names the memory ("rank 2's rings").
std::string too_small(int fd, uint64_t bytes, const std::string& what);

// This process's pid namespace ("pid:[4026531836]"), "" if unknown: a published pid can be compared
// with SO_PEERCRED's only where both processes are in the same one.
std::string pid_namespace();

}  // namespace cohort::handoff
