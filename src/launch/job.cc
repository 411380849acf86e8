#include "launch/job.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "cohort/error.h"
#include "common/log.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/output.h"
#include "store/memory_store.h"
#include "store/tcp_store.h"

extern char** environ;

namespace cohort::launch {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

// The default deadline of the main thread's store calls once the job runs: each is one small request
// (publish the end or a failure, count finished nodes) to a store that answers thousands of clients in
// about a second. A node cut off from the head must not sit out a long default in one of them: while
// the call blocks, the main loop cannot see its control channel close and stop its workers.
constexpr Millis kStoreCallTimeout{5000};

bool is_terminating(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT; }

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

void say(const std::string& line) {
  std::string out = "cohort run: " + line + "\n";
  write_fully(2, out.data(), out.size());
}

// How an attempt ended, as every node agrees through the store key "end".
struct EndInfo {
  std::string kind;  // "done" (all workers finished), "failure", "interrupted", "lost", "agent", "join"
  int code = 0;      // the launcher's exit code
  std::string summary;
  bool restartable() const { return (kind == "failure" || kind == "done") && code != 0; }
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(EndInfo, kind, code, summary)

std::string end_to_string(const EndInfo& e) { return nlohmann::json(e).dump(); }
// A failure that only reports another one: the worker's communicator lost a peer ("lost rank N
// (host)") or heard a peer's failure notice ("rank N (host) failed: ..."), and it exited with an error
// code. When a peer is killed, its neighbours' errors can reach the launcher before the kill itself;
// the kill, not their report of it, is the job's root cause (summary and exit code).
bool is_consequence(const EndInfo& e) {
  return e.kind == "failure" && e.summary.find(" exited with code ") != std::string::npos &&
         (e.summary.find("lost rank ") != std::string::npos || e.summary.find(") failed: ") != std::string::npos);
}
// Whether `e` should replace `current` as the root cause.
bool is_root_cause_of(const EndInfo& e, const EndInfo& current) {
  return e.kind == "failure" && !is_consequence(e) && is_consequence(current);
}

EndInfo end_from_string(const std::string& s) {
  try {
    return nlohmann::json::parse(s).get<EndInfo>();
  } catch (const std::exception&) {
    return EndInfo{"lost", 1, "malformed end record in the store: " + s};
  }
}

struct Worker {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Clock::time_point started, ended;
  UniqueFd out, err;  // read ends (invalid when not piped or at EOF)
  std::unique_ptr<OutputSink> sink;
};

struct AgentChild {
  NodePlan node;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  UniqueFd in, out, err;
  std::unique_ptr<OutputSink> sink;
};

// Events from the store watcher thread to the loop.
struct WatchEvent {
  enum Kind { kJoined, kEnd, kLost, kJoinTimeout } kind;
  std::string text;
  int attempt = 0;
};

class EventQueue {
 public:
  EventQueue() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  int fd() const { return fd_.get(); }
  void push(WatchEvent e) {
    {
      std::lock_guard<std::mutex> g(m_);
      q_.push_back(std::move(e));
    }
    uint64_t one = 1;
    [[maybe_unused]] auto r = ::write(fd_.get(), &one, sizeof one);
  }
  std::deque<WatchEvent> take() {
    uint64_t v;
    [[maybe_unused]] auto r = ::read(fd_.get(), &v, sizeof v);
    std::lock_guard<std::mutex> g(m_);
    return std::exchange(q_, {});
  }

 private:
  UniqueFd fd_;
  std::mutex m_;
  std::deque<WatchEvent> q_;
};

std::string node_key(int r) { return "node/" + std::to_string(r); }

struct WatchParams {
  int nnodes = 1;
  int this_node = 0;
  double join_timeout_s = 300;
  std::string store_addr;
};

// Multi-node: waits for every node to register (saying every few seconds who is missing), then for
// the attempt's "end" record, on its own store connection. It is detached: it owns everything it
// touches, and a stop flag ends it within one wait slice without the loop ever waiting for it.
void watcher_main(std::shared_ptr<Store> store, std::shared_ptr<EventQueue> events,
                  std::shared_ptr<std::atomic<bool>> stop, WatchParams p, int attempt) {
  try {
    auto started = Clock::now();
    auto deadline =
        started + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(p.join_timeout_s));
    std::vector<std::string> keys;
    for (int r = 0; r < p.nnodes; ++r) keys.push_back(node_key(r));
    auto missing_nodes = [&] {
      std::vector<int> missing;
      for (int r = 0; r < p.nnodes; ++r)
        if (!store->check({node_key(r)})) missing.push_back(r);
      return missing;
    };
    for (;;) {
      if (*stop) return;
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      if (left <= Millis(0)) {
        events->push({WatchEvent::kJoinTimeout,
                      fmt::format("node ranks {} did not join within {} s (--join-timeout; store at {})",
                                  str::format_ranges(missing_nodes()), p.join_timeout_s, p.store_addr),
                      attempt});
        return;
      }
      try {
        store->wait(keys, std::min(left, Millis(3000)));
        break;
      } catch (const TimeoutError&) {
        auto missing = missing_nodes();
        if (!missing.empty() && !*stop)
          say(fmt::format("{}waiting for node ranks {} to join ({:.0f} s of {} s){}",
                          p.this_node >= 0 ? fmt::format("node {}: ", p.this_node) : "",
                          str::format_ranges(missing), std::chrono::duration<double>(Clock::now() - started).count(),
                          p.join_timeout_s, attempt > 0 ? fmt::format(", restart {}", attempt) : ""));
      }
    }
    events->push({WatchEvent::kJoined, "", attempt});
    for (;;) {
      if (*stop) return;
      try {
        store->wait({"end"}, Millis(1000));
        events->push({WatchEvent::kEnd, store->get("end"), attempt});
        return;
      } catch (const TimeoutError&) {
      }
    }
  } catch (const Error& e) {
    if (!*stop) events->push({WatchEvent::kLost, e.what(), attempt});
  }
}

class Job {
 public:
  explicit Job(JobContext ctx) : ctx_(std::move(ctx)), plan_(ctx_.plan) {}
  int run();

