// `cohort bench store`: join time of N store clients, each with its own connection.
//
// Every client connects, authenticates (HMAC challenge-response with the job token), sets its own
// key and passes a barrier exactly like Store::barrier on a TcpStore: set "<b>/rank/<i>",
// add "<b>/count", wait "<b>/done" (pipelined in the write that carries the handshake answer);
// the client whose add returns N sets "<b>/done", which releases everybody. Join time = start to
// the last client released.
//
// Thousands of clients cannot each have an OS thread, so the clients are non-blocking state
// machines over epoll, spread over a few threads. They speak through the same frame encoder and
// the same authentication code as the library's client, one socket and one handshake each. Each
// thread keeps a bounded number of connections in their handshake (the window), so a storm of
// connects never overflows the server's accept queue (net.core.somaxconn).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/wait.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "cohort/error.h"
#include "command.h"
#include "common/deadline.h"
#include "common/socket.h"
#include "common/strings.h"
#include "store/auth.h"
#include "store/protocol.h"
#include "store/tcp_store.h"

namespace cohort::tools {
namespace {

using Clock = std::chrono::steady_clock;
using proto::Op;

enum class State : uint8_t { kIdle, kConnecting, kHandshake, kJoined, kReleased, kFailed };

// Request ids of the pipelined requests.
constexpr uint32_t kSetId = 1, kAddId = 2, kWaitId = 3, kDoneId = 4;

struct Client {
  int fd = -1;
  State state = State::kIdle;
  uint32_t index = 0;  // global client number (its rank in the barrier)
  uint32_t slot = 0;   // position in its driver thread's list (the epoll cookie)
  double connected_s = 0;  // handshake done (Welcome), from the start
  double released_s = 0;   // wait on the release key answered
  std::string in;
  std::string pending;  // bytes the socket did not take yet
};

struct RunConfig {
  net::Address server;
  std::string token;
  std::string barrier;  // key prefix of this repetition
  uint32_t clients = 0;
  size_t window = 0;   // handshakes in flight per thread
  uint32_t sources = 1;  // loopback source addresses the clients are spread over
  Clock::time_point start;
  Clock::time_point deadline;
  // Set when a client failed: the barrier can no longer complete, so every thread stops.
  std::atomic<bool>* abort = nullptr;
};

struct ThreadResult {
  std::vector<double> connect_s, release_s;
  size_t failed = 0;
  std::string first_error;
};

class Driver {
 public:
  Driver(const RunConfig& cfg, std::vector<Client*> clients) : cfg_(cfg), clients_(std::move(clients)) {
    for (size_t i = 0; i < clients_.size(); ++i) clients_[i]->slot = static_cast<uint32_t>(i);
  }

  ThreadResult run() {
    epoll_.reset(epoll_create1(EPOLL_CLOEXEC));
    std::vector<epoll_event> events(512);
    size_t finished = 0;
    while (finished < clients_.size()) {
      while (in_handshake_ < cfg_.window && next_ < clients_.size()) start(*clients_[next_++]);
      if (Clock::now() > cfg_.deadline) {
        fail_rest("deadline passed");
        break;
      }
      if (cfg_.abort->load(std::memory_order_relaxed)) {
        fail_rest("another client failed, so the barrier cannot complete");
        break;
      }
      int n = epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()), 100);
      if (n < 0 && errno != EINTR) {
        fail_rest(net::errno_string("epoll_wait", errno));
        break;
      }
      for (int i = 0; i < n; ++i) {
        on_event(*clients_[events[i].data.u32], events[i].events);
      }
      finished = done_;
    }
    ThreadResult r;
    for (Client* c : clients_) {
      if (c->state == State::kReleased) {
        r.connect_s.push_back(c->connected_s);
        r.release_s.push_back(c->released_s);
      } else {
        ++r.failed;
      }
      if (c->fd >= 0) ::close(c->fd);
      c->fd = -1;
    }
    r.first_error = first_error_;
    return r;
  }

 private:
  double since_start() const { return std::chrono::duration<double>(Clock::now() - cfg_.start).count(); }

