#pragma once
// One shared-memory segment per intra-host group, that can never leak.
//
// Local rank 0 creates an anonymous memfd (nothing ever appears in /dev/shm or any file system),
// listens on an *abstract* Unix socket (no file either; the name disappears with the socket) and hands
// the descriptor to every other local rank with SCM_RIGHTS. Each rank maps it once; after the
// handshake no name exists anywhere, so the memory goes away with the last process that maps it,
// whether the job ends normally, fails or is killed with SIGKILL.
//
// The abstract socket's name is no secret (/proc/net/unix lists it to every user), so the handoff
// checks who is at the other end (common/handoff.h): local rank 0 hands the descriptor only to the
// processes of the group's local ranks, and they take one only from local rank 0's process.

#include <cstddef>
#include <string>
#include <vector>

#include "common/deadline.h"

namespace cohort {
class Store;
}

namespace cohort::shm {

// Part of a segment, in bytes from its start.
struct SegmentRange {
  size_t offset = 0;
  size_t bytes = static_cast<size_t>(-1);  // -1: to the end
};

class Segment {
 public:
  // Collective over the `local_size` ranks that share `address` (an abstract socket name, e.g. from
  // rendezvous_address). Local rank 0 creates `bytes` bytes; the others must pass the same size.
  // Throws TimeoutError when a rank does not show up before `deadline`, MismatchError on a size mismatch.
  // Every page is faulted in at once (none inside the first timed collectives), unless `populate` names
  // a part: then only that part is, and the rest is mapped as it is touched. A rank's RSS counts the
  // shared pages it has mapped, so a segment of N parts, one per rank, populated whole by every rank,
  // would show each rank's RSS N parts large though only one is its own.
  // `pids` (null, or local_size entries) is the process of each local rank, as the job's store names it:
  // local rank 0 hands the memory to those processes only (anyone else who connects gets a warning in
  // the log and nothing more; the wait goes on), the others take it only from local rank 0's process.
  // An entry of 0 accepts any process of this user, and the pid seen fills it, so that a group's later
  // segments are checked against the processes of its first (create_at's callers agree the address
  // out of band and have no pids to give).
  static Segment establish(const std::string& address, int local_rank, int local_size, size_t bytes,
                           Deadline deadline, SegmentRange populate = {}, std::vector<int>* pids = nullptr);

  Segment() = default;
  ~Segment();
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// A fresh abstract-socket name: "cohort-shm/<job_key>/<pid>-<random>".
std::string random_address(const std::string& job_key);

// Local rank 0 picks a random address and publishes it under "<key_prefix>/shm/address" in the store;
// the other local ranks read it (waiting up to the store's timeout).
std::string rendezvous_address(Store& store, const std::string& key_prefix, int local_rank);

}  // namespace cohort::shm
