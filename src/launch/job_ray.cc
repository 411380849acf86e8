// Ray mode (`cohort run --ray`, docs/ray.md): this node's part in bringing a Ray cluster up on the job's
// nodes, starting the driver on the head once every node has joined, and taking the cluster down with the
// job.
//
//   node 0, the head: picks its GCS port (--ray-port or HEAD_PORT, else a free one) and its other ports,
//     starts `ray start --head ... --block` as its process 0 and probes the GCS port until it answers; then
//     publishes the GCS address in the job's store ("ray/gcs") and runs `ray status` until the cluster's
//     usage lists every node's Rank:<n> resource (its own only, in a job that does not count its nodes:
//     RayPlan::open_membership); then it starts the driver (PROGRAM) as its process 1.
//   node k: waits for "ray/gcs" in the store (a watcher thread: no sleeps), then starts
//     `ray start --address GCS ... --block` as its process 0.
// Each of these waits has the --join-timeout deadline, and one that runs out ends the job naming what is
// missing. `ray start --block` stays in the foreground as long as its node's Ray runs, so the Ray
// processes are supervised as any process of the job: one that ends stops the job naming its node, and the
// job's end (the driver's: job_workers.cc, on_worker_exit) stops them all: SIGTERM to their process group
// (on which Ray's --block stops its node's processes), SIGKILL after --kill-grace, then whatever they left
// outside it (the launcher is their subreaper). `ray stop` is not used: it stops every Ray process of the
// host, another job's cluster's too.
//
// What is retried on a timer, and why: a GCS that starts up tells so only by answering, and Ray says who
// has joined only through `ray status`. The GCS is probed every 0.1 s; `ray status` runs again 0.1 s after
// the last one ended, doubling to 1 s, and one that runs longer than 10 s is stopped.
//
// Why an object of its own (RayCluster, job_internal.h): its phases, timer, probe and addresses are Ray's
// alone. What it needs of the supervisor is narrow (the attempt's end, the loop's attention for its two
// descriptors, starting process 0 or 1), so the supervisor holds one and hands it its events, its
// descriptors and its child's exit; everything else of Job stays out of reach.
#include <fcntl.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/log.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/job_internal.h"

namespace cohort::launch::job_detail {

namespace {

constexpr double kRayStatusLimitS = 10;  // a `ray status` that runs longer is stopped (and run again)
constexpr double kRayNoteEveryS = 3;     // a line naming who is missing, as the store's join waits print
constexpr size_t kRayStatusMaxBytes = 1 << 20;
constexpr double kRayHeadMarginS = 5;   // the other nodes wait this much longer for the head than it for its GCS

// Whether this host could bind `port` on every address now: no other socket holds it. A listening socket
// with SO_REUSEPORT (gRPC's servers, Ray's among them, set it) still makes this bind fail, which is the
// point: two Ray heads on one port would otherwise both listen and share the port's connections.
bool port_free_here(int port) {
  try {
    net::listen_tcp("", static_cast<uint16_t>(port), 1, false);
    return true;
  } catch (const Error&) {
    return false;
  }
}

std::string seconds_text(double s) { return fmt::format("{:g} s", s); }

}  // namespace

void ray_head_watcher_main(std::shared_ptr<Store> store, std::shared_ptr<EventQueue> events,
                           std::shared_ptr<std::atomic<bool>> stop, int node_rank, double timeout_s, int attempt) {
  try {
    // A little longer than the head's own deadline: the head's account of why its GCS did not answer
    // comes first.
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s + kRayHeadMarginS));
    for (;;) {
      if (*stop) return;
      const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      if (left <= Millis(0)) {
        events->push({WatchEvent::kRayHeadTimeout,
                      fmt::format("node {}: the Ray head (node 0) did not answer within {} (--join-timeout): its "
                                  "GCS address never came in the job's store",
                                  node_rank, seconds_text(timeout_s)),
                      attempt});
        return;
      }
      try {
        // Slices, so that the stop flag is seen within half a second.
        store->wait({"ray/gcs"}, std::min(left, Millis(500)));
        events->push({WatchEvent::kRayHead, store->get("ray/gcs"), attempt});
        return;
      } catch (const TimeoutError&) {
      }
    }
  } catch (const Error& e) {
    // The store is lost: the job's watcher thread reports that (kLost) and ends the job.
    log::info("Ray: stopped waiting for the head's address: {}", e.what());
  }
}

void RayCluster::arm_timer(double seconds) {
  itimerspec its{};
  const auto ns = static_cast<long long>(std::max(seconds, 1e-6) * 1e9);
  its.it_value.tv_sec = ns / 1000000000;
  its.it_value.tv_nsec = ns % 1000000000;
  timerfd_settime(timer_fd_.get(), 0, &its, nullptr);
}