  void start(Client& c) {
    c.fd = ::socket(cfg_.server.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c.fd < 0) return fail(c, net::errno_string("socket", errno));
    if (cfg_.sources > 1) {
      // Spread the clients over loopback source addresses 127.1.x.y: on one host every connect()
      // to the same server otherwise searches one shared ephemeral port range (the kernel's
      // __inet_hash_connect), which dominates at thousands of clients. Real clients come from
      // many hosts, each with its own port range. The port is still chosen at connect().
      int one = 1;
      setsockopt(c.fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
      sockaddr_in src{};
      src.sin_family = AF_INET;
      src.sin_addr.s_addr = htonl(0x7f010000u | (1u + c.index % cfg_.sources));
      if (::bind(c.fd, reinterpret_cast<const sockaddr*>(&src), sizeof src) != 0) {
        return fail(c, net::errno_string("bind to a loopback source address", errno));
      }
    }
    int rc = ::connect(c.fd, reinterpret_cast<const sockaddr*>(&cfg_.server.storage), cfg_.server.length);
    if (rc != 0 && errno != EINPROGRESS) return fail(c, net::errno_string("connect", errno));
    c.state = State::kConnecting;
    ++in_handshake_;
    // Edge-triggered, registered once: no epoll_ctl per state change.
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLET;
    ev.data.u32 = local_index(c);
    epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, c.fd, &ev);
  }

  uint32_t local_index(const Client& c) const { return c.slot; }

  void on_event(Client& c, uint32_t ev) {
    if (c.state == State::kConnecting) {
      if (ev & (EPOLLERR | EPOLLHUP)) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        return fail(c, net::errno_string("connect", err ? err : ECONNRESET));
      }
      c.state = State::kHandshake;
      if (!(ev & EPOLLIN)) return;
    }
    if ((ev & EPOLLOUT) && !c.pending.empty()) {
      if (!send_now(c, {})) return;
    }
    if (ev & (EPOLLIN | EPOLLHUP | EPOLLERR)) read(c);
  }

  void read(Client& c) {
    char buf[4096];
    for (;;) {
      ssize_t n = ::recv(c.fd, buf, sizeof buf, 0);
      if (n > 0) {
        c.in.append(buf, static_cast<size_t>(n));
        if (static_cast<size_t>(n) < sizeof buf) break;
        continue;
      }
      if (n == 0) return fail(c, "the server closed the connection");
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      return fail(c, net::errno_string("receive", errno));
    }
    size_t off = 0;
    while (c.state != State::kFailed && c.state != State::kReleased) {
      proto::FrameView f;
      auto r = proto::decode_frame(c.in.data() + off, c.in.size() - off, proto::kDefaultMaxFrame, &f);
      if (r.status == proto::DecodeStatus::kNeedMore) break;
      if (r.status == proto::DecodeStatus::kBad) return fail(c, "malformed frame from the server");
      off += r.consumed;
      on_frame(c, f);
    }
    if (c.fd >= 0) c.in.erase(0, off);
  }

  void on_frame(Client& c, const proto::FrameView& f) {
    switch (f.op) {
      case Op::kChallenge: {
        proto::Challenge ch;
        if (!proto::parse_challenge(f.payload, &ch) || ch.magic != proto::kMagic) {
          return fail(c, "unexpected greeting (not a cohort store)");
        }
        std::string proof = ch.auth_required ? store_auth::proof(cfg_.token, ch.nonce) : std::string();
        out_.clear();
        proto::encode_hello(out_, proof);
        // The barrier of Store::barrier, pipelined behind the handshake answer.
        key_.assign(cfg_.barrier).append("/rank/").append(std::to_string(c.index));
        proto::encode_set(out_, kSetId, key_, "1");
        proto::encode_add(out_, kAddId, cfg_.barrier + "/count", 1);
        proto::encode_keys(out_, Op::kWait, kWaitId, {cfg_.barrier + "/done"},
                           proto::clamp_timeout_ms(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                       cfg_.deadline - Clock::now())
                                                       .count()));
        send_now(c, out_);
        return;
      }
      case Op::kWelcome:
        c.connected_s = since_start();
        c.state = State::kJoined;
        --in_handshake_;
        return;
      case Op::kRefused:
      case Op::kClosing: {
        proto::Reader rd(f.payload);
        return fail(c, fmt::format("{}: {}", f.op == Op::kRefused ? "refused" : "closed", rd.bytes()));
      }
      case Op::kOk:
        if (f.id == kAddId) {
          proto::Reader rd(f.payload);
          if (rd.i64() == static_cast<int64_t>(cfg_.clients)) {
            out_.clear();
            proto::encode_set(out_, kDoneId, cfg_.barrier + "/done", "1");
            send_now(c, out_);
          }
        } else if (f.id == kWaitId) {
          c.released_s = since_start();
          c.state = State::kReleased;
          ++done_;
        }
        return;
      default:
        return fail(c, fmt::format("unexpected reply {} to request {}", static_cast<unsigned>(f.op), f.id));
    }
  }

  // Sends `data` (after anything still pending). Returns false when the client failed.
  bool send_now(Client& c, std::string_view data) {
    c.pending.append(data);
    while (!c.pending.empty()) {
      ssize_t n = ::send(c.fd, c.pending.data(), c.pending.size(), MSG_NOSIGNAL);
      if (n > 0) {
        c.pending.erase(0, static_cast<size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // EPOLLOUT (edge) resumes
      fail(c, net::errno_string("send", errno));
      return false;
    }
    return true;
  }

  void fail(Client& c, const std::string& why) {
    if (c.state == State::kConnecting || c.state == State::kHandshake) --in_handshake_;
    if (c.state != State::kFailed && c.state != State::kReleased) ++done_;
    c.state = State::kFailed;
    cfg_.abort->store(true);
    if (first_error_.empty()) first_error_ = fmt::format("client {}: {}", c.index, why);
    if (c.fd >= 0) {
      epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, c.fd, nullptr);
      ::close(c.fd);
      c.fd = -1;
    }
  }

  void fail_rest(const std::string& why) {
    for (Client* c : clients_) {
      if (c->state != State::kReleased && c->state != State::kFailed) fail(*c, why);
    }
  }

  const RunConfig& cfg_;
  std::vector<Client*> clients_;
  UniqueFd epoll_;
  size_t next_ = 0;
  size_t in_handshake_ = 0;
  size_t done_ = 0;
  std::string out_;
  std::string key_;
  std::string first_error_;
};

