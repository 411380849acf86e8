// Shared-memory point-to-point transport: the design is described in shm_transport.h.
#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <random>
#include <unordered_map>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/env.h"
#include "common/fd.h"
#include "common/handoff.h"
#include "common/host_identity.h"
#include "common/log.h"
#include "common/strings.h"
#include "transport/matching.h"
#include "transport/transport_base.h"

namespace cohort::transport {
namespace {

const env::BytesSetting kRingBytes("COHORT_SHM_P2P_RING_BYTES", 1 << 20,
                                   "bytes of each shared-memory point-to-point ring (rounded up to a power of two)");
const env::IntSetting kSpinUs("COHORT_SHM_P2P_SPIN_US", 20,
                              "microseconds a shm transport poll() spins before it sleeps on its eventfd");

constexpr uint32_t kAbortMagic = 0x41534843;  // "CHSA": the sender failed; the text follows
constexpr uint32_t kByeMagic = 0x42534843;    // "CHSB": the sender destroys its transport
constexpr uint64_t kMsgMagic = 0x314d5348434f48ull;
constexpr size_t kLine = 64;
// Ring indices are published after every piece this large, so that the two copies overlap instead of
// taking turns on whole rings.
constexpr size_t kPublishBytes = 64 * 1024;
// Sleep slice while waiting: a dead peer is noticed through its socket anyway; the slice bounds
// how late a missed condition (none known) could be seen.
constexpr int kSliceMs = 100;

using Hello = handoff::Hello;

struct CtlRecord {
  uint32_t magic;
  uint32_t cls;
};

// The owner's doorbell: set while the owner sleeps in poll(2) (peers then write its eventfd).
struct alignas(kLine) Doorbell {
  std::atomic<uint32_t> sleeping;
};
// One ring's indices, each on its own cache line: head is written by the producer only, tail by
// the consumer only. Both count bytes since the start (never wrap; 64 bits).
struct RingIndices {
  alignas(kLine) std::atomic<uint64_t> head;
  alignas(kLine) std::atomic<uint64_t> tail;
};
static_assert(sizeof(RingIndices) == 2 * kLine);

struct MsgHeader {
  uint64_t magic;
  uint64_t tag;
  uint64_t sub;
  Signature signature;
  uint64_t total;
};
static_assert(sizeof(MsgHeader) == 48, "ring message header layout");

// Early messages' buffers kept for reuse (tcp's COHORT_TCP_POOL_BYTES default): a pipelined ring
// sends chunks ahead of the receiver's posted window.
constexpr size_t kUnexpectedPoolBytes = size_t(64) << 20;

using SendItem = PendingSend<MsgHeader>;

struct Mapping {
  void* p = nullptr;
  size_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (p) ::munmap(p, bytes);
  }
};

struct Peer {
  bool used = false;
  UniqueFd sock;     // control channel (abstract SOCK_SEQPACKET)
  UniqueFd event;    // the peer's eventfd
  Mapping theirs;    // the peer's memfd: holds the ring this rank writes
  Doorbell* their_bell = nullptr;
  RingIndices* out = nullptr;
  char* out_data = nullptr;
  RingIndices* in = nullptr;  // in this rank's memfd
  char* in_data = nullptr;
  // send side
  std::deque<SendItem> sendq;
  // receive side (stream parser)
  MsgHeader hdr{};
  size_t hdr_got = 0;
  bool in_payload = false;
  char* dst = nullptr;
  size_t dst_left = 0;
  size_t msg_total = 0;
  int target_req = -1;
  Unexpected* target_unx = nullptr;
  bool sinking = false;  // the message being read is thrown away (Matching::dropping): not copied out
  MessageKey target_key{};
  // lifecycle
  bool bye = false;     // the peer destroyed its transport (orderly)
  bool closed = false;  // its socket reported end of file
  bool told_us = false;  // it sent this rank its failure notice (it needs none back)
};

size_t round_up_pow2(uint64_t v) {
  size_t r = 4096;
  while (r < v) r <<= 1;
  return r;
}

[[noreturn]] void throw_errno(const std::string& what) {
  throw Error(fmt::format("shm transport: {}: {}", what, std::strerror(errno)));
}

class ShmTransport final : public TransportBase {
 public:
  explicit ShmTransport(const TransportOptions& o)
      : TransportBase(o.rank, o.size, "shm", kUnexpectedPoolBytes, o.max_unexpected_bytes),
        scope_(scope_hash(o.job_scope)),
        slow_warning_(o.slow_warning),
        ring_bytes_(round_up_pow2(kRingBytes.get())),
        ring_mask_(ring_bytes_ - 1), spin_(std::chrono::microseconds(std::max<int64_t>(0, kSpinUs.get()))),
        peers_(static_cast<size_t>(o.size)), info_(static_cast<size_t>(o.size)) {
    shm_key_ = local_host_identity().shm_key();
    std::random_device rd;
    uint64_t rnd = (uint64_t(rd()) << 32) ^ rd();
    socket_name_ = fmt::format("cohort-p2p/{:016x}/{}/{}-{:016x}", scope_, rank_, ::getpid(), rnd);
    listener_.emplace(socket_name_, std::max(16, size_), fmt::format("shm transport rank {}", rank_));
    event_.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!event_) throw_errno("eventfd");
  }

