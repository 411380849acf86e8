#include "common/handoff.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "cohort/error.h"
#include "common/log.h"
#include "common/socket.h"
#include "common/strings.h"

namespace cohort::handoff {

Credentials peer_of(int sock) {
  ucred c{};
  socklen_t len = sizeof c;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &c, &len) != 0)
    throw Error(fmt::format("cannot read the credentials of a Unix socket's peer (SO_PEERCRED): {}",
                            std::strerror(errno)));
  return Credentials{int(c.pid), uint32_t(c.uid), uint32_t(c.gid)};
}

std::string refusal(const Credentials& peer, int expected_pid, const std::string& whom) {
  const uint32_t uid = ::geteuid();
  if (peer.uid != uid)
    return fmt::format("pid {} runs as uid {}, not as this job's uid {}", peer.pid, peer.uid, uid);
  // pid 0: the peer is in a pid namespace this process cannot see; it cannot be the pid published.
  if (expected_pid > 0 && peer.pid != expected_pid)
    return fmt::format("pid {} is not {} (pid {})", peer.pid, whom, expected_pid);
  return {};
}

std::string too_small(int fd, uint64_t bytes, const std::string& what) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return fmt::format("cannot fstat {}: {}", what, std::strerror(errno));
  // Memory files only (a memfd; shmem and hugetlbfs are the only files that have seals): a file on a
  // disk could be truncated under the mapping, or be the wrong thing to map altogether.
  if (!S_ISREG(st.st_mode) || ::fcntl(fd, F_GET_SEALS) < 0)
    return fmt::format("{} is not a memory file (st_mode {:o})", what, st.st_mode);
  if (uint64_t(st.st_size) < bytes)
    return fmt::format("{} holds {} bytes; {} are needed", what, uint64_t(st.st_size), bytes);
  return {};
}

std::string pid_namespace() {
  char buf[64];
  const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof buf);
  return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

namespace {

enum class Read { kNothing, kClosed, kBad, kGot };

// One message from `sock`, which has something to read (or nothing yet: kNothing): kGot with `*out`'s
// hello and descriptors when it is a hello that `expect` takes (a role of it, its descriptors as
// `expect` and the hello say), else why not in `*why`.
Read read_hello(int sock, const Expect& expect, Received* out, std::string* why) {
  // One byte more than a hello: a longer message is seen as such (SOCK_SEQPACKET truncates it), not
  // read as a hello.
  char buf[sizeof(Hello) + 1];
  std::vector<UniqueFd> fds;
  const ssize_t n = net::recv_with_fds(sock, buf, sizeof buf, &fds, MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return Read::kNothing;
  if (n == 0 || (n < 0 && errno == ECONNRESET)) {
    *why = "it closed the connection without a hello";
    return Read::kClosed;
  }
  const Hello& h = out->hello;
  *why = n < 0 ? fmt::format("recvmsg: {}", std::strerror(errno))
                : parse_hello(buf, size_t(n), expect.scope, &out->hello);
  if (why->empty() && !expect.pids.count(h.role))
    *why = fmt::format("its hello claims {} {}, which is not awaited ({})", expect.role, h.role, expect.awaited());
  if (why->empty() && (fds.size() != h.fds || h.fds != expect.fds))
    *why = fmt::format("{} descriptor(s) came, its hello says {}, {} are expected", fds.size(), h.fds, expect.fds);
  for (size_t i = 0; i < fds.size() && why->empty(); ++i)
    if (h.sizes[i] > 0) *why = too_small(fds[i].get(), h.sizes[i], fmt::format("the memory of descriptor {}", i));
  if (!why->empty()) return Read::kBad;
  out->fds = std::move(fds);
  return Read::kGot;
}

// Waits until `fd` has `events` or `until` passes (false). Throws Error when poll(2) fails.
bool wait_for(int fd, short events, Deadline until) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, until.poll_ms(100));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) throw Error(fmt::format("poll of a handoff socket: {}", std::strerror(errno)));
    if (until.expired()) return false;
  }
}

}  // namespace

void send(int sock, Hello hello, const std::vector<int>& fds, Deadline deadline, const std::string& to) {
  hello.fds = uint16_t(fds.size());
  for (;;) {
    const ssize_t n = fds.empty() ? ::send(sock, &hello, sizeof hello, MSG_NOSIGNAL | MSG_DONTWAIT)
                                  : net::send_with_fds(sock, &hello, sizeof hello, fds, MSG_DONTWAIT);
    if (n == ssize_t(sizeof hello)) return;
    if (n >= 0 || (errno != EAGAIN && errno != EINTR))
      throw PeerLostError(fmt::format("cannot send the memory handoff's hello to {}: {}", to,
                                      n >= 0 ? "short write" : std::strerror(errno)));
    if (!wait_for(sock, POLLOUT, deadline))
      throw TimeoutError(fmt::format("timed out sending the memory handoff's hello to {}", to));
  }
}