 private:
  // Set-up
  void setup_signals();
  void start_store();
  void start_agents();
  // One attempt
  EndInfo run_attempt(int attempt);
  void spawn_workers(int attempt);
  void spawn_worker(Worker& w, const NodePlan& node, int attempt, const std::vector<int>& cpus,
                    const GpuAssignment& gpu);
  // Loop handlers
  void on_signal(int sig);
  void reap();
  void on_worker_exit(Worker& w, int status);
  void on_agent_exit(AgentChild& a, int status);
  void on_control_input();
  void publish_end(const EndInfo& e);
  void adopt_end(const EndInfo& e);
  void upgrade_end(const EndInfo& e);
  // Sets store key `key` to `e` unless another node set it first, and replaces theirs when it only
  // reports `e` (is_consequence). Returns what the key holds afterwards. Throws on a store error.
  std::string claim_root_cause(const std::string& key, const EndInfo& e);
  void begin_stop();
  void send_stop_signal();
  void kill_all(int sig);
  void drain(int fd, OutputSink& sink, bool is_stderr, UniqueFd& holder);
  void arm_timer(double seconds);
  void disarm_timer();
  void epoll_add(int fd);
  void epoll_del(int fd);
  std::string failure_summary(const Worker& w);
  int running_workers() const;
  int running_agents() const;

  JobContext ctx_;
  Plan& plan_;
  std::vector<GpuAssignment> gpus_;  // per local rank (empty: not a GPU job)
  bool distributed_ = false;
  UniqueFd epoll_, signal_fd_, timer_fd_;
  std::unique_ptr<StoreServer> server_;
  std::string store_addr_;
  int torch_port_ = 0;
  std::shared_ptr<Store> base_store_;   // coordination (main thread)
  std::shared_ptr<Store> base_client_;  // the TCP client under base_store_ (its default timeout)
  std::shared_ptr<Store> watch_base_;   // the watcher thread's own connection
  std::shared_ptr<Store> attempt_store_;
  StoreClientOptions client_options_;
  // Shared with the (detached) watcher threads, which may outlive an attempt by one wait slice.
  std::shared_ptr<EventQueue> events_ = std::make_shared<EventQueue>();
  std::shared_ptr<std::atomic<bool>> watcher_stop_ = std::make_shared<std::atomic<bool>>(false);
  std::vector<Worker> workers_;
  std::vector<AgentChild> agents_;
  // Attempt state
  bool stopping_ = false;
  bool reporting_ = false;  // in the report window: the stop signal is not sent yet (see begin_stop)
  bool killed_ = false;
  bool done_reported_ = false;
  bool joined_ = false;
  std::optional<EndInfo> end_;
  std::optional<EndInfo> first_failure_;  // --no-abort-on-failure
  Clock::time_point end_seen_;
  bool head_lost_ = false;
  std::string control_buf_;
  bool control_open_ = false;
};

void Job::epoll_add(int fd) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  if (epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0)
    throw Error(net::errno_string("epoll_ctl(ADD)", errno));
}
void Job::epoll_del(int fd) { epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr); }

