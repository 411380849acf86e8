#include "transport/shm/segment.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cohort/error.h"
#include "cohort/store.h"
#include "common/fd.h"
#include "common/handoff.h"
#include "common/log.h"
#include "common/socket.h"
#include "transport/shm/handoff_wire.h"

namespace cohort::shm {
namespace {

using Hello = handoff_wire::SegmentHello;

[[noreturn]] void throw_errno(const std::string& what) {
  throw Error(fmt::format("shm: {}: {}", what, std::strerror(errno)));
}

void wait_fd(int fd, short events, Deadline deadline, const std::string& what) {
  pollfd p{fd, events, 0};
  for (;;) {
    int r = ::poll(&p, 1, deadline.poll_ms(100));
    if (r > 0) return;
    if (r < 0 && errno != EINTR) throw_errno("poll while " + what);
    if (deadline.expired()) throw TimeoutError(fmt::format("shm: timed out {}", what));
  }
}

void send_exact(int fd, const void* data, size_t n, Deadline deadline, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
    } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
      wait_fd(fd, POLLOUT, deadline, what);
    } else {
      throw_errno(what);
    }
  }
}

void recv_exact(int fd, void* data, size_t n, Deadline deadline, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    wait_fd(fd, POLLIN, deadline, what);
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r == 0) {
      throw PeerLostError(fmt::format("shm: connection closed while {}", what));
    } else if (errno != EAGAIN && errno != EINTR) {
      throw_errno(what);
    }
  }
}

// Maps the whole segment and faults in the pages of `populate` now rather than inside the first timed
// collectives (the rest are mapped when first touched: minor faults, the pages exist once their owner
// touched them).
void* map_fd(int fd, size_t bytes, SegmentRange populate) {
  const size_t begin = std::min(populate.offset, bytes), end = begin + std::min(populate.bytes, bytes - begin);
  const bool whole = begin == 0 && end == bytes;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | (whole ? MAP_POPULATE : 0), fd, 0);
  if (p == MAP_FAILED) throw_errno(fmt::format("mmap of {} bytes", bytes));
  if (whole || end == begin) return p;
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  char* first = static_cast<char*>(p) + begin / page * page;
  char* last = static_cast<char*>(p) + end;
  // MADV_POPULATE_WRITE (Linux 5.14): allocates and maps the range in one call. Older kernels refuse it
  // (EINVAL): read one byte per page instead (a read fault on a shared memfd mapping allocates the
  // page too), which cannot race with anything a peer writes.
  if (::madvise(first, static_cast<size_t>(last - first), MADV_POPULATE_WRITE) != 0) {
    for (const volatile char* q = first; q < last; q += page) (void)*q;
  }
  return p;
}

}  // namespace