void RayCluster::open() {
  // Its own timer: its probes must not disturb the meaning of the supervisor's kill-grace timer.
  timer_fd_.reset(timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
  if (!timer_fd_) throw Error(net::errno_string("timerfd_create", errno));
  supervisor_.watch(timer_fd_.get());
}

void RayCluster::fail(const std::string& kind, const std::string& why) {
  supervisor_.publish_end(EndInfo{kind, 1, why});
}

void RayCluster::lost_store(const Error& e) {
  supervisor_.adopt_end(EndInfo{"lost", 1, fmt::format("lost the job's store at {}: {}", store_addr_, e.what())});
}

std::vector<std::string> RayCluster::node_argv() const {
  return ray_node_argv(plan_, plan_.this_node, node_ip_, gcs_, ports_);
}

bool RayCluster::on_readable(int fd) {
  if (timer_fd_ && fd == timer_fd_.get()) {
    uint64_t ticks;
    [[maybe_unused]] auto r = ::read(fd, &ticks, sizeof ticks);
    on_timer();
    return true;
  }
  if (status_out_ && fd == status_out_.get()) {
    drain_status();
    return true;
  }
  return false;
}

bool RayCluster::on_exit(pid_t pid, int status) {
  if (pid != status_pid_) return false;
  on_status_exit(status);
  return true;
}

std::string RayCluster::head_ip() {
  // HEAD_ADDR when the platform named the head; else the name the job knows node 0 by: its -H/--hostfile
  // entry, or in a per-node job the store's address (node 0 hosts the store).
  std::string name, what;
  if (!plan_.ray.head_address.empty()) {
    name = plan_.ray.head_address;
    what = "HEAD_ADDR";
  } else if (plan_.mode == Mode::kFanOut) {
    name = plan_.node(0)->host;
    what = "node 0's -H/--hostfile entry";
  } else if (plan_.mode == Mode::kLocal) {
    return "127.0.0.1";  // a one-node cluster: nobody else needs to reach it
  } else {
    name = plan_.master_addr;
    what = "the store's address, " + plan_.source_of("store address");
  }
  const std::string ip = net::resolve(name, 0).host();
  const bool loopback = ip.rfind("127.", 0) == 0 || ip == "::1";
  if (loopback && (plan_.nnodes > 1 || plan_.ray.open_membership))
    throw ConfigError(fmt::format("the Ray head's address {} ({}) resolves to {} here, a loopback address the other "
                                  "nodes cannot reach; name node 0 by an address they reach",
                                  name, what, ip));
  if (!loopback && !is_this_machine(ip, this_machine(false)))
    throw ConfigError(fmt::format("the Ray head's address {} ({}) resolves to {}, which is not an address of this "
                                  "host, node 0 ({})",
                                  name, what, ip, net::hostname()));
  return ip;
}

void RayCluster::start(int attempt, std::shared_ptr<Store> attempt_store, const StoreClientOptions& client,
                       const std::string& store_addr, std::shared_ptr<EventQueue> events,
                       std::shared_ptr<std::atomic<bool>> stop) {
  attempt_store_ = std::move(attempt_store);
  store_addr_ = store_addr;
  attempt_ = attempt;
  since_ = Clock::now();
  deadline_ =
      since_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(plan_.join_timeout_s));
  next_note_ = since_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kRayNoteEveryS));
  retry_s_ = 0.1;
  last_status_.clear();
  const NodePlan& node = *plan_.node(plan_.this_node);
  if (plan_.this_node != 0) {
    // A connection of the thread's own (store clients are not shared between threads).
    phase_ = Phase::kWaitingForHead;
    try {
      auto store = make_prefix_store(connect_tcp_store(client),
                                     fmt::format("cohort/launch/{}/attempt/{}", plan_.job_id, attempt));
      std::thread(ray_head_watcher_main, store, events, stop, plan_.this_node, plan_.join_timeout_s, attempt).detach();
    } catch (const Error& e) {
      lost_store(e);
    }
    return;
  }
  int port = plan_.ray.head_port;
  try {
    node_ip_ = head_ip();
    if (port > 0 && !port_free_here(port))
      throw ConfigError(fmt::format("the Ray head's GCS port {} ({}) is in use on {}: another Ray head (or another "
                                    "program) listens there; choose another port, or leave --ray-port and HEAD_PORT "
                                    "unset to let cohort pick a free one",
                                    port, plan_.ray.head_port_source, node.host));
    if (port == 0) port = pick_free_port("");
    ports_ =
        pick_ray_ports(plan_.ray.first_port, plan_.ray.last_port, plan_.job_id, port, node.host, &port_free_here);
  } catch (const Error& e) {
    fail("failure", fmt::format("node 0 ({}): {}", node.host, e.what()));
    return;
  }
  gcs_ = ray_address(node_ip_, port);
  try {
    if (distributed_) attempt_store_->set("ray/node/0", node_ip_);
  } catch (const Error& e) {
    lost_store(e);
    return;
  }
  start_process_(0, attempt);
  phase_ = Phase::kHeadStarting;
  arm_timer(0.05);
}

