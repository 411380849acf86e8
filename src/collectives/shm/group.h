#pragma once
// shm::Group: collectives among the ranks of one host, working in shared memory directly.
//
// The group owns one segment (transport/shm/segment.h): a control line per rank (step flags, see
// transport/shm/sync.h) and, per rank, two staging slots of slot_bytes that only their owner writes.
// Every operation runs in rounds; a round starts with "write my slot, post, wait for all", so the slot
// a rank writes in round t was last read by its peers in round t-2, whose reads finished before they
// posted round t-1 (which the writer waited for). Two slots alternate, so no extra flag is needed.
//
// Algorithms (docs/algorithms-shm.md has the bytes each one moves):
//  * allreduce, broadcast and allgather of at most InlineLines::kCapacity bytes per rank (allreduce also
//    <= small_bytes): the data travels inline in cache lines that carry their round (small.h, small.cc);
//    allreduce then reduces all P contributions on every rank, in rank order.
//  * allreduce, small (<= small_bytes): each rank copies its input into its slot; after one wait every
//    rank reduces all P slots itself, in rank order (so every rank gets the same bits).
//  * allreduce, large: per chunk (at most slot_bytes, see GroupOptions::chunk_bytes), each rank copies the P-1 slices that peers own into
//    its slot; rank r reduces slice r of the chunk reading its own input and the peers' slots (rank
//    order), writes the result into its slot, and after a second wait every rank copies the other
//    slices' results from their owners' slots into its output.
//    The copies into the slots are cached or streaming (common/copy.h), as the link probe found
//    faster (SlotCopy below); an allreduce far slower than this link has shown gets it measured again.
//  * allreduce, in place on memory from allocate_shared(): every rank's buffer is mapped by every peer,
//    so nothing is staged: after one wait rank r reduces slice r reading the peers' buffers directly
//    and writes the result into every rank's buffer; a second wait ends it (2 n bytes through memory
//    per rank instead of 4.5 n for P = 2).
//  * allreduce_update, gradients and parameters both on allocate_shared memory: like the in-place
//    allreduce, but rank r applies the optimizer's update to slice r of its parameters right after
//    reducing it and writes the parameters (not the gradients) into every rank's (2.5 n per rank for
//    P = 2, against 2 n + 3 n for the allreduce and a separate SGD pass).
//  * reduce_scatter: the first half of the large allreduce, with slice r = output block r.
//  * allgather: each rank copies its chunk into its slot; after one wait everyone copies the peers'.
//  * broadcast: the root copies a chunk into its slot; the others copy it out after waiting for it.
//    The root of an inline broadcast returns without waiting for the receivers: it has InlineLines::kDepth
//    sets of lines, used in turn, and confirms the receivers' arrival (and compares their signatures, from
//    their lines) only before it reuses a set, or before any other call (small.cc).
//  * barrier: post, wait for all.
//  * single copy (allgather(v), alltoall(v), gather, scatter, broadcast and reduce_scatter from
//    single_copy_bytes, when the check at creation found that every rank may read every peer's memory with
//    process_vm_readv): one round in which every rank publishes its buffers' addresses in its slot; then each
//    rank copies what it receives straight from the peer's buffer into its own (gather: each rank writes its
//    block into the root's with process_vm_writev), one copy per byte instead of two through a slot; a second
//    round ends the call, after which no peer touches this rank's buffers. reduce_scatter reads the peers'
//    pieces of its block into this core's cache and reduces them with its own input there: two rounds in all,
//    where the staged path waits once per chunk.
// Reductions for kAvg divide once, by the group size, on the reduced slice.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/store.h"
#include "cohort/types.h"
#include "collectives/shm/small.h"
#include "common/affinity.h"
#include "transport/shm/segment.h"
#include "transport/shm/sync.h"

