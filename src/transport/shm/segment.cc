#include "transport/shm/segment.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "cohort/error.h"
#include "cohort/store.h"
#include "common/fd.h"
#include "common/handoff.h"

namespace cohort::shm {
namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw Error(fmt::format("shm: {}: {}", what, std::strerror(errno)));
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
  // The memfd handoff (common/handoff.h): scope, the address; role k, local rank k; values, the group's
  // size and the segment's. Local rank 0's reply attaches the memfd, checked before it is mapped.
  const uint64_t scope = handoff::scope_of(address);
  Segment seg;
  seg.size_ = bytes;
  if (local_rank == 0) {
    UniqueFd mem(::memfd_create("cohort-shm", MFD_CLOEXEC));
    if (!mem) throw_errno("memfd_create");
    if (::ftruncate(mem.get(), static_cast<off_t>(bytes)) != 0) throw_errno(fmt::format("ftruncate to {} bytes", bytes));
    seg.data_ = map_fd(mem.get(), bytes, populate);
    if (local_size == 1) return seg;
    handoff::Listener listener(address, local_size, "shm: local rank 0");
    handoff::Expect expect{scope, {}, "local rank", 0};
    for (int k = 1; k < local_size; ++k) expect.pids[uint32_t(k)] = pid_of(k);
    while (!expect.pids.empty()) {
      std::optional<handoff::Received> got = listener.accept(expect, deadline);
      if (!got)
        throw TimeoutError(fmt::format("shm: timed out local rank 0 waiting for local rank(s) {} of {} to map the "
                                       "segment", expect.awaited(), local_size));
      const uint32_t k = got->hello.role;
      // The process is local rank k's: sizes that differ are the job's mistake, not an intruder's.
      if (got->hello.values[0] != uint64_t(local_size) || got->hello.values[1] != bytes)
        throw MismatchError(fmt::format("shm: local rank {} joined with local size {} and {} bytes; local rank 0 has "
                                        "local size {} and {} bytes",
                                        k, got->hello.values[0], got->hello.values[1], local_size, bytes));
      expect.pids.erase(k);
      if (pids) (*pids)[k] = got->from.pid;
      handoff::Hello reply = handoff::make_hello(scope, 0, uint64_t(local_size), bytes);
      reply.sizes[0] = bytes;
      handoff::send(got->sock.get(), reply, {mem.get()}, deadline, fmt::format("local rank {}", k));
    }
    return seg;
  }

  // Other local ranks: connect (rank 0 may not be listening yet), say hello, receive the descriptor.
  const std::string rank0 = fmt::format("local rank 0 (for local rank {})", local_rank);
  UniqueFd conn = handoff::connect(address, pid_of(0), rank0, deadline);
  handoff::send(conn.get(), handoff::make_hello(scope, uint32_t(local_rank), uint64_t(local_size), bytes), {},
                deadline, rank0);
  std::optional<handoff::Received> got =
      handoff::receive(conn.get(), handoff::Expect{scope, {{0, pid_of(0)}}, "local rank", 1}, deadline, "shm: " + rank0);
  if (!got)
    throw TimeoutError(fmt::format("shm: local rank {} timed out waiting for the segment from local rank 0", local_rank));
  if (pids) (*pids)[0] = got->from.pid;
  // The protocol checked the memfd against the size the reply gives; that must be the agreed one.
  if (got->hello.sizes[0] < bytes)
    throw MismatchError(fmt::format("shm: local rank 0 offered local rank {} a segment of {} bytes; {} were agreed",
                                    local_rank, got->hello.sizes[0], bytes));
  seg.data_ = map_fd(got->fds[0].get(), bytes, populate);
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