void Job::setup_signals() {
  // Block the handled signals in this thread before any other thread exists, so that every thread
  // inherits the mask and the signals are only ever read from the signalfd.
  sigset_t set;
  sigemptyset(&set);
  for (int s : kForwarded) sigaddset(&set, s);
  sigaddset(&set, SIGCHLD);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a closed console must not kill the launcher
  signal_fd_.reset(signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
  epoll_.reset(epoll_create1(EPOLL_CLOEXEC));
  timer_fd_.reset(timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
  if (!signal_fd_ || !epoll_ || !timer_fd_) throw Error(net::errno_string("signalfd/epoll/timerfd", errno));
  epoll_add(signal_fd_.get());
  epoll_add(timer_fd_.get());
  epoll_add(events_->fd());
}

void Job::arm_timer(double seconds) {
  itimerspec its{};
  if (seconds > 0) {
    auto ns = static_cast<long long>(seconds * 1e9);
    its.it_value.tv_sec = ns / 1000000000;
    its.it_value.tv_nsec = ns % 1000000000;
  } else {
    its.it_value.tv_nsec = 1;  // fire at once
  }
  timerfd_settime(timer_fd_.get(), 0, &its, nullptr);
}

void Job::disarm_timer() {
  itimerspec zero{};
  timerfd_settime(timer_fd_.get(), 0, &zero, nullptr);
}

void Job::start_store() {
  // The port workers hand to torch's env:// (its rank 0 hosts a TCPStore there) must differ from
  // the cohort store's port, so the store host picks a second free port.
  auto pick_free_port = [](const std::string& host) {
    auto fd = net::listen_tcp(host, 0, 1, false);
    return static_cast<int>(net::local_address(fd.get()).port());
  };
  bool local = plan_.mode == Mode::kLocal;
  if (plan_.host_store) {
    StoreServerOptions so;
    so.host = local ? "127.0.0.1" : "";
    so.port = static_cast<uint16_t>(plan_.master_port);
    so.token = ctx_.token;
    try {
      server_ = StoreServer::start(so);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("cannot host the job's store: {}; leave --master-port (and MASTER_PORT) unset to "
                                    "let the OS choose a free port",
                                    e.what()));
    }
    store_addr_ = fmt::format("{}:{}", plan_.master_addr, server_->port());
    plan_.master_port = server_->port();
    torch_port_ = pick_free_port(local ? "127.0.0.1" : "");
  } else {
    store_addr_ = fmt::format("{}:{}", plan_.master_addr, plan_.master_port);
    torch_port_ = ctx_.torch_port;
  }
  if (!distributed_) {
    base_store_ = make_memory_store();
    return;
  }
  StoreClientOptions co;
  co.host = plan_.master_addr;
  co.port = static_cast<uint16_t>(plan_.master_port);
  co.token = ctx_.token;
  if (plan_.host_store) co.host = "127.0.0.1";  // our own server listens on every interface
  // Joining nodes may start long before node 0: keep trying for the join timeout, saying so.
  auto deadline = Deadline::after(std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(plan_.join_timeout_s)));
  auto started = Clock::now();
  for (;;) {
    co.timeout = std::min<Millis>(Millis(5000), deadline.remaining());
    try {
      base_store_ = connect_tcp_store(co);
      watch_base_ = connect_tcp_store(co);
      break;
    } catch (const AuthError&) {
      throw;
    } catch (const Error& e) {
      if (deadline.expired())
        throw TimeoutError(fmt::format("node {}: the job's store at {} (node 0) did not answer within {} s "
                                       "(--join-timeout): {}",
                                       plan_.this_node, store_addr_, plan_.join_timeout_s, e.what()));
      say(fmt::format("node {}: waiting for node 0's store at {} ({:.0f} s of {} s)", plan_.this_node, store_addr_,
                      std::chrono::duration<double>(Clock::now() - started).count(), plan_.join_timeout_s));
    }
  }
  co.timeout = Millis(60000);
  client_options_ = co;
  base_client_ = base_store_;
  base_store_->set_timeout(Millis(60000));
  watch_base_->set_timeout(Millis(60000));
  base_store_ = make_prefix_store(base_store_, "cohort/launch/" + plan_.job_id);
  watch_base_ = make_prefix_store(watch_base_, "cohort/launch/" + plan_.job_id);
  if (plan_.mode == Mode::kPerNode) {
    if (plan_.host_store) base_store_->set("torch_port", std::to_string(torch_port_));
    else torch_port_ = std::stoi(base_store_->get("torch_port"));
  }
}

void Job::start_agents() {
  // Fan-out: every host but this one runs `cohort agent` through the ssh command; the plan (with the
  // token, never on a command line) goes over the agent's stdin, which then stays open as the
  // control channel: "sig N" lines forward signals, EOF means the head is gone.
  auto ssh = str::split(plan_.ssh_command, ' ');
  if (ssh.empty()) throw ConfigError("--ssh-command is empty");
  for (const auto& node : plan_.nodes) {
    if (node.local) continue;
    AgentChild a;
    a.node = node;
    Plan remote = plan_;
    remote.this_node = node.node_rank;
    remote.host_store = false;
    for (auto& n : remote.nodes) n.local = n.node_rank == node.node_rank;
    nlohmann::json msg = {{"plan", nlohmann::json::parse(plan_to_json(remote))},
                          {"token", ctx_.token},
                          {"torch_port", torch_port_}};
    std::string line = msg.dump() + "\n";
    std::vector<std::string> argv = ssh;
    argv.push_back(node.host);
    argv.push_back(ctx_.self_exe);
    argv.push_back("agent");
    int in[2], out[2], err[2];
    if (pipe2(in, O_CLOEXEC) || pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC))
      throw Error(net::errno_string("pipe2", errno));
    std::vector<char*> args;
    for (auto& s : argv) args.push_back(s.data());
    args.push_back(nullptr);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) throw Error(net::errno_string("fork", errno));
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      signal(SIGPIPE, SIG_DFL);
      dup2(in[0], 0);
      dup2(out[1], 1);
      dup2(err[1], 2);
      execvp(args[0], args.data());
      dprintf(2, "cannot run ssh command '%s': %s\n", args[0], strerror(errno));
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    close(err[1]);
    a.pid = pid;
    a.running = true;
    a.in.reset(in[1]);
    a.out.reset(out[0]);
    a.err.reset(err[0]);
    // drain() reads until EAGAIN: blocking pipes would stall the event loop (and with it SIGTERM
    // handling) as soon as an agent's ssh session prints anything (found by tests/multihost).
    net::set_nonblocking(a.out.get(), true);
    net::set_nonblocking(a.err.get(), true);
    write_fully(a.in.get(), line.data(), line.size());
    OutputTargets t;
    t.line_mode = true;
    a.sink = std::make_unique<OutputSink>(std::move(t), 5);
    epoll_add(a.out.get());
    epoll_add(a.err.get());
    agents_.push_back(std::move(a));
  }
}

