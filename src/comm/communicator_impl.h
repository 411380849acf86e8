#pragma once
// CommunicatorImpl: cohort::Communicator over the transports, and the coll::Context the collective
// algorithms run on.
//
// Thread model (docs/thread_model.md): exactly one thread drives the transports at a time, the one
// holding `drive_`. Blocking calls take it and run the algorithm on the calling thread, which
// drives the sockets itself (busy-poll for COHORT_SPIN_US, then epoll_wait with a timeout): no
// hand-off on the latency path. *_async calls queue Work that the communicator's progress thread
// runs in call order under the same lock; a blocking call first runs any queued work itself so
// that every rank executes operations in call order.
//
// Message scoping: tag = (communicator id << 32) | operation sequence number, sub = (slot << 32) |
// index of the message in its (peer, slot) stream. Every message also carries the operation's
// signature (op, dtype, reduce op, root, count) so a rank that called something else is detected.

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cohort/communicator.h"
#include "collectives/context.h"
#include "comm/op.h"
#include "comm/peer_exits.h"
#include "comm/topology.h"
#include "common/deadline.h"
#include "common/affinity.h"
#include "transport/shm/sync.h"
#include "trace/recorder.h"
#include "transport/transport.h"

namespace cohort::shm {
class Group;
}

namespace cohort::comm {

class WorkImpl;
class P2PWork;

// Where the launcher publishes the exits of the ranks' processes (comm/peer_exits.h), when one does
// (from_env under `cohort run`): the world communicator's store, and this communicator's ranks there.
struct ExitWatch {
  std::shared_ptr<Store> store;  // under the world communicator's prefix
  std::vector<int> ranks;        // ranks[this communicator's rank] = world rank (empty: the same)
};

// Everything create() learned at bootstrap.
struct CommSetup {
  std::shared_ptr<Store> root_store;  // the store as given (child communicators derive prefixes)
  std::string prefix;                 // this communicator's key prefix
  int rank = 0;
  int size = 1;
  CommOptions options;
  // For a child communicator whose errors must name the parent's ranks (the hierarchical path's
  // cross-host communicators): world_ranks[child rank] = rank in the world. Empty: ranks are world ranks.
  std::vector<int> world_ranks;
  bool child = false;  // made by split/subgroup/the hierarchical path (not the communicator a user created)
  // Connections only (the parameter server's messages): no shared-memory collective group and no
  // hierarchical sub-communicators, whose set-up is collective and would tie the ranks' lifetimes.
  bool connections_only = false;
  // With connections_only: the peers to connect to (empty: all). The parameter server's world
  // connects workers to servers only, never workers to workers.
  std::vector<bool> connect_to;
  std::shared_ptr<const ExitWatch> exits;  // null: nobody publishes exits
  // TransportOptions::max_unexpected_bytes: the parameter server's world sets its request limit.
  size_t max_unexpected_bytes = SIZE_MAX;
};

class CommunicatorImpl final : public Communicator,
                               public coll::Context,
                               public std::enable_shared_from_this<CommunicatorImpl> {
 public:
  explicit CommunicatorImpl(CommSetup setup);
  ~CommunicatorImpl() override;

  // Publishes this rank, reads the others, derives the topology and connects (collective).
  void bootstrap();

  // ---- Communicator ----
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return topology_.local_rank; }
  int local_size() const override { return topology_.local_size; }
  std::string host_of(int rank) const override;
  const CommOptions& options() const override { return options_; }