// `cohort store serve` in a child process: the server's descriptors then do not count against the
// bench's RLIMIT_NOFILE (16384 clients + 16384 server sockets exceed a 20000 hard limit), and the
// server is as separate from the clients as in a real job.
class ServerProcess {
 public:
  explicit ServerProcess(const std::string& token) {
    int out[2];
    if (pipe2(out, O_CLOEXEC) != 0) throw Error(net::errno_string("pipe", errno));
    pid_ = fork();
    if (pid_ < 0) throw Error(net::errno_string("fork", errno));
    if (pid_ == 0) {
      dup2(out[1], 1);
      setenv("COHORT_JOB_TOKEN", token.c_str(), 1);
      execl("/proc/self/exe", "cohort", "store", "serve", "--host", "127.0.0.1", "--port", "0", nullptr);
      _exit(127);
    }
    ::close(out[1]);
    UniqueFd rd(out[0]);
    std::string line;
    char ch;
    Deadline deadline = Deadline::after(std::chrono::seconds(10));
    while (line.find('\n') == std::string::npos) {
      pollfd p{rd.get(), POLLIN, 0};
      if (::poll(&p, 1, deadline.poll_ms()) <= 0) break;
      if (::read(rd.get(), &ch, 1) != 1) break;
      line.push_back(ch);
    }
    const std::string marker = "serving at ";
    auto at = line.find(marker);
    if (at == std::string::npos) {
      stop();
      throw Error("cohort bench store: the store server process did not start (no 'serving at' line)");
    }
    std::string address = line.substr(at + marker.size());
    address = address.substr(0, address.find(' '));
    auto [host, port] = net::split_host_port(address);
    address_ = net::resolve(host, port);
  }
  ~ServerProcess() { stop(); }
  const net::Address& address() const { return address_; }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  net::Address address_;
};

