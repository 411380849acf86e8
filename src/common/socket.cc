#include "common/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>

#include <fmt/core.h>

#include "cohort/error.h"

namespace cohort::net {

uint16_t Address::port() const {
  if (family() == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&storage)->sin_port);
  if (family() == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_port);
  return 0;
}

void Address::set_port(uint16_t port) {
  if (family() == AF_INET) reinterpret_cast<sockaddr_in*>(&storage)->sin_port = htons(port);
  if (family() == AF_INET6) reinterpret_cast<sockaddr_in6*>(&storage)->sin6_port = htons(port);
}

std::string Address::host() const {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (family() == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&storage)->sin_addr, buf, sizeof buf);
  } else if (family() == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&storage)->sin6_addr, buf, sizeof buf);
  } else {
    return "?";
  }
  return buf;
}

std::string Address::to_string() const {
  if (family() == AF_INET6) return fmt::format("[{}]:{}", host(), port());
  return fmt::format("{}:{}", host(), port());
}

std::string errno_string(const std::string& what, int err) {
  return fmt::format("{}: {}", what, std::strerror(err));
}

Address resolve(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string service = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    throw ConfigError(fmt::format("cannot resolve host '{}': {}", host, gai_strerror(rc)));
  }
  // Prefer IPv4 when both exist: loopback and cluster addresses here are IPv4.
  addrinfo* pick = res;
  for (addrinfo* p = res; p != nullptr; p = p->ai_next) {
    if (p->ai_family == AF_INET) {
      pick = p;
      break;
    }
  }
  Address a;
  std::memcpy(&a.storage, pick->ai_addr, pick->ai_addrlen);
  a.length = pick->ai_addrlen;
  freeaddrinfo(res);
  return a;
}

std::string route_address_to(const std::string& host) {
  Address to = resolve(host, 9);
  UniqueFd fd(::socket(to.family(), SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd) throw Error(errno_string("socket", errno));
  // connect() on a UDP socket sends nothing: it only chooses the route and the source address.
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&to.storage), to.length) != 0)
    throw Error(errno_string(fmt::format("no route to {}: connect", host), errno));
  return local_address(fd.get()).host();
}

std::pair<std::string, uint16_t> split_host_port(const std::string& s) {
  std::string host;
  std::string port;
  if (!s.empty() && s[0] == '[') {
    auto close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':') {
      throw ConfigError(fmt::format("malformed address '{}': expected [ipv6]:port", s));
    }
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    auto colon = s.rfind(':');
    if (colon == std::string::npos) {
      throw ConfigError(fmt::format("malformed address '{}': expected host:port", s));
    }
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  char* end = nullptr;
  long p = std::strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p < 0 || p > 65535) {
    throw ConfigError(fmt::format("malformed address '{}': port must be 0-65535", s));
  }
  return {host, static_cast<uint16_t>(p)};
}

void set_nonblocking(int fd, bool on) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0) throw Error(errno_string("fcntl(F_GETFL)", errno));
  flags = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  if (fcntl(fd, F_SETFL, flags) < 0) throw Error(errno_string("fcntl(F_SETFL)", errno));
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void set_keepalive(int fd, int idle_s, int interval_s, int count) {
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof idle_s);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof interval_s);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
}

UniqueFd listen_tcp(const std::string& host, uint16_t port, int backlog, bool nonblocking) {
  Address a = resolve(host, port, /*passive=*/true);
  UniqueFd fd(::socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0));
  if (!fd) throw Error(errno_string("socket", errno));
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a.storage), a.length) != 0) {
    int err = errno;
    if (err == EADDRINUSE) {
      // The fact only: what to do instead depends on where the port came from, which the caller knows
      // (the launcher, `cohort store serve`, a rank 0 that hosts the store at MASTER_PORT).
      throw ConfigError(fmt::format("port {} on {} is already in use", port, host.empty() ? "*" : host));
    }
    throw ConfigError(errno_string(fmt::format("bind to {}", a.to_string()), err));
  }
  if (::listen(fd.get(), backlog) != 0) {
    // With SO_REUSEADDR two processes may both bind a port that neither listens on yet; the second to
    // listen is the one told it is taken (two launchers started at once with one --rdzv-endpoint).
    if (errno == EADDRINUSE)
      throw ConfigError(fmt::format("port {} on {} is already in use", port, host.empty() ? "*" : host));
    throw Error(errno_string("listen", errno));
  }
  return fd;
}

Address local_address(int fd) {
  Address a;
  a.length = sizeof a.storage;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a.storage), &a.length);
  return a;
}

Address peer_address(int fd) {
  Address a;
  a.length = sizeof a.storage;
  getpeername(fd, reinterpret_cast<sockaddr*>(&a.storage), &a.length);
  return a;
}