void Job::spawn_worker(Worker& w, const NodePlan& node, int attempt, const std::vector<int>& cpus,
                       const GpuAssignment& gpu) {
  WorkerSlot slot{w.rank, w.local_rank, node.nproc, node.node_rank, gpu};
  auto vars = worker_env(plan_, slot, store_addr_, torch_port_, ctx_.token, attempt, ctx_.env);
  // Environment: the launcher's, with cohort's variables replacing any of the same name.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    std::string_view kv(*e);
    auto name = kv.substr(0, kv.find('='));
    bool replaced = false;
    for (const auto& v : vars)
      if (v.first == name) replaced = true;
    if (!replaced) env_strings.emplace_back(kv);
  }
  for (const auto& [k, v] : vars) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = plan_.program;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::string path = plan_.program_path;

  OutputTargets t;
  t.tag = plan_.tag_output ? fmt::format("[{}:{}] ", node.host, w.rank) : "";
  t.merge_stderr = plan_.merge_stderr;
  t.to_console = plan_.all_ranks_to_console || std::find(plan_.ranks_to_console.begin(), plan_.ranks_to_console.end(),
                                                          w.rank) != plan_.ranks_to_console.end();
  if (!plan_.output_dir.empty()) {
    std::string dir = fmt::format("{}/rank.{}", plan_.output_dir, w.rank);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw ConfigError(fmt::format("--output-filename: cannot create {}: {}", dir, ec.message()));
    auto open_file = [&](const char* name) {
      std::string p = dir + "/" + name;
      UniqueFd fd(::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_APPEND, 0644));
      if (!fd) throw ConfigError(net::errno_string("--output-filename: open " + p, errno));
      return fd;
    };
    t.file_out = open_file("stdout");
    if (!plan_.merge_stderr) t.file_err = open_file("stderr");
  }
  // stdout goes straight to the console when nothing needs to see it; stderr is always piped for
  // the failure summary's last lines.
  // With --merge-stderr-to-stdout both descriptors share one pipe, so the order of lines is kept.
  bool merge = plan_.merge_stderr;
  bool pipe_stdout = merge || plan_.tag_output || t.file_out || !t.to_console;
  int out[2] = {-1, -1}, err[2] = {-1, -1}, exec_err[2] = {-1, -1};
  if ((pipe_stdout && pipe2(out, O_CLOEXEC)) || (!merge && pipe2(err, O_CLOEXEC)) || pipe2(exec_err, O_CLOEXEC))
    throw Error(net::errno_string("pipe2", errno));
  cpu_set_t cpuset;
  CPU_ZERO(&cpuset);
  for (int c : cpus) CPU_SET(c, &cpuset);
  bool stdin_null = ctx_.agent_mode;
  pid_t parent = getpid();

  pid_t pid = fork();
  if (pid < 0) throw Error(net::errno_string("fork", errno));
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);  // the launcher died before prctl took effect
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);
    if (!cpus.empty()) sched_setaffinity(0, sizeof cpuset, &cpuset);
    if (stdin_null) {
      int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, 0);
    }
    if (out[1] >= 0) dup2(out[1], 1);
    dup2(merge ? out[1] : err[1], 2);
    execve(path.c_str(), argv.data(), envp.data());
    int e = errno;
    [[maybe_unused]] auto r = ::write(exec_err[1], &e, sizeof e);
    _exit(127);
  }
  setpgid(pid, pid);  // also from the parent: no window where a signal to the group misses it
  if (out[1] >= 0) close(out[1]);
  if (err[1] >= 0) close(err[1]);
  close(exec_err[1]);
  int child_errno = 0;
  ssize_t got;
  do got = ::read(exec_err[0], &child_errno, sizeof child_errno);
  while (got < 0 && errno == EINTR);
  close(exec_err[0]);
  w.pid = pid;
  w.running = true;
  w.started = Clock::now();
  if (out[0] >= 0) w.out.reset(out[0]);
  if (err[0] >= 0) w.err.reset(err[0]);
  w.sink = std::make_unique<OutputSink>(std::move(t));
  if (got == static_cast<ssize_t>(sizeof child_errno)) {
    // exec failed: the child exits 127 at once; the summary says why.
    std::string msg = fmt::format("cannot run {}: {}\n", path, strerror(child_errno));
    w.sink->on_data(true, msg.data(), msg.size());
  }
  if (w.out) {
    net::set_nonblocking(w.out.get(), true);
    epoll_add(w.out.get());
  }
  if (w.err) {
    net::set_nonblocking(w.err.get(), true);
    epoll_add(w.err.get());
  }
}