void RayCluster::on_head(const std::string& gcs) {
  if (supervisor_.ended() || phase_ != Phase::kWaitingForHead) return;
  const NodePlan& node = *plan_.node(plan_.this_node);
  try {
    gcs_ = gcs;
    // The interface this node reaches the head by: the address the head sees it from (Ray's own default
    // on a head looks for a route to 8.8.8.8, which a cluster's private network may not have).
    node_ip_ = net::route_address_to(net::split_host_port(gcs).first);
    ports_ = pick_ray_ports(plan_.ray.first_port, plan_.ray.last_port, plan_.job_id, 0, node.host, &port_free_here);
    attempt_store_->set(fmt::format("ray/node/{}", plan_.this_node), node_ip_);
  } catch (const Error& e) {
    fail("failure", fmt::format("node {} ({}): cannot join the Ray head at {}: {}", plan_.this_node, node.host, gcs,
                                e.what()));
    return;
  }
  start_process_(0, attempt_);
  phase_ = Phase::kNodeRunning;
}

void RayCluster::on_timer() {
  if (supervisor_.ended() || supervisor_.stopping()) return;
  if (phase_ == Phase::kHeadStarting) {
    try {
      auto [host, port] = net::split_host_port(gcs_);
      net::connect_tcp(net::resolve(host, port), Deadline::after(Millis(300)));
    } catch (const Error&) {
      if (Clock::now() < deadline_) {
        arm_timer(0.1);
        return;
      }
      fail("join", fmt::format("the Ray head (node 0, {}) did not answer at {} within {} (--join-timeout): its "
                               "`ray start --head` runs, but nothing listens on the GCS port",
                               plan_.node(0)->host, gcs_, seconds_text(plan_.join_timeout_s)));
      return;
    }
    // The GCS answers: the other nodes may join it now.
    try {
      if (distributed_) attempt_store_->set("ray/gcs", gcs_);
    } catch (const Error& e) {
      lost_store(e);
      return;
    }
    phase_ = Phase::kWaitingForNodes;
    start_status();
    return;
  }
  if (phase_ != Phase::kWaitingForNodes) return;
  if (status_pid_ > 0) {
    // The probe overran its time: its end (reap) decides what comes next.
    last_status_ = fmt::format("`ray status` did not answer within {}", seconds_text(kRayStatusLimitS));
    kill(-status_pid_, SIGKILL);
    return;
  }
  start_status();
}

void RayCluster::start_status() {
  std::vector<std::string> argv = ray_status_argv(plan_.ray.command_path, gcs_);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) throw Error(net::errno_string("pipe2", errno));
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) throw Error(net::errno_string("fork", errno));
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec. A process group of its own, as the workers: a
    // Ctrl-C on the terminal reaches the launcher only.
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(out[1], 1);
    dup2(out[1], 2);
    execv(args[0], args.data());
    dprintf(2, "cannot run %s: %s\n", args[0], strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  close(out[1]);
  status_pid_ = pid;
  status_out_.reset(out[0]);
  status_text_.clear();
  net::set_nonblocking(status_out_.get(), true);
  supervisor_.watch(status_out_.get());
  arm_timer(kRayStatusLimitS);
}

