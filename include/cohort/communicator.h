#pragma once
// cohort::Communicator: a group of ranks that run collectives together.
//
// Semantics follow MPI and torch.distributed so results can be checked against them. Buffers are
// raw pointers plus an element count and a DataType; `send == recv` means in place. All calls on one
// communicator must be made in the same order on every rank (as in MPI); a different op, size,
// dtype or order is detected and thrown as MismatchError on the ranks involved.
//
// Blocking calls run on the calling thread and return when the local buffers may be reused.
// *_async calls return a Work handle and run in order with the communicator's other calls.
// Every wait is bounded by options().timeout (COHORT_TIMEOUT); a rank that waits longer than
// options().slow_warning logs which ranks it is waiting for.
//
// Construction is collective: every rank of the group must construct (or split) together.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "cohort/store.h"
#include "cohort/types.h"

namespace cohort {

struct CommOptions {
  // Deadline of one operation, and of construction. COHORT_TIMEOUT (seconds) overrides the default.
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // Where `timeout` came from, as a TimeoutError names it: empty means COHORT_TIMEOUT (its default, or
  // the variable). A caller that sets `timeout` from its own option names that option here (the
  // PyTorch backend: "timeout=0:00:05 given to init_process_group or new_group"). COHORT_TIMEOUT, when
  // set, overrides `timeout` and this.
  std::string timeout_source;
  // After this long waiting, log which ranks have not progressed (COHORT_SLOW_WARNING, seconds).
  std::chrono::milliseconds slow_warning{std::chrono::seconds(5)};
  // Transport preference: "auto" (shm on the same host, else TCP), "tcp" or "shm".
  // COHORT_TRANSPORT overrides.
  std::string transport = "auto";
  // Prefix for this communicator's keys in the store (job-scoped; chosen by from_env/create).
  std::string store_prefix = "comm";
};

// Handle of an asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;
  // Waits until the operation completes; rethrows its error. A timeout of zero means the
  // communicator's own deadline. GPU work (cohort/gpu.h) is waited for in stream order instead: the
  // caller's current CUDA stream waits for the operation, and the host does not block.
  virtual void wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) = 0;
  // Blocks the calling thread until the operation has completed, also GPU work; rethrows its error.
  virtual void synchronize(std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) { wait(timeout); }
  // True when the operation has finished (successfully or not); never blocks.
  virtual bool test() = 0;
  // The error the operation ended with, or nullptr.
  virtual std::exception_ptr exception() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  // Builds the world communicator from the environment: COHORT_* set by `cohort run`, else
  // torchrun's (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), else Open MPI's or Slurm's rank
  // variables with MASTER_ADDR/MASTER_PORT. Without a launcher, rank 0 hosts the store.
  static std::shared_ptr<Communicator> from_env(CommOptions options = {});
  // Builds a communicator of `size` ranks that meet at `store`.
  static std::shared_ptr<Communicator> create(std::shared_ptr<Store> store, int rank, int size,
                                              CommOptions options = {});

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Ranks on this host, and this rank's index among them.
  virtual int local_rank() const = 0;
  virtual int local_size() const = 0;
  // Host name of `rank` (for messages).
  virtual std::string host_of(int rank) const = 0;
  virtual const CommOptions& options() const = 0;

  // ---- collectives (blocking) ----
  virtual void allreduce(const void* send, void* recv, size_t count, DataType dtype,
                         ReduceOp op) = 0;
  virtual void reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                      int root) = 0;
  virtual void broadcast(void* buf, size_t count, DataType dtype, int root) = 0;
  // recv holds size() * count elements, rank r's contribution at r * count.
  virtual void allgather(const void* send, void* recv, size_t count, DataType dtype) = 0;
  // recv_counts[r] elements from rank r, placed back to back in rank order.
  virtual void allgatherv(const void* send, size_t send_count, void* recv,
                          const std::vector<size_t>& recv_counts, DataType dtype) = 0;
  virtual void gather(const void* send, void* recv, size_t count, DataType dtype, int root) = 0;
  virtual void scatter(const void* send, void* recv, size_t count, DataType dtype, int root) = 0;
  // send holds size() * recv_count elements; rank r receives the reduction of block r.
  virtual void reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype,
                              ReduceOp op) = 0;
  // send and recv hold size() * count elements; block r goes to / comes from rank r.
  virtual void alltoall(const void* send, void* recv, size_t count, DataType dtype) = 0;
  // Counts and displacements in elements, one per rank.
  virtual void alltoallv(const void* send, const std::vector<size_t>& send_counts,
                         const std::vector<size_t>& send_displs, void* recv,
                         const std::vector<size_t>& recv_counts,
                         const std::vector<size_t>& recv_displs, DataType dtype) = 0;
  virtual void barrier() = 0;

  // ---- point to point ----
  virtual void send(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag = 0) = 0;
  virtual void recv(void* buf, size_t count, DataType dtype, int peer, uint32_t tag = 0) = 0;
  // Receives the next message sent to this rank with `tag` by whichever rank's comes first, and
  // returns that rank (MPI_ANY_SOURCE; torch's recv() without src). It takes one peer's next message of
  // the same (peer, tag) stream that recv(peer, tag) would take, so both can be mixed. Bounded by the
  // communicator's timeout like every wait.
  virtual int recv_any(void* buf, size_t count, DataType dtype, uint32_t tag = 0) = 0;
  // Non-blocking forms: the send or receive is posted at once (in call order, which is what matches a
  // (peer, tag) stream's messages) and the Work completes when the buffer may be reused. Unlike the
  // *_async collectives below they do not wait for earlier operations, so a rank may post a receive,
  // then a send, and wait for both. Their bytes move whenever the communicator is driven: a wait on
  // them or on any operation, and each test() (which polls once when no other thread is driving).
  // Bounded by the communicator's timeout from the time they were posted.
  virtual std::shared_ptr<Work> send_async(const void* buf, size_t count, DataType dtype, int peer,
                                           uint32_t tag = 0) = 0;
  virtual std::shared_ptr<Work> recv_async(void* buf, size_t count, DataType dtype, int peer, uint32_t tag = 0) = 0;

  // ---- asynchronous variants (run in call order on the communicator's progress thread) ----
  virtual std::shared_ptr<Work> allreduce_async(const void* send, void* recv, size_t count,
                                                DataType dtype, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> broadcast_async(void* buf, size_t count, DataType dtype,
                                                int root) = 0;
  virtual std::shared_ptr<Work> allgather_async(const void* send, void* recv, size_t count,
                                                DataType dtype) = 0;
  virtual std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv,
                                                     size_t recv_count, DataType dtype,
                                                     ReduceOp op) = 0;
  virtual std::shared_ptr<Work> barrier_async() = 0;

  // ---- groups ----
  // Collective over this communicator: ranks with the same color form a new communicator,
  // ordered by (key, old rank). A negative color returns nullptr for that rank.
  virtual std::shared_ptr<Communicator> split(int color, int key) = 0;
  // Collective over the listed ranks only (every listed rank must call it with the same list).
  virtual std::shared_ptr<Communicator> subgroup(const std::vector<int>& ranks) = 0;

  // Fails every pending and future operation with AbortedError(reason) on this rank.
  virtual void abort(const std::string& reason) = 0;

  // ---- memory ----
  // Collective (every rank, in the same order, with the same size): `bytes` of zeroed memory for a
  // buffer that is reduced in place again and again, like DDP's gradient buckets. When all ranks share
  // one host it is shared memory the peers map too, and an in-place allreduce on it (every rank passing
  // the same range) reads their copies directly instead of staging through copies; elsewhere it is
  // ordinary memory. Valid while the returned pointer (or a copy of it) lives.
  virtual std::shared_ptr<void> allocate_shared(size_t bytes);

  // ---- an in-place allreduce for buffers the caller did not allocate (the PyTorch backend) ----
  // Collective: allreduce(buf, buf, count, dtype, op), where each rank's buffer may lie in
  // allocate_shared memory or not, whatever the peers' do. When every rank passes the same range of one
  // allocate_shared buffer it runs in place on the shared memory; where they differ it stages, as for
  // ordinary memory (a plain allreduce would throw MismatchError). One call, one operation: the ranks
  // learn each other's buffers from the call's own signature, with no collective of their own.
  // `want_shared`: this rank would like its buffer to live in memory the peers map (it is reduced again
  // and again, and `count` elements are all of it). When every rank asks for it and the call did not
  // run in place, the call ends with a collective allocate_shared of count * dtype_size(dtype) bytes on
  // every rank and returns that memory (the caller copies its buffer there and reduces it there from
  // then on: in place, on every rank that did the same); otherwise, and on communicators whose
  // allocate_shared gives ordinary memory, it returns null. Every rank calls this, not allreduce, for
  // the same operation (the variant is part of the call's signature).
  virtual std::shared_ptr<void> allreduce_shareable(void* buf, size_t count, DataType dtype, ReduceOp op,
                                                    bool want_shared);

  // ---- a gradient reduction fused with the optimizer's step ----
  // update(offset, count, reduced, params): applies an optimizer's step to params[0, count) from the
  // reduced gradients reduced[0, count), both starting at element `offset` of the whole buffer. It must
  // be elementwise (depend on nothing but its range, `offset` and what it captured), deterministic, and
  // must not throw.
  using ParameterUpdate = std::function<void(size_t offset, size_t count, const float* reduced, float* params)>;
  // Collective: reduces `grads` (float32, kSum or kAvg) across the ranks and applies `update` to
  // `params` with the result. Every rank passes the same count and equal params; all ranks end with
  // equal params. `grads` is left unspecified (this rank's own contribution, or the reduced values).
  // When every rank is on one host and both buffers are ranges of allocate_shared memory, it is one
  // pass over memory: each rank reduces a slice of the gradients, updates that slice of its parameters
  // and writes the result into every peer's (docs/algorithms-shm.md, "Allreduce fused with the
  // update"); otherwise an allreduce of `grads` in place, then `update` of the whole range on each rank.
  virtual void allreduce_update(float* grads, float* params, size_t count, ReduceOp op, const ParameterUpdate& update);
  // Whether allreduce_update on allocate_shared buffers is the one-pass path here. Where it is not, a
  // framework gains more from overlapping the gradients' allreduce with backward (DistributedSGD then
  // leaves DDP's overlapped averaging on).
  virtual bool one_pass_update() const { return false; }

  // ---- diagnostics ----
  // What the communicator decided and measured when it was created: whether its waits yield the core
  // (docs/algorithms-shm.md, "Whether a wait yields") and, with a shared-memory group, the link between
  // its ranks on this host (their CPUs, a round trip, cache-to-cache against own-cache copy speed; "The
  // link probe", skipped with COHORT_SHM_PROBE=0).
  virtual std::string link_report() const { return {}; }
  // What this rank's shared-memory group copied so far on its single-copy path (docs/algorithms-shm.md,
  // "Single copy"): how many calls took it and the bytes this rank read from peers and wrote into them
  // (empty without a group). Says which rank did which part of a collective's copies.
  virtual std::string copy_report() const { return {}; }
};

}  // namespace cohort
