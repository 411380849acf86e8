#include "common/handoff.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "cohort/error.h"

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
  if (!S_ISREG(st.st_mode)) return fmt::format("{} is not a memory file (st_mode {:o})", what, st.st_mode);
  if (uint64_t(st.st_size) < bytes)
    return fmt::format("{} holds {} bytes; {} are needed", what, uint64_t(st.st_size), bytes);
  return {};
}

std::string pid_namespace() {
  char buf[64];
  const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof buf);
  return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

}  // namespace cohort::handoff