namespace cohort::shm {

// How data is written into the staging slots that peers read next (common/copy.h).
enum class SlotCopy : uint8_t {
  kCached,     // memcpy: the reader pulls the lines from the writer's cache
  kStreaming,  // non-temporal stores: the lines go to memory, the reader fetches them from there
};
const char* slot_copy_name(SlotCopy copy);

struct GroupOptions {
  size_t slot_bytes;             // staging slot per rank (two of them); chunk size of the pipelines
  size_t small_bytes;            // allreduce up to this size uses the one-round algorithm
  std::chrono::nanoseconds spin;  // busy-poll budget of a wait before it sleeps
  // The pipelines' chunk (at most slot_bytes). 0: an eighth of the L2 cache of the ranks' CPUs (the
  // smallest among them), a power of two of at least 64 KiB; slot_bytes where the L2 is unknown.
  // COHORT_SHM_CHUNK_BYTES. docs/algorithms-shm.md, "The chunk".
  size_t chunk_bytes = 0;
  // COHORT_SHM_COPY: "auto" (the probe chooses; cached until it has run), "cached" or "streaming".
  std::string slot_copy = "auto";
  // A large allreduce (>= one chunk) running at under 1/slow_factor of the fastest one this group has
  // seen marks the link as suspect; every recheck_every large allreduces the ranks compare marks in one
  // round, and if any rank has one they all probe the link again and choose the copy anew (a probe
  // that changes nothing doubles the interval, up to 1024). 0: never.
  double slow_factor = 3.0;
  uint32_t recheck_every = 32;
  // Single copy between the ranks' own buffers (process_vm_readv/writev) for the collectives that only move data,
  // and reduce_scatter, from this many bytes per call (the N blocks of allgather's output, alltoall's, gather's,
  // scatter's and reduce_scatter's buffer; broadcast's buffer); below it they stage through the slots or go over
  // the transports as before. alltoallv, whose sizes differ between ranks, takes it whenever single copy is on.
  // COHORT_SHM_SINGLE_COPY (on/off), COHORT_SHM_SINGLE_COPY_BYTES.
  bool single_copy = true;
  size_t single_copy_bytes = size_t{1} << 20;
  // The copies this rank makes itself on the single-copy path (its own block, and peers' allocate_shared
  // buffers through its mapping) use non-temporal stores from this many bytes on: a destination that
  // size would not stay in this core's caches anyway, and streaming stores skip reading each line before
  // writing it (a third of the memory traffic of the copy). 0: never. COHORT_SHM_STREAMING_BYTES.
  size_t streaming_bytes = size_t{4} << 20;
  // From COHORT_SHM_SLOT_BYTES, COHORT_SHM_SMALL_BYTES, COHORT_SHM_SPIN (the spin yields the core
  // after its first microseconds, so an oversubscribed host still makes progress), COHORT_SHM_CHUNK_BYTES,
  // COHORT_SHM_COPY.
  // Small messages inline with their flag (small.h). COHORT_SHM_INLINE.
  bool inline_small = true;
  // An inline broadcast's root returns without waiting for its receivers; it confirms their arrival
  // before it reuses those lines, or at its next call of another kind. COHORT_SHM_EARLY_ROOT.
  bool early_root = true;
  // A rank takes its lines of the next small round for writing while it waits in this one
  // (InlineLines::claim). COHORT_SHM_CLAIM_LINES.
  bool claim_lines = true;
  static GroupOptions from_env(int local_size);
};
// COHORT_SHM_INLINE, COHORT_SHM_EARLY_ROOT, COHORT_SHM_CLAIM_LINES (small.cc).
bool inline_small_from_env();
bool early_root_from_env();
bool claim_lines_from_env();

// What Group::probe measured on one local rank (docs/perf-shm.md, "The link probe").
struct LinkProbe {
  int32_t cpu = -1;            // the CPU this rank ran on during the probe (sched_getcpu)
  float round_ns = 0;          // median of 31 rounds of every rank (post, wait for all): cache-line round trips
  float peer_copy_gbps = 0;    // copying probe_bytes another rank has just written (cache to cache), best of 2
  float own_copy_gbps = 0;     // copying probe_bytes this rank has just written (its own cache), best of 2
  uint32_t probe_bytes = 0;
  float probe_us = 0;          // the probe's own time on this rank, after the ranks met
  // The two ways into a slot, end to end: this rank writing probe_bytes into its slot (from a buffer
  // in its cache) with memcpy and with streaming stores, and copying out what another rank wrote
  // with streaming stores (from memory). peer_copy_gbps is the read of the cached way. Best of 2.
  float cached_write_gbps = 0;
  float streaming_write_gbps = 0;
  float streaming_read_gbps = 0;
};

// The copy the slots get, from every rank's probe: the way with the lower cost per byte through a
// slot (1/write + 1/read, means over ranks); streaming must win by 20 %, since the probe moves only
// probe_bytes and a wrong switch costs more than a missed one. `setting` "cached" or "streaming"
// overrides. `why` says which figures decided.
struct SlotCopyChoice {
  SlotCopy copy = SlotCopy::kCached;
  std::string why;
};
SlotCopyChoice choose_slot_copy(const std::vector<LinkProbe>& probes, const std::string& setting);

// The chunk from the smallest L2 of the ranks' CPUs (bytes; 0 = unknown), as GroupOptions::chunk_bytes
// says, and why. `setting` nonzero overrides (clamped to the slot).
struct ChunkChoice {
  size_t bytes = 0;
  std::string why;
};
ChunkChoice choose_chunk(size_t smallest_l2, size_t setting, size_t slot_bytes);
// The L2 cache of the CPU this thread runs on (sysfs, else sysconf); 0 if unknown.
size_t l2_cache_bytes();

class Group {
 public:
  // Collective over the local ranks. Local rank 0 publishes the segment's (abstract socket) address
  // under "<key_prefix>/shm/address" in the store; key_prefix must be unique to the job/communicator.
  // `pids`: the process of each local rank as the job published it (the communicator's peer entries);
  // the segments are handed to those processes only (Segment::establish). Empty: any process of this
  // user at the first segment, and the same processes at every later one.
  static std::unique_ptr<Group> create(Store& store, int local_rank, int local_size, const std::string& key_prefix,
                                       std::chrono::milliseconds timeout, std::vector<int> pids = {});
  // Same, with an address agreed beforehand (shm::random_address); no store needed.
  static std::unique_ptr<Group> create_at(const std::string& address, int local_rank, int local_size,
                                          std::chrono::milliseconds timeout, const GroupOptions& options,
                                          std::vector<int> pids = {});
  // The bytes of the segment create_at maps for `local_size` ranks with `options`.
  static size_t segment_bytes(int local_size, const GroupOptions& options);

