// The TCP store server: one thread, one epoll set, non-blocking sockets, no thread per connection.
//
// Thread model: start() binds and listens on the caller's thread (so a port in use is reported
// there), then everything else (accepts, reads, the key-value map, parked waits, timers) lives on
// the loop thread; stop() wakes it through an eventfd and joins it. Waits are parked on the server:
// a wait, get or multi_get for a missing key registers its id under each missing key (`waiting_`),
// and creating a key wakes exactly the waiters filed under it. A barrier's release is one set
// that wakes every participant. docs/store.md has the protocol.
//
// Leases: a connection may hold wills (keys to set when it ends) and a silence limit. Its end (EOF,
// an error, or silence past the limit, which closes it) queues the wills, and the loop sets them once
// the current event is handled: setting a key wakes waiters and may close other connections, which
// must not happen under the feet of the code that is closing this one.
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <queue>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/log.h"
#include "common/socket.h"
#include "store/auth.h"
#include "store/protocol.h"
#include "store/tcp_store.h"

namespace cohort {
namespace {

using Clock = std::chrono::steady_clock;
using proto::Op;

constexpr uint64_t kListenId = 0;
constexpr uint64_t kWakeId = 1;
constexpr size_t kReadChunk = 64 * 1024;
constexpr size_t kReadBudget = 1 << 20;  // bytes read from one connection per wake-up (fairness)

struct Conn {
  uint64_t id = 0;
  UniqueFd fd;
  net::Address peer;
  bool authenticated = false;
  bool writing = false;  // EPOLLOUT registered
  std::string nonce;
  std::string in;
  std::string out;
  size_t out_sent = 0;
  Clock::time_point partial_since{};  // when an incomplete frame started waiting in `in`
  std::vector<uint64_t> waiters;       // ids of this connection's parked waits
  // Its lease (kLease): wills set when it ends, and the silence that ends it (0: none).
  std::vector<std::pair<std::string, std::string>> wills;
  std::chrono::milliseconds lease{0};
  Clock::time_point last_frame{};
  // Its fence (kFence): writes are refused while the integer at fence_key exceeds fence_epoch.
  std::string fence_key;  // empty: not fenced
  int64_t fence_epoch = 0;
};

struct Waiter {
  uint64_t conn = 0;
  uint32_t request = 0;
  Op op = Op::kWait;
  std::vector<std::string> keys;
  size_t missing = 0;
  Clock::time_point started{};
  Clock::time_point deadline{};
};

enum class TimerKind : uint8_t { kHandshake, kPartialFrame, kWaiter, kRearmListen, kLease };

struct Timer {
  Clock::time_point at;
  TimerKind kind;
  uint64_t id;
  bool operator>(const Timer& o) const { return at > o.at; }
};

class TcpStoreServer : public StoreServer {
 public:
  explicit TcpStoreServer(StoreServerOptions options) : options_(std::move(options)) {
    listen_fd_ = net::listen_tcp(options_.host, options_.port, options_.backlog, /*nonblocking=*/true);
    port_ = net::local_address(listen_fd_.get()).port();
    // Accepted sockets inherit these from the listening socket (one call each instead of one per
    // connection): no Nagle delay on small replies, and keep-alive probes that notice a peer whose
    // host vanished (a half-open connection) within about 2 minutes.
    net::set_nodelay(listen_fd_.get());
    net::set_keepalive(listen_fd_.get(), 60, 10, 6);
    std::string host = options_.host;
    if (host.empty() || host == "0.0.0.0" || host == "::") host = net::hostname();
    address_ = host.find(':') != std::string::npos ? fmt::format("[{}]:{}", host, port_) : fmt::format("{}:{}", host, port_);
    epoll_fd_.reset(epoll_create1(EPOLL_CLOEXEC));
    wake_fd_.reset(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    if (!epoll_fd_ || !wake_fd_) throw Error(net::errno_string("store server: epoll/eventfd", errno));
    add_fd(listen_fd_.get(), kListenId, EPOLLIN);
    add_fd(wake_fd_.get(), kWakeId, EPOLLIN);
    log::info("store: serving at {} (backlog {}, {})", address_, options_.backlog,
              options_.token.empty() ? "no authentication" : "job token required");
    thread_ = std::thread([this] { loop(); });
  }

  ~TcpStoreServer() override { stop(); }

  uint16_t port() const override { return port_; }
  std::string address() const override { return address_; }
  uint64_t requests() const override { return requests_.load(std::memory_order_relaxed); }

  void stop() override {
    if (stopping_.exchange(true)) {
      if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
      return;
    }
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd_.get(), &one, sizeof one);
    (void)ignored;
    if (thread_.joinable()) thread_.join();
  }