UniqueFd connect_tcp(const Address& addr, Deadline deadline) {
  UniqueFd fd(::socket(addr.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) throw Error(errno_string("socket", errno));
  int rc = ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr.storage), addr.length);
  if (rc != 0 && errno != EINPROGRESS) {
    throw PeerLostError(errno_string(fmt::format("connect to {}", addr.to_string()), errno));
  }
  if (rc != 0) {
    pollfd p{fd.get(), POLLOUT, 0};
    for (;;) {
      int n = ::poll(&p, 1, deadline.poll_ms());
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) {
        throw TimeoutError(fmt::format("connect to {}: no answer before the deadline", addr.to_string()));
      }
      break;
    }
    int err = 0;
    socklen_t len = sizeof err;
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) throw PeerLostError(errno_string(fmt::format("connect to {}", addr.to_string()), err));
  }
  set_nonblocking(fd.get(), false);
  set_nodelay(fd.get());
  return fd;
}

void send_all(int fd, const void* data, size_t len, Deadline deadline, const std::string& peer) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pf{fd, POLLOUT, 0};
      int r = ::poll(&pf, 1, deadline.poll_ms());
      if (r == 0) throw TimeoutError(fmt::format("send to {}: deadline passed", peer));
      continue;
    }
    throw PeerLostError(errno_string(fmt::format("send to {}", peer), errno));
  }
}

void recv_all(int fd, void* data, size_t len, Deadline deadline, const std::string& peer) {
  char* p = static_cast<char*>(data);
  while (len > 0) {
    ssize_t n = ::recv(fd, p, len, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) throw PeerLostError(fmt::format("{} closed the connection", peer));
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd pf{fd, POLLIN, 0};
      int r = ::poll(&pf, 1, deadline.poll_ms());
      if (r == 0) throw TimeoutError(fmt::format("receive from {}: deadline passed", peer));
      continue;
    }
    throw PeerLostError(errno_string(fmt::format("receive from {}", peer), errno));
  }
}

std::string hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

std::vector<std::string> interface_addresses(const std::string& spec, const std::string& setting) {
  // The entries: interface names, and subnets as (network, mask) in host byte order.
  std::vector<std::string> names;
  std::vector<std::pair<uint32_t, uint32_t>> subnets;
  size_t start = 0;
  while (start <= spec.size()) {
    size_t comma = spec.find(',', start);
    std::string entry = spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    start = comma == std::string::npos ? spec.size() + 1 : comma + 1;
    if (entry.empty()) continue;
    auto slash = entry.find('/');
    if (slash == std::string::npos) {
      names.push_back(entry);
      continue;
    }
    in_addr net{};
    char* end = nullptr;
    long bits = std::strtol(entry.c_str() + slash + 1, &end, 10);
    if (inet_pton(AF_INET, entry.substr(0, slash).c_str(), &net) != 1 || *end != '\0' || slash + 1 == entry.size() ||
        bits < 0 || bits > 32)
      throw ConfigError(fmt::format("{}={}: '{}' is neither an interface name nor an IPv4 subnet such as 10.0.0.0/8",
                                    setting, spec, entry));
    uint32_t mask = bits == 0 ? 0 : ~uint32_t(0) << (32 - bits);
    subnets.emplace_back(ntohl(net.s_addr) & mask, mask);
  }
  if (names.empty() && subnets.empty()) throw ConfigError(fmt::format("{}='{}': names no interface", setting, spec));
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) throw Error(errno_string("getifaddrs", errno));
  std::vector<std::string> out, seen;
  for (ifaddrs* i = list; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
    const uint32_t addr = ntohl(reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr);
    char text[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof text);
    seen.push_back(fmt::format("{} {}", i->ifa_name, text));
    bool match = false;
    for (const auto& n : names) match = match || n == i->ifa_name;
    for (const auto& [network, mask] : subnets) match = match || (addr & mask) == network;
    if (match) out.emplace_back(text);
  }
  freeifaddrs(list);
  if (out.empty()) {
    std::string have;
    for (const auto& s : seen) have += (have.empty() ? "" : ", ") + s;
    throw ConfigError(fmt::format("{}={}: no interface of this host ({}) matches; its IPv4 interfaces: {}", setting,
                                  spec, hostname(), have.empty() ? std::string("none") : have));
  }
  return out;
}

sockaddr_un abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(addr.sun_path))
    throw InvalidArgument(fmt::format("abstract socket name '{}' is longer than {} bytes", name, sizeof(addr.sun_path) - 1));
  addr.sun_path[0] = '\0';  // abstract namespace
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

ssize_t send_with_fds(int sock, const void* data, size_t len, const std::vector<int>& fds, int flags) {
  if (fds.empty() || fds.size() > kMaxPassedFds) {
    errno = EINVAL;
    return -1;
  }
  iovec iov{const_cast<void*>(data), len};
  alignas(cmsghdr) char control[CMSG_SPACE(kMaxPassedFds * sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
  std::memcpy(CMSG_DATA(cm), fds.data(), fds.size() * sizeof(int));
  return ::sendmsg(sock, &msg, flags | MSG_NOSIGNAL);
}

ssize_t recv_with_fds(int sock, void* data, size_t len, std::vector<UniqueFd>* fds, int flags) {
  iovec iov{data, len};
  alignas(cmsghdr) char control[CMSG_SPACE(kMaxPassedFds * sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t r = ::recvmsg(sock, &msg, flags | MSG_CMSG_CLOEXEC);
  if (r < 0) return r;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
      fds->emplace_back(fd);
    }
  }
  return r;
}

}  // namespace cohort::net