void Job::spawn_workers(int attempt) {
  const NodePlan* node = plan_.node(plan_.this_node);
  if (!node) return;
  const std::vector<int> cpus = allowed_cpus();
  auto bindings = compute_bindings(plan_.bind_to, node->nproc, cpus, numa_node_cpus(), physical_cores(cpus),
                                   near_cpus_of(gpus_));
  // Per-rank output folders first: a folder that cannot be made stops the job before any worker runs.
  if (!plan_.output_dir.empty()) {
    for (int l = 0; l < node->nproc; ++l) {
      std::string dir = fmt::format("{}/rank.{}", plan_.output_dir, node->first_rank + l);
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) throw ConfigError(fmt::format("--output-filename: cannot create {}: {}", dir, ec.message()));
    }
  }
  workers_.clear();
  workers_.resize(static_cast<size_t>(node->nproc));
  for (int l = 0; l < node->nproc; ++l) {
    workers_[l].rank = node->first_rank + l;
    workers_[l].local_rank = l;
  }
  for (int l = 0; l < node->nproc; ++l) {
    if (end_) break;  // a signal arrived meanwhile
    spawn_worker(workers_[l], *node, attempt, bindings[l], gpus_.empty() ? GpuAssignment{} : gpus_[l]);
  }
}

int Job::running_workers() const {
  int n = 0;
  for (const auto& w : workers_) n += w.running;
  return n;
}
int Job::running_agents() const {
  int n = 0;
  for (const auto& a : agents_) n += a.running;
  return n;
}

void Job::kill_all(int sig) {
  for (auto& w : workers_)
    if (w.running) kill(-w.pid, sig);
}

// How long workers get to notice a lost peer and say so themselves before the launcher signals
// them. Their communicators see a closed connection within milliseconds and fail with a message
// naming the lost rank and host; a SIGTERM sent at the same moment would usually win the race and
// leave only the launcher's summary. Capped by --kill-grace (0 keeps "SIGKILL at once").
constexpr double kReportWindowS = 1.0;

void Job::begin_stop() {
  if (stopping_) return;
  stopping_ = true;
  if (running_workers() == 0) return;
  if (plan_.kill_grace_s <= 0) {
    kill_all(SIGKILL);
    killed_ = true;
    return;
  }
  // A failure elsewhere (a worker, an agent, the store): the workers here are most likely blocked on
  // the lost peer and about to fail on their own, naming it. An interruption is signalled at once.
  if (end_ && end_->kind != "interrupted" && end_->kind != "done") {
    reporting_ = true;
    arm_timer(std::min(kReportWindowS, plan_.kill_grace_s));
    return;
  }
  send_stop_signal();
}

void Job::send_stop_signal() {
  reporting_ = false;
  kill_all(SIGTERM);
  arm_timer(plan_.kill_grace_s);
}

void Job::publish_end(const EndInfo& e) {
  if (end_) return;
  if (distributed_ && !head_lost_) {
    try {
      // Another node may have won the race: theirs is the root cause, unless it only reports ours.
      adopt_end(end_from_string(claim_root_cause("end", e)));
      return;
    } catch (const Error& err) {
      log::warn("could not publish the job's end to the store: {}", err.what());
    }
  }
  adopt_end(e);
}

std::string Job::claim_root_cause(const std::string& key, const EndInfo& e) {
  const std::string mine = end_to_string(e);
  auto now = attempt_store_->compare_set(key, "", mine);
  // Compared with what the store holds (not a re-serialised copy), so a lost race is seen as such.
  if (now != mine && is_root_cause_of(e, end_from_string(now))) now = attempt_store_->compare_set(key, now, mine);
  return now;
}

void Job::upgrade_end(const EndInfo& e) {
  // Only in the report window: no worker here has been signalled, so a death by signal is genuine.
  if (!end_ || !reporting_ || !is_root_cause_of(e, *end_)) return;
  if (distributed_ && !head_lost_) {
    try {
      end_ = end_from_string(claim_root_cause("end", e));  // ours, or another node's root cause that came first
      return;
    } catch (const Error& err) {
      log::warn("could not publish the job's root cause to the store: {}", err.what());
    }
  }
  end_ = e;
}

void Job::adopt_end(const EndInfo& e) {
  if (end_) return;
  end_ = e;
  end_seen_ = Clock::now();
  *watcher_stop_ = true;
  if (e.kind != "done") begin_stop();
  if (!agents_.empty() && plan_.host_store) {
    // Remote agents stop their workers on their own (they watch the store); give them the grace
    // plus a margin before the head kills the ssh connections.
    if (!stopping_ || running_workers() == 0) arm_timer(plan_.kill_grace_s + 10);
  }
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return fmt::format("was killed by {}{}", signal_name(sig),
                       sig == SIGKILL ? " (possibly the out-of-memory killer: see dmesg)" : "");
  }
  return "ended";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string Job::failure_summary(const Worker& w) {
  double secs = std::chrono::duration<double>(w.ended - w.started).count();
  std::string s = fmt::format("rank {} on {} (pid {}) {} after {:.2f} s", w.rank, plan_.node(plan_.this_node)->host,
                              w.pid, describe_status(w.status), secs);
  auto tail = w.sink->stderr_tail();
  if (tail.empty()) {
    s += "; it wrote nothing to stderr";
  } else {
    s += plan_.merge_stderr ? "; last lines of its output (stderr merged):" : "; last lines of its stderr:";
    for (const auto& l : tail) s += "\n    | " + l;
  }
  return s;
}