 private:
  // ---- event loop -------------------------------------------------------------------------
  void loop() {
    std::vector<epoll_event> events(1024);
    while (!stopping_.load(std::memory_order_relaxed)) {
      int n = epoll_wait(epoll_fd_.get(), events.data(), static_cast<int>(events.size()), next_timeout_ms());
      if (n < 0) {
        if (errno == EINTR) continue;
        log::error("store: epoll_wait failed: {}", std::strerror(errno));
        break;
      }
      for (int i = 0; i < n; ++i) {
        uint64_t id = events[i].data.u64;
        if (id == kWakeId) continue;  // stop() asked; the loop condition sees it
        if (id == kListenId) {
          accept_all();
          continue;
        }
        auto it = conns_.find(id);
        if (it == conns_.end()) continue;  // closed earlier in this batch
        Conn& c = *it->second;
        uint32_t ev = events[i].events;
        if (ev & EPOLLOUT) {
          if (!flush(c)) continue;
        }
        if (ev & (EPOLLIN | EPOLLHUP | EPOLLERR)) on_readable(c);
      }
      run_timers();
      fire_wills();
    }
    shutdown_all();
  }

  void add_fd(int fd, uint64_t id, uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      throw Error(net::errno_string("store server: epoll_ctl(ADD)", errno));
    }
  }

  void set_writing(Conn& c, bool on) {
    if (c.writing == on) return;
    epoll_event ev{};
    ev.events = EPOLLIN | (on ? static_cast<uint32_t>(EPOLLOUT) : 0u);
    ev.data.u64 = c.id;
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
    c.writing = on;
  }

  int next_timeout_ms() {
    while (!timers_.empty() && is_stale(timers_.top())) timers_.pop();
    if (timers_.empty()) return -1;
    auto left = timers_.top().at - Clock::now();
    if (left <= Clock::duration::zero()) return 0;
    // Round up so that a timer never fires a little early and spins.
    return static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(left).count());
  }

