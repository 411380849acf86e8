// The TCP store client: one connection, one mutex around it (calls from many threads are
// serialised), every call bounded by a deadline. Replies carry the request id, so a reply that
// comes after its call gave up is recognised and dropped, and a call may pipeline several requests
// (the barrier sends set + add + wait in one write).
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/deadline.h"
#include "common/log.h"
#include "common/socket.h"
#include "common/strings.h"
#include "store/auth.h"
#include "store/memory_store.h"
#include "store/protocol.h"
#include "store/tcp_store.h"

namespace cohort {
namespace {

using proto::Op;

constexpr uint32_t kClientMaxFrame = 1u << 30;

struct Reply {
  Op op = Op::kOk;
  std::string payload;
};

class TcpStore : public Store {
 public:
  // With `notice`, the connection asks for that notice before authenticating and ends there
  // (fetch_store_notice): notice_value() then holds the answer.
  explicit TcpStore(const StoreClientOptions& options, const std::string* notice = nullptr)
      : options_(options), notice_(notice) {
    address_ = options_.host.find(':') != std::string::npos ? fmt::format("[{}]:{}", options_.host, options_.port)
                                                            : fmt::format("{}:{}", options_.host, options_.port);
    timeout_ = options_.timeout;
    std::lock_guard<std::mutex> g(mutex_);
    connect_locked(Deadline::after(options_.timeout));
  }

  std::string auth_token() const override { return options_.token; }
  const std::optional<std::string>& notice_value() const { return notice_value_; }

  void set(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_set(out_, id, key, value);
    expect_ok(call(id, Deadline::after(timeout()), "set"), "set", timeout());
  }

  std::string get(const std::string& key) override {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_get(out_, id, key, proto::clamp_timeout_ms(timeout().count()));
    Reply r = call(id, wait_deadline(timeout()), "get");
    expect_ok(r, "get", timeout());
    proto::Reader rd(r.payload);
    auto v = rd.bytes();
    if (!rd.at_end()) malformed("get");
    return std::string(v);
  }

  int64_t add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_add(out_, id, key, delta);
    return read_i64(call(id, Deadline::after(timeout()), "add"), "add");
  }

  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_compare_set(out_, id, key, expected, desired);
    Reply r = call(id, Deadline::after(timeout()), "compare_set");
    expect_ok(r, "compare_set", timeout());
    proto::Reader rd(r.payload);
    auto v = rd.bytes();
    if (!rd.at_end()) malformed("compare_set");
    return std::string(v);
  }

  bool remove(const std::string& key) override {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_delete(out_, id, key);
    return read_bool(call(id, Deadline::after(timeout()), "delete"), "delete");
  }

  int64_t num_keys() override {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_num_keys(out_, id);
    return read_i64(call(id, Deadline::after(timeout()), "num_keys"), "num_keys");
  }

  bool check(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_keys(out_, Op::kCheck, id, keys, 0);
    return read_bool(call(id, Deadline::after(timeout()), "check"), "check");
  }

  void wait(const std::vector<std::string>& keys, Millis timeout) override {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_keys(out_, Op::kWait, id, keys, proto::clamp_timeout_ms(timeout.count()));
    expect_ok(call(id, wait_deadline(timeout), "wait"), "wait", timeout);
  }
  using Store::wait;

  std::vector<std::string> multi_get(const std::vector<std::string>& keys) override {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_keys(out_, Op::kMultiGet, id, keys, proto::clamp_timeout_ms(timeout().count()));
    Reply r = call(id, wait_deadline(timeout()), "multi_get");
    expect_ok(r, "multi_get", timeout());
    proto::Reader rd(r.payload);
    uint32_t n = rd.count(4);
    std::vector<std::string> values;
    values.reserve(n);
    for (uint32_t i = 0; i < n && rd.ok(); ++i) values.emplace_back(rd.bytes());
    if (!rd.at_end() || values.size() != keys.size()) malformed("multi_get");
    return values;
  }