struct RepResult {
  double total_s = 0;
  double connect_p50_s = 0, connect_p99_s = 0;
  double first_release_s = 0;
  size_t failed = 0;
  std::string first_error;
};

double percentile(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// One repetition: N clients on `threads` driver threads against `server`.
RepResult run_rep(const net::Address& server, const std::string& token, const std::string& barrier, uint32_t n,
                  int threads, size_t window, uint32_t sources, double timeout_s) {
  std::vector<Client> clients(n);
  for (uint32_t i = 0; i < n; ++i) clients[i].index = i;
  RunConfig cfg;
  std::atomic<bool> abort{false};
  cfg.abort = &abort;
  cfg.server = server;
  cfg.token = token;
  cfg.barrier = barrier;
  cfg.clients = n;
  cfg.sources = sources;
  threads = std::max(1, std::min<int>(threads, static_cast<int>(n)));
  cfg.window = std::max<size_t>(1, window / static_cast<size_t>(threads));
  std::vector<std::unique_ptr<Driver>> drivers;
  for (int t = 0; t < threads; ++t) {
    std::vector<Client*> mine;
    for (uint32_t i = static_cast<uint32_t>(t); i < n; i += static_cast<uint32_t>(threads)) mine.push_back(&clients[i]);
    drivers.push_back(std::make_unique<Driver>(cfg, std::move(mine)));
  }
  std::vector<ThreadResult> results(threads);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      results[t] = drivers[t]->run();
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  cfg.start = Clock::now();
  cfg.deadline = cfg.start + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  RepResult r;
  std::vector<double> connect, release;
  for (auto& tr : results) {
    connect.insert(connect.end(), tr.connect_s.begin(), tr.connect_s.end());
    release.insert(release.end(), tr.release_s.begin(), tr.release_s.end());
    r.failed += tr.failed;
    if (r.first_error.empty()) r.first_error = tr.first_error;
  }
  r.connect_p50_s = percentile(connect, 0.5);
  r.connect_p99_s = percentile(connect, 0.99);
  if (!release.empty()) {
    r.total_s = *std::max_element(release.begin(), release.end());
    r.first_release_s = *std::min_element(release.begin(), release.end());
  }
  return r;
}

// Enough descriptors for the clients (and the server, when it runs in this process).
void raise_nofile(uint64_t needed) {
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur >= needed) return;
  rlimit want = rl;
  want.rlim_cur = needed;
  if (want.rlim_max < needed) want.rlim_max = needed;  // allowed for root (CAP_SYS_RESOURCE)
  if (setrlimit(RLIMIT_NOFILE, &want) != 0) {
    want.rlim_max = rl.rlim_max;
    want.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &want);
    fmt::print(stderr, "warning: RLIMIT_NOFILE is {} (hard limit); {} clients need about {}\n", rl.rlim_max,
               needed / 2, needed);
  }
}

std::string hex(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) out += fmt::format("{:02x}", b);
  return out;
}