  // ---- accepting ----------------------------------------------------------------------------
  void accept_all() {
    // Many connections arrive per wake-up in a storm: accept until the queue is empty.
    for (;;) {
      net::Address peer;
      peer.length = sizeof peer.storage;
      int fd = accept4(listen_fd_.get(), reinterpret_cast<sockaddr*>(&peer.storage), &peer.length,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // Out of descriptors: stop accepting for a moment instead of spinning on a readable socket.
          log::warn("store: cannot accept more connections ({}); {} open; retrying in 100 ms",
                    std::strerror(errno), conns_.size());
          epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, listen_fd_.get(), nullptr);
          timers_.push({Clock::now() + std::chrono::milliseconds(100), TimerKind::kRearmListen, 0});
          return;
        }
        log::warn("store: accept failed: {}", std::strerror(errno));
        return;
      }
      auto c = std::make_unique<Conn>();
      c->id = next_conn_id_++;
      c->fd.reset(fd);
      c->peer = peer;
      c->nonce = store_auth::make_nonce();
      proto::encode_challenge(c->out, !options_.token.empty(), c->nonce);
      add_fd(fd, c->id, EPOLLIN);
      timers_.push({Clock::now() + options_.handshake_timeout, TimerKind::kHandshake, c->id});
      Conn& ref = *c;
      conns_.emplace(c->id, std::move(c));
      flush(ref);
    }
  }

  // ---- reading and dispatch -----------------------------------------------------------------
  void on_readable(Conn& c) {
    const uint64_t id = c.id;
    size_t budget = kReadBudget;
    bool peer_closed = false;
    while (budget > 0) {
      ssize_t n = ::recv(c.fd.get(), scratch_, sizeof scratch_, 0);
      if (n > 0) {
        c.in.append(scratch_, static_cast<size_t>(n));
        budget -= std::min(budget, static_cast<size_t>(n));
        if (static_cast<size_t>(n) < kReadChunk) break;
        continue;
      }
      if (n == 0) {
        peer_closed = true;
        break;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      close_conn(id, fmt::format("receive failed: {}", std::strerror(errno)), log::Level::kInfo, false);
      return;
    }
    processing_ = id;
    bool open = process_frames(c);
    processing_ = 0;
    if (!open) return;
    if (peer_closed) {
      flush(c);
      close_conn(id, "the client closed the connection", log::Level::kDebug, false);
      return;
    }
    flush(c);
  }

  // Handles every complete frame in c.in. Returns false when the connection was closed.
  bool process_frames(Conn& c) {
    size_t off = 0;
    const uint64_t id = c.id;
    while (off < c.in.size()) {
      proto::FrameView frame;
      auto r = proto::decode_frame(c.in.data() + off, c.in.size() - off, options_.max_frame, &frame);
      if (r.status == proto::DecodeStatus::kNeedMore) break;
      if (r.status == proto::DecodeStatus::kBad) {
        close_conn(id,
                   r.length < proto::kMinLength
                       ? fmt::format("malformed frame (length field {})", r.length)
                       : fmt::format("frame of {} bytes exceeds the limit of {} bytes", r.length, options_.max_frame),
                   log::Level::kInfo, true);
        return false;
      }
      off += r.consumed;
      if (!handle_frame(c, frame)) return false;
    }
    if (off > 0) {
      c.in.erase(0, off);
      if (c.lease.count() > 0) {
        c.last_frame = Clock::now();
        timers_.push({c.last_frame + c.lease, TimerKind::kLease, c.id});
      }
    }
    if (c.in.empty()) {
      c.partial_since = {};
    } else if (c.partial_since == Clock::time_point{}) {
      c.partial_since = Clock::now();
      timers_.push({c.partial_since + options_.frame_timeout, TimerKind::kPartialFrame, c.id});
    }
    return true;
  }

  bool handle_frame(Conn& c, const proto::FrameView& frame) {
    if (!c.authenticated) return handle_hello(c, frame);
    std::string error;
    if (!proto::parse_request(frame, &request_, &error)) {
      close_conn(c.id, error, log::Level::kInfo, true);
      return false;
    }
    execute(c, request_);
    return true;
  }

  bool handle_hello(Conn& c, const proto::FrameView& frame) {
    proto::Hello hello;
    if (frame.op == Op::kNotice) return handle_notice(c, frame);
    if (frame.op != Op::kHello) {
      close_conn(c.id, fmt::format("expected the handshake, got operation {}", static_cast<unsigned>(frame.op)),
                 log::Level::kInfo, true);
      return false;
    }
    if (!proto::parse_hello(frame.payload, &hello) || hello.magic != proto::kMagic) {
      close_conn(c.id, "malformed handshake (not a cohort store client)", log::Level::kInfo, true);
      return false;
    }
    std::string refusal;
    if (hello.version != proto::kVersion) {
      refusal = fmt::format("protocol version {} is not supported (the server speaks version {})", hello.version,
                            proto::kVersion);
    } else if (!options_.token.empty()) {
      if (hello.proof.empty()) {
        refusal = "the client has no job token (set COHORT_JOB_TOKEN to the job's token)";
      } else if (!store_auth::verify(options_.token, c.nonce, hello.proof)) {
        refusal = "the client's job token does not match the job's";
      }
    }
    if (!refusal.empty()) {
      log::warn("store: refused connection from {}: {}", c.peer.to_string(), refusal);
      proto::encode_string_reply(c.out, Op::kRefused, frame.id, refusal);
      const uint64_t id = c.id;
      flush(c);
      close_conn(id, "", log::Level::kDebug, false);
      return false;
    }
    c.authenticated = true;
    c.nonce.clear();
    proto::Writer(c.out).begin(Op::kWelcome, frame.id).end();
    return true;
  }

  // A notice is served before authentication and leaves the connection in the handshake: it is what
  // lets a node without the token yet (a Slurm per-node job's) fetch what it decodes the token from.
  bool handle_notice(Conn& c, const proto::FrameView& frame) {
    std::string_view name;
    if (!proto::parse_notice(frame.payload, &name)) {
      close_conn(c.id, "malformed notice request (not a cohort store client)", log::Level::kInfo, true);
      return false;
    }
    auto it = options_.notices.find(std::string(name));
    if (it == options_.notices.end())
      proto::encode_string_reply(c.out, Op::kError, frame.id, fmt::format("this store has no notice '{}'", name));
    else
      proto::encode_string_reply(c.out, Op::kOk, frame.id, it->second);
    return true;
  }

  // ---- operations ---------------------------------------------------------------------------
  void reply_ok(Conn& c, uint32_t id) { proto::Writer(c.out).begin(Op::kOk, id).end(); }

  // Inserts or overwrites; wakes the waiters of a key that did not exist.
  void put(std::string_view key, std::string_view value) {
    key_scratch_.assign(key);
    auto [it, inserted] = data_.try_emplace(key_scratch_);
    it->second.assign(value);
    if (inserted) key_created(it->first);
  }

  // The epoch at `key` (missing: 0); nullopt when the value is not an integer.
  std::optional<int64_t> epoch_at(const std::string& key) const {
    auto it = data_.find(key);
    if (it == data_.end() || it->second.empty()) return 0;
    int64_t v = 0;
    auto [p, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
    if (ec != std::errc() || p != it->second.data() + it->second.size()) return std::nullopt;
    return v;
  }

  // Why a write of fenced connection `c` must not be done ("" when it may).
  std::string stale_reason(const Conn& c) const {
    if (c.fence_key.empty()) return "";
    auto now = epoch_at(c.fence_key);
    if (!now) return fmt::format("stale epoch: the store's epoch key '{}' does not hold an integer", c.fence_key);
    if (*now <= c.fence_epoch) return "";
    return fmt::format("stale epoch: this connection writes for epoch {} but the store is at epoch {} ('{}')",
                       c.fence_epoch, *now, c.fence_key);
  }

  static bool is_write(Op op) {
    return op == Op::kSet || op == Op::kAdd || op == Op::kCompareSet || op == Op::kDelete || op == Op::kMultiSet;
  }

  void execute(Conn& c, const proto::Request& r) {
    requests_.fetch_add(1, std::memory_order_relaxed);
    if (is_write(r.op)) {
      std::string stale = stale_reason(c);
      if (!stale.empty()) {
        proto::encode_string_reply(c.out, Op::kStale, r.id, stale);
        return;
      }
    }
    switch (r.op) {
      case Op::kSet:
        put(r.key, r.value);
        reply_ok(c, r.id);
        break;
      case Op::kGet:
      case Op::kMultiGet:
      case Op::kWait:
        park_or_answer(c, r);
        break;
      case Op::kAdd: {
        key_scratch_.assign(r.key);
        auto [it, inserted] = data_.try_emplace(key_scratch_);
        int64_t v = 0;
        if (!inserted && !it->second.empty()) {
          auto [p, ec] = std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
          if (ec != std::errc() || p != it->second.data() + it->second.size()) {
            proto::encode_string_reply(c.out, Op::kError, r.id,
                                       fmt::format("store add on key '{}': value is not an integer", r.key));
            break;
          }
        }
        v += r.delta;
        char buf[24];
        auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
        it->second.assign(buf, end);
        proto::Writer(c.out).begin(Op::kOk, r.id).i64(v).end();
        if (inserted) key_created(it->first);
        break;
      }
      case Op::kCompareSet: {
        key_scratch_.assign(r.key);
        auto it = data_.find(key_scratch_);
        std::string_view result;
        if (it == data_.end()) {
          if (r.expected.empty()) {
            put(r.key, r.value);
            result = r.value;
          } else {
            result = r.expected;  // torch's convention: a missing key answers `expected`
          }
        } else if (it->second == r.expected) {
          it->second.assign(r.value);
          result = r.value;
        } else {
          result = it->second;
        }
        proto::encode_string_reply(c.out, Op::kOk, r.id, result);
        break;
      }
      case Op::kDelete: {
        key_scratch_.assign(r.key);
        bool existed = data_.erase(key_scratch_) > 0;
        proto::Writer(c.out).begin(Op::kOk, r.id).u8(existed ? 1 : 0).end();
        break;
      }
      case Op::kNumKeys:
        proto::Writer(c.out).begin(Op::kOk, r.id).i64(static_cast<int64_t>(data_.size())).end();
        break;
      case Op::kCheck: {
        bool all = true;
        for (auto k : r.keys) {
          key_scratch_.assign(k);
          if (!data_.count(key_scratch_)) {
            all = false;
            break;
          }
        }
        proto::Writer(c.out).begin(Op::kOk, r.id).u8(all ? 1 : 0).end();
        break;
      }
      case Op::kMultiSet:
        if (r.keys.size() != r.values.size()) {
          proto::encode_string_reply(c.out, Op::kError, r.id, "store multi_set: keys and values differ in number");
          break;
        }
        for (size_t i = 0; i < r.keys.size(); ++i) put(r.keys[i], r.values[i]);
        reply_ok(c, r.id);
        break;
      case Op::kLease:
        if (r.keys.size() != r.values.size()) {
          proto::encode_string_reply(c.out, Op::kError, r.id, "store lease: keys and values differ in number");
          break;
        }
        c.wills.clear();
        for (size_t i = 0; i < r.keys.size(); ++i) c.wills.emplace_back(r.keys[i], r.values[i]);
        c.lease = std::chrono::milliseconds(r.timeout_ms);
        // process_frames arms the silence timer from this frame on.
        reply_ok(c, r.id);
        break;
      case Op::kFence: {
        c.fence_key.assign(r.key);
        c.fence_epoch = r.delta;
        std::string stale = stale_reason(c);
        if (!stale.empty()) {
          proto::encode_string_reply(c.out, Op::kStale, r.id, stale);
          break;
        }
        proto::Writer(c.out).begin(Op::kOk, r.id).i64(epoch_at(c.fence_key).value_or(0)).end();
        break;
      }
      default:
        break;  // parse_request admits requests only
    }
  }

  void park_or_answer(Conn& c, const proto::Request& r) {
    auto w = std::make_unique<Waiter>();
    w->conn = c.id;
    w->request = r.id;
    w->op = r.op;
    if (r.op == Op::kGet) {
      w->keys.emplace_back(r.key);
    } else {
      w->keys.reserve(r.keys.size());
      for (auto k : r.keys) w->keys.emplace_back(k);
    }
    w->started = Clock::now();
    w->deadline = w->started + std::chrono::milliseconds(r.timeout_ms);
    uint64_t wid = next_waiter_id_++;
    w->missing = file_missing(wid, *w);
    if (w->missing == 0) {
      answer(c, *w);
      return;
    }
    if (r.timeout_ms == 0) {
      time_out(c, *w);
      return;
    }
    c.waiters.push_back(wid);
    timers_.push({w->deadline, TimerKind::kWaiter, wid});
    waiters_.emplace(wid, std::move(w));
  }

  // Files waiter `wid` under each of its keys that does not exist yet; returns how many.
  size_t file_missing(uint64_t wid, const Waiter& w) {
    size_t missing = 0;
    for (const auto& k : w.keys) {
      if (data_.count(k)) continue;
      auto& list = waiting_[k];
      if (!list.empty() && list.back() == wid) continue;  // the same key twice in one wait
      list.push_back(wid);
      ++missing;
    }
    return missing;
  }

  void key_created(const std::string& key) {
    auto it = waiting_.find(key);
    if (it == waiting_.end()) return;
    std::vector<uint64_t> ids = std::move(it->second);
    waiting_.erase(it);
    for (uint64_t wid : ids) {
      auto wit = waiters_.find(wid);
      if (wit == waiters_.end()) continue;  // timed out or its connection closed
      Waiter& w = *wit->second;
      if (--w.missing > 0) continue;
      // A key it had seen may have been deleted since: file it again for what is missing now.
      w.missing = file_missing(wid, w);
      if (w.missing > 0) continue;
      auto cit = conns_.find(w.conn);
      if (cit != conns_.end()) {
        Conn& c = *cit->second;
        answer(c, w);
        std::erase(c.waiters, wid);
        // The connection whose frames are being processed is flushed when its batch ends (and
        // must not be closed under the frame loop's feet).
        if (c.id != processing_) flush(c);
      }
      waiters_.erase(wit);
    }
  }

  void answer(Conn& c, const Waiter& w) {
    proto::Writer wr(c.out);
    wr.begin(Op::kOk, w.request);
    if (w.op == Op::kGet) {
      wr.bytes(data_.find(w.keys[0])->second);
    } else if (w.op == Op::kMultiGet) {
      wr.u32(static_cast<uint32_t>(w.keys.size()));
      for (const auto& k : w.keys) wr.bytes(data_.find(k)->second);
    }
    wr.end();
  }

  void time_out(Conn& c, const Waiter& w) {
    proto::Writer wr(c.out);
    wr.begin(Op::kTimedOut, w.request);
    auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - w.started).count();
    wr.u32(proto::clamp_timeout_ms(waited));
    size_t count_at = c.out.size();
    wr.u32(0);
    uint32_t n = 0;
    for (const auto& k : w.keys) {
      if (data_.count(k)) continue;
      wr.bytes(k);
      ++n;
    }
    for (int b = 0; b < 4; ++b) c.out[count_at + b] = static_cast<char>((n >> (8 * b)) & 0xff);
    wr.end();
  }

  // ---- timers -------------------------------------------------------------------------------
  bool is_stale(const Timer& t) const {
    switch (t.kind) {
      case TimerKind::kHandshake: {
        auto it = conns_.find(t.id);
        return it == conns_.end() || it->second->authenticated;
      }
      case TimerKind::kPartialFrame: {
        auto it = conns_.find(t.id);
        return it == conns_.end() || it->second->partial_since == Clock::time_point{} ||
               it->second->partial_since + options_.frame_timeout > t.at;
      }
      case TimerKind::kWaiter:
        return !waiters_.count(t.id);
      case TimerKind::kRearmListen:
        return false;
      case TimerKind::kLease: {
        // Stale when a later frame armed a later timer (or the lease was dropped).
        auto it = conns_.find(t.id);
        return it == conns_.end() || it->second->lease.count() == 0 || it->second->last_frame + it->second->lease > t.at;
      }
    }
    return true;
  }

  void run_timers() {
    auto now = Clock::now();
    while (!timers_.empty() && timers_.top().at <= now) {
      Timer t = timers_.top();
      timers_.pop();
      if (is_stale(t)) continue;
      switch (t.kind) {
        case TimerKind::kHandshake:
          close_conn(t.id,
                     fmt::format("no handshake within {} ms (a client that connects and says nothing)",
                                 options_.handshake_timeout.count()),
                     log::Level::kInfo, true);
          break;
        case TimerKind::kPartialFrame:
          close_conn(t.id,
                     fmt::format("an incomplete frame stalled for {} ms (half-open or stuck client)",
                                 options_.frame_timeout.count()),
                     log::Level::kInfo, true);
          break;
        case TimerKind::kWaiter: {
          auto wit = waiters_.find(t.id);
          Waiter& w = *wit->second;
          auto cit = conns_.find(w.conn);
          if (cit != conns_.end()) {
            Conn& c = *cit->second;
            time_out(c, w);
            std::erase(c.waiters, t.id);
            flush(c);
          }
          // Ids left in waiting_ lists are skipped when their key comes; drop them now from short lists.
          for (const auto& k : w.keys) {
            auto lit = waiting_.find(k);
            if (lit == waiting_.end() || lit->second.size() > 64) continue;
            std::erase(lit->second, t.id);
            if (lit->second.empty()) waiting_.erase(lit);
          }
          waiters_.erase(wit);
          break;
        }
        case TimerKind::kRearmListen:
          add_fd(listen_fd_.get(), kListenId, EPOLLIN);
          break;
        case TimerKind::kLease: {
          auto it = conns_.find(t.id);
          close_conn(t.id,
                     fmt::format("its lease ran out: no request for {} ms (the holder is frozen or cut off)",
                                 it->second->lease.count()),
                     log::Level::kInfo, true);
          break;
        }
      }
    }
  }

  // Sets the wills of connections that ended (see the file comment: never inside close_conn).
  void fire_wills() {
    while (!pending_wills_.empty()) {
      auto [key, value] = std::move(pending_wills_.front());
      pending_wills_.pop_front();
      key_scratch_.assign(key);
      if (data_.count(key_scratch_)) continue;  // a will never overwrites what was set explicitly
      put(key, value);
    }
  }

  // ---- writing and closing ------------------------------------------------------------------
  // Sends what is queued. Returns false when the connection was closed.
  bool flush(Conn& c) {
    while (c.out_sent < c.out.size()) {
      ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_NOSIGNAL);
      if (n > 0) {
        c.out_sent += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (c.out.size() - c.out_sent > 2 * static_cast<size_t>(options_.max_frame)) {
          close_conn(c.id, "the client does not read its replies", log::Level::kInfo, false);
          return false;
        }
        set_writing(c, true);
        return true;
      }
      close_conn(c.id, fmt::format("send failed: {}", std::strerror(errno)), log::Level::kDebug, false);
      return false;
    }
    c.out.clear();
    c.out_sent = 0;
    set_writing(c, false);
    return true;
  }

  // Closes a connection, telling the client why (best effort) when `tell` is set.
  void close_conn(uint64_t id, const std::string& reason, log::Level level, bool tell) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Conn& c = *it->second;
    if (!reason.empty()) {
      if (level == log::Level::kInfo) {
        log::info("store: closing connection from {}: {}", c.peer.to_string(), reason);
      } else {
        log::debug("store: closing connection from {}: {}", c.peer.to_string(), reason);
      }
    }
    if (tell) {
      // Best effort, never blocking: what was queued for the client, then the reason.
      proto::encode_string_reply(c.out, Op::kClosing, 0, reason);
      ssize_t ignored = ::send(c.fd.get(), c.out.data() + c.out_sent, c.out.size() - c.out_sent,
                               MSG_NOSIGNAL | MSG_DONTWAIT);
      (void)ignored;
    }
    for (uint64_t wid : c.waiters) waiters_.erase(wid);
    // A fenced connection's wills are writes like any other: a store at a newer epoch drops them.
    if (std::string stale = stale_reason(c); !stale.empty() && !c.wills.empty()) {
      log::info("store: the wills of the connection from {} are not set: {}", c.peer.to_string(), stale);
      c.wills.clear();
    }
    for (auto& will : c.wills) pending_wills_.push_back(std::move(will));
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
    conns_.erase(it);
  }

  void shutdown_all() {
    log::info("store: stopping; closing {} connection(s)", conns_.size());
    std::string frame;
    proto::encode_string_reply(frame, Op::kClosing, 0, "the store server is stopping");
    for (auto& [id, c] : conns_) {
      ssize_t ignored = ::send(c->fd.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      (void)ignored;
    }
    conns_.clear();
    waiters_.clear();
    waiting_.clear();
    listen_fd_.reset();
  }

  StoreServerOptions options_;
  UniqueFd listen_fd_;
  UniqueFd epoll_fd_;
  UniqueFd wake_fd_;
  uint16_t port_ = 0;
  std::string address_;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  std::atomic<uint64_t> requests_{0};  // requests executed (after the handshake), for requests()

  // Loop-thread state.
  uint64_t next_conn_id_ = 2;  // 0 and 1 are the listening socket and the wake-up eventfd
  uint64_t next_waiter_id_ = 1;
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> conns_;
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, std::vector<uint64_t>> waiting_;  // missing key -> waiter ids
  std::unordered_map<uint64_t, std::unique_ptr<Waiter>> waiters_;
  std::priority_queue<Timer, std::vector<Timer>, std::greater<Timer>> timers_;
  std::deque<std::pair<std::string, std::string>> pending_wills_;  // of connections that ended
  uint64_t processing_ = 0;   // connection whose frames are being handled (0: none)
  char scratch_[kReadChunk];  // receive buffer shared by all connections
  proto::Request request_;    // reused: keeps its vectors' capacity
  std::string key_scratch_;   // reused for lookups by string_view
};

}  // namespace

std::unique_ptr<StoreServer> StoreServer::start(StoreServerOptions options) {
  return std::make_unique<TcpStoreServer>(std::move(options));
}

}  // namespace cohort