  void multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values) override {
    if (keys.size() != values.size()) {
      throw InvalidArgument(fmt::format("store multi_set: {} keys but {} values", keys.size(), values.size()));
    }
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_multi_set(out_, id, keys, values);
    expect_ok(call(id, Deadline::after(timeout()), "multi_set"), "multi_set", timeout());
  }

  // The connection's lease (proto::Op::kLease): wills and silence limit, replacing earlier ones.
  void lease(Millis limit, const std::vector<std::string>& keys, const std::vector<std::string>& values) {
    std::lock_guard<std::mutex> g(mutex_);
    uint32_t id = begin();
    proto::encode_lease(out_, id, proto::clamp_timeout_ms(limit.count()), keys, values);
    expect_ok(call(id, Deadline::after(timeout()), "lease"), "lease", timeout());
  }

  // Same keys and messages as Store::barrier, but set + add + wait travel in one write, and the
  // missing ranks of a timed-out barrier come from one server-side check instead of one per rank.
  void barrier(const std::string& name, int rank, int world, Millis timeout) override {
    std::lock_guard<std::mutex> g(mutex_);
    Deadline deadline = wait_deadline(timeout);
    const std::string done_key = name + "/done";
    uint32_t set_id = begin();
    proto::encode_set(out_, set_id, name + "/rank/" + std::to_string(rank), "1");
    uint32_t add_id = next_id();
    proto::encode_add(out_, add_id, name + "/count", 1);
    uint32_t wait_id = next_id();
    proto::encode_keys(out_, Op::kWait, wait_id, {done_key}, proto::clamp_timeout_ms(timeout.count()));
    send_pending(deadline, "barrier", {set_id, add_id, wait_id});
    expect_ok(await(set_id, deadline, "barrier"), "barrier", timeout);
    int64_t arrived = read_i64(await(add_id, deadline, "barrier"), "barrier");
    if (arrived == world) {
      out_.clear();
      uint32_t done_id = next_id();
      proto::encode_set(out_, done_id, done_key, "1");
      send_pending(deadline, "barrier", {done_id});
      expect_ok(await(done_id, deadline, "barrier"), "barrier", timeout);
    }
    Reply r = await(wait_id, deadline, "barrier");
    if (r.op != Op::kTimedOut) {
      expect_ok(r, "barrier", timeout);
      return;
    }
    // Which ranks never arrived: a zero-timeout wait on every arrival key answers with the missing ones.
    std::vector<std::string> rank_keys;
    rank_keys.reserve(world);
    for (int i = 0; i < world; ++i) rank_keys.push_back(name + "/rank/" + std::to_string(i));
    uint32_t check_id = begin();
    proto::encode_keys(out_, Op::kWait, check_id, rank_keys, 0);
    Reply missing_reply = call(check_id, Deadline::after(this->timeout()), "barrier");
    std::vector<int> missing;
    if (missing_reply.op == Op::kTimedOut) {
      proto::Reader rd(missing_reply.payload);
      rd.u32();
      uint32_t n = rd.count(4);
      const std::string prefix = name + "/rank/";
      for (uint32_t i = 0; i < n && rd.ok(); ++i) {
        auto k = rd.bytes();
        if (k.size() > prefix.size()) missing.push_back(std::atoi(std::string(k.substr(prefix.size())).c_str()));
      }
    }
    std::sort(missing.begin(), missing.end());
    throw TimeoutError(fmt::format("barrier '{}' timed out after {} ms: {} of {} ranks arrived; missing rank(s) {}",
                                   name, timeout.count(), world - static_cast<int>(missing.size()), world,
                                   str::format_ranges(missing)));
  }

 private:
  // ---- connecting ---------------------------------------------------------------------------
  void connect_locked(Deadline deadline) {
    std::mt19937_64 rng(std::random_device{}());
    Millis delay{10};
    std::string last_error;
    int attempts = 0;
    for (;;) {
      ++attempts;
      connected_ = false;
      broken_.clear();
      try {
        net::Address addr = net::resolve(options_.host, options_.port);
        fd_ = net::connect_tcp(addr, deadline);
        net::set_nonblocking(fd_.get(), true);
        in_.clear();
        in_off_ = 0;
        handshake(deadline);
        if (!options_.fence_key.empty()) fence(deadline);
        if (attempts > 1) log::debug("store: connected to {} after {} attempts", address_, attempts);
        return;
      } catch (const PeerLostError& e) {
        last_error = e.what();
      } catch (const TimeoutError& e) {
        last_error = e.what();
      } catch (const ConfigError& e) {  // a name that does not resolve (yet)
        last_error = e.what();
      }
      fd_.reset();
      if (deadline.expired()) break;
      // Exponential back-off with jitter (x0.5 .. x1.5) so that thousands of clients started
      // together do not retry in lock step.
      std::uniform_real_distribution<double> jitter(0.5, 1.5);
      auto sleep = std::chrono::duration_cast<Millis>(delay * jitter(rng));
      sleep = std::min(sleep, deadline.remaining());
      std::this_thread::sleep_for(sleep);
      delay = std::min(delay * 2, Millis(1000));
      if (deadline.expired()) break;
    }
    throw PeerLostError(fmt::format("store at {} unreachable: no connection within {} ({} attempts; last error: {})",
                                    address_, format_duration(options_.timeout), attempts, last_error));
  }

  // Server speaks first: Challenge -> Hello(proof) -> Welcome | Refused.
  void handshake(Deadline deadline) {
    proto::FrameView f;
    read_frame(deadline, "handshake", &f);
    proto::Challenge ch;
    if (f.op == Op::kClosing) {
      throw PeerLostError(fmt::format("the server closed the connection: {}", string_payload(f.payload)));
    }
    if (f.op != Op::kChallenge || !proto::parse_challenge(f.payload, &ch) || ch.magic != proto::kMagic) {
      throw ConfigError(fmt::format("store at {}: the server is not a cohort store (unexpected greeting)", address_));
    }
    if (ch.version != proto::kVersion) {
      throw ConfigError(fmt::format("store at {} speaks protocol version {}, this client version {}", address_,
                                    ch.version, proto::kVersion));
    }
    std::string proof;
    if (ch.auth_required && !options_.token.empty()) proof = store_auth::proof(options_.token, ch.nonce);
    consume_frame();
    if (notice_) {
      out_.clear();
      proto::encode_notice(out_, *notice_);
      send_pending(deadline, "notice", {});
      read_frame(deadline, "notice", &f);
      if (f.op == Op::kOk) notice_value_ = string_payload(f.payload);
      else if (f.op != Op::kError)
        throw PeerLostError(fmt::format("unexpected reply {} to the notice request", static_cast<unsigned>(f.op)));
      consume_frame();
      return;  // not authenticated: this connection is only for the notice
    }
    out_.clear();
    proto::encode_hello(out_, proof);
    send_pending(deadline, "handshake", {});
    read_frame(deadline, "handshake", &f);
    if (f.op == Op::kRefused) {
      throw AuthError(fmt::format("store at {} refused the job token: {}", address_, string_payload(f.payload)));
    }
    if (f.op == Op::kClosing) {
      throw PeerLostError(fmt::format("the server closed the connection: {}", string_payload(f.payload)));
    }
    if (f.op != Op::kWelcome) {
      throw PeerLostError(fmt::format("unexpected reply {} to the handshake", static_cast<unsigned>(f.op)));
    }
    consume_frame();
    connected_ = true;
  }

  // Binds this connection's writes to the options' epoch (proto::Op::kFence).
  void fence(Deadline deadline) {
    uint32_t id = begin();
    proto::encode_fence(out_, id, options_.fence_key, options_.fence_epoch);
    Reply r = call(id, deadline, "fence");
    expect_ok(r, "fence", timeout());
    proto::Reader rd(r.payload);
    rd.i64();
    if (!rd.at_end()) malformed("fence");
  }

  // ---- framing over the socket --------------------------------------------------------------
  uint32_t next_id() {
    if (++last_id_ == 0) ++last_id_;  // 0 is reserved for unsolicited server frames
    return last_id_;
  }

  // Starts a call: fails fast on a lost connection, clears the output buffer, returns a fresh id.
  uint32_t begin() {
    if (!broken_.empty()) throw PeerLostError(broken_);
    out_.clear();
    // Calls are serialised and each awaits all of its replies, so anything still listed here
    // belongs to a call that gave up: its late replies are to be dropped.
    in_flight_.clear();
    early_.clear();
    return next_id();
  }

  Deadline wait_deadline(Millis timeout) const {
    if (timeout.count() >= std::numeric_limits<uint32_t>::max()) return Deadline::never();
    return Deadline::after(timeout + options_.reply_grace);
  }

  [[noreturn]] void lost(const std::string& cause) {
    if (!connected_) throw PeerLostError(cause);  // still connecting: the back-off loop retries
    broken_ = fmt::format("store at {} unreachable: {}", address_, cause);
    fd_.reset();
    throw PeerLostError(broken_);
  }

  void send_pending(Deadline deadline, const char* what, std::initializer_list<uint32_t> ids) {
    for (uint32_t id : ids) in_flight_.insert(id);
    try {
      net::send_all(fd_.get(), out_.data(), out_.size(), deadline, address_);
    } catch (const PeerLostError& e) {
      if (!connected_) throw;
      lost(e.what());
    } catch (const TimeoutError&) {
      if (!connected_)
        throw TimeoutError(fmt::format("store at {} did not take the {} request within its deadline", address_, what));
      lost(fmt::format("the {} request could not be sent within its deadline (the server, or the link to it, is gone)",
                       what));
    }
  }

  Reply call(uint32_t id, Deadline deadline, const char* what) {
    send_pending(deadline, what, {id});
    return await(id, deadline, what);
  }

  // Reads frames until the reply to `id` arrives; replies to other in-flight requests of this call
  // are kept, replies to abandoned requests dropped.
  Reply await(uint32_t id, Deadline deadline, const char* what) {
    auto early = early_.find(id);
    if (early != early_.end()) {
      Reply r = std::move(early->second);
      early_.erase(early);
      in_flight_.erase(id);
      return r;
    }
    for (;;) {
      proto::FrameView f;
      try {
        read_frame(deadline, what, &f);
      } catch (const TimeoutError&) {
        in_flight_.erase(id);
        throw;
      }
      if (f.op == Op::kClosing) lost(fmt::format("the server closed the connection: {}", string_payload(f.payload)));
      Reply r{f.op, std::string(f.payload)};
      uint32_t got = f.id;
      consume_frame();
      if (got == id) {
        in_flight_.erase(id);
        return r;
      }
      if (in_flight_.count(got)) early_.emplace(got, std::move(r));
    }
  }

  // Makes one whole frame available at the start of in_ (views stay valid until consume_frame).
  void read_frame(Deadline deadline, const char* what, proto::FrameView* f) {
    for (;;) {
      auto r = proto::decode_frame(in_.data() + in_off_, in_.size() - in_off_, kClientMaxFrame, f);
      if (r.status == proto::DecodeStatus::kFrame) {
        frame_size_ = r.consumed;
        return;
      }
      if (r.status == proto::DecodeStatus::kBad) lost("malformed frame from the server");
      char buf[16384];
      ssize_t n = ::recv(fd_.get(), buf, sizeof buf, 0);
      if (n > 0) {
        if (in_off_ > 0 && in_off_ == in_.size()) {
          in_.clear();
          in_off_ = 0;
        }
        in_.append(buf, static_cast<size_t>(n));
        continue;
      }
      if (n == 0) {
        if (!connected_) throw PeerLostError("the server closed the connection during the handshake");
        lost("the connection was closed by the server");
      }
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        if (!connected_) throw PeerLostError(net::errno_string("receive", errno));
        lost(net::errno_string("receive", errno));
      }
      pollfd p{fd_.get(), POLLIN, 0};
      int rc = ::poll(&p, 1, deadline.poll_ms(1 << 30));
      if (rc == 0) {
        // The server answers every request by its deadline (a wait's own, then TimedOut): no answer
        // by the deadline plus the grace means the server, or the link to it, is gone. The connection
        // is done with: a late answer would belong to a request nobody waits for any more.
        if (!connected_)
          throw TimeoutError(fmt::format("store at {} did not answer {} within its deadline", address_, what));
        lost(fmt::format("no answer to {} within its deadline (the server, or the link to it, is gone)", what));
      }
    }
  }

  void consume_frame() {
    in_off_ += frame_size_;
    frame_size_ = 0;
    if (in_off_ == in_.size()) {
      in_.clear();
      in_off_ = 0;
    }
  }

  static std::string string_payload(std::string_view payload) {
    proto::Reader rd(payload);
    auto s = rd.bytes();
    return rd.ok() ? std::string(s) : std::string("(no reason given)");
  }

  [[noreturn]] void malformed(const char* what) { lost(fmt::format("malformed reply to {}", what)); }

  void expect_ok(const Reply& r, const char* what, Millis timeout) {
    switch (r.op) {
      case Op::kOk:
        return;
      case Op::kTimedOut: {
        proto::Reader rd(r.payload);
        rd.u32();
        uint32_t n = rd.count(4);
        std::vector<std::string> missing;
        for (uint32_t i = 0; i < n && rd.ok(); ++i) missing.emplace_back(rd.bytes());
        throw TimeoutError(missing_keys_message(missing, timeout));
      }
      case Op::kError:
        throw InvalidArgument(string_payload(r.payload));
      case Op::kStale:
        throw StaleEpochError(fmt::format("store at {}: {}", address_, string_payload(r.payload)));
      default:
        malformed(what);
    }
  }

  int64_t read_i64(const Reply& r, const char* what) {
    expect_ok(r, what, timeout());
    proto::Reader rd(r.payload);
    int64_t v = rd.i64();
    if (!rd.at_end()) malformed(what);
    return v;
  }

  bool read_bool(const Reply& r, const char* what) {
    expect_ok(r, what, timeout());
    proto::Reader rd(r.payload);
    uint8_t v = rd.u8();
    if (!rd.at_end()) malformed(what);
    return v != 0;
  }

  StoreClientOptions options_;
  std::string address_;
  std::mutex mutex_;
  UniqueFd fd_;
  bool connected_ = false;  // handshake done: a lost connection now breaks the store for good
  const std::string* notice_ = nullptr;
  std::optional<std::string> notice_value_;
  std::string broken_;      // set when the connection is lost: every later call throws it
  uint32_t last_id_ = 0;
  std::string out_;
  std::string in_;
  size_t in_off_ = 0;
  size_t frame_size_ = 0;
  std::set<uint32_t> in_flight_;
  std::map<uint32_t, Reply> early_;
};