  int rank() const { return rank_; }
  int size() const { return size_; }

  // out[i] = op over ranks of in[i]; `in` may equal `out`.
  void allreduce(const void* in, void* out, size_t count, DataType dtype, ReduceOp op);
  // in has size()*count elements; out (count elements) = op over ranks of block rank() of in.
  void reduce_scatter(const void* in, void* out, size_t count, DataType dtype, ReduceOp op);
  // out (size()*bytes) = concatenation of every rank's `in` (bytes each), in rank order. `in` may be
  // out + rank()*bytes.
  void allgather(const void* in, void* out, size_t bytes);
  void broadcast(void* data, size_t bytes, int root);
  void barrier();

  // ---- Single copy (see the algorithms above; docs/algorithms-shm.md, "Single copy") ----
  // Whether every rank of this group may copy from every peer's memory (checked once at creation,
  // alike on every rank), and why (or why not).
  bool single_copy() const { return single_copy_; }
  const std::string& single_copy_why() const { return single_copy_why_; }
  // Whether a call whose result is `bytes` (equal on every rank) takes the single-copy path.
  bool single_copy_for(size_t bytes) const { return single_copy_ && bytes >= options_.single_copy_bytes; }
  // Calls that took it so far (tests, logs).
  uint64_t single_copies() const { return single_copies_; }
  // Whether a call of `bytes_per_rank` (allreduce: its buffer; allgather: one rank's block; broadcast:
  // the buffer) goes inline with the flags (small.h), and how many calls did so far (tests, logs).
  bool inline_for(size_t bytes_per_rank) const;
  // Whether a broadcast of `bytes` returns on its root without waiting for the receivers.
  bool early_root_for(size_t bytes) const;
  uint64_t inline_calls() const { return inline_calls_; }
  // Broadcasts whose root returned without waiting for the receivers (tests, logs).
  uint64_t early_roots() const { return early_roots_; }
  // The check an early broadcast root makes at its next call (its receivers arrived, and called the same
  // broadcast), made now for every such broadcast not yet confirmed: for the group's owner when it ends,
  // since a rank whose last calls were those broadcasts has no next call to find a mismatch at (two ranks
  // that both took themselves for the root would otherwise both return and neither name it). Waits as a
  // call does (deadline, dead peers); throws MismatchError, TimeoutError or PeerLostError as a call does.
  void confirm_early_broadcasts();
  // Bytes this rank moved on the single-copy path so far: read from peers, written into peers (tests,
  // benchmarks: which rank did which part of the copy), and how many of them went through the mapping of
  // an allocate_shared buffer (plain loads and stores) rather than process_vm_readv/writev.
  struct CopiedBytes {
    uint64_t pulled = 0, pushed = 0;
    uint64_t mapped = 0;
  };
  CopiedBytes single_copied() const { return copied_; }
  // A single-copy broadcast of `bytes` among `ranks`: the bytes at the end of every receiver's buffer
  // that the root writes into it while each receiver reads the rest (a multiple of a page).
  static size_t broadcast_root_share(size_t bytes, int ranks);
  // Whether the single-copy broadcast splits its copies that way: only where the ranks' CPU sets hold
  // a CPU for every rank (decided at creation from every rank's affinity, alike on all ranks). Ranks
  // that share cores have no idle root core to gain, and the root's writes into P-1 address spaces
  // measured slower there (4 ranks on one CPU: 1.05-1.5x).
  bool broadcast_splits() const { return cpus_for_every_rank_; }
  // These four run only on the single-copy path (the caller checks single_copy_for; alltoallv only
  // single_copy()). Counts and displacements are in elements of `elem` bytes, as the communicator's.
  // alltoallv: send == recv is allowed (the input is copied aside first).
  void alltoallv(const void* send, const size_t* send_counts, const size_t* send_displs, void* recv,
                 const size_t* recv_counts, const size_t* recv_displs, size_t elem);
  // recv_counts[q] elements from rank q, back to back in rank order; send == recv: the contribution
  // is already at its place.
  void allgatherv(const void* send, size_t send_count, void* recv, const size_t* recv_counts, size_t elem);
  // `bytes` per rank; the root's recv (gather) / send (scatter) holds size() blocks. send == recv on the
  // root: its own block is already in place (as coll::gather/scatter).
  void gather(const void* send, void* recv, size_t bytes, int root);
  void scatter(const void* send, void* recv, size_t bytes, int root);
  // Collective: measures the link between the local ranks (well under a millisecond on an idle pair:
  // 31 rounds, then every rank in turn writes probe_bytes into its slot and the others copy it out)
  // and returns every rank's figures, index = local rank. The slow mode of issue 22 (cohort merely
  // equal to Open MPI in some runs) was blamed on slow cache-to-cache transfers: this tells.
  // Also chooses the slots' copy from the figures (choose_slot_copy, options' slot_copy).
  std::vector<LinkProbe> probe();
  // One line for logs and the bench's header: CPUs, round trip, cache-to-cache against own-cache copy.
  static std::string describe(const std::vector<LinkProbe>& probes);
  // The copy the slots get now, and the line of the probe that chose it (with the reason and how many
  // times a slow allreduce had the link probed again). Any thread may ask.
  SlotCopy slot_copy() const { return slot_copy_.load(std::memory_order_relaxed); }
  size_t chunk_bytes() const { return chunk_.bytes; }
  std::string link_line() const;
  uint32_t reprobes() const { return reprobes_.load(std::memory_order_relaxed); }
  // Whether this group's waits yield the core while they spin (see PeerSync::set_yield): chosen at
  // creation from the ranks' CPU affinities, alike on all ranks (common/affinity.h, COHORT_YIELD), and why.
  bool waits_yield() const { return sync_.yields(); }
  // Replaces that choice (the communicator knows the CPU sets of every rank on this machine, also of
  // other groups' ranks, e.g. hosts simulated in network namespaces). Every member must get the same.
  void set_wait_policy(const affinity::YieldChoice& choice) {
    sync_.set_yield(choice.yield);
    wait_policy_ = choice.why;
  }
  const std::string& wait_policy() const { return wait_policy_; }