int run_bench_store(std::vector<std::string> args) {
  CLI::App app("Measures the store's join time: N clients (each its own connection) connect, authenticate, set "
               "their key and pass a barrier (add + wait). Starts a local server unless --addr is given.",
               "cohort bench store");
  std::string clients_text = "64,256,1024,4096";
  int threads = 2;
  int reps = 3;
  size_t window = 1024;
  std::string addr;
  std::string token_file;
  double timeout_s = 120;
  std::string server_mode = "process";
  uint32_t source_addrs = 64;
  app.add_option("--clients", clients_text, "client counts, e.g. 1024 or 64,256,1024");
  app.add_option("--threads", threads, "client driver threads (each drives its share over epoll)");
  app.add_option("--reps", reps, "repetitions per client count");
  app.add_option("--window", window, "connections in their handshake at once, over all threads (pacing)");
  app.add_option("--addr", addr, "use the store at host:port instead of starting one");
  app.add_option("--token-file", token_file, "job token for --addr (default: COHORT_JOB_TOKEN)");
  app.add_option("--source-addrs", source_addrs,
                 "spread the clients over this many loopback source addresses 127.1.0.x (1: all from the "
                 "default source, as one host's processes would be)");
  app.add_option("--timeout", timeout_s, "seconds one repetition may take");
  app.add_option("--server", server_mode, "where the local server runs: process (a child `cohort store serve`) or thread")
      ->check(CLI::IsMember({"process", "thread"}));
  if (!parse_command_line(app, args)) return 0;
  std::vector<int> counts = str::parse_int_list(clients_text, "--clients");
  if (counts.empty() || reps < 1 || threads < 1 || window < 1) {
    throw ConfigError("cohort bench store: --clients, --reps, --threads and --window must be positive");
  }
  int max_n = *std::max_element(counts.begin(), counts.end());
  raise_nofile(static_cast<uint64_t>(max_n) * (addr.empty() && server_mode == "thread" ? 2 : 1) + 1024);

  std::string token;
  if (!addr.empty()) {
    token = job_token(token_file);
  } else {
    token = hex(store_auth::make_nonce());  // a job token, as the launcher would make one
  }
  std::string run_id = hex(store_auth::make_nonce()).substr(0, 8);

  fmt::print("# cohort bench store: each client = own TCP connection + HMAC handshake + set + add + wait "
             "(barrier); {} driver thread(s), window {}, {} loopback source address(es), {}\n",
             threads, window, source_addrs,
             !addr.empty() ? "server at " + addr
             : server_mode == "process" ? "server: a child `cohort store serve` process"
                                        : "server: a thread of this process");
  fmt::print("{:>8} {:>5} {:>12} {:>10} {:>10} {:>14} {:>14} {:>7}\n", "clients", "reps", "total_s(med)", "min_s",
             "max_s", "connect_p50_s", "connect_p99_s", "errors");
  bool any_failed = false;
  for (int n : counts) {
    std::vector<double> totals;
    std::vector<RepResult> rows;
    size_t errors = 0;
    std::string first_error;
    for (int rep = 0; rep < reps; ++rep) {
      std::unique_ptr<StoreServer> server;
      std::unique_ptr<ServerProcess> server_process;
      net::Address target;
      if (addr.empty() && server_mode == "process") {
        server_process = std::make_unique<ServerProcess>(token);
        target = server_process->address();
      } else if (addr.empty()) {
        StoreServerOptions so;
        so.host = "127.0.0.1";
        so.token = token;
        so.backlog = std::max(n, 4096);
        server = StoreServer::start(so);
        target = net::resolve("127.0.0.1", server->port());
      } else {
        auto [h, p] = net::split_host_port(addr);
        target = net::resolve(h, p);
      }
      const bool loopback = target.family() == AF_INET &&
                            (ntohl(reinterpret_cast<const sockaddr_in*>(&target.storage)->sin_addr.s_addr) >> 24) == 127;
      RepResult r = run_rep(target, token, fmt::format("bench/{}/{}/{}", run_id, n, rep), static_cast<uint32_t>(n),
                            threads, window, loopback ? std::max(1u, source_addrs) : 1u, timeout_s);
      if (server) server->stop();
      server_process.reset();
      totals.push_back(r.total_s);
      rows.push_back(r);
      errors += r.failed;
      if (first_error.empty()) first_error = r.first_error;
    }
    // The row of the median repetition gives the connect percentiles.
    std::vector<size_t> order(rows.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return rows[a].total_s < rows[b].total_s; });
    const RepResult& med = rows[order[order.size() / 2]];
    fmt::print("{:>8} {:>5} {:>12.4f} {:>10.4f} {:>10.4f} {:>14.4f} {:>14.4f} {:>7}\n", n, reps, med.total_s,
               rows[order.front()].total_s, rows[order.back()].total_s, med.connect_p50_s, med.connect_p99_s, errors);
    std::fflush(stdout);
    if (errors > 0) {
      any_failed = true;
      fmt::print(stderr, "cohort bench store: {} client(s) failed at N = {}; first: {}\n", errors, n, first_error);
    }
  }
  return any_failed ? 1 : 0;
}

Registration reg_bench_store("bench store", "measure the store's join time with N clients (connect, auth, set, barrier)",
                 run_bench_store);

}  // namespace
}  // namespace cohort::tools