void RayCluster::drain_status() {
  char buf[16384];
  for (;;) {
    ssize_t n = ::read(status_out_.get(), buf, sizeof buf);
    if (n > 0) {
      if (status_text_.size() < kRayStatusMaxBytes) status_text_.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    supervisor_.unwatch(status_out_.get());
    status_out_.reset();
    return;
  }
}

void RayCluster::on_status_exit(int status) {
  // What it wrote before it ended is in the pipe: read it all (a process it left behind holding the pipe
  // could keep it from its end, so the read stays non-blocking).
  if (status_out_) drain_status();
  status_pid_ = -1;
  if (supervisor_.ended() || supervisor_.stopping() || phase_ != Phase::kWaitingForNodes) return;
  const RayStatus seen = parse_ray_status(status_text_);
  std::vector<int> missing;
  for (int r = 0; r < plan_.nnodes; ++r)
    if (!seen.ranks.count(r)) missing.push_back(r);
  const bool answered = WIFEXITED(status) && WEXITSTATUS(status) == 0 && seen.understood;
  if (answered && missing.empty()) {
    start_driver();
    return;
  }
  if (!answered && !(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)) {
    // Its last line says why (Ray ends a failure with the exception's line).
    std::string last;
    for (const auto& line : str::split(status_text_, '\n'))
      if (!str::trim(line).empty()) last = std::string(str::trim(line));
    last_status_ = fmt::format("`ray status --address {}` {}{}", gcs_, describe_status(status),
                                   last.empty() ? "" : ": " + last);
  }
  const auto now = Clock::now();
  const double waited = std::chrono::duration<double>(now - since_).count();
  if (now >= deadline_) {
    std::vector<int> present(seen.ranks.begin(), seen.ranks.end());
    if (answered)
      fail("join", fmt::format("Ray node{} {} did not join the Ray cluster at {} within {} (--join-timeout); "
                               "`ray status` lists {}",
                               missing.size() == 1 ? "" : "s", node_names(missing), gcs_,
                               seconds_text(plan_.join_timeout_s),
                               present.empty() ? "no node's Rank:<n>"
                                               : "the Rank:<n> of node" + std::string(present.size() == 1 ? " " : "s ") +
                                                     str::format_ranges(present) + " only"));
    else
      fail("join", fmt::format("the Ray cluster at {} did not tell who has joined within {} (--join-timeout): {}",
                               gcs_, seconds_text(plan_.join_timeout_s), last_status_));
    return;
  }
  if (now >= next_note_) {
    say(fmt::format("waiting for Ray node{} {} to join the Ray cluster at {} ({:.0f} s of {}){}",
                    missing.size() == 1 ? "" : "s", node_names(missing), gcs_, waited,
                    seconds_text(plan_.join_timeout_s), answered ? "" : "; " + last_status_));
    next_note_ = now + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(kRayNoteEveryS));
  }
  arm_timer(retry_s_);
  retry_s_ = std::min(1.0, retry_s_ * 2);
}

void RayCluster::stop() {
  if (status_pid_ > 0) {
    kill(-status_pid_, SIGKILL);
    int status = 0;
    while (waitpid(status_pid_, &status, 0) < 0 && errno == EINTR) {
    }
    status_pid_ = -1;
  }
  if (status_out_) {
    supervisor_.unwatch(status_out_.get());
    status_out_.reset();
  }
  itimerspec zero{};
  if (timer_fd_) timerfd_settime(timer_fd_.get(), 0, &zero, nullptr);
  phase_ = Phase::kOff;
}

std::string RayCluster::node_names(const std::vector<int>& ranks) {
  // Each node's host name (its agent's, from the store) and the address its Ray started on ("ray/node/<r>",
  // absent when it never started its Ray).
  std::vector<std::string> names;
  for (int r : ranks) {
    std::string host = plan_.node(r) ? plan_.node(r)->host : "?";
    std::string ip;
    if (distributed_ && attempt_store_) {
      try {
        if (attempt_store_->check({node_key(r)})) host = attempt_store_->get(node_key(r));
        const std::string key = fmt::format("ray/node/{}", r);
        if (attempt_store_->check({key})) ip = attempt_store_->get(key);
      } catch (const Error&) {
      }
    }
    names.push_back(ip.empty() ? fmt::format("{} ({}: its Ray was not started)", r, host)
                               : fmt::format("{} ({}, {})", r, host, ip));
  }
  return str::join(names, ", ");
}

void RayCluster::start_driver() {
  phase_ = Phase::kDriverRunning;
  if (plan_.ray.open_membership)
    say(fmt::format("the Ray head at {} is up ({:.1f} s); starting the driver on {} (the job does not say how many "
                    "nodes it has: the others join the head as they start, and Ray holds a task for Rank:<n> until "
                    "node n has joined)",
                    gcs_, std::chrono::duration<double>(Clock::now() - since_).count(), plan_.node(0)->host));
  else
    say(fmt::format("the Ray cluster at {} has its {} node{} ({:.1f} s); starting the driver on {}", gcs_,
                    plan_.nnodes, plan_.nnodes == 1 ? "" : "s",
                    std::chrono::duration<double>(Clock::now() - since_).count(), plan_.node(0)->host));
  start_process_(1, attempt_);
}

}  // namespace cohort::launch::job_detail