  // Collective (every local rank, in the same order, with the same size): `bytes` of zeroed memory that
  // the peers map too, in a segment of its own that goes away when the last holder drops it (it may
  // outlive the group). An in-place allreduce on a range of it reads the peers' copies directly instead
  // of staging through the slots. All ranks must reduce the same range: the range is part of the call's
  // signature, so a rank that passes another range (or ordinary memory) gets a MismatchError.
  std::shared_ptr<void> allocate_shared(size_t bytes);
  // Allreduces that took the in-place path on allocate_shared memory (tests, logs).
  uint64_t shared_allreduces() const { return shared_allreduces_; }

  // An in-place allreduce of `buf` whose ranks may each pass allocate_shared memory or not
  // (Communicator::allreduce_shareable). The ranks learn each other's buffers from the signatures they
  // publish anyway, so it costs no extra call: above the small limit, the in-place path's first round
  // (post, wait) comes first on every rank; when every rank's tag names the same range of one
  // allocation the call goes on in place, otherwise every rank stages it (allreduce_large), where a
  // plain allreduce would throw MismatchError. `want_shared`, on a call above the small limit that did
  // not run in place: when every rank passed it, the call ends with allocate_shared(count * dtype size)
  // on every rank (same order everywhere, like any call) and returns that memory; null otherwise.
  // Not concurrently with allocate_shared (both number the allocations).
  std::shared_ptr<void> allreduce_shareable(void* buf, size_t count, DataType dtype, ReduceOp op, bool want_shared);
  // In a shareable call's published flags: this rank asks for shared memory (tallied, never compared).
  // The operation's own flags (collectives/op_kind.h) use the low bits.
  static constexpr uint8_t kCallWantsShared = 0x80;

