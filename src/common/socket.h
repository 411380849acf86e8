#pragma once
// Small, blocking-with-deadline socket helpers shared by the store, the launcher and the TCP
// transport. Anything that fails throws a cohort::Error whose message names the address and the
// system call (e.g. "connect to 10.0.0.2:29500: Connection refused").

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/deadline.h"
#include "common/fd.h"

namespace cohort::net {

// A resolved socket address (IPv4 or IPv6).
struct Address {
  sockaddr_storage storage{};
  socklen_t length = 0;

  int family() const { return storage.ss_family; }
  uint16_t port() const;
  void set_port(uint16_t port);
  // "1.2.3.4:80" or "[::1]:80".
  std::string to_string() const;
  // Numeric host only ("1.2.3.4", "::1").
  std::string host() const;
};

// Resolves host (name or numeric; "" means the wildcard address) and port. Throws ConfigError.
Address resolve(const std::string& host, uint16_t port, bool passive = false);

// This machine's address on the route to `host` (the source address the kernel picks for it, found
// with an unconnected-in-practice UDP socket): where a peer that reaches `host` can reach us. Throws
// ConfigError when `host` does not resolve, Error when there is no route.
std::string route_address_to(const std::string& host);

// "host:port" or "[v6]:port" -> (host, port). Throws ConfigError on a malformed string.
std::pair<std::string, uint16_t> split_host_port(const std::string& s);

// strerror(errno) formatted as "what: message".
std::string errno_string(const std::string& what, int err);

// Listening TCP socket bound to host:port (port 0: chosen by the OS). SO_REUSEADDR, CLOEXEC.
// A port in use throws ConfigError naming it.
UniqueFd listen_tcp(const std::string& host, uint16_t port, int backlog, bool nonblocking);
// The address a bound socket actually has (to learn the port the OS chose).
Address local_address(int fd);
Address peer_address(int fd);

// Connects with a deadline (non-blocking connect + poll). Returns a blocking socket with
// TCP_NODELAY set. Throws PeerLostError (refused/unreachable) or TimeoutError.
UniqueFd connect_tcp(const Address& addr, Deadline deadline);

void set_nonblocking(int fd, bool on);
void set_nodelay(int fd);
// Enables TCP keep-alive probing so a dead host is noticed in about idle+interval*count seconds.
void set_keepalive(int fd, int idle_s, int interval_s, int count);

// Sends/receives exactly `len` bytes on a blocking or non-blocking socket, polling with the
// deadline. recv_all throws PeerLostError when the peer closes before `len` bytes came.
void send_all(int fd, const void* data, size_t len, Deadline deadline, const std::string& peer);
void recv_all(int fd, void* data, size_t len, Deadline deadline, const std::string& peer);

// This machine's host name.
std::string hostname();

// The IPv4 addresses of this host's interfaces that `spec` selects, in interface order: a comma-separated
// list of interface names (eth0, ib0, lo) and IPv4 subnets (10.1.0.0/16), as Open MPI's
// btl_tcp_if_include / oob_tcp_if_include take them (loopback, too, when named). Throws ConfigError naming `setting` and this host's interfaces when an entry is
// malformed or nothing matches.
std::vector<std::string> interface_addresses(const std::string& spec, const std::string& setting);

// Unix sockets in the abstract namespace (no file is created; the name goes away with the socket).
// Throws InvalidArgument naming `name` when it does not fit sun_path.
sockaddr_un abstract_address(const std::string& name, socklen_t* len);

// Unix sockets: one message of `len` bytes with descriptors attached (SCM_RIGHTS, at most
// kMaxPassedFds). Returns sendmsg's result (-1 with errno set).
constexpr size_t kMaxPassedFds = 4;
ssize_t send_with_fds(int sock, const void* data, size_t len, const std::vector<int>& fds, int flags);
// Receives up to `len` bytes and the descriptors attached (close-on-exec), appended to *fds, which
// owns them (so a malformed message leaks nothing). Returns recvmsg's result (-1 with errno set).
ssize_t recv_with_fds(int sock, void* data, size_t len, std::vector<UniqueFd>* fds, int flags);

}  // namespace cohort::net
