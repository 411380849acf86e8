// shm_intruder: a process that is not part of a job and tries to get into its shared memory the way
// any user of the host could, for the hostile handoff tests (shm_handoff_test.cc). It finds the job's
// abstract socket in /proc/net/unix (listed there for every user), connects, and sends a plausible
// hello with a memfd of its own attached, 4 KiB long where the hello claims far more (mapped whole,
// it would kill the victim with SIGBUS). It prints "sent" once the hello is on its way, then waits for
// the answer:
//   "refused": the victim closed the connection without handing over anything (exit 0);
//   "BREACH ...": the victim sent descriptors back (its memory), exit 1;
//   anything else (socket never seen, no answer in time): a line saying what, exit 2.
//
//   shm_intruder p2p PID RANK CLAIMED     the shm transport of rank RANK (process PID); claims to be
//                                         rank CLAIMED (a lower one, whose hello it would accept)
//   shm_intruder segment PID SIZE BYTES   the collectives segment local rank 0 (process PID) offers
//                                         to SIZE local ranks, BYTES long; claims to be local rank 1
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/fd.h"
#include "common/handoff_wire.h"
#include "common/socket.h"

using namespace cohort;

namespace {

// The first abstract socket in /proc/net/unix whose name starts with `prefix` and contains `part`,
// without its leading '@'; waits up to 10 s for it to appear.
std::string find_socket(const std::string& prefix, const std::string& part) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    std::ifstream f("/proc/net/unix");
    std::string line;
    while (std::getline(f, line)) {
      const size_t at = line.find(" @" + prefix);
      if (at == std::string::npos) continue;
      const std::string name = line.substr(at + 2);
      if (name.find(part) != std::string::npos) return name;
    }
    if (std::chrono::steady_clock::now() > end) return {};
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

// Connected to `name`, or invalid (errno says why). A name appears in /proc/net/unix when it is
// bound, a moment before its owner listens: until then connect(2) is refused, and it is tried again
// (for up to 10 s), as a real peer does. (Giving up at the first refusal made the segment test fail
// about once in 85 runs, when local rank 0 was descheduled between bind and listen.)
UniqueFd connect_to(const std::string& name) {
  socklen_t len = 0;
  sockaddr_un addr = net::abstract_address(name, &len);
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!s) return {};
    if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), len) == 0) return s;
    if (errno != ECONNREFUSED || std::chrono::steady_clock::now() > end) return {};
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// A memfd of 4 KiB: far shorter than any hello claims.
UniqueFd small_memfd() {
  UniqueFd m(::memfd_create("intruder", MFD_CLOEXEC));
  if (m && ::ftruncate(m.get(), 4096) != 0) return {};
  return m;
}

// Waits up to 10 s for the victim's answer and reports it.
int verdict(int sock, const std::string& victim) {
  pollfd p{sock, POLLIN, 0};
  if (::poll(&p, 1, 10000) != 1) {
    std::printf("no answer from %s in 10 s\n", victim.c_str());
    return 2;
  }
  char buf[64];
  std::vector<UniqueFd> fds;
  const ssize_t n = net::recv_with_fds(sock, buf, sizeof buf, &fds, MSG_DONTWAIT);
  if (!fds.empty()) {
    std::printf("BREACH: %s handed %zu descriptor(s) to pid %d (uid %d)\n", victim.c_str(), fds.size(), ::getpid(),
                int(::geteuid()));
    return 1;
  }
  if (n <= 0) {
    std::printf("refused\n");
    return 0;
  }
  std::printf("%s answered %zd bytes without descriptors\n", victim.c_str(), n);
  return 2;
}

// The hello could not be sent: refused, where the victim closed the connection before it came (it
// looked at who connected first); else a line saying why not.
int send_failed(const std::string& name) {
  if (errno == EPIPE || errno == ECONNRESET) {
    std::printf("sent\nrefused: '%s' closed the connection before the hello\n", name.c_str());
    return 0;
  }
  std::printf("could not send a hello to '%s': %s\n", name.c_str(), std::strerror(errno));
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: shm_intruder p2p PID RANK CLAIMED | segment PID SIZE BYTES\n");
    return 2;
  }
  const std::string mode = argv[1], pid = argv[2];
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  UniqueFd mem = small_memfd();
  if (!mem) {
    std::printf("no memfd: %s\n", std::strerror(errno));
    return 2;
  }
  if (mode == "p2p") {
    // The transport's socket: "cohort-p2p/<scope, hex>/<rank>/<pid>-<random>". Its hello (the memfd
    // handoff's, common/handoff_wire.h): the claimed rank, the scope, the sender's memfd sized 1 MiB
    // of rings (the default) and more, the ring size and the receiver's ring slot.
    const int rank = std::atoi(argv[3]), claimed = std::atoi(argv[4]);
    const std::string name = find_socket("cohort-p2p/", "/" + std::to_string(rank) + "/" + pid + "-");
    if (name.empty()) {
      std::printf("rank %d's shm socket never appeared in /proc/net/unix\n", rank);
      return 2;
    }
    const uint64_t scope = std::strtoull(name.substr(11, 16).c_str(), nullptr, 16);
    handoff::Hello hello = handoff::make_hello(scope, uint32_t(claimed));
    hello.fds = 2;
    hello.sizes[0] = 64 + 128 + (1u << 20);
    hello.values[0] = 1u << 20;
    UniqueFd s = connect_to(name);
    UniqueFd event(::eventfd(0, EFD_CLOEXEC));
    if (!s || !event || net::send_with_fds(s.get(), &hello, sizeof hello, {mem.get(), event.get()}, MSG_NOSIGNAL) != sizeof hello)
      return send_failed(name);
    std::printf("sent\n");
    return verdict(s.get(), "rank " + std::to_string(rank));
  }
  if (mode == "segment") {
    // The segment's socket: "cohort-shm/<key>/<pid of local rank 0>-<random>". Its hello: the scope
    // (the name's hash), local rank 1, the local size and the segment's bytes.
    const std::string name = find_socket("cohort-shm/", "/" + pid + "-");
    if (name.empty()) {
      std::printf("the segment's socket never appeared in /proc/net/unix\n");
      return 2;
    }
    handoff::Hello hello = handoff::make_hello(handoff::scope_of(name), 1);
    hello.values[0] = std::strtoull(argv[3], nullptr, 10);
    hello.values[1] = std::strtoull(argv[4], nullptr, 10);
    UniqueFd s = connect_to(name);
    if (!s || ::send(s.get(), &hello, sizeof hello, MSG_NOSIGNAL) != sizeof hello) return send_failed(name);
    std::printf("sent\n");
    return verdict(s.get(), "local rank 0");
  }
  std::fprintf(stderr, "shm_intruder: unknown mode '%s'\n", mode.c_str());
  return 2;
}