  // An allreduce fused with an optimizer's step (Communicator::allreduce_update), when `grads` and
  // `params` (count float32 each) are both ranges of allocate_shared memory; returns false, having
  // done nothing, otherwise (the caller then reduces and updates in two steps). After one wait, rank r
  // reduces slice r of every rank's gradients a cache-sized piece at a time, applies `update` to that
  // piece of its own parameters and copies the result into every peer's parameters; a second wait
  // ends it. `grads` keep this rank's contribution. Both ranges are part of the call's signature.
  using ParameterUpdate = std::function<void(size_t offset, size_t count, const float* reduced, float* params)>;
  bool allreduce_update(float* grads, float* params, size_t count, ReduceOp op, const ParameterUpdate& update);
  uint64_t fused_updates() const { return fused_updates_; }

  // ---- Error semantics of the communicator (comm/communicator_impl_shm.cc installs these) ----
  // The signature the following group calls publish (until the next set_call). After the first wait
  // of each call, every rank compares its peers' published signatures with its own and throws
  // MismatchError(formatter(peer, theirs, ours)) on the first that differs.
  void set_call(const CallSignature& call) { call_ = call; }
  using MismatchFormatter =
      std::function<std::string(int local_peer, const CallSignature& theirs, const CallSignature& ours)>;
  void set_mismatch_formatter(MismatchFormatter f) { mismatch_formatter_ = std::move(f); }
  // See PeerSync::set_watch / set_peer_namer.
  void set_watch(std::function<void(int local_peer)> watch) { sync_.set_watch(std::move(watch)); }
  void set_peer_namer(std::function<std::string(int local_peer)> namer) { sync_.set_peer_namer(std::move(namer)); }
  // Local ranks that have not reached this rank's step (meaningful inside a watch callback).
  std::vector<int> lagging() const { return sync_.lagging(); }
  // The call local rank q published last (for "last seen in operation #N" in timeout messages).
  CallSignature last_call_of(int q) const;

