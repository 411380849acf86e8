// The TCP transport (the design is in tcp_transport.h): one class, TcpTransport, and the wire and
// connection records it works on. It is one file of about 950 lines on purpose: every part of it
// (the authenticated set-up, the send queue's flush, the reader's staging and fragments, a peer's
// failure notice and goodbye) advances the same per-connection state (Conn) inside one epoll loop,
// and the invariants that keep a duplex stream from deadlocking (reading never stops while anything
// is pending; a cut message poisons its connection) hold across all of them. The hello's message
// formats and proof live apart (tcp_hello.h, tcp_hello_mac.cc), as does the matching of messages to
// receives shared with the shared-memory transport (transport/matching.h).
#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <set>
#include <unordered_map>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/env.h"
#include "common/fd.h"
#include "common/host_identity.h"
#include "common/log.h"
#include "common/socket.h"
#include "common/strings.h"
#include "transport/matching.h"
#include "transport/tcp/tcp_hello.h"
#include "transport/transport_base.h"

namespace cohort::transport {
namespace {

const env::IntSetting kConnections("COHORT_TCP_CONNECTIONS", 2,
                                   "TCP connections per peer; large messages are split across them");
const env::BytesSetting kSplitBytes("COHORT_TCP_SPLIT_BYTES", 256 * 1024,
                                    "messages at least this large are split across the TCP connections");
const env::BytesSetting kSocketBuffer("COHORT_TCP_SOCKET_BUFFER", 0,
                                      "SO_SNDBUF/SO_RCVBUF of TCP connections (0 = kernel auto-tuning)");
const env::StringSetting kAdvertise("COHORT_TCP_ADDR", "",
                                    "address peers on other hosts dial (default: first non-loopback IPv4)");
const env::StringSetting kInterfaces("COHORT_TCP_IFNAME", "",
                                     "interfaces (eth0,ib0) or IPv4 subnets (10.0.0.0/8) whose addresses peers on "
                                     "other hosts dial (mpirun's -mca btl_tcp_if_include sets it; default: every "
                                     "non-loopback interface; COHORT_TCP_ADDR wins)");
const env::SecondsSetting kKeepAlive("COHORT_TCP_KEEPALIVE", 10.0,
                                     "idle seconds before TCP keep-alive probes start (3 probes, 2 s apart)");

constexpr uint32_t kDataMagic = 0x31544843;   // "CHT1"
constexpr int kHelloSeconds = 10;  // an accepted connection has this long to finish its hello (tcp/tcp_hello.h)
constexpr uint32_t kAbortMagic = 0x31414843;  // "CHA1": the sender failed; payload = its error message
constexpr uint32_t kByeMagic = 0x31424843;    // "CHB1": the sender destroys its transport; no more data
constexpr size_t kStagingBytes = 64 * 1024;
constexpr size_t kMaxFragment = size_t(1) << 30;
constexpr int kMaxIov = 64;

struct WireHeader {
  uint32_t magic;
  uint32_t frag_bytes;
  uint64_t tag;
  uint64_t sub;
  Signature signature;
  uint64_t total;
  uint64_t offset;
};
static_assert(sizeof(WireHeader) == 56, "wire header layout");

using tcp_hello::Challenge;
using tcp_hello::Hello;
using tcp_hello::Proof;

// A connection in the middle of its hello: dialed (waiting for the Challenge) or accepted (waiting for
// the Hello, then for the Proof).
struct Handshake {
  UniqueFd fd;
  bool dialed = false;
  bool proof_next = false;  // accepted: the Hello was answered, the Proof comes next
  int peer = -1;  // dialed: the rank dialed; accepted: the rank its Hello claims (once read)
  int index = 0;
  std::string from;      // the other end's address, for messages
  std::string my_nonce;  // the nonce this end sent
  std::string peer_nonce;
  Deadline deadline = Deadline::never();
  char buf[64];
  size_t have = 0;  // bytes of the expected message read so far
  size_t need = 0;  // its size
};
static_assert(sizeof(Handshake::buf) >= sizeof(Challenge) && sizeof(Handshake::buf) >= sizeof(Hello));

const env::BytesSetting kPoolBytes("COHORT_TCP_POOL_BYTES", 64 << 20,
                                   "memory kept for reuse by messages that arrive before their receive");

using SendItem = PendingSend<WireHeader>;

struct Conn {
  UniqueFd fd;
  int peer = -1;
  int index = 0;
  // receive side
  std::unique_ptr<char[]> staging{new char[kStagingBytes]};
  size_t st_begin = 0, st_end = 0;
  bool in_payload = false;
  char* dst = nullptr;
  size_t dst_left = 0;
  size_t frag_bytes = 0;
  int target_req = -1;
  Unexpected* target_unx = nullptr;
  // The fragment being read is thrown away (Matching::dropping): its bytes go through `staging`
  // and no further, however large the message claims to be.
  bool sinking = false;
  MessageKey target_key{};
  // send side
  std::deque<SendItem> sendq;
  bool want_out = false;
  // orderly shutdown: the peer sends a goodbye header before closing
  bool bye_received = false;
  bool closed = false;
  bool midstream = false;  // a message was cut off by a failure: nothing more may be written
  // a peer's failure notice being received
  bool receiving_abort = false;
  uint8_t abort_class = 0;
  std::string abort_text;
};

std::vector<std::string> local_addresses() {
  std::vector<std::string> out;
  std::string adv = kAdvertise.get();
  if (!adv.empty()) return {adv};
  if (std::string chosen = kInterfaces.get(); !chosen.empty()) return net::interface_addresses(chosen, kInterfaces.name());
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      if (!(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
      char buf[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
      out.emplace_back(buf);
    }
    freeifaddrs(ifs);
  }
  return out;
}

// Loopback is usable between processes of the same boot and network namespace.
std::string loopback_key() {
  HostIdentity h = local_host_identity();
  return h.boot_id + "/" + h.net_ns;
}

class TcpTransport final : public TransportBase {
 public:
  explicit TcpTransport(const TransportOptions& o)
      : TransportBase(o.rank, o.size, "tcp", size_t(kPoolBytes.get()), o.max_unexpected_bytes),
        scope_(scope_hash(o.job_scope)), job_scope_(o.job_scope), token_(o.token),
        slow_warning_(o.slow_warning),
        connections_(int(std::max<int64_t>(1, kConnections.get()))),
        split_bytes_(std::max<uint64_t>(4096, kSplitBytes.get())),
        peers_(static_cast<size_t>(o.size)) {
    if (connections_ > 64) throw ConfigError(fmt::format("COHORT_TCP_CONNECTIONS={}: expected 1 to 64", connections_));
    listener_ = net::listen_tcp("", 0, std::max(128, size_ * connections_), /*nonblocking=*/false);
    apply_buffer_size(listener_.get());
    port_ = net::local_address(listener_.get()).port();
    epoll_.reset(epoll_create1(EPOLL_CLOEXEC));
    if (!epoll_) throw Error(net::errno_string("epoll_create1", errno));
    conns_.resize(static_cast<size_t>(size_));
  }

  ~TcpTransport() override {
    log::debug("tcp transport rank {}: {} message(s), {} byte(s) arrived before their receive was posted", rank_,
               stats_unexpected_, stats_unexpected_bytes_);
    // Say goodbye on every idle connection so that peers can tell an orderly exit from a crash.
    WireHeader bye{};
    bye.magic = kByeMagic;
    for (auto& per_peer : conns_) {
      for (auto& c : per_peer) {
        if (c->closed || !c->sendq.empty() || failed_) continue;
        (void)::send(c->fd.get(), &bye, sizeof bye, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    }
  }

  const char* name() const override { return "tcp"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  // "tcp;<loopback key>;<port>;<addr,addr,...>"
  std::string descriptor() const override {
    return fmt::format("tcp;{};{};{}", loopback_key(), port_, str::join(local_addresses(), ","));
  }
  bool can_reach(const std::string& d) const override { return str::starts_with(d, "tcp;"); }

  // Dials the higher ranks and accepts the lower ones, every connection through the authenticated hello
  // (tcp/tcp_hello.h). All handshakes advance together in one poll loop: a dialer waits for the acceptor's
  // challenge, and a connection that says nothing (or the wrong thing) holds up no other.
  void connect(const std::vector<PeerInfo>& peers, const std::vector<bool>& use, Deadline deadline) override {
    for (int r = 0; r < size_; ++r) peers_[size_t(r)] = peers[size_t(r)];
    std::vector<std::unique_ptr<Handshake>> pending;
    // The higher ranks to dial, in ascending order. They are dialed one peer per turn of the loop below,
    // which serves in between what has arrived: a peer's Challenge is answered, and a lower rank's Hello
    // taken, without waiting for the last dial (rank 0 of 64 dials 126 connections).
    std::vector<int> to_dial;
    for (int j = rank_ + 1; j < size_; ++j)
      if (use[size_t(j)]) to_dial.push_back(j);
    size_t dialed = 0;
    int expected = 0;  // connections from lower ranks still to be accepted
    for (int j = 0; j < rank_; ++j) expected += use[size_t(j)] ? connections_ : 0;
    std::vector<int> got(static_cast<size_t>(size_), 0);
    std::set<std::pair<int, int>> taken;  // (rank, index) of the accepted connections
    auto dials_left = [&] {
      return std::count_if(pending.begin(), pending.end(), [](auto& h) { return h->dialed; });
    };
    net::set_nonblocking(listener_.get(), true);
    auto log_interval = slow_warning_;
    auto next_log = Deadline::Clock::now() + log_interval;
    while (expected > 0 || dialed < to_dial.size() || dials_left() > 0) {
      if (deadline.expired())
        throw TimeoutError("TCP connect: " + missing_connections(use, got, pending, "never connected"));
      if (Deadline::Clock::now() > next_log) {
        log::warn("waiting for TCP connections: {}", missing_connections(use, got, pending, "not connected yet"));
        log_interval *= 2;
        next_log = Deadline::Clock::now() + log_interval;
      }
      // An accepted connection that outlived its 10 s is dropped: an impostor, or a peer that died in the
      // middle of its hello (a rank does not dial twice: it is then named when the overall deadline passes).
      auto now = Deadline::Clock::now();
      std::erase_if(pending, [&](const std::unique_ptr<Handshake>& h) {
        if (h->dialed || h->deadline.at() > now) return false;
        log::warn("dropped a TCP connection from {} that did not finish the hello within {} s", h->from,
                  kHelloSeconds);
        return true;
      });
      if (dialed < to_dial.size()) dial(to_dial[dialed++], deadline, pending);
      std::vector<pollfd> fds;
      fds.push_back({listener_.get(), POLLIN, 0});
      for (auto& h : pending) fds.push_back({h->fd.get(), POLLIN, 0});
      int n = ::poll(fds.data(), fds.size(), dialed < to_dial.size() ? 0 : deadline.poll_ms(250));
      if (n <= 0) continue;
      const size_t polled = fds.size() - 1;  // pending[i] is fds[i + 1]; those accepted now come after
      if (fds[0].revents & POLLIN) accept_pending(pending, deadline);
      for (size_t i = 0; i < pending.size(); ++i) {
        // A connection accepted just now is tried at once: its Hello has usually arrived with it.
        if (i < polled && !fds[i + 1].revents) continue;
        Handshake& h = *pending[i];
        if (!read_handshake(h)) {
          if (h.dialed)
            throw PeerLostError(fmt::format("rank {} ({}) at {} closed the connection during the TCP hello", h.peer,
                                            peers_[size_t(h.peer)].host, h.from));
          h.fd.reset();  // an accepted connection that went away: forget it
          continue;
        }
        if (h.have < h.need) continue;
        if (h.dialed) {
          finish_dial(h);
        } else if (!h.proof_next) {
          answer_hello(h, use, taken);
        } else if (check_proof(h, taken)) {
          taken.insert({h.peer, h.index});
          got[size_t(h.peer)]++;
          --expected;
          add_conn(std::move(h.fd), h.peer, h.index);
        }
      }
      std::erase_if(pending, [](const std::unique_ptr<Handshake>& h) { return !h->fd; });
    }
    // Every rank is connected: whatever is still in its hello here is not one of them.
    for (const auto& h : pending)
      log::warn("closed a TCP connection from {} that had not finished its hello when every rank had connected",
                h->from);
    for (auto& per_peer : conns_) {
      std::sort(per_peer.begin(), per_peer.end(), [](auto& a, auto& b) { return a->index < b->index; });
    }
    listener_.reset();
  }

  RequestId isend(int peer, const Envelope& env, const void* data, size_t bytes) override {
    bool to_self = false;
    uint32_t idx = start_send(peer, env, data, bytes, to_self);
    if (to_self) return m_.id(idx);
    Request& r = m_[idx];
    auto& pc = conns_[size_t(peer)];
    if (peer_left(peer)) fail_peer_left(peer, "send to");
    if (pc.empty()) throw InvalidArgument(fmt::format("tcp transport does not serve rank {}", peer));
    size_t nfrag = 1;
    if (bytes >= split_bytes_ && pc.size() > 1) nfrag = pc.size();
    nfrag = std::max(nfrag, (bytes + kMaxFragment - 1) / kMaxFragment);
    size_t per = (bytes + nfrag - 1) / nfrag;
    per = (per + 4095) & ~size_t(4095);
    r.remaining = 0;
    size_t first_conn = nfrag > 1 ? rr_[size_t(peer)]++ : 0;
    for (size_t off = 0, i = 0; i == 0 || off < bytes; ++i) {
      size_t len = std::min(per, bytes - off);
      Conn& c = *pc[(first_conn + i) % pc.size()];
      SendItem item{};
      item.header = WireHeader{kDataMagic, uint32_t(len), env.tag, env.sub, env.signature, bytes, off};
      item.payload = r.data + off;
      item.length = len;
      item.written = 0;
      item.request = idx;
      c.sendq.push_back(item);
      r.remaining++;
      off += len;
      if (bytes == 0) break;
    }
    // Write at once on the calling thread (the latency path); what does not fit waits for EPOLLOUT.
    for (size_t i = 0; i < std::min(nfrag, pc.size()); ++i) {
      Conn& c = *pc[(first_conn + i) % pc.size()];
      if (!c.sendq.empty() && !c.want_out) flush(c);
      if (failed_) break;
    }
    return m_.id(idx);
  }

  RequestId irecv(int peer, const Envelope& env, void* data, size_t bytes) override {
    bool matched = false;
    uint32_t idx = start_recv(peer, env, data, bytes, matched);
    if (matched) return m_.id(idx);
    if (peer != rank_ && peer_left(peer)) fail_peer_left(peer, "receive from");
    m_.post(idx);
    return m_.id(idx);
  }


  bool poll(int timeout_ms) override {
    if (failed_) return false;
    epoll_event evs[64];
    int n = epoll_wait(epoll_.get(), evs, 64, timeout_ms);
    if (n <= 0) return false;
    for (int i = 0; i < n && !failed_; ++i) {
      Conn& c = *static_cast<Conn*>(evs[i].data.ptr);
      if (evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) read_conn(c);
      if (!failed_ && (evs[i].events & EPOLLOUT)) flush(c);
    }
    return true;
  }

  void fail(std::exception_ptr error) override {
    if (failed_) return;
    failed_ = error;
    // A message cut off here would leave the stream unparseable, and then no failure notice could
    // follow it: finish the fragment being written (its buffer is still the caller's, the operation
    // has not returned), within a short bound. Only a connection that cannot take it stays cut off.
    const Deadline finish = Deadline::after(std::chrono::milliseconds(200));
    for (auto& per_peer : conns_) {
      for (auto& c : per_peer) {
        if (!c->midstream && !c->closed && !c->sendq.empty() && c->sendq.front().written != 0)
          finish_partial(*c, finish);
        c->midstream = c->midstream || (!c->sendq.empty() && c->sendq.front().written != 0);
        c->sendq.clear();
        c->in_payload = false;
        c->sinking = false;
      }
    }
    m_.clear();
  }


  // Every peer hears the root cause, except those that told it to this rank: a rank that failed because
  // of a notice passes it on too, so that nobody sees only its closed connections once it exits
  // (and then names it instead of the rank that died).
  void notify_peers(ErrorClass cls, const std::string& message) override {
    std::string text = message.substr(0, 4096);
    WireHeader h{};
    h.magic = kAbortMagic;
    h.frag_bytes = uint32_t(text.size());
    h.signature.op = uint8_t(cls);
    h.total = text.size();
    const Deadline finish = Deadline::after(std::chrono::milliseconds(200));
    for (size_t peer = 0; peer < conns_.size(); ++peer) {
      if (told_by_.count(int(peer))) continue;
      for (auto& c : conns_[peer]) {
        // Only on a connection that is not in the middle of a message (the stream stays parseable):
        // a fragment being written is finished first when it can be.
        if (!c->closed && !c->midstream && !c->sendq.empty() && c->sendq.front().written != 0)
          finish_partial(*c, finish);
        if (c->closed || c->midstream || (!c->sendq.empty() && c->sendq.front().written != 0)) continue;
        iovec iov[2] = {{&h, sizeof h}, {text.data(), text.size()}};
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = 2;
        (void)::sendmsg(c->fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        break;  // one connection per peer is enough
      }
    }
  }

 private:
  std::string peer_host(int peer) const override { return peers_[size_t(peer)].host; }

  net::Address choose_address(int peer) {
    const std::string& d = peers_[size_t(peer)].descriptor;
    auto parts = str::split(d, ';', true);
    if (parts.size() < 4 || parts[0] != "tcp") {
      throw PeerLostError(fmt::format("rank {} ({}) published no TCP endpoint ('{}')", peer, peers_[size_t(peer)].host, d));
    }
    uint16_t port = uint16_t(std::stoi(parts[2]));
    if (parts[1] == loopback_key()) return net::resolve("127.0.0.1", port);
    auto addrs = str::split(parts[3], ',');
    if (addrs.empty()) {
      throw PeerLostError(fmt::format("rank {} ({}) is on another host but published no address", peer,
                                      peers_[size_t(peer)].host));
    }
    return net::resolve(addrs[0], port);
  }

  void apply_buffer_size(int fd) {
    uint64_t b = kSocketBuffer.get();
    if (b == 0) return;
    int v = int(std::min<uint64_t>(b, 1u << 30));
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, sizeof v);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &v, sizeof v);
  }

  void add_conn(UniqueFd fd, int peer, int index) {
    net::set_nonblocking(fd.get(), true);
    net::set_nodelay(fd.get());
    int idle = std::max(1, int(kKeepAlive.get()));
    net::set_keepalive(fd.get(), idle, 2, 3);
    apply_buffer_size(fd.get());
    auto c = std::make_unique<Conn>();
    c->fd = std::move(fd);
    c->peer = peer;
    c->index = index;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = c.get();
    if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, c->fd.get(), &ev) != 0) {
      throw Error(net::errno_string("epoll_ctl", errno));
    }
    conns_[size_t(peer)].push_back(std::move(c));
    if (rr_.size() != size_t(size_)) rr_.assign(static_cast<size_t>(size_), 0);
  }

  // Opens this rank's connections to rank `j` and sends each its Hello; the Challenge is read in connect()'s loop.
  void dial(int j, const Deadline& deadline, std::vector<std::unique_ptr<Handshake>>& pending) {
    net::Address addr = choose_address(j);
    for (int c = 0; c < connections_; ++c) {
      UniqueFd fd;
      try {
        fd = net::connect_tcp(addr, deadline);
      } catch (const Error& e) {
        throw PeerLostError(fmt::format("cannot connect to rank {} ({}) at {}: {}", j, peers_[size_t(j)].host,
                                        addr.to_string(), e.what()));
      }
      auto hs = std::make_unique<Handshake>();
      hs->dialed = true;
      hs->peer = j;
      hs->index = c;
      hs->from = addr.to_string();
      hs->my_nonce = tcp_hello::make_nonce();
      hs->deadline = deadline;
      Hello h = tcp_hello::make(rank_, c, j, scope_, hs->my_nonce);
      net::send_all(fd.get(), &h, sizeof h, deadline, fmt::format("rank {}", j));
      net::set_nonblocking(fd.get(), true);
      hs->fd = std::move(fd);
      hs->need = sizeof(Challenge);
      pending.push_back(std::move(hs));
    }
  }

  // "rank(s) 0-2 (host(s) a,b) never connected; rank(s) 5 (host(s) c) did not answer the hello"
  std::string missing_connections(const std::vector<bool>& use, const std::vector<int>& got,
                                  const std::vector<std::unique_ptr<Handshake>>& pending, const char* what) {
    std::vector<int> missing, silent;
    std::vector<std::string> hosts, silent_hosts;
    for (int j = 0; j < rank_; ++j) {
      if (use[size_t(j)] && got[size_t(j)] < connections_) {
        missing.push_back(j);
        if (hosts.size() < 8) hosts.push_back(peers_[size_t(j)].host);
      }
    }
    for (const auto& h : pending) {
      if (!h->dialed || (!silent.empty() && silent.back() == h->peer)) continue;
      silent.push_back(h->peer);
      if (silent_hosts.size() < 8) silent_hosts.push_back(peers_[size_t(h->peer)].host);
    }
    std::vector<std::string> parts;
    if (!missing.empty())
      parts.push_back(
          fmt::format("rank(s) {} (host(s) {}) {}", str::format_ranges(missing), str::join(hosts, ","), what));
    if (!silent.empty())
      parts.push_back(fmt::format("rank(s) {} (host(s) {}) did not answer the hello", str::format_ranges(silent),
                                  str::join(silent_hosts, ",")));
    return str::join(parts, "; ");
  }

  // Takes every connection waiting on the listener; each has kHelloSeconds to send its Hello and Proof.
  void accept_pending(std::vector<std::unique_ptr<Handshake>>& pending, const Deadline& deadline) {
    for (;;) {
      UniqueFd fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!fd) return;  // EAGAIN: none left (or a transient error: poll reports the next one)
      auto hs = std::make_unique<Handshake>();
      try {
        hs->from = net::peer_address(fd.get()).to_string();
      } catch (const Error&) {
        hs->from = "an unknown address";
      }
      hs->fd = std::move(fd);
      hs->need = sizeof(Hello);
      hs->deadline = Deadline::earliest(deadline, Deadline::after(std::chrono::seconds(kHelloSeconds)));
      pending.push_back(std::move(hs));
    }
  }

  // Reads what has arrived of the message `h` waits for. False when the connection was closed or failed.
  bool read_handshake(Handshake& h) {
    while (h.have < h.need) {
      ssize_t k = ::recv(h.fd.get(), h.buf + h.have, h.need - h.have, MSG_DONTWAIT);
      if (k > 0) {
        h.have += size_t(k);
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      return k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
    return true;
  }

  // A short write to a connection in its hello (a few dozen bytes into an empty socket buffer).
  bool send_handshake(Handshake& h, const void* data, size_t bytes) {
    try {
      net::send_all(h.fd.get(), data, bytes, Deadline::earliest(h.deadline, Deadline::after(std::chrono::seconds(1))),
                    h.from);
      return true;
    } catch (const Error&) {
      return false;
    }
  }

  void refuse(Handshake& h, const std::string& why) {
    log::warn("refused a TCP connection from {}: {}", h.from, why);
    h.fd.reset();
  }

  // Accepted connection, its Hello read: a dialer of this communicator that means this rank gets the
  // Challenge; anything else is refused.
  void answer_hello(Handshake& h, const std::vector<bool>& use, const std::set<std::pair<int, int>>& taken) {
    Hello m;
    if (std::string why = tcp_hello::check(h.buf, sizeof(Hello), scope_, rank_, connections_, &m); !why.empty())
      return refuse(h, why);
    if (!use[m.rank] || taken.count({int(m.rank), int(m.index)}))
      return refuse(h, fmt::format("its hello claims rank {} connection {}, which this rank does not expect", m.rank,
                                   m.index));
    h.peer = int(m.rank);
    h.index = int(m.index);
    h.peer_nonce.assign(m.nonce, sizeof m.nonce);
    h.my_nonce = tcp_hello::make_nonce();
    Challenge c{tcp_hello::kChallengeMagic, uint32_t(rank_), {}, {}};
    std::memcpy(c.nonce, h.my_nonce.data(), sizeof c.nonce);
    const std::string mac = tcp_hello::mac(token_, tcp_hello::Role::kAcceptor, fields(h));
    std::memcpy(c.mac, mac.data(), sizeof c.mac);
    if (!send_handshake(h, &c, sizeof c)) return refuse(h, "it went away during the hello");
    h.have = 0;
    h.need = sizeof(Proof);
    h.proof_next = true;
  }

  // Accepted connection, its Proof read: true when it proves the job token (the slot is then its).
  bool check_proof(Handshake& h, const std::set<std::pair<int, int>>& taken) {
    Proof p;
    std::memcpy(&p, h.buf, sizeof p);
    if (p.magic != tcp_hello::kProofMagic || !tcp_hello::verify(token_, tcp_hello::Role::kDialer, fields(h), p.mac)) {
      refuse(h, fmt::format("it claims to be rank {} but does not prove the job token (its HMAC is wrong: someone "
                            "outside the job, or a rank given another COHORT_JOB_TOKEN)",
                            h.peer));
      return false;
    }
    if (taken.count({h.peer, h.index})) {
      refuse(h, fmt::format("rank {} connection {} is connected already", h.peer, h.index));
      return false;
    }
    return true;
  }

  // Dialed connection, the acceptor's Challenge read: the acceptor must prove the token first (else this
  // rank talks to the wrong process, and says so); then this end's Proof and the connection is up.
  void finish_dial(Handshake& h) {
    Challenge c;
    std::memcpy(&c, h.buf, sizeof c);
    h.peer_nonce.assign(c.nonce, sizeof c.nonce);
    const std::string& host = peers_[size_t(h.peer)].host;
    if (c.magic != tcp_hello::kChallengeMagic || c.rank != uint32_t(h.peer) ||
        !tcp_hello::verify(token_, tcp_hello::Role::kAcceptor, fields(h), c.mac)) {
      throw AuthError(fmt::format("rank {} ({}) at {} does not prove the job token in the TCP hello (another process "
                                  "on that port, or rank {} was given another COHORT_JOB_TOKEN)",
                                  h.peer, host, h.from, h.peer));
    }
    Proof p{tcp_hello::kProofMagic, 0, {}};
    const std::string mac = tcp_hello::mac(token_, tcp_hello::Role::kDialer, fields(h));
    std::memcpy(p.mac, mac.data(), sizeof p.mac);
    if (!send_handshake(h, &p, sizeof p))
      throw PeerLostError(
          fmt::format("rank {} ({}) at {} closed the connection during the TCP hello", h.peer, host, h.from));
    add_conn(std::move(h.fd), h.peer, h.index);
  }

  // The hello's fields of connection `h`, seen from this end.
  tcp_hello::Fields fields(const Handshake& h) const {
    tcp_hello::Fields f;
    f.scope = job_scope_;
    f.index = uint32_t(h.index);
    f.dialer = uint32_t(h.dialed ? rank_ : h.peer);
    f.acceptor = uint32_t(h.dialed ? h.peer : rank_);
    f.dialer_nonce = h.dialed ? h.my_nonce : h.peer_nonce;
    f.acceptor_nonce = h.dialed ? h.peer_nonce : h.my_nonce;
    return f;
  }

  void set_want_out(Conn& c, bool on) {
    if (c.want_out == on) return;
    c.want_out = on;
    epoll_event ev{};
    ev.events = EPOLLIN | (on ? uint32_t(EPOLLOUT) : 0u);
    ev.data.ptr = &c;
    epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
  }

  void conn_error(Conn& c, const std::string& what) {
    fail(std::make_exception_ptr(PeerLostError(
        fmt::format("lost rank {} ({}): {}", c.peer, peers_[size_t(c.peer)].host, what))));
  }

  // A send to (or a receive from) the peer failed (EPIPE, ECONNRESET: it is gone). What it sent before it went is still
  // in this socket's receive queue (and maybe in its other connections'): its failure notice among it,
  // when it failed because of another rank. Read that first, so that this rank names the root cause
  // rather than the neighbour that passed it on and exited.
  void write_failed(Conn& c, const std::string& what) {
    for (auto& conn : conns_[size_t(c.peer)])
      if (!conn->closed && !failed_) read_conn(*conn);
    if (!failed_) conn_error(c, what);
  }

  // The peer said goodbye and closed this connection. Once all of its connections are closed,
  // whatever this rank still expects from it can never come.
  void conn_closed_after_bye(Conn& c) {
    c.closed = true;
    epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
    if (!peer_left(c.peer)) return;
    for (auto& [key, idx] : m_.posted) {
      if (key.peer == c.peer) {
        fail(std::make_exception_ptr(PeerLostError(fmt::format(
            "rank {} ({}) left (destroyed its communicator) while this rank still expects a message from it", c.peer,
            peers_[size_t(c.peer)].host))));
        return;
      }
    }
  }
  bool peer_left(int peer) const {
    const auto& pc = conns_[size_t(peer)];
    if (pc.empty()) return false;
    for (const auto& c : pc)
      if (!c->closed) return false;
    return true;
  }

  void flush(Conn& c) {
    while (!c.sendq.empty()) {
      iovec iov[kMaxIov];
      int n = 0;
      for (auto it = c.sendq.begin(); it != c.sendq.end() && n + 2 <= kMaxIov; ++it) {
        size_t w = it->written;
        if (w < sizeof(WireHeader)) {
          iov[n++] = {reinterpret_cast<char*>(&it->header) + w, sizeof(WireHeader) - w};
          if (it->length) iov[n++] = {const_cast<char*>(it->payload), it->length};
        } else {
          iov[n++] = {const_cast<char*>(it->payload) + (w - sizeof(WireHeader)), it->length - (w - sizeof(WireHeader))};
        }
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = size_t(n);
      ssize_t k = ::sendmsg(c.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          set_want_out(c, true);
          return;
        }
        write_failed(c, net::errno_string("send", errno));
        return;
      }
      size_t left = size_t(k);
      while (left > 0 || (!c.sendq.empty() && c.sendq.front().written == sizeof(WireHeader) + c.sendq.front().length)) {
        SendItem& item = c.sendq.front();
        size_t need = sizeof(WireHeader) + item.length - item.written;
        size_t take = std::min(need, left);
        item.written += take;
        left -= take;
        if (item.written == sizeof(WireHeader) + item.length) {
          Request& r = m_[item.request];
          if (--r.remaining == 0) r.done = true;
          c.sendq.pop_front();
          if (c.sendq.empty()) break;
        } else {
          break;
        }
      }
    }
    set_want_out(c, false);
  }

  void read_conn(Conn& c) {
    for (;;) {
      if (failed_) return;
      ssize_t n;
      if (c.in_payload && !c.sinking) {
        if (c.st_begin == c.st_end) c.st_begin = c.st_end = 0;
        iovec iov[2] = {{c.dst, c.dst_left}, {c.staging.get() + c.st_end, kStagingBytes - c.st_end}};
        n = ::readv(c.fd.get(), iov, iov[1].iov_len ? 2 : 1);
        if (n > 0) {
          size_t got = size_t(n);
          // A short read means the socket is drained: skip the recv that would only say EAGAIN
          // (level-triggered epoll reports the connection again when more arrives).
          bool drained = got < iov[0].iov_len + (iov[1].iov_len ? iov[1].iov_len : 0);
          if (got >= c.dst_left) {
            c.st_end += got - c.dst_left;
            c.dst_left = 0;
            c.in_payload = false;
            finish_fragment(c);
            parse_staging(c);
          } else {
            c.dst += got;
            c.dst_left -= got;
          }
          if (drained) return;
          continue;
        }
      } else {
        if (c.st_begin == c.st_end) {
          c.st_begin = c.st_end = 0;
        } else if (kStagingBytes - c.st_end < sizeof(WireHeader)) {
          std::memmove(c.staging.get(), c.staging.get() + c.st_begin, c.st_end - c.st_begin);
          c.st_end -= c.st_begin;
          c.st_begin = 0;
        }
        size_t want = kStagingBytes - c.st_end;
        n = ::recv(c.fd.get(), c.staging.get() + c.st_end, want, MSG_DONTWAIT);
        if (n > 0) {
          c.st_end += size_t(n);
          parse_staging(c);
          if (size_t(n) < want) return;  // drained (see above)
          continue;
        }
      }
      if (n == 0) {
        if (c.bye_received && !c.in_payload && c.st_begin == c.st_end) {
          conn_closed_after_bye(c);
        } else {
          // The peer is gone. It may have said why on another of its connections: read those first.
          c.closed = true;
          epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
          for (auto& other : conns_[size_t(c.peer)])
            if (!other->closed && !failed_) read_conn(*other);
          if (!failed_) conn_error(c, "the connection was closed without a goodbye (process exited or was killed)");
        }
        return;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      // ECONNRESET and the like: gone as well; its notice may be on another of its connections.
      const std::string what = net::errno_string("recv", errno);
      c.closed = true;
      epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
      write_failed(c, what);
      return;
    }
  }

  void parse_staging(Conn& c) {
    if (c.in_payload && c.sinking) {  // what came of a fragment thrown away: skipped
      size_t skip = std::min(c.dst_left, c.st_end - c.st_begin);
      c.st_begin += skip;
      c.dst_left -= skip;
      if (c.dst_left > 0) return;
      c.in_payload = false;
      finish_fragment(c);
    }
    while (!c.in_payload && !failed_ && c.st_end - c.st_begin >= sizeof(WireHeader)) {
      WireHeader h;
      std::memcpy(&h, c.staging.get() + c.st_begin, sizeof h);
      c.st_begin += sizeof h;
      if (h.magic == kByeMagic) {
        c.bye_received = true;
        continue;
      }
      if (h.magic == kAbortMagic && h.frag_bytes <= 64 * 1024) {
        c.receiving_abort = true;
        c.abort_class = h.signature.op;
        c.abort_text.assign(h.frag_bytes, '\0');
        c.dst = c.abort_text.data();
        c.dst_left = h.frag_bytes;
        c.frag_bytes = h.frag_bytes;
        c.target_req = -1;
        c.target_unx = nullptr;
      } else if (h.magic != kDataMagic || h.offset + h.frag_bytes > h.total) {
        conn_error(c, "protocol error: malformed message header");
        return;
      } else {
        begin_fragment(c, h);
      }
      if (failed_) return;
      size_t avail = std::min(c.dst_left, c.st_end - c.st_begin);
      if (avail && !c.sinking) {
        std::memcpy(c.dst, c.staging.get() + c.st_begin, avail);
        c.dst += avail;
      }
      c.st_begin += avail;
      c.dst_left -= avail;
      if (c.dst_left == 0) {
        finish_fragment(c);
      } else {
        c.in_payload = true;
      }
    }
  }

  void begin_fragment(Conn& c, const WireHeader& h) {
    MessageKey k{c.peer, h.tag, h.sub};
    note_arrival(c.peer, h.tag, h.signature, h.total);
    c.frag_bytes = h.frag_bytes;
    c.dst_left = h.frag_bytes;
    c.target_key = k;
    auto it = m_.posted.find(k);
    if (it != m_.posted.end()) {
      Request& r = m_[it->second];
      try {
        check_match(c.peer, h.signature, h.total, r);
      } catch (const Error&) {
        return;  // the transport is failed now; test() reports it
      }
      c.target_req = int(it->second);
      c.target_unx = nullptr;
      c.dst = r.data + h.offset;
      return;
    }
    if (Dropped* d = m_.dropping(k, h.total)) {
      if (d->total != h.total) {
        conn_error(c, "protocol error: fragments of one message disagree on its size");
        return;
      }
      c.sinking = true;
      c.target_req = -1;
      c.target_unx = nullptr;
      c.dst = nullptr;
      return;
    }
    Unexpected* u;
    auto found = m_.unexpected.find(k);
    if (found == m_.unexpected.end()) {  // its first fragment
      ++stats_unexpected_;
      stats_unexpected_bytes_ += h.total;
      u = &m_.add_unexpected(k, h.signature, h.total);
    } else if (found->second.total != h.total) {
      conn_error(c, "protocol error: fragments of one message disagree on its size");
      return;
    } else {
      u = &found->second;
    }
    c.target_req = -1;
    c.target_unx = u;
    c.dst = u->buf.get() + h.offset;
  }

  // Writes the rest of the fragment at the front of c's queue (header and payload), blocking in
  // poll up to `deadline`. On success the stream ends on a message boundary.
  void finish_partial(Conn& c, const Deadline& deadline) {
    SendItem& item = c.sendq.front();
    const size_t total = sizeof(WireHeader) + item.length;
    while (item.written < total) {
      iovec iov[2];
      int n = 0;
      if (item.written < sizeof(WireHeader)) {
        iov[n++] = {reinterpret_cast<char*>(&item.header) + item.written, sizeof(WireHeader) - item.written};
        if (item.length) iov[n++] = {const_cast<char*>(item.payload), item.length};
      } else {
        iov[n++] = {const_cast<char*>(item.payload) + (item.written - sizeof(WireHeader)),
                    item.length - (item.written - sizeof(WireHeader))};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = size_t(n);
      ssize_t k = ::sendmsg(c.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        item.written += size_t(k);
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && !deadline.expired()) {
        pollfd p{c.fd.get(), POLLOUT, 0};
        ::poll(&p, 1, deadline.poll_ms());
        continue;
      }
      return;  // the peer does not read (or is gone): this connection stays cut off
    }
    c.sendq.pop_front();
  }

  void finish_fragment(Conn& c) {
    if (c.receiving_abort) {
      c.receiving_abort = false;
      told_by_.insert(c.peer);
      std::string msg = fmt::format("rank {} ({}) failed: {}", c.peer, peers_[size_t(c.peer)].host, c.abort_text);
      switch (ErrorClass(c.abort_class)) {
        case ErrorClass::kTimeout: fail(std::make_exception_ptr(TimeoutError(msg))); break;
        case ErrorClass::kPeerLost: fail(std::make_exception_ptr(PeerLostError(msg))); break;
        case ErrorClass::kMismatch: fail(std::make_exception_ptr(MismatchError(msg))); break;
        default: fail(std::make_exception_ptr(AbortedError(msg))); break;
      }
      return;
    }
    if (c.sinking) {
      c.sinking = false;
      m_.dropped_bytes(c.target_key, c.frag_bytes);
      return;
    }
    if (c.target_req >= 0) {
      Request& r = m_[size_t(c.target_req)];
      r.remaining -= c.frag_bytes;
      if (r.remaining == 0) {
        r.done = true;
        m_.posted.erase(r.key);
      }
      c.target_req = -1;
      return;
    }
    Unexpected* u = c.target_unx;
    c.target_unx = nullptr;
    if (!u) return;
    u->received += c.frag_bytes;
    if (u->received == u->total) m_.unexpected_arrived(c.target_key, *u);
  }

  uint64_t scope_;
  std::string job_scope_;
  std::string token_;  // the job token the hello proves (tcp/tcp_hello.h); may be empty
  std::chrono::nanoseconds slow_warning_;  // connect(): first "waiting for" warning, then doubling
  int connections_;
  size_t split_bytes_;
  uint16_t port_ = 0;
  UniqueFd listener_;
  UniqueFd epoll_;
  std::vector<std::vector<std::unique_ptr<Conn>>> conns_;
  std::vector<size_t> rr_;
  std::vector<PeerInfo> peers_;
  std::set<int> told_by_;  // peers whose failure notice this rank received (they need none back)
  uint64_t stats_unexpected_ = 0, stats_unexpected_bytes_ = 0;  // messages buffered before their receive
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(const TransportOptions& options) {
  return std::make_unique<TcpTransport>(options);
}

}  // namespace cohort::transport