  ~ShmTransport() override {
    log::debug("shm transport rank {}: {} message(s) received; {} message(s), {} byte(s) arrived before their receive "
               "was posted", rank_, stats_messages_, stats_unexpected_, stats_unexpected_bytes_);
    // Say goodbye so that peers can tell an orderly exit from a crash (as TCP does).
    CtlRecord bye{kByeMagic, 0};
    for (auto& p : peers_) {
      if (!p.used || p.closed || failed_ || !p.sendq.empty()) continue;
      (void)::send(p.sock.get(), &bye, sizeof bye, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
  }

  const char* name() const override { return "shm"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::string descriptor() const override {
    return fmt::format("shm;{};{}", shm_key_, socket_name_);
  }
  bool can_reach(const std::string& d) const override {
    std::string key, name;
    return parse_descriptor(d, &key, &name) && key == shm_key_;
  }

  void connect(const std::vector<PeerInfo>& peers, const std::vector<bool>& use, Deadline deadline) override {
    info_ = peers;
    // This rank's memfd: a doorbell line, then one ring per peer served over shm (slot = its index
    // among those peers), so the memory scales with the ranks on this host, not the world.
    const size_t stride = sizeof(RingIndices) + ring_bytes_;
    std::vector<uint64_t> slot(static_cast<size_t>(size_), 0);
    size_t slots = 0;
    for (int r = 0; r < size_; ++r)
      if (r != rank_ && use[size_t(r)]) slot[size_t(r)] = slots++;
    map_bytes_ = kLine + slots * stride;
    UniqueFd mem(::memfd_create("cohort-shm-p2p", MFD_CLOEXEC));
    if (!mem) throw_errno("memfd_create");
    if (::ftruncate(mem.get(), static_cast<off_t>(map_bytes_)) != 0)
      throw_errno(fmt::format("ftruncate to {} bytes", map_bytes_));
    mine_.bytes = map_bytes_;
    mine_.p = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, mem.get(), 0);
    if (mine_.p == MAP_FAILED) {
      mine_.p = nullptr;
      throw_errno(fmt::format("mmap of {} bytes", map_bytes_));
    }
    bell_ = new (mine_.p) Doorbell{};
    for (int r = 0; r < size_; ++r) {
      Peer& p = peers_[size_t(r)];
      p.used = r != rank_ && use[size_t(r)];
      if (!p.used) continue;
      char* base = static_cast<char*>(mine_.p) + kLine + size_t(slot[size_t(r)]) * stride;
      p.in = new (base) RingIndices{};
      p.in_data = base + sizeof(RingIndices);
    }
    // The memfd handoff (common/handoff.h): role, the rank; each hello attaches this rank's memfd (sized)
    // and eventfd, and says the ring size and which ring of the memfd its receiver writes.
    auto hello_for = [&](int peer) {
      Hello h = handoff::make_hello(scope_, uint32_t(rank_), ring_bytes_, slot[size_t(peer)]);
      h.sizes[0] = map_bytes_;
      return h;
    };
    const std::vector<int> my_fds = {mem.get(), event_.get()};

    // Dial the higher ranks and say hello (their listeners exist since construction: the backlog
    // holds the hello until they accept), then accept the lower ones, then read the higher ones'
    // replies. Nobody waits on anyone who waits on it: a rank's dials never wait for an answer.
    std::vector<int> dialed;
    for (int j = rank_ + 1; j < size_; ++j) {
      if (!peers_[size_t(j)].used) continue;
      std::string key, name;
      if (!parse_descriptor(info_[size_t(j)].descriptor, &key, &name))
        throw PeerLostError(fmt::format("rank {} ({}) published no shm endpoint ('{}')", j, host(j),
                                        info_[size_t(j)].descriptor));
      const std::string whom = fmt::format("rank {} ({})", j, host(j));
      UniqueFd s = handoff::connect(name, info_[size_t(j)].pid, whom, deadline);
      handoff::send(s.get(), hello_for(j), my_fds, deadline, whom);
      peers_[size_t(j)].sock = std::move(s);
      dialed.push_back(j);
    }
    auto log_interval = slow_warning_;
    auto next_log = Deadline::Clock::now() + log_interval;
    // Until `deadline`, in slices that end when it is time to say who is missing.
    auto slice = [&] {
      if (deadline.expired()) throw TimeoutError("shm transport connect: " + missing(dialed, "never connected"));
      if (Deadline::Clock::now() > next_log) {
        log::warn("waiting for shared-memory channels: {}", missing(dialed, "not connected yet"));
        log_interval *= 2;
        next_log = Deadline::Clock::now() + log_interval;
      }
      return Deadline::earliest(deadline, Deadline(next_log));
    };
    handoff::Expect lower{scope_, {}, "rank", 2};
    for (int j = 0; j < rank_; ++j)
      if (peers_[size_t(j)].used) lower.pids[uint32_t(j)] = info_[size_t(j)].pid;
    while (!lower.pids.empty()) {
      std::optional<handoff::Received> got = listener_->accept(lower, slice());
      if (!got) continue;
      const int j = int(got->hello.role);
      handoff::send(got->sock.get(), hello_for(j), my_fds, deadline, fmt::format("rank {} ({})", j, host(j)));
      attach(j, std::move(got->sock), *got);
      lower.pids.erase(uint32_t(j));
    }
    while (!dialed.empty()) {
      const int j = dialed.front();
      std::optional<handoff::Received> got =
          handoff::receive(peers_[size_t(j)].sock.get(), handoff::Expect{scope_, {{uint32_t(j), 0}}, "rank", 2}, slice(),
                           fmt::format("shm transport: rank {} ({})", j, host(j)));
      if (!got) continue;
      attach(j, std::move(peers_[size_t(j)].sock), *got);
      dialed.erase(dialed.begin());
    }
    listener_.reset();
    connected_ = true;
  }

  RequestId isend(int peer, const Envelope& env, const void* data, size_t bytes) override {
    bool to_self = false;
    uint32_t idx = start_send(peer, env, data, bytes, to_self);
    if (to_self) return m_.id(idx);
    Request& r = m_[idx];
    Peer& p = peers_[size_t(peer)];
    if (!p.used || !p.out) throw InvalidArgument(fmt::format("shm transport does not serve rank {}", peer));
    if (p.bye || p.closed) fail_peer_left(peer, "send to");
    SendItem item{};
    item.header = MsgHeader{kMsgMagic, env.tag, env.sub, env.signature, bytes};
    item.payload = r.data;
    item.length = bytes;
    item.written = 0;
    item.request = idx;
    p.sendq.push_back(item);
    write_ring(peer);  // latency path: as much as fits, now
    return m_.id(idx);
  }

  RequestId irecv(int peer, const Envelope& env, void* data, size_t bytes) override {
    bool matched = false;
    uint32_t idx = start_recv(peer, env, data, bytes, matched);
    if (matched) return m_.id(idx);
    Request& r = m_[idx];
    if (peer != rank_ && (peers_[size_t(peer)].bye || peers_[size_t(peer)].closed)) {
      // What it sent before leaving is in the ring: take it first.
      read_ring(peer);
      if (failed_) std::rethrow_exception(failed_);
      if (r.done) return m_.id(idx);
      if (!m_.find_unexpected(r)) fail_peer_left(peer, "receive from");
      return irecv_after_drain(idx);
    }
    m_.post(idx);
    return m_.id(idx);
  }


  bool poll(int timeout_ms) override {
    if (failed_ || !connected_) return false;
    bool any = progress();
    if (any) return true;
    // Sockets (notices, goodbyes, a dead peer's hang-up) are looked at without waiting at most
    // once per millisecond on the spinning path, so that poll(0) stays free of system calls.
    auto now = Deadline::Clock::now();
    if (now - last_socket_check_ > std::chrono::milliseconds(1)) {
      last_socket_check_ = now;
      any = check_sockets(0) || any;
      if (failed_) return true;
    }
    if (timeout_ms == 0) return any;
    auto spin_end = now + spin_;
    while (Deadline::Clock::now() < spin_end) {
      if (progress()) return true;
    }
    // Sleep: announce it, look once more (a peer that moved an index before it saw the flag did
    // not ring), then wait for the eventfd or a socket.
    auto end = timeout_ms < 0 ? Deadline::Clock::time_point::max()
                              : Deadline::Clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      bell_->sleeping.store(1, std::memory_order_seq_cst);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (progress()) {
        bell_->sleeping.store(0, std::memory_order_relaxed);
        return true;
      }
      int ms = kSliceMs;
      if (timeout_ms >= 0) {
        // Rounded up: a truncated "0 ms left" would turn the rest of the wait into a loop of
        // poll(2) calls that return at once (found with the parameter server's 1 ms slices).
        auto left = std::chrono::ceil<std::chrono::milliseconds>(end - Deadline::Clock::now()).count();
        ms = int(std::clamp<long>(left, 0, kSliceMs));
      }
      bool woke = check_sockets(ms);
      bell_->sleeping.store(0, std::memory_order_relaxed);
      if (failed_) return true;
      if (progress() || woke) return true;
      if (Deadline::Clock::now() >= end) return false;
    }
  }

  void fail(std::exception_ptr error) override {
    if (failed_) return;
    failed_ = error;
    for (auto& p : peers_) {
      p.sendq.clear();
      p.in_payload = false;
      p.hdr_got = 0;
      p.target_req = -1;
      p.target_unx = nullptr;
      p.sinking = false;
    }
    m_.clear();
  }

  // Every peer hears the root cause except those that told it to this rank (see the TCP transport:
  // a rank failed by a notice passes it on, so nobody names it once it exits).
  void notify_peers(ErrorClass cls, const std::string& message) override {
    std::string rec(sizeof(CtlRecord), '\0');
    CtlRecord h{kAbortMagic, uint32_t(cls)};
    std::memcpy(rec.data(), &h, sizeof h);
    rec += message.substr(0, 4096);
    for (auto& p : peers_) {
      if (!p.used || !p.sock || p.closed || p.told_us) continue;
      (void)::send(p.sock.get(), rec.data(), rec.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
  }

 private:
  static bool parse_descriptor(const std::string& d, std::string* key, std::string* name) {
    if (!str::starts_with(d, "shm;")) return false;
    size_t last = d.rfind(';');
    if (last == std::string::npos || last < 4) return false;
    *key = d.substr(4, last - 4);
    *name = d.substr(last + 1);
    return !key->empty() && !name->empty();
  }

  std::string host(int r) const { return r >= 0 && size_t(r) < info_.size() ? info_[size_t(r)].host : "?"; }

  std::string missing(const std::vector<int>& awaiting_reply, const char* what) const {
    std::vector<int> ranks = awaiting_reply;
    for (int j = 0; j < rank_; ++j)
      if (peers_[size_t(j)].used && !peers_[size_t(j)].out) ranks.push_back(j);
    std::sort(ranks.begin(), ranks.end());
    std::vector<std::string> hosts;
    for (int j : ranks)
      if (hosts.size() < 8) hosts.push_back(host(j));
    return fmt::format("rank(s) {} (host(s) {}) {}", str::format_ranges(ranks), str::join(hosts, ","), what);
  }

  // Maps rank r's memfd and keeps its eventfd and the socket, once the ring layout its hello gives (the
  // ring size, where this rank's ring lies) is checked. Its two descriptors, and the memfd's size
  // against h.sizes[0], the handoff checked.
  void attach(int r, UniqueFd sock, handoff::Received& got) {
    Peer& p = peers_[size_t(r)];
    const Hello& h = got.hello;
    if (h.values[0] != ring_bytes_)
      throw MismatchError(fmt::format("shm handshake: rank {} ({}) has rings of {} bytes; this rank has rings of {} bytes",
                                      r, host(r), h.values[0], ring_bytes_));
    const auto offset = handoff::slot_offset(h.values[1], h.sizes[0], sizeof(RingIndices) + ring_bytes_, kLine);
    if (h.values[1] >= uint64_t(size_) || !offset)
      throw MismatchError(fmt::format("shm handshake: rank {} ({}) offered ring {} of a {}-byte segment", r, host(r),
                                      h.values[1], h.sizes[0]));
    p.sock = std::move(sock);
    p.event = std::move(got.fds[1]);
    p.theirs.bytes = h.sizes[0];
    p.theirs.p = ::mmap(nullptr, h.sizes[0], PROT_READ | PROT_WRITE, MAP_SHARED, got.fds[0].get(), 0);
    if (p.theirs.p == MAP_FAILED) {
      p.theirs.p = nullptr;
      throw_errno(fmt::format("mmap of rank {}'s {} bytes", r, h.sizes[0]));
    }
    char* base = static_cast<char*>(p.theirs.p);
    p.their_bell = reinterpret_cast<Doorbell*>(base);
    p.out = reinterpret_cast<RingIndices*>(base + *offset);
    p.out_data = base + *offset + sizeof(RingIndices);
    // The memfd descriptor itself is not kept: the mapping holds the memory.
  }

  void wake(Peer& p) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (p.their_bell->sleeping.load(std::memory_order_relaxed)) {
      uint64_t one = 1;
      (void)!::write(p.event.get(), &one, sizeof one);
    }
  }

  // Producer: moves queued sends into the ring to `peer`. Returns whether anything moved.
  bool write_ring(int peer) {
    Peer& p = peers_[size_t(peer)];
    if (p.sendq.empty()) return false;
    uint64_t head = p.out->head.load(std::memory_order_relaxed);
    uint64_t tail = p.out->tail.load(std::memory_order_acquire);
    size_t space = ring_bytes_ - size_t(head - tail);
    if (space == 0) return false;
    const uint64_t start = head;
    while (!p.sendq.empty() && space > 0) {
      SendItem& it = p.sendq.front();
      if (it.written < sizeof(MsgHeader)) {
        size_t n = std::min(space, sizeof(MsgHeader) - it.written);
        ring_put(p.out_data, head, reinterpret_cast<const char*>(&it.header) + it.written, n);
        head += n;
        space -= n;
        it.written += n;
      }
      if (it.written >= sizeof(MsgHeader) && space > 0) {
        size_t off = it.written - sizeof(MsgHeader);
        size_t n = std::min({space, it.length - off, kPublishBytes});
        if (n) ring_put(p.out_data, head, it.payload + off, n);
        head += n;
        space -= n;
        it.written += n;
        // Publish every piece at once: the consumer copies out while this rank copies in.
        if (n == kPublishBytes) p.out->head.store(head, std::memory_order_release);
      }
      if (it.written == sizeof(MsgHeader) + it.length) {
        m_[it.request].done = true;
        p.sendq.pop_front();
      }
    }
    if (head == start) return false;
    p.out->head.store(head, std::memory_order_release);
    wake(p);
    return true;
  }

  // Consumer: parses what the ring from `peer` holds. Returns whether anything moved.
  bool read_ring(int peer) {
    Peer& p = peers_[size_t(peer)];
    uint64_t tail = p.in->tail.load(std::memory_order_relaxed);
    uint64_t head = p.in->head.load(std::memory_order_acquire);
    if (head == tail) return false;
    const uint64_t start = tail;
    while (tail != head && !failed_) {
      size_t avail = size_t(head - tail);
      if (!p.in_payload) {
        size_t n = std::min(avail, sizeof(MsgHeader) - p.hdr_got);
        ring_get(p.in_data, tail, reinterpret_cast<char*>(&p.hdr) + p.hdr_got, n);
        tail += n;
        p.hdr_got += n;
        if (p.hdr_got < sizeof(MsgHeader)) break;
        p.hdr_got = 0;
        if (p.hdr.magic != kMsgMagic) {
          fail(std::make_exception_ptr(PeerLostError(
              fmt::format("lost rank {} ({}): protocol error in its shared-memory ring", peer, host(peer)))));
          break;
        }
        begin_message(peer);
        if (failed_) break;
        if (p.dst_left == 0) finish_message(peer);
        else p.in_payload = true;
      } else {
        size_t n = std::min({avail, p.dst_left, kPublishBytes});
        if (!p.sinking) {
          ring_get(p.in_data, tail, p.dst, n);
          p.dst += n;
        }
        tail += n;
        p.dst_left -= n;
        // Free every piece at once, so that the producer refills while this rank copies out.
        if (n == kPublishBytes) p.in->tail.store(tail, std::memory_order_release);
        if (p.dst_left == 0) {
          p.in_payload = false;
          finish_message(peer);
        }
      }
    }
    p.in->tail.store(tail, std::memory_order_release);
    wake(p);
    return tail != start;
  }

  void ring_put(char* ring, uint64_t pos, const char* src, size_t n) const {
    size_t off = size_t(pos) & ring_mask_;
    size_t first = std::min(n, ring_bytes_ - off);
    std::memcpy(ring + off, src, first);
    if (n > first) std::memcpy(ring, src + first, n - first);
  }
  void ring_get(const char* ring, uint64_t pos, char* dst, size_t n) const {
    size_t off = size_t(pos) & ring_mask_;
    size_t first = std::min(n, ring_bytes_ - off);
    std::memcpy(dst, ring + off, first);
    if (n > first) std::memcpy(dst + first, ring, n - first);
  }

  void begin_message(int peer) {
    Peer& p = peers_[size_t(peer)];
    const MsgHeader& h = p.hdr;
    MessageKey k{peer, h.tag, h.sub};
    ++stats_messages_;
    note_arrival(peer, h.tag, h.signature, h.total);
    p.msg_total = h.total;
    p.dst_left = h.total;
    p.target_key = k;
    auto it = m_.posted.find(k);
    if (it != m_.posted.end()) {
      Request& r = m_[it->second];
      try {
        check_match(peer, h.signature, h.total, r);
      } catch (const Error&) {
        return;  // the transport is failed now; test() reports it
      }
      p.target_req = int(it->second);
      p.target_unx = nullptr;
      p.dst = r.data;  // straight into the user's buffer
      return;
    }
    if (m_.unexpected.count(k)) {
      fail(std::make_exception_ptr(PeerLostError(fmt::format(
          "rank {} ({}) sent two messages with the same tag {:#x} and sub {:#x}", peer, host(peer), h.tag, h.sub))));
      return;
    }
    if (m_.dropping(k, h.total)) {
      p.sinking = true;
      p.target_req = -1;
      p.target_unx = nullptr;
      p.dst = nullptr;
      return;
    }
    ++stats_unexpected_;
    stats_unexpected_bytes_ += h.total;
    Unexpected& u = m_.add_unexpected(k, h.signature, h.total);
    p.target_req = -1;
    p.target_unx = &u;
    p.dst = u.buf.get();
  }

  void finish_message(int peer) {
    Peer& p = peers_[size_t(peer)];
    if (p.sinking) {
      p.sinking = false;
      m_.dropped_bytes(p.target_key, p.msg_total);
      return;
    }
    if (p.target_req >= 0) {
      Request& r = m_[size_t(p.target_req)];
      r.done = true;
      m_.posted.erase(r.key);
      p.target_req = -1;
      return;
    }
    Unexpected* u = p.target_unx;
    p.target_unx = nullptr;
    if (!u) return;
    u->received = u->total;
    m_.unexpected_arrived(p.target_key, *u);
  }

  // A receive posted after its peer left, whose message was found (partly) in the ring.
  RequestId irecv_after_drain(uint32_t idx) {
    Request& r = m_[idx];
    Unexpected& u = *m_.find_unexpected(r);
    check_match(r.peer, u.signature, u.total, r);
    if (u.received == u.total) {
      m_.adopt(idx, u);
      return m_.id(idx);
    }
    fail(std::make_exception_ptr(PeerLostError(fmt::format(
        "rank {} ({}) left in the middle of a message to this rank", r.peer, host(r.peer)))));
    std::rethrow_exception(failed_);
  }

  bool progress() {
    bool any = false;
    for (int q = 0; q < size_ && !failed_; ++q) {
      Peer& p = peers_[size_t(q)];
      if (!p.used || !p.out) continue;
      any = read_ring(q) || any;
      if (!p.sendq.empty()) any = write_ring(q) || any;
    }
    return any;
  }

  // Looks at the control sockets (and sleeps on them and the eventfd up to `ms`). Returns whether
  // something happened.
  bool check_sockets(int ms) {
    std::vector<pollfd> fds;
    std::vector<int> who;
    fds.push_back({event_.get(), POLLIN, 0});
    who.push_back(-1);
    for (int q = 0; q < size_; ++q) {
      Peer& p = peers_[size_t(q)];
      if (!p.used || !p.sock || p.closed) continue;
      fds.push_back({p.sock.get(), POLLIN, 0});
      who.push_back(q);
    }
    int n = ::poll(fds.data(), fds.size(), ms);
    if (n <= 0) return false;
    if (fds[0].revents & POLLIN) {
      uint64_t v;
      (void)!::read(event_.get(), &v, sizeof v);
    }
    for (size_t i = 1; i < fds.size() && !failed_; ++i)
      if (fds[i].revents) read_socket(who[i]);
    return true;
  }

  void read_socket(int q) {
    Peer& p = peers_[size_t(q)];
    char buf[sizeof(CtlRecord) + 4096 + 64];
    for (;;) {
      ssize_t n = ::recv(p.sock.get(), buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        n = 0;  // ECONNRESET and the like: the peer is gone
      }
      if (n == 0) {
        p.closed = true;
        peer_gone(q);
        return;
      }
      CtlRecord h{};
      if (size_t(n) < sizeof h) continue;
      std::memcpy(&h, buf, sizeof h);
      if (h.magic == kByeMagic) {
        p.bye = true;
        peer_gone(q);
        if (failed_) return;
      } else if (h.magic == kAbortMagic) {
        std::string text(buf + sizeof h, size_t(n) - sizeof h);
        p.told_us = true;
        std::string msg = fmt::format("rank {} ({}) failed: {}", q, host(q), text);
        switch (ErrorClass(h.cls)) {
          case ErrorClass::kTimeout: fail(std::make_exception_ptr(TimeoutError(msg))); break;
          case ErrorClass::kPeerLost: fail(std::make_exception_ptr(PeerLostError(msg))); break;
          case ErrorClass::kMismatch: fail(std::make_exception_ptr(MismatchError(msg))); break;
          default: fail(std::make_exception_ptr(AbortedError(msg))); break;
        }
        return;
      }
    }
  }

  // The peer said goodbye or its socket closed. What it wrote before is in the ring: take it, then
  // fail whatever can no longer complete.
  void peer_gone(int q) {
    Peer& p = peers_[size_t(q)];
    read_ring(q);
    if (failed_) return;
    if (!p.bye) {
      fail(std::make_exception_ptr(PeerLostError(fmt::format(
          "lost rank {} ({}): its process exited or was killed (shared-memory channel closed without a goodbye)", q,
          host(q)))));
      return;
    }
    bool waiting = p.in_payload || p.hdr_got != 0 || !p.sendq.empty();
    for (auto& [key, idx] : m_.posted) waiting = waiting || key.peer == q;
    if (waiting) {
      fail(std::make_exception_ptr(PeerLostError(fmt::format(
          "rank {} ({}) left (destroyed its communicator) while this rank still expects a message from it", q,
          host(q)))));
    }
  }

  std::string peer_host(int peer) const override { return host(peer); }

  uint64_t scope_;
  std::chrono::nanoseconds slow_warning_;  // connect(): first "waiting for" warning, then doubling
  size_t ring_bytes_;
  size_t ring_mask_;
  std::chrono::nanoseconds spin_;
  std::string shm_key_;  // this host's identity (read once; equal keys can share memory)
  std::string socket_name_;
  std::optional<handoff::Listener> listener_;  // until connect() is done
  UniqueFd event_;
  Mapping mine_;
  size_t map_bytes_ = 0;
  Doorbell* bell_ = nullptr;
  bool connected_ = false;
  std::vector<Peer> peers_;
  std::vector<PeerInfo> info_;
  Deadline::Clock::time_point last_socket_check_{};
  uint64_t stats_messages_ = 0, stats_unexpected_ = 0, stats_unexpected_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Transport> make_shm_transport(const TransportOptions& options) {
  return std::make_unique<ShmTransport>(options);
}

}  // namespace cohort::transport