  void allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) override;
  void reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) override;
  void broadcast(void* buf, size_t count, DataType dtype, int root) override;
  void allgather(const void* send, void* recv, size_t count, DataType dtype) override;
  void allgatherv(const void* send, size_t send_count, void* recv, const std::vector<size_t>& recv_counts,
                  DataType dtype) override;
  void gather(const void* send, void* recv, size_t count, DataType dtype, int root) override;
  void scatter(const void* send, void* recv, size_t count, DataType dtype, int root) override;
  void reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) override;
  void alltoall(const void* send, void* recv, size_t count, DataType dtype) override;
  void alltoallv(const void* send, const std::vector<size_t>& send_counts, const std::vector<size_t>& send_displs,
                 void* recv, const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                 DataType dtype) override;
  void barrier() override;
  void send(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override;
  void recv(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override;
  int recv_any(void* buf, size_t count, DataType dtype, uint32_t tag) override;
  std::shared_ptr<Work> send_async(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override;
  std::shared_ptr<Work> recv_async(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) override;
  // For P2PWork (send_async/recv_async): whether its request completed, polling the transports once
  // when no other thread is driving them; and a wait for it that drives them.
  void p2p_test(P2PWork& work);
  void p2p_wait(P2PWork& work, std::chrono::milliseconds timeout);

  std::shared_ptr<Work> allreduce_async(const void* send, void* recv, size_t count, DataType dtype,
                                        ReduceOp op) override;
  std::shared_ptr<Work> broadcast_async(void* buf, size_t count, DataType dtype, int root) override;
  std::shared_ptr<Work> allgather_async(const void* send, void* recv, size_t count, DataType dtype) override;
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, size_t recv_count, DataType dtype,
                                             ReduceOp op) override;
  std::shared_ptr<Work> barrier_async() override;

  std::shared_ptr<Communicator> split(int color, int key) override;
  std::shared_ptr<Communicator> subgroup(const std::vector<int>& ranks) override;
  void abort(const std::string& reason) override;
  std::shared_ptr<void> allocate_shared(size_t bytes) override;
  std::shared_ptr<void> allreduce_shareable(void* buf, size_t count, DataType dtype, ReduceOp op,
                                            bool want_shared) override;
  void allreduce_update(float* grads, float* params, size_t count, ReduceOp op,
                        const ParameterUpdate& update) override;
  bool one_pass_update() const override;
  std::string link_report() const override;
  std::string copy_report() const override;

  // ---- coll::Context (called by the algorithms, on the thread holding drive_) ----
  coll::RequestId isend(int peer, const void* data, size_t bytes, uint32_t slot) override;
  coll::RequestId irecv(int peer, void* data, size_t bytes, uint32_t slot) override;
  void wait(coll::RequestId id) override;
  void* scratch(size_t bytes, int index) override;

  const Topology& topology() const { return topology_; }
  // Keeps `thing` (e.g. the store server rank 0 hosts without a launcher) alive as long as this.
  void keep_alive(std::shared_ptr<void> thing) { kept_alive_.push_back(std::move(thing)); }
  uint32_t id() const { return comm_id_; }
  // The intra-host shared-memory group (comm/shm_path.h), or null when ranks span hosts or
  // COHORT_TRANSPORT=tcp.
  shm::Group* shm_group() const { return shm_group_.get(); }
  // Hierarchical allreduce (ranks on several hosts, the same number on each): the group of this
  // rank's host and the communicator of the ranks with this local rank on every host; null otherwise.
  shm::Group* host_group() const { return host_group_.get(); }
  Communicator* cross_host() const { return cross_host_.get(); }
  // The current operation's number and signature, as the shm group publishes them (comm/shm_path.h).
  shm::CallSignature shm_call() const;

  // For a layer above that exchanges its own messages over this communicator's connections instead
  // of running collectives on it (the parameter server, src/ps/): the transport serving each peer,
  // and all of them (to poll). Only for a communicator made for that purpose and never used for
  // collectives, so that nothing else drives its transports (docs/thread_model.md).
  transport::Transport* transport_to(int peer) const { return route_[size_t(peer)]; }
  const std::vector<std::unique_ptr<transport::Transport>>& transports() const { return transports_; }

 private:
  using Body = std::function<void()>;
  // Runs one operation on the calling thread (blocking API).
  void run_blocking(const OpDesc& desc, const Body& body);
  template <typename Done>
  void drive_until(Done done);
  // Queues one operation for the progress thread (async API).
  std::shared_ptr<Work> run_async(OpDesc desc, Body body);
  void execute_locked(const OpDesc& desc, const Body& body);
  void drain_queue_locked();
  void progress_thread_main();
  void check_usable() const;
  [[noreturn]] void fail_and_throw(std::exception_ptr error);
  // The parent of this (cross-host) communicator failed with `message` (already in world ranks):
  // fail too, and tell this communicator's peers, who may be blocked in it and would otherwise only
  // see this rank leave. Called on the parent's driving thread, which is the only one driving this.
  void fail_from_parent(const std::string& message, transport::Transport::ErrorClass cls);

  std::shared_ptr<Work> post_p2p(bool is_send, void* buf, size_t count, DataType dtype, int peer, uint32_t tag);
  // Point-to-point on an already-running op (send/recv API).
  void wait_request(transport::Transport* t, transport::RequestId id, int peer);
  transport::Transport* route(int peer) const { return route_[size_t(peer)]; }
  [[noreturn]] void throw_timeout();
  // What a TimeoutError names as the deadline's origin (CommOptions::timeout_source).
  std::string timeout_source() const;
  // Exits the launcher published (comm/peer_exits.h). exit_rank needs exits_; the others do nothing
  // without it.
  int exit_rank(int rank) const { return exits_->ranks.empty() ? rank : exits_->ranks[size_t(rank)]; }
  // `rank`'s exit record, waiting up to `wait` for it to appear; nullopt when none (or unreadable).
  std::optional<ExitRecord> read_exit(int rank, std::chrono::milliseconds wait);
  // During the join: when the launcher counted new exits since `seen`, throws PeerLostError naming
  // a rank whose process ended before it joined.
  void check_exits_while_joining(int64_t& seen, Deadline::Clock::time_point start);
  [[noreturn]] void throw_exited_before_joining(int rank, const ExitRecord& gone, Deadline::Clock::time_point start);
  // A lost peer's error, with what its launcher says about its end in front when it published that:
  // "rank 1 exited (code 0) before operation #7: <the error>". Other errors as they are.
  std::exception_ptr explain_exit(std::exception_ptr error);
  void warn_slow(std::chrono::nanoseconds waited);
  std::string waiting_for_text();
  std::string peer_text(int peer) const;
  std::string mismatch_text(int peer, const transport::Signature& theirs, const transport::Signature& ours);

  void validate_dtype_op(DataType dtype, ReduceOp op, bool needs_op) const;
  void validate_buffer(const void* p, size_t count, const char* what) const;
  void validate_root(int root) const;

  // `members[child rank]` = rank here (for the exit records, comm/peer_exits.h).
  std::shared_ptr<Communicator> create_child(const std::string& prefix, int rank, int size,
                                             const std::vector<int>& members, std::vector<int> world_ranks = {});
  // `text` with every "rank N (" (how messages name a peer: rank and host) renamed to the world rank
  // (child communicators with world_ranks only).
  std::string in_world_ranks(const std::string& text) const;
  int world_rank(int rank) const { return world_ranks_.empty() ? rank : world_ranks_[size_t(rank)]; }

  // The shm group's waits under this communicator's error semantics (communicator_impl_shm.cc):
  // abort, deadline and slow warnings, failure notices, mismatch and peer names. members[local rank]
  // = communicator rank.
  void install_shm_semantics(shm::Group& group, std::vector<int> members);
  // Runs the group's link probe (collective over the group) unless COHORT_SHM_PROBE=0; keeps its line.
  void probe_link(shm::Group& group);
  std::string shm_waiting_text() const;
  struct ShmLagging {
    int rank;
    bool seen;
    uint64_t seq;
    transport::Signature signature;
  };
  std::vector<ShmLagging> shm_waiting_;  // set while a group wait reports (warn_slow/throw_timeout)
  Deadline::Clock::time_point shm_next_notice_poll_{};

  std::vector<std::shared_ptr<void>> kept_alive_;  // destroyed last (declared first)
  trace::Recorder& recorder_ = trace::Recorder::instance();  // the flight recorder and timeline
  // identity and settings
  std::shared_ptr<Store> root_store_;
  std::shared_ptr<Store> store_;  // prefixed
  std::string prefix_;
  int rank_;
  int size_;
  CommOptions options_;
  uint32_t comm_id_;
  std::chrono::nanoseconds spin_;
  std::chrono::nanoseconds progress_spin_;  // the *_async progress thread's budget

  // bootstrap results
  Topology topology_;
  std::vector<std::unique_ptr<transport::Transport>> transports_;
  std::vector<transport::Transport*> route_;  // per peer
  std::unique_ptr<shm::Group> shm_group_;     // all ranks on one host: collectives in shared memory
  std::unique_ptr<shm::Group> host_group_;    // several hosts: this host's ranks (hierarchical allreduce)
  std::string link_report_;                   // link_report() before (or without) a probe: the wait policy
  shm::Group* probed_group_ = nullptr;        // the group whose probe link_report() shows
  bool yield_in_waits_ = true;                // wait()'s spin yields the core (common/affinity.h)
  affinity::YieldChoice yield_choice_{true, "waits yield the core"};  // also given to the shm groups
  std::vector<int> world_ranks_;  // see CommSetup::world_ranks
  bool child_ = false;
  bool connections_only_ = false;  // CommSetup::connections_only
  std::vector<bool> connect_to_;    // CommSetup::connect_to
  size_t max_unexpected_bytes_ = SIZE_MAX;  // CommSetup::max_unexpected_bytes
  std::shared_ptr<const ExitWatch> exits_;  // CommSetup::exits
  std::shared_ptr<Communicator> cross_host_;  // several hosts: same local rank on every host

  // the drive lock and the current operation (guarded by drive_)
  std::mutex drive_;
  // The current collective's number: 1, 2, 3, ... (64-bit: 32 bits run out within hours of small
  // operations). Messages carry its low 32 bits (wire_seq), which are never 0 or kP2PSeq: numbers
  // whose low bits are either are skipped, by every rank alike.
  uint64_t seq_ = 0;
  uint32_t wire_seq() const { return uint32_t(seq_); }
  // The full number of an operation whose message carried `wire` (a peer's, near ours).
  uint64_t full_seq(uint32_t wire) const { return seq_ + uint64_t(int64_t(int32_t(wire - wire_seq()))); }
  trace::OpRun timeline_run_;  // the timeline's run of identical short operations (trace/recorder.h)
  OpDesc op_;
  transport::Signature op_sig_;
  Deadline op_deadline_ = Deadline::never();
  Deadline::Clock::time_point op_start_;
  Deadline::Clock::time_point next_warning_;
  std::chrono::nanoseconds warning_interval_{};
  std::unordered_map<uint64_t, uint32_t> send_index_, recv_index_;          // per op: (peer, slot)
  std::unordered_map<uint64_t, uint32_t> p2p_send_index_, p2p_recv_index_;  // persistent: (peer, tag)
  std::optional<uint32_t> any_source_tag_;  // a recv from any source is waiting (for its messages)
  int any_source_next_ = 0;                 // the peer it asks first next time (round-robin)
  struct Pending {
    coll::RequestId id;          // what the algorithm holds (unique per communicator)
    transport::RequestId tid;    // the transport's own id
    transport::Transport* transport;
    int peer;
  };
  coll::RequestId next_id_ = 1;
  std::vector<Pending> pending_;  // outstanding requests of the current op
  std::vector<std::unique_ptr<char[]>> scratch_;
  std::vector<size_t> scratch_size_;
  std::unordered_map<std::string, int> subgroup_counter_;
  int split_counter_ = 0;

  // failure: first error sticks
  mutable std::mutex fail_mutex_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> abort_requested_{false};
  std::string root_cause_;
  std::string abort_reason_;

  // async work
  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::pair<std::shared_ptr<WorkImpl>, std::pair<OpDesc, Body>>> queue_;
  // queue_.size(), readable without queue_mutex_: a blocking call finds the queue empty (the usual case)
  // with one load instead of a lock. An operation queued by this thread before the call is counted
  // (program order); one queued by another thread at the same instant has no order against it anyway.
  std::atomic<uint32_t> queued_{0};
  bool stop_ = false;
  std::thread progress_;
};

}  // namespace cohort::comm