// StoreLease: one TcpStore connection with a lease, and a thread that keeps it alive. The thread
// shares its state with the object, so that drop() can leave it to finish a renewal in flight (on a
// cut link that takes up to the lease) without waiting for it.
class TcpStoreLease : public StoreLease {
  struct State {
    std::shared_ptr<TcpStore> store;  // null once dropped
    Millis limit;
    std::function<void(const std::string&)> on_lost;
    std::mutex m;
    std::condition_variable cv;
    bool stop = false;
    std::string lost;

    void mark_lost(const std::string& why) {
      {
        std::lock_guard<std::mutex> g(m);
        if (!lost.empty() || stop) return;
        lost = why;
      }
      if (on_lost) on_lost(why);
    }
  };

 public:
  TcpStoreLease(const StoreClientOptions& options, Millis limit, std::function<void(const std::string&)> on_lost)
      : s_(std::make_shared<State>()) {
    s_->store = std::make_shared<TcpStore>(options);
    s_->limit = limit;
    s_->on_lost = std::move(on_lost);
    // A heartbeat is given the whole lease to come back: the server has it (the lease holds), and
    // only an answer that never comes, or a closed connection, means the store or the link is gone.
    s_->store->set_timeout(std::max(Millis(1), limit));
    s_->store->lease(limit, {}, {});
    thread_ = std::thread([s = s_] { keep_alive(*s); });
  }