  Group(Segment segment, int local_rank, int local_size, std::chrono::milliseconds timeout,
        const GroupOptions& options);

  // The `reserved` word of a call's signature when it reduces shared memory: nonzero, and equal on two
  // ranks only if both reduce the same range of the same allocation.
  static uint32_t shared_tag(uint32_t allocation, size_t offset);

 private:
  // One allocate_shared() call: every rank's part, `per_rank` bytes each, in one segment.
  struct SharedRegion {
    Segment segment;
    size_t per_rank;
    uint32_t id;
    char* part(int rank) const { return static_cast<char*>(segment.data()) + static_cast<size_t>(rank) * per_rank; }
  };

  // `shared_tag` goes into the signature this call publishes (0: not on shared memory).
  // `tally`: the call is shareable (allreduce_shareable): its signatures are compared without the shared
  // tag and the request bit, which are tallied into tally_ instead; `group_flags` go into the published
  // flags (kCallWantsShared).
  template <typename Body>
  void guarded(const char* what, Body&& body, uint32_t shared_tag = 0, bool tally = false, uint8_t group_flags = 0);
  char* slot(int rank, unsigned parity) const;
  unsigned next_parity() { return round_++ & 1u; }
  // sync_.wait_all, then (once per call) the signature comparison.
  void wait_all(const char* what);
  void check_calls();
  // check_calls for the call whose signature this rank published in control-line entry `entry` as `ours`.
  void compare_calls(unsigned entry, const CallSignature& ours);
  // The rounds of inline broadcasts whose root (this rank) returned without waiting (see early_root),
  // oldest first, with what it published; at most kDepth - 1 of them.
  struct Unconfirmed {
    uint64_t round = 0;
    CallSignature call{};
  };
  Unconfirmed unconfirmed_[InlineLines::kDepth];
  unsigned unconfirmed_first_ = 0, unconfirmed_count_ = 0;
  // The next call is an inline broadcast of which this rank is the root: guarded() confirms only the
  // rounds whose lines it is about to reuse.
  bool next_call_early_root_ = false;
  // Confirms the unconfirmed rounds up to `through` (all: UINT64_MAX), oldest first: waits for every
  // peer's lines of that round (then for its step, with the deadline and dead-peer checks of every wait)
  // and compares the signature in them with this rank's (MismatchError).
  void confirm_arrivals(uint64_t through);
  // Polls rank q's lines for `round` for a short while (as inline_round does); whether they showed it.
  bool poll_lines(int q, uint64_t round) const;
  // Ends this inline broadcast's round without waiting, to be confirmed later (its root).
  void leave_unconfirmed();
  // One round at creation: every rank publishes its CPU affinity; waits spin without yielding when the
  // ranks' CPU sets are pairwise disjoint (each has cores of its own: nobody waits for this core).
  void choose_wait_policy();
  // One round at creation: every rank publishes its L2 size; the chunk follows the smallest.
  void choose_chunk_size();
  // Two rounds at creation: every rank publishes its pid and a word of its memory, reads every peer's
  // with process_vm_readv, and says whether all reads worked; single copy is on only if all did.
  void choose_single_copy();
  // A single-copy call: round one publishes `header` (this rank's addresses, then any per-peer table)
  // and waits for everyone; `copies(parity)` then moves the data (the peers' headers are in their
  // slots of that parity); round two ends the call.
  template <typename Copies>
  void single_copy_call(const char* what, const uint64_t* header, size_t words, Copies&& copies);
  const uint64_t* header_of(int q, unsigned parity) const { return reinterpret_cast<const uint64_t*>(slot(q, parity)); }
  // process_vm_readv / process_vm_writev of `bytes` between this rank's `local` and local rank q's
  // address `remote`; a failure names the peer and the cause.
  void kernel_pull(int q, void* local, uint64_t remote, size_t bytes, const char* what);
  void kernel_push(int q, uint64_t remote, const void* local, size_t bytes, const char* what);
  // A buffer as a single-copy call publishes it in its header: two words, its address in the publisher's
  // memory and its shared locator (nonzero when it lies in allocate_shared memory: which allocation, at
  // which offset of the publisher's part). A peer that maps the same allocation copies it with its own
  // loads and stores; otherwise, or for ordinary memory, the kernel copies (process_vm_readv/writev).
  struct PeerBuffer {
    uint64_t address = 0, locator = 0;
  };
  static constexpr size_t kBufferWords = 2;
  void publish(uint64_t* words, const void* data, size_t bytes);
  static PeerBuffer peer_buffer(const uint64_t* words) { return {words[0], words[1]}; }
  // Where this rank maps bytes [offset, offset + bytes) of local rank q's buffer `remote`, with `hold`
  // keeping that mapping alive; null when `remote` is not allocate_shared memory or this rank no longer
  // holds that allocation. A locator that names a range beyond its allocation's part throws, naming q.
  const char* mapped(int q, PeerBuffer remote, uint64_t offset, size_t bytes,
                     std::shared_ptr<SharedRegion>* hold, const char* what);
  // The live allocation numbered `id`, or null.
  std::shared_ptr<SharedRegion> shared_by_id(uint32_t id);
  // Copies `bytes` between this rank's memory and bytes [offset, offset + bytes) of local rank q's
  // buffer: through the mapping when there is one, else with process_vm_readv / process_vm_writev.
  void pull(int q, void* local, PeerBuffer remote, uint64_t offset, size_t bytes, const char* what);
  // A copy this rank makes on the single-copy path: memmove, or streaming stores from streaming_bytes on
  // (when the two ranges do not overlap).
  void copy_block(void* dst, const void* src, size_t bytes) const;
  void push(int q, PeerBuffer remote, uint64_t offset, const void* local, size_t bytes, const char* what);
  // reduce_scatter's single-copy path: each rank reduces its block a cache-sized piece at a time,
  // reading the peers' pieces of it from their inputs (through the mapping of an allocate_shared input,
  // else copied in with process_vm_readv) and its own in place.
  void reduce_scatter_single(const char* in, char* out, size_t count, DataType dtype, ReduceOp op);

