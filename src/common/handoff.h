#pragma once
// The memfd handoff: how processes of one host pass memory to each other. The shared-memory
// collectives' segment (local rank 0 to the others), the shm transport's rings (each pair of ranks
// swaps them) and a parameter server's tables (server to worker) all go through it: one side listens
// on an abstract Unix socket (Listener), the other connects (connect), and each message is one
// versioned hello (common/handoff_wire.h) with its descriptors attached (send, receive).
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
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/fd.h"
#include "common/handoff_wire.h"

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

// ---- the protocol ----

// A hello received with its descriptors (checked) and its connection (for the reply).
struct Received {
  UniqueFd sock;
  Credentials from;  // the sender (SO_PEERCRED)
  Hello hello{};
  std::vector<UniqueFd> fds;
};

// Whom a side waits for, and what their hello must say.
struct Expect {
  uint64_t scope = 0;            // the hello's scope (scope_of the name both ends agreed on)
  std::map<uint32_t, int> pids;  // role -> the pid it must have (0: any process of this uid)
  std::string role = "rank";     // what a role is called, for log lines ("local rank")
  uint16_t fds = 0;              // how many descriptors the hello attaches
  std::string awaited() const;   // "rank(s) 1-3"
};

// Sends `hello` with `fds` attached (their count goes in hello.fds), waiting for room until `deadline`.
// Throws TimeoutError, or PeerLostError when the peer is gone; `to` names it ("rank 3").
void send(int sock, Hello hello, const std::vector<int>& fds, Deadline deadline, const std::string& to);

// The one hello of the process at the other end of `sock` (checked when it connected), from a role of
// `expect`, with its descriptors checked; nullopt when nothing came before `until`. Throws
// PeerLostError when the peer closed instead, MismatchError when it sent anything else; `from` names it.
std::optional<Received> receive(int sock, const Expect& expect, Deadline until, const std::string& from);

// Connects to the listener on abstract socket `name`, waiting until `deadline` for it to listen, and
// checks that the process listening is `expected_pid` (0: any process of this uid), which is `whom`
// ("rank 3"): whoever listens on a published name gets what this process sends next. Throws
// TimeoutError, or PeerLostError naming the process that holds the name.
UniqueFd connect(const std::string& name, int expected_pid, const std::string& whom, Deadline deadline);

// The side that waits: an abstract SOCK_SEQPACKET socket (no file, no permissions: every user sees its
// name in /proc/net/unix).
class Listener {
 public:
  // Throws Error when `name` cannot be bound (taken). `log_as` starts each refusal's log line.
  Listener(const std::string& name, int backlog, std::string log_as);
  // Connections that never said hello are refused now, each with its line.
  ~Listener();

  // The next peer that passes every check, or nullopt at `until` (a timeout, or time to say who is
  // missing: the caller's to say). A peer must run as this uid and be the process of one of expect's
  // roles (checked before anything is read), then say a hello `receive` would take, for its own role.
  // Any other is refused with one warning line, and the wait goes on; a peer that never speaks holds
  // nobody up. The caller removes the roles it served.
  std::optional<Received> accept(const Expect& expect, Deadline until);

 private:
  struct Pending {
    UniqueFd sock;
    Credentials who;
  };
  void refuse(const Credentials& who, const std::string& why) const;

  std::string name_;
  std::string log_as_;
  UniqueFd fd_;
  std::vector<Pending> pending_;
};

}  // namespace cohort::handoff