void Job::drain(int fd, OutputSink& sink, bool is_stderr, UniqueFd& holder) {
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      sink.on_data(is_stderr, buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    // EOF or error: this stream is finished.
    sink.on_eof(is_stderr);
    epoll_del(fd);
    holder.reset();
    return;
  }
}

void Job::on_worker_exit(Worker& w, int status) {
  w.running = false;
  w.status = status;
  w.ended = Clock::now();
  // Collect what the worker wrote before it died (the summary needs its last stderr lines).
  if (w.err) drain(w.err.get(), *w.sink, true, w.err);
  if (w.out) drain(w.out.get(), *w.sink, false, w.out);
  bool failed = status != 0;
  if (failed && end_ && plan_.abort_on_failure) upgrade_end(EndInfo{"failure", exit_code_of(status), failure_summary(w)});
  if (failed && !stopping_ && !end_) {
    EndInfo e{"failure", exit_code_of(status), failure_summary(w)};
    if (plan_.abort_on_failure) {
      publish_end(e);
    } else {
      say(fmt::format("{} (--no-abort-on-failure: the others run on)", e.summary));
      // The first failure, unless it only reports this one (see is_consequence).
      if (!first_failure_ || is_root_cause_of(e, *first_failure_)) {
        first_failure_ = e;
        if (distributed_) {
          try {
            claim_root_cause("first_failure", e);
          } catch (const Error& err) {
            // The store is unreachable: this node is cut off from the job and stops.
            adopt_end(EndInfo{"lost", 1, fmt::format("lost the job's store at {}: {}", store_addr_, err.what())});
          }
        }
      }
    }
  }
  if (running_workers() == 0) {
    reporting_ = false;
    if (stopping_) {
      if (running_agents() > 0 && plan_.host_store) arm_timer(plan_.kill_grace_s + 10);
      else disarm_timer();
    }
    if (!done_reported_) {
      done_reported_ = true;
      if (!distributed_) {
        if (!end_) adopt_end(first_failure_ ? EndInfo{"done", first_failure_->code, first_failure_->summary}
                                            : EndInfo{"done", 0, ""});
      } else if (!end_ && !head_lost_) {
        try {
          int64_t finished = attempt_store_->add("done", 1);
          if (finished == plan_.nnodes) {
            EndInfo done{"done", 0, ""};
            std::vector<std::string> ff{"first_failure"};
            if (attempt_store_->check(ff)) {
              auto f = end_from_string(attempt_store_->get("first_failure"));
              done = EndInfo{"done", f.code, f.summary};
            }
            publish_end(done);
          }
        } catch (const Error& err) {
          adopt_end(EndInfo{"lost", 1, fmt::format("lost the job's store at {}: {}", store_addr_, err.what())});
        }
      }
    }
  }
}

void Job::on_agent_exit(AgentChild& a, int status) {
  a.running = false;
  a.status = status;
  if (a.err) drain(a.err.get(), *a.sink, true, a.err);
  if (a.out) drain(a.out.get(), *a.sink, false, a.out);
  if (!end_) {
    std::string s = fmt::format("the agent for host {} (node {}, ranks {}-{}) {} before the job ended", a.node.host,
                                a.node.node_rank, a.node.first_rank, a.node.first_rank + a.node.nproc - 1,
                                describe_status(status));
    auto tail = a.sink->stderr_tail();
    if (!tail.empty()) s += "; its last stderr lines:";
    for (const auto& l : tail) s += "\n    | " + l;
    int code = exit_code_of(status);
    publish_end(EndInfo{"agent", code == 0 ? 1 : code, s});
  }
}

void Job::on_signal(int sig) {
  if (sig == SIGCHLD) {
    reap();
    return;
  }
  // Forward to every worker's process group, and to remote agents over their control channel.
  for (auto& w : workers_)
    if (w.running) kill(-w.pid, stopping_ && !reporting_ && is_terminating(sig) && sig == SIGINT ? SIGKILL : sig);
  std::string line = fmt::format("sig {}\n", sig);
  for (auto& a : agents_)
    if (a.running && a.in) write_fully(a.in.get(), line.data(), line.size());
  if (!is_terminating(sig)) return;
  if (reporting_) {
    // The signal just forwarded is the stop signal: the report window ends, the grace begins.
    reporting_ = false;
    if (running_workers() > 0) arm_timer(plan_.kill_grace_s);
    return;
  }
  if (stopping_ && sig == SIGINT) {
    killed_ = true;  // a second Ctrl-C: no more grace
    return;
  }
  if (!end_)
    publish_end(EndInfo{"interrupted", 128 + sig,
                        fmt::format("interrupted by {}{}", signal_name(sig),
                                    plan_.nnodes > 1 ? fmt::format(" on node {}", plan_.this_node) : "")});
  // The signal itself was the SIGTERM; SIGKILL follows after the grace.
  if (!stopping_) {
    stopping_ = true;
    if (running_workers() > 0) arm_timer(plan_.kill_grace_s);
  }
}

void Job::reap() {
  for (;;) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    bool known = false;
    for (auto& w : workers_)
      if (w.running && w.pid == pid) {
        on_worker_exit(w, status);
        known = true;
        break;
      }
    if (known) continue;
    for (auto& a : agents_)
      if (a.running && a.pid == pid) {
        on_agent_exit(a, status);
        break;
      }
  }
}