std::optional<Received> receive(int sock, const Expect& expect, Deadline until, const std::string& from) {
  Received got;
  std::string why;
  for (Read r = Read::kNothing; r == Read::kNothing;) {
    if (!wait_for(sock, POLLIN, until)) return std::nullopt;
    r = read_hello(sock, expect, &got, &why);
    if (r == Read::kClosed)
      throw PeerLostError(fmt::format("{} closed the connection instead of sending its hello", from));
    if (r == Read::kBad) throw MismatchError(fmt::format("{} sent no valid memory handoff hello: {}", from, why));
  }
  got.from = peer_of(sock);
  return got;
}

UniqueFd connect(const std::string& name, int expected_pid, const std::string& whom, Deadline deadline) {
  socklen_t len = 0;
  const sockaddr_un addr = net::abstract_address(name, &len);
  for (;;) {
    UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!s) throw Error(fmt::format("socket for a memory handoff: {}", std::strerror(errno)));
    if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), len) == 0) {
      // The name came from the store, but anyone could have bound it first: SO_PEERCRED of a connected
      // socket is the process that listens.
      if (std::string why = refusal(peer_of(s.get()), expected_pid, whom); !why.empty())
        throw PeerLostError(
            fmt::format("will not connect to {}: its socket '{}' is held by another process: {}", whom, name, why));
      return s;
    }
    // Not listening yet (ECONNREFUSED: bound, or not even that), or its backlog is full (EAGAIN).
    if (errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN && errno != EINTR)
      throw PeerLostError(fmt::format("cannot connect to {} at '{}': {}", whom, name, std::strerror(errno)));
    if (deadline.expired())
      throw TimeoutError(fmt::format("timed out waiting for {} to listen on '{}'", whom, name));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Listener::Listener(const std::string& name, int backlog, std::string log_as) : name_(name), log_as_(std::move(log_as)) {
  fd_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd_) throw Error(fmt::format("{}: socket: {}", log_as_, std::strerror(errno)));
  socklen_t len = 0;
  const sockaddr_un addr = net::abstract_address(name, &len);
  if (::bind(fd_.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0 || ::listen(fd_.get(), backlog) != 0)
    throw Error(fmt::format("{}: cannot listen on abstract socket '{}': {}", log_as_, name, std::strerror(errno)));
}

Listener::~Listener() {
  for (const Pending& p : pending_) refuse(p.who, "it connected but never said hello");
}

void Listener::refuse(const Credentials& who, const std::string& why) const {
  log::warn("{}: refused a connection to its socket '{}' (pid {}): {}", log_as_, name_, who.pid, why);
}

std::string Expect::awaited() const {
  std::vector<int> roles;
  for (const auto& [r, pid] : pids) roles.push_back(int(r));
  return str::format_ranges(roles);
}

std::optional<Received> Listener::accept(const Expect& expect, Deadline until) {
  for (;;) {
    std::vector<pollfd> fds{{fd_.get(), POLLIN, 0}};
    for (const Pending& p : pending_) fds.push_back({p.sock.get(), POLLIN, 0});
    const int n = ::poll(fds.data(), fds.size(), until.poll_ms(100));
    if (n < 0 && errno != EINTR) throw Error(fmt::format("{}: poll: {}", log_as_, std::strerror(errno)));
    // The hellos of the connections accepted before (backwards: a refused one is erased).
    for (size_t i = pending_.size(); n > 0 && i-- > 0;) {
      if (fds[i + 1].revents == 0) continue;
      Received got;
      std::string why;
      const Read r = read_hello(pending_[i].sock.get(), expect, &got, &why);
      if (r == Read::kNothing) continue;
      Pending p = std::move(pending_[i]);
      pending_.erase(pending_.begin() + long(i));
      // The hello says which role it is; the kernel says which process: they must agree.
      if (r == Read::kGot)
        why = refusal(p.who, expect.pids.at(got.hello.role), fmt::format("{} {}", expect.role, got.hello.role));
      if (!why.empty()) {
        refuse(p.who, why);
        continue;
      }
      got.sock = std::move(p.sock);
      got.from = p.who;
      return got;
    }
    if (n > 0 && (fds[0].revents & POLLIN)) {
      UniqueFd c(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (c) {
        // Before reading anything: a process of another user, or none of those awaited, gets nothing and
        // cannot hold this side up by never saying hello.
        const Credentials who = peer_of(c.get());
        std::string why = refusal(who, 0, "");
        bool member = false;
        for (const auto& [role, pid] : expect.pids) member = member || pid == 0 || pid == who.pid;
        if (why.empty() && !member)
          why = fmt::format("pid {} is none of the {}s awaited ({})", who.pid, expect.role, expect.awaited());
        if (why.empty()) pending_.push_back(Pending{std::move(c), who});
        else refuse(who, why);
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED) {
        throw Error(fmt::format("{}: accept on '{}': {}", log_as_, name_, std::strerror(errno)));
      }
    }
    if (until.expired()) return std::nullopt;
  }
}

}  // namespace cohort::handoff