  // The probe's rounds and the choice, inside a guarded call (probe(), or a recheck within an allreduce).
  std::vector<LinkProbe> measure_link();
  // Copies into this rank's slot with the chosen copy.
  void write_slot(char* dst, const void* src, size_t bytes) const;
  // After each large allreduce: notes a slow one; every recheck_every, one round to compare notes.
  void after_large_allreduce(size_t bytes, std::chrono::steady_clock::duration took);

  void allreduce_small(const void* in, void* out, size_t count, DataType dtype, ReduceOp op);
  // The inline path (small.cc): one round in which every rank writes its lines (a broadcast's non-roots
  // only their first: no data) and waits for the peers' lines it needs; returns the round.
  uint64_t inline_round(const char* what, const void* data, size_t bytes, int root);
  void allreduce_inline(const void* in, void* out, size_t count, DataType dtype, ReduceOp op);
  void allgather_inline(const void* in, void* out, size_t bytes);
  void broadcast_inline(void* data, size_t bytes, int root);
  void allreduce_large(const void* in, void* out, size_t count, DataType dtype, ReduceOp op);
  void allreduce_shared(const SharedRegion& region, size_t offset, size_t count, DataType dtype, ReduceOp op);
  // allreduce_shared after its first round.
  void reduce_shared(const SharedRegion& region, size_t offset, size_t count, DataType dtype, ReduceOp op);
  // The live allocation holding [data, data + bytes) in this rank's part, and the offset there.
  std::shared_ptr<SharedRegion> find_shared(const void* data, size_t bytes, size_t* offset);