void Job::on_control_input() {
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(0, buf, sizeof buf);
    if (n > 0) {
      control_buf_.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    // EOF: the head launcher (or the ssh connection to it) is gone. Stop everything here.
    epoll_del(0);
    control_open_ = false;
    head_lost_ = true;
    if (!end_) adopt_end(EndInfo{"lost", 1, fmt::format("node {}: lost the connection to the head launcher; stopping "
                                                        "this node's workers",
                                                        plan_.this_node)});
    begin_stop();
    break;
  }
  size_t nl;
  while ((nl = control_buf_.find('\n')) != std::string::npos) {
    std::string line = control_buf_.substr(0, nl);
    control_buf_.erase(0, nl + 1);
    if (line.rfind("sig ", 0) == 0) {
      int sig = std::atoi(line.c_str() + 4);
      for (int s : kForwarded)
        if (s == sig) on_signal(sig);
    }
  }
}

EndInfo Job::run_attempt(int attempt) {
  stopping_ = reporting_ = killed_ = done_reported_ = false;
  end_.reset();
  first_failure_.reset();
  workers_.clear();
  watcher_stop_ = std::make_shared<std::atomic<bool>>(false);
  if (distributed_) {
    attempt_store_ = make_prefix_store(base_store_, fmt::format("attempt/{}", attempt));
    // Each attempt's watcher gets a connection of its own (the previous one may still be finishing
    // its last wait slice on the old one).
    if (attempt > 0)
      watch_base_ = make_prefix_store(connect_tcp_store(client_options_), "cohort/launch/" + plan_.job_id);
    auto watch_store = make_prefix_store(watch_base_, fmt::format("attempt/{}", attempt));
    if (plan_.this_node >= 0) attempt_store_->set(node_key(plan_.this_node), net::hostname());
    if (base_client_) base_client_->set_timeout(kStoreCallTimeout);  // joined: only short requests from here
    joined_ = false;
    WatchParams params{plan_.nnodes, plan_.this_node, plan_.join_timeout_s, store_addr_};
    std::thread(watcher_main, watch_store, events_, watcher_stop_, params, attempt).detach();
  } else {
    joined_ = true;
    spawn_workers(attempt);
    if (workers_.empty()) adopt_end(EndInfo{"done", 0, ""});
  }

  std::vector<epoll_event> evs(64);
  for (;;) {
    bool local_done = running_workers() == 0 && (joined_ || end_);
    bool agents_done = running_agents() == 0;
    if (end_ && local_done && (agents_done || !plan_.host_store)) break;
    if (head_lost_ && running_workers() == 0) break;
    int n = epoll_wait(epoll_.get(), evs.data(), static_cast<int>(evs.size()), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(net::errno_string("epoll_wait", errno));
    }
    for (int i = 0; i < n; ++i) {
      int fd = evs[i].data.fd;
      if (fd == signal_fd_.get()) {
        signalfd_siginfo si;
        while (::read(fd, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) on_signal(static_cast<int>(si.ssi_signo));
      } else if (fd == timer_fd_.get()) {
        uint64_t ticks;
        [[maybe_unused]] auto r = ::read(fd, &ticks, sizeof ticks);
        if (reporting_ && running_workers() > 0) {
          send_stop_signal();  // the report window is over: SIGTERM, SIGKILL after the grace
        } else if (running_workers() > 0) {
          kill_all(SIGKILL);
          killed_ = true;
          if (!agents_.empty()) arm_timer(10);
        } else {
          for (auto& a : agents_)
            if (a.running) kill(-a.pid, SIGKILL);
        }
      } else if (fd == events_->fd()) {
        for (auto& ev : events_->take()) {
          if (ev.attempt != attempt) continue;  // from an earlier attempt's watcher
          switch (ev.kind) {
            case WatchEvent::kJoined:
              joined_ = true;
              if (!end_) spawn_workers(attempt);
              break;
            case WatchEvent::kEnd:
              adopt_end(end_from_string(ev.text));
              break;
            case WatchEvent::kLost:
              adopt_end(EndInfo{"lost", 1, fmt::format("lost the job's store (its host, node 0, is gone?): {}", ev.text)});
              break;
            case WatchEvent::kJoinTimeout:
              adopt_end(EndInfo{"join", 1, ev.text});
              break;
          }
        }
      } else if (fd == 0 && control_open_) {
        on_control_input();
      } else {
        bool handled = false;
        for (auto& w : workers_) {
          if (w.out && fd == w.out.get()) drain(fd, *w.sink, false, w.out), handled = true;
          else if (w.err && fd == w.err.get()) drain(fd, *w.sink, true, w.err), handled = true;
          if (handled) break;
        }
        if (handled) continue;
        for (auto& a : agents_) {
          if (a.out && fd == a.out.get()) drain(fd, *a.sink, false, a.out), handled = true;
          else if (a.err && fd == a.err.get()) drain(fd, *a.sink, true, a.err), handled = true;
          if (handled) break;
        }
        if (!handled) epoll_del(fd);
      }
    }
  }
  disarm_timer();
  *watcher_stop_ = true;
  // Whatever the workers left behind in their process groups goes too.
  for (auto& w : workers_) {
    kill(-w.pid, SIGKILL);
    if (w.out) drain(w.out.get(), *w.sink, false, w.out);
    if (w.err) drain(w.err.get(), *w.sink, true, w.err);
  }
  // Per-node mode: node 0 keeps the store up until every node has seen the outcome.
  if (distributed_ && plan_.mode == Mode::kPerNode && !head_lost_ && end_->kind != "lost") {
    try {
      if (attempt_store_->add("exited", 1) == plan_.nnodes) attempt_store_->set("all_exited", "1");
      // Nodes that never joined (or a lost store) will not report: do not wait for them.
      if (plan_.host_store && end_->kind != "lost" && end_->kind != "join")
        attempt_store_->wait({"all_exited"}, Millis(static_cast<int64_t>((plan_.kill_grace_s + 10) * 1000)));
    } catch (const Error& e) {
      log::warn("not every node reported its workers stopped: {}", e.what());
    }
  }
  // Another node may have replaced a reported consequence with its root cause after this node
  // adopted the end (upgrade_end): the summary and exit code follow the store's last word.
  if (distributed_ && !head_lost_ && is_consequence(*end_)) {
    try {
      std::vector<std::string> key{"end"};
      if (attempt_store_->check(key)) {
        EndInfo last = end_from_string(attempt_store_->get("end"));
        if (is_root_cause_of(last, *end_)) end_ = last;
      }
    } catch (const Error& err) {
      log::warn("could not read the job's root cause from the store: {}", err.what());
    }
  }
  return *end_;
}

int Job::run() {
  distributed_ = plan_.nnodes > 1 || plan_.mode == Mode::kFanOut || ctx_.agent_mode;
  // A GPU job: this node's GPUs are checked before anything starts (an agent of a fan-out sees its
  // own host's GPUs here for the first time).
  if (const NodePlan* node = plan_.node(plan_.this_node); node && !plan_.gpus_per_node_spec.empty()) {
    if (!ctx_.gpus) ctx_.gpus = detect_gpus(ctx_.env);
    gpus_ = assign_gpus(plan_.gpus_per_node_spec, plan_.gpu_share, node->nproc, *ctx_.gpus, net::hostname());
    if (plan_.gpus_per_node == 0)
      plan_.gpus_per_node = resolve_gpus_per_node(plan_.gpus_per_node_spec, *ctx_.gpus, net::hostname());
  }
  setup_signals();
  if (ctx_.agent_mode) {
    net::set_nonblocking(0, true);
    epoll_add(0);
    control_open_ = true;
  }
  start_store();
  if (plan_.mode == Mode::kFanOut && plan_.host_store) start_agents();
  if (plan_.set_omp_threads && plan_.this_node >= 0 && !ctx_.agent_mode)
    say(fmt::format("setting OMP_NUM_THREADS=1 for each worker (it was unset and {} workers share a node); set it "
                    "yourself to choose another value",
                    plan_.node(plan_.this_node)->nproc));
  int attempt = 0;
  for (;;) {
    EndInfo e = run_attempt(attempt);
    bool print = !ctx_.agent_mode;
    if (e.restartable() && attempt < plan_.max_restarts && !head_lost_) {
      ++attempt;
      if (print)
        say(fmt::format("restarting every worker (restart {} of {}) after: {}", attempt, plan_.max_restarts,
                        e.summary));
      continue;
    }
    if (print && e.code != 0) {
      if (e.kind == "failure" || e.kind == "done")
        say(fmt::format("job failed (exit {}): {}", e.code, e.summary));
      else
        say(fmt::format("job stopped (exit {}): {}", e.code, e.summary));
    }
    if (!agents_.empty()) {
      for (auto& a : agents_) a.in.reset();
    }
    if (server_) server_->stop();
    return e.code;
  }
}

}  // namespace