Segment Segment::establish(const std::string& address, int local_rank, int local_size, size_t bytes,
                           Deadline deadline, SegmentRange populate, std::vector<int>* pids) {
  if (pids && pids->size() != static_cast<size_t>(local_size))
    throw InvalidArgument(fmt::format("shm: {} pids for a group of {} local ranks", pids->size(), local_size));
  // The process local rank k must be (0: any of this user's).
  auto pid_of = [&](int k) { return pids ? (*pids)[static_cast<size_t>(k)] : 0; };
  socklen_t addr_len = 0;
  sockaddr_un addr = net::abstract_address(address, &addr_len);
  Segment seg;
  seg.size_ = bytes;
  if (local_rank == 0) {
    UniqueFd mem(::memfd_create("cohort-shm", MFD_CLOEXEC));
    if (!mem) throw_errno("memfd_create");
    if (::ftruncate(mem.get(), static_cast<off_t>(bytes)) != 0) throw_errno(fmt::format("ftruncate to {} bytes", bytes));
    seg.data_ = map_fd(mem.get(), bytes, populate);
    if (local_size == 1) return seg;
    UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!listener) throw_errno("socket");
    if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), addr_len) != 0)
      throw_errno(fmt::format("bind abstract socket '{}'", address));
    if (::listen(listener.get(), local_size) != 0) throw_errno("listen");
    std::vector<bool> seen(static_cast<size_t>(local_size), false);
    for (int served = 1; served < local_size; ++served) {
      const std::string what = fmt::format("local rank 0 waiting for {} of {} local ranks to map the segment",
                                           local_size - served, local_size - 1);
      wait_fd(listener.get(), POLLIN, deadline, what);
      UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!conn) {
        if (errno == EAGAIN || errno == EINTR) {
          --served;
          continue;
        }
        throw_errno("accept");
      }
      // Before reading anything: a process of another user, or none of the group's, gets nothing and
      // cannot hold this rank up by never saying hello.
      const handoff::Credentials peer = handoff::peer_of(conn.get());
      std::string refused = handoff::refusal(peer, 0, "");
      if (refused.empty() && pids) {
        bool member = false;
        for (int k = 1; k < local_size; ++k)
          member = member || (!seen[static_cast<size_t>(k)] && (pid_of(k) == 0 || pid_of(k) == peer.pid));
        if (!member) refused = fmt::format("pid {} is none of the group's local ranks", peer.pid);
      }
      Hello hello{};
      if (refused.empty()) {
        recv_exact(conn.get(), &hello, sizeof hello, deadline, "reading a local rank's hello");
        // (Unsigned: a local rank read as a negative int would index the group's pids out of bounds.)
        if (hello.local_rank > 0 && hello.local_rank < static_cast<uint32_t>(local_size))
          refused = handoff::refusal(peer, pid_of(static_cast<int>(hello.local_rank)),
                                     fmt::format("local rank {}", hello.local_rank));
      }
      if (!refused.empty()) {
        log::warn("shm: local rank 0 refused a connection to the segment's socket '{}': {}", address, refused);
        --served;
        continue;
      }
      std::string why = handoff_wire::check_segment_hello(&hello, sizeof hello, local_size, bytes, &hello);
      if (why.empty() && seen[hello.local_rank])
        why = fmt::format("local rank {} asked for the segment twice", hello.local_rank);
      if (!why.empty()) throw MismatchError("shm: " + why);
      seen[hello.local_rank] = true;
      if (pids) (*pids)[hello.local_rank] = peer.pid;
      // Reply: the size again, with the memfd attached.
      uint64_t reply = bytes;
      wait_fd(conn.get(), POLLOUT, deadline, "sending the segment");
      if (net::send_with_fds(conn.get(), &reply, sizeof reply, {mem.get()}, 0) != static_cast<ssize_t>(sizeof reply))
        throw_errno("sendmsg of the segment descriptor");
    }
    return seg;
  }

  // Other local ranks: connect (rank 0 may not be listening yet), say hello, receive the descriptor.
  UniqueFd conn;
  for (;;) {
    conn = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!conn) throw_errno("socket");
    if (::connect(conn.get(), reinterpret_cast<sockaddr*>(&addr), addr_len) == 0) break;
    if (errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN && errno != EINTR)
      throw_errno(fmt::format("connect to local rank 0 at '{}'", address));
    if (deadline.expired())
      throw TimeoutError(fmt::format("shm: local rank {} timed out waiting for local rank 0 to offer the segment",
                                     local_rank));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // The name came from the store, but anyone could have bound it first: only local rank 0's process
  // may hand this rank memory (SO_PEERCRED of a connected socket: the process that listens).
  const handoff::Credentials owner = handoff::peer_of(conn.get());
  if (std::string why = handoff::refusal(owner, pid_of(0), "local rank 0"); !why.empty())
    throw Error(fmt::format("shm: local rank {} will not take the segment offered at '{}': {}", local_rank, address,
                            why));
  if (pids) (*pids)[0] = owner.pid;
  int flags = ::fcntl(conn.get(), F_GETFL);
  ::fcntl(conn.get(), F_SETFL, flags | O_NONBLOCK);
  Hello hello{handoff_wire::kSegmentHelloMagic, static_cast<uint32_t>(local_rank), static_cast<uint32_t>(local_size), 0,
              bytes};
  send_exact(conn.get(), &hello, sizeof hello, deadline, "sending hello to local rank 0");
  uint64_t reply = 0;
  wait_fd(conn.get(), POLLIN, deadline, fmt::format("local rank {} waiting for the segment from local rank 0", local_rank));
  std::vector<UniqueFd> fds;
  ssize_t r = net::recv_with_fds(conn.get(), &reply, sizeof reply, &fds, 0);
  if (r == 0) throw PeerLostError(fmt::format("shm: local rank 0 closed the connection instead of sending the segment "
                                              "(local rank {} joined with local size {}, {} bytes)",
                                              local_rank, local_size, bytes));
  if (r != static_cast<ssize_t>(sizeof reply)) throw_errno("recvmsg of the segment descriptor");
  if (fds.size() != 1) throw Error("shm: local rank 0 sent no descriptor");
  UniqueFd mem = std::move(fds[0]);
  if (std::string why = handoff::too_small(mem.get(), bytes, "the segment local rank 0 sent"); !why.empty())
    throw MismatchError(fmt::format("shm: local rank {}: {}", local_rank, why));
  seg.data_ = map_fd(mem.get(), bytes, populate);
  return seg;
}

Segment::~Segment() {
  if (data_ != nullptr) ::munmap(data_, size_);
}

Segment::Segment(Segment&& other) noexcept : data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

std::string random_address(const std::string& job_key) {
  std::random_device rd;
  uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  std::string key = job_key.size() > 60 ? job_key.substr(job_key.size() - 60) : job_key;
  return fmt::format("cohort-shm/{}/{}-{:016x}", key, ::getpid(), r);
}

std::string rendezvous_address(Store& store, const std::string& key_prefix, int local_rank) {
  const std::string key = key_prefix + "/shm/address";
  if (local_rank == 0) {
    std::string address = random_address(key_prefix);
    store.set(key, address);
    return address;
  }
  return store.get(key);
}

}  // namespace cohort::shm