  Segment segment_;
  std::string address_;  // the segment's rendezvous name; allocate_shared derives its own from it
  std::vector<int> pids_;  // each local rank's process: allocate_shared's segments go to these only
  int rank_;
  int size_;
  GroupOptions options_;
  PeerSync sync_;
  uint64_t round_ = 0;
  CallSignature call_{};        // from set_call
  CallSignature active_{};      // what the running call published: call_ plus its shared tag
  uint64_t calls_ = 0;          // group calls so far; call_ goes to control line entry calls_ & 1
  bool compare_pending_ = false;
  // What check_calls found in a shareable call's signatures (every rank sees the same ones, so every
  // rank finds the same): all ranks on the same range of one allocation; all ranks asking for memory.
  struct Tally {
    bool enabled = false;  // this call is shareable
    bool same_shared_range = false;
    bool all_want_shared = false;
  } tally_;
  MismatchFormatter mismatch_formatter_;
  std::string failure_;  // first error; later calls repeat it
  std::string wait_policy_;
  bool cpus_for_every_rank_ = false;  // the union of the ranks' CPU sets has at least one CPU per rank
  std::chrono::milliseconds timeout_;
  std::mutex shared_mutex_;  // allocate_shared (user thread) against find_shared (progress thread)
  std::vector<std::weak_ptr<SharedRegion>> shared_;
  uint32_t shared_allocations_ = 0;
  uint64_t shared_allreduces_ = 0;
  uint64_t fused_updates_ = 0;
  bool single_copy_ = false;          // choose_single_copy's verdict, alike on every rank
  std::string single_copy_why_;
  std::vector<int> peer_pids_;        // every local rank's process, as it published itself
  uint64_t single_copies_ = 0;
  InlineLines inline_;         // this group's lines for small messages, after the slots
  uint64_t inline_calls_ = 0;
  uint64_t early_roots_ = 0;
  CopiedBytes copied_;
  std::vector<char> reduce_pieces_;  // reduce_scatter_single: the peers' pieces and an accumulator
  // reduce_scatter_single: each peer's input where this rank maps it (null: copied in by the kernel), and
  // the allocations those mappings belong to, held for the call's length.
  std::vector<const char*> reduce_direct_;
  std::vector<std::shared_ptr<SharedRegion>> reduce_holds_;
  std::vector<char> alltoall_aside_;  // an in-place alltoallv's input, which peers read while it is overwritten
  std::vector<char> aside_;  // allreduce_shared's accumulator for local ranks >= 2; allreduce_update's
  ChunkChoice chunk_;  // alike on every rank (the slices of a chunk depend on it)
  std::atomic<SlotCopy> slot_copy_{SlotCopy::kCached};
  mutable std::mutex link_mutex_;  // link_line_ (written by the thread running collectives, read by any)
  std::string link_line_;
  std::atomic<uint32_t> reprobes_{0};
  double fastest_gbps_ = 0;     // the fastest large allreduce so far (bytes / time on this rank)
  bool slow_seen_ = false;      // a large allreduce since the last recheck ran far below it
  uint64_t large_allreduces_ = 0;
  uint64_t recheck_every_ = 0;  // options' recheck_every, doubled after each probe that changed nothing
};

}  // namespace cohort::shm