EnvMap current_env() {
  EnvMap env;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

int run_job(JobContext ctx) {
  Job job(std::move(ctx));
  return job.run();
}

int run_agent_from_stdin() {
  // The first line of stdin is the head's message; the rest of stdin stays the control channel.
  std::string line;
  char c;
  pollfd pfd{0, POLLIN, 0};
  auto deadline = Deadline::after(std::chrono::seconds(60));
  while (true) {
    if (poll(&pfd, 1, deadline.poll_ms()) <= 0) throw TimeoutError("agent: no plan from the head launcher within 60 s");
    ssize_t n = ::read(0, &c, 1);
    if (n <= 0) throw PeerLostError("agent: the head launcher closed the connection before sending the plan");
    if (c == '\n') break;
    line += c;
  }
  nlohmann::json msg;
  try {
    msg = nlohmann::json::parse(line);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("agent: malformed message from the head launcher ({})", e.what()));
  }
  JobContext ctx;
  ctx.plan = plan_from_json(msg.at("plan").dump());
  ctx.token = msg.value("token", "");
  ctx.torch_port = msg.value("torch_port", 0);
  ctx.agent_mode = true;
  ctx.env = current_env();
  // The program is resolved again here: this host's PATH decides.
  ctx.plan.program_path = resolve_program(ctx.plan.program.at(0));
  log::set_identity(fmt::format("agent node {}", ctx.plan.this_node));
  return run_job(std::move(ctx));
}

}  // namespace cohort::launch