  ~TcpStoreLease() override {
    if (!thread_.joinable()) return;  // dropped
    {
      std::lock_guard<std::mutex> g(s_->m);
      s_->stop = true;
    }
    s_->cv.notify_all();
    thread_.join();
    // An orderly release: the wills are dropped, so ending this connection announces nothing.
    if (s_->lost.empty()) {
      try {
        s_->store->lease(Millis(0), {}, {});
      } catch (const Error&) {
      }
    }
  }

  void set_wills(const std::vector<std::pair<std::string, std::string>>& wills) override {
    std::vector<std::string> keys, values;
    for (const auto& [k, v] : wills) keys.push_back(k), values.push_back(v);
    std::shared_ptr<TcpStore> store;
    {
      std::lock_guard<std::mutex> g(s_->m);
      store = s_->store;
    }
    if (!store) throw PeerLostError("store lease: set_wills after the lease was dropped");
    try {
      store->lease(s_->limit, keys, values);
    } catch (const Error& e) {
      s_->mark_lost(e.what());
      throw;
    }
  }

  std::string lost() const override {
    std::lock_guard<std::mutex> g(s_->m);
    return s_->lost;
  }

  void drop() override {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> g(s_->m);
      s_->stop = true;
      s_->store.reset();  // the connection closes, wills in place, once the thread lets go of it too
    }
    s_->cv.notify_all();
    thread_.detach();
  }

 private:
  static void keep_alive(State& s) {
    const Millis period = std::max(Millis(1), s.limit / 4);
    std::unique_lock<std::mutex> lk(s.m);
    while (!s.stop && s.lost.empty()) {
      s.cv.wait_for(lk, period, [&] { return s.stop; });
      if (s.stop) break;
      std::shared_ptr<TcpStore> store = s.store;
      lk.unlock();
      try {
        store->check({});  // any request renews the lease
      } catch (const Error& e) {
        s.mark_lost(e.what());
        lk.lock();
        break;
      }
      store.reset();
      lk.lock();
    }
  }

  std::shared_ptr<State> s_;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<StoreLease> StoreLease::open(const StoreClientOptions& options, Millis lease,
                                             std::function<void(const std::string&)> on_lost) {
  if (lease.count() <= 0) throw InvalidArgument("store lease: the silence limit must be positive");
  return std::make_unique<TcpStoreLease>(options, lease, std::move(on_lost));
}

std::shared_ptr<Store> connect_tcp_store(const StoreClientOptions& options) {
  return std::make_shared<TcpStore>(options);
}

std::optional<std::string> fetch_store_notice(const StoreClientOptions& options, const std::string& name) {
  TcpStore once(options, &name);
  return once.notice_value();
}

std::shared_ptr<Store> connect_tcp_store(const std::string& address, Millis timeout) {
  auto [host, port] = net::split_host_port(address);
  StoreClientOptions o;
  o.host = host;
  o.port = port;
  o.timeout = timeout;
  if (const char* t = std::getenv("COHORT_JOB_TOKEN")) o.token = t;
  return connect_tcp_store(o);
}

}  // namespace cohort
