// horovodrun's elastic driver (tools/horovodrun_elastic.h), and `cohort horovodrun-agent`, the per-node
// agent it starts on every host: `cohort run` with Horovod's variables for every worker.
//
// Why a driver of per-node agents rather than a fan-out: a fan-out (`cohort run -H`) has a fixed host
// list, while cohort's elastic jobs (`--nnodes MIN:MAX`, src/launch/job_elastic.cc) already admit a node
// that starts at any time (at the next generation) and go on without a node whose agent leaves. So all the
// driver adds is Horovod's host discovery: it starts an agent where a host appears and stops the agent of a
// host that vanishes; the generations, the rendezvous and the store stay the elastic job's own.
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <map>
#include <set>
#include <thread>

#include "cohort/error.h"
#include "command.h"
#include "common/deadline.h"
#include "common/env.h"
#include "common/socket.h"
#include "common/strings.h"
#include "horovodrun_elastic.h"
#include "launch/plan.h"

namespace cohort::tools {
namespace {

const env::SecondsSetting kDiscoveryTimeout("COHORT_HOROVOD_DISCOVERY_TIMEOUT", 10,
                                            "horovodrun's elastic driver: how long one run of the host discovery "
                                            "script may take before it is killed and counted as failed");

// Horovod's driver looks for host changes once a second (DISCOVER_HOSTS_FREQUENCY_SECS).
constexpr auto kDiscoveryPeriod = std::chrono::seconds(1);

using Clock = std::chrono::steady_clock;

void say(const std::string& line) { fmt::print(stderr, "horovodrun: {}\n", line); }

std::string self_executable() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw Error(net::errno_string("readlink /proc/self/exe", errno));
  return std::string(buf, static_cast<size_t>(n));
}

// One run of the discovery script: its stdout, or why it failed (exit code, signal, deadline).
struct DiscoveryRun {
  bool ok = false;
  std::string out;
  std::string error;
};

DiscoveryRun run_discovery_script(const std::string& script, double timeout_s) {
  DiscoveryRun r;
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0) throw Error(net::errno_string("pipe", errno));
  if (pipe2(err, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    throw Error(net::errno_string("pipe", errno));
  }
  pid_t pid = fork();
  if (pid < 0) throw Error(net::errno_string("fork", errno));
  if (pid == 0) {
    setpgid(0, 0);  // its own group: a script that hangs is killed with whatever it started
    dup2(out[1], 1);
    dup2(err[1], 2);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    execl("/bin/sh", "sh", "-c", script.c_str(), nullptr);
    _exit(127);
  }
  setpgid(pid, pid);
  close(out[1]);
  close(err[1]);
  const Deadline deadline = Deadline::after(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  std::string errtext;
  bool out_open = true, err_open = true, timed_out = false;
  while (out_open || err_open) {
    pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
    int n = poll(fds, 2, deadline.poll_ms());
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) {
      timed_out = true;
      break;
    }
    char buf[4096];
    for (int i = 0; i < 2; ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t got = read(fds[i].fd, buf, sizeof buf);
      if (got <= 0) {
        (i == 0 ? out_open : err_open) = false;
        fds[i].fd = -1;
      } else {
        (i == 0 ? r.out : errtext).append(buf, static_cast<size_t>(got));
      }
    }
  }
  close(out[0]);
  close(err[0]);
  int status = 0;
  // Both pipes closed: the script ends now (or left a child holding nothing of ours); wait for it
  // until the same deadline.
  while (!timed_out) {
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (deadline.expired()) {
      timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (timed_out) {
    kill(-pid, SIGKILL);
    waitpid(pid, &status, 0);
    r.error = fmt::format("did not finish within {} (COHORT_HOROVOD_DISCOVERY_TIMEOUT); killed", env::format_seconds(timeout_s));
    return r;
  }
  std::string last_err;
  for (const auto& l : str::split(errtext, '\n'))
    if (!str::trim(l).empty()) last_err = std::string(str::trim(l));
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    r.ok = true;
    return r;
  }
  r.error = WIFEXITED(status) ? fmt::format("exited with code {}", WEXITSTATUS(status))
                              : fmt::format("was killed by signal {}", WTERMSIG(status));
  if (!last_err.empty()) r.error += ": " + last_err;
  return r;
}

std::atomic<int> g_signal{0};
void on_signal(int sig) { g_signal.store(sig); }

// The driver: the listed hosts, one agent per host, and the job's end.
class ElasticDriver {
 public:
  explicit ElasticDriver(const ElasticDriverOptions& o) : o_(o), self_(self_executable()) {}

  int run();

 private:
  struct Agent {
    std::string host;
    int slots = 0;
    pid_t pid = -1;
    int stdin_fd = -1;     // a remote agent's ssh: its end stops the agent (the wrapper's `read`)
    bool stopping = false;  // the driver stopped it: its host left the list
  };

  std::vector<std::pair<std::string, int>> discover(bool first);
  bool is_local(const std::string& host) const { return launch::is_this_machine(host, machine_); }
  int running_slots() const;
  void reconcile(const std::vector<std::pair<std::string, int>>& hosts);
  void start_agent(const std::string& host, int slots);
  void stop_agent(Agent& a, int sig);
  void wait_for_store(const Agent& first);
  // Reaps the agents that ended; returns false once none is left.
  bool reap();
  int stop_all(const std::string& why, int code);
  void remove_commit_files() const;

  const ElasticDriverOptions& o_;
  const std::string self_;
  launch::MachineFacts machine_ = launch::this_machine();
  std::string run_id_, token_, master_addr_;
  int master_port_ = 0;
  std::vector<Agent> agents_;            // running (or being stopped)
  std::set<std::string> blacklist_;      // hosts whose agent failed: never started again (Horovod's blacklist)
  bool started_ = false;                 // the first hosts' agents are started: later ones join a running job
  bool finished_ = false;                // an agent ended with 0: the training is done, start no more
  int failure_code_ = 0;                 // the first agent that ended with an error
  std::string failure_;
  Clock::time_point discovery_failing_since_{}, short_since_{};
  bool discovery_failing_ = false, short_ = false;
};

std::vector<std::pair<std::string, int>> ElasticDriver::discover(bool first) {
  if (o_.discovery_script.empty()) return o_.hosts;
  DiscoveryRun r = run_discovery_script(o_.discovery_script, kDiscoveryTimeout.get());
  std::string error = r.error;
  std::vector<std::pair<std::string, int>> hosts;
  if (r.ok) {
    try {
      hosts = parse_discovered_hosts(r.out, o_.slots_per_host);
    } catch (const ConfigError& e) {
      error = e.what();
    }
  }
  if (error.empty()) {
    if (discovery_failing_) say("the host discovery script works again");
    discovery_failing_ = false;
    return hosts;
  }
  // Horovod's rule: a script that fails on its first run is a mistake in the line (fail now); later,
  // a failure is taken as passing, and the last list stands, up to --elastic-timeout.
  const std::string line = fmt::format("host discovery script {}: {}", o_.discovery_script, error);
  if (first) throw ConfigError(line);
  if (!discovery_failing_) {
    discovery_failing_ = true;
    discovery_failing_since_ = Clock::now();
    say(line + fmt::format("; keeping the last list of hosts, for up to {} (--elastic-timeout)",
                           env::format_seconds(o_.elastic_timeout_s)));
  }
  if (Clock::now() - discovery_failing_since_ > std::chrono::duration<double>(o_.elastic_timeout_s))
    throw Error(line + fmt::format(", and has failed for longer than --elastic-timeout {}",
                                   env::format_seconds(o_.elastic_timeout_s)));
  std::vector<std::pair<std::string, int>> last;
  for (const auto& a : agents_)
    if (!a.stopping) last.emplace_back(a.host, a.slots);
  return last;
}

int ElasticDriver::running_slots() const {
  int n = 0;
  for (const auto& a : agents_)
    if (!a.stopping) n += a.slots;
  return n;
}

void ElasticDriver::start_agent(const std::string& host, int slots) {
  // Each agent is a node of one elastic job: the same bounds, store and run id everywhere. MIN is one node:
  // the driver itself holds the job to --min-np processes (the bound is on processes, cohort's on nodes).
  const int max_restarts = o_.reset_limit ? *o_.reset_limit : 1000000;
  std::vector<std::string> agent = {self_,
                                    "horovodrun-agent",
                                    "--nnodes",
                                    fmt::format("1:{}", o_.max_np),
                                    "--nproc-per-node",
                                    std::to_string(slots),
                                    "--master-addr",
                                    master_addr_,
                                    "--master-port",
                                    std::to_string(master_port_),
                                    "--run-id",
                                    run_id_,
                                    "--max-restarts",
                                    std::to_string(max_restarts),
                                    // The first generation waits for the agents started with it (they start at
                                    // once, here), not the 5 s of torchrun's default last call.
                                    "--rdzv-conf",
                                    "last_call_timeout=1",
                                    "--join-timeout",
                                    o_.start_timeout ? *o_.start_timeout : fmt::format("{}", o_.elastic_timeout_s)};
  agent.insert(agent.end(), o_.agent_flags.begin(), o_.agent_flags.end());
  agent.push_back("--");
  agent.insert(agent.end(), o_.command.begin(), o_.command.end());

  const bool local = is_local(host);
  std::vector<std::string> argv;
  std::string handoff;  // what a remote agent reads first on its stdin
  if (local) {
    argv = agent;
  } else {
    // On another host: `cohort horovodrun-agent --from-stdin` reads its arguments, the job token and the
    // folder to work in from its stdin (never on a command line, and no shell quoting through ssh), then
    // keeps reading: the end of stdin (the driver stopped the host, or is gone) stops the agent.
    // The driver's environment goes too, as horovodrun hands its own to the workers it starts over ssh.
    std::error_code ec;
    nlohmann::json env = nlohmann::json::object();
    for (char** e = environ; *e; ++e) {
      std::string entry(*e);
      auto eq = entry.find('=');
      if (eq != std::string::npos && launch::forwarded_to_other_hosts(entry.substr(0, eq)))
        env[entry.substr(0, eq)] = entry.substr(eq + 1);
    }
    handoff = nlohmann::json{{"args", std::vector<std::string>(agent.begin() + 2, agent.end())},  // after self and the command
                             {"token", token_},
                             {"cwd", std::filesystem::current_path(ec).string()},
                             {"env", env}}
                  .dump() +
              "\n";
    argv = o_.ssh;
    argv.insert(argv.end(), {host, self_, "horovodrun-agent", "--from-stdin"});
  }
  int in[2] = {-1, -1};
  if (!local && pipe2(in, O_CLOEXEC) != 0) throw Error(net::errno_string("pipe", errno));
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) throw Error(net::errno_string("fork", errno));
  if (pid == 0) {
    setpgid(0, 0);  // Ctrl-C reaches the driver alone, which stops the agents in order
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (local) {
      // Two names of this machine (localhost, 127.0.0.1) are two hosts of the list: each agent is a node
      // of its own (COHORT_HOST_ID, as cohort's tests stand hosts on one machine).
      setenv("COHORT_HOST_ID", host.c_str(), 1);
      setenv("COHORT_JOB_TOKEN", token_.c_str(), 1);
    } else {
      dup2(in[0], 0);
    }
    std::vector<char*> args;
    for (auto& s : argv) args.push_back(const_cast<char*>(s.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    dprintf(2, "horovodrun: cannot run %s: %s\n", args[0], strerror(errno));
    _exit(127);
  }
  setpgid(pid, pid);
  Agent a;
  a.host = host;
  a.slots = slots;
  a.pid = pid;
  if (!local) {
    close(in[0]);
    a.stdin_fd = in[1];
    if (write(a.stdin_fd, handoff.data(), handoff.size()) < 0) { /* a failed ssh shows as the agent's exit */ }
  }
  agents_.push_back(a);
}

void ElasticDriver::stop_agent(Agent& a, int sig) {
  if (a.stdin_fd >= 0) {
    close(a.stdin_fd);  // the remote agent's stdin ends: it stops as on SIGTERM
    a.stdin_fd = -1;
  }
  kill(a.pid, sig);
}

void ElasticDriver::reconcile(const std::vector<std::pair<std::string, int>>& hosts) {
  // Gone from the list: stop the host's agent; the others end their generation and go on without it.
  for (auto& a : agents_) {
    if (a.stopping) continue;
    bool listed = std::any_of(hosts.begin(), hosts.end(), [&](const auto& h) { return h.first == a.host; });
    if (listed) continue;
    say(fmt::format("host {} is no longer listed by the discovery script: stopping its agent; the other hosts go on "
                    "at the job's next generation",
                    a.host));
    a.stopping = true;
    stop_agent(a, SIGTERM);
  }
  if (finished_) return;
  // New in the list: an agent, with the slots that --max-np leaves (Horovod assigns at most max-np slots).
  for (const auto& listed_host : hosts) {
    // Named references, not a structured binding: clang 14 (the sanitizer build) cannot capture those.
    const std::string& host = listed_host.first;
    const int slots = listed_host.second;
    if (blacklist_.count(host)) continue;
    if (std::any_of(agents_.begin(), agents_.end(), [&](const Agent& a) { return a.host == host; })) continue;
    int room = o_.max_np - running_slots();
    if (room <= 0) break;
    int use = std::min(slots, room);
    say(fmt::format("host {} is listed with {} slot{}: starting its agent with {} process{}{}", host, slots,
                    slots == 1 ? "" : "s", use, use == 1 ? "" : "es",
                    started_ ? "; it joins at the job's next generation" : ""));
    start_agent(host, use);
  }
  // Fewer slots than --min-np: Horovod waits for more hosts up to --elastic-timeout, then stops the job.
  // (Not while the first hosts start: the driver waited for --min-np slots before it started any.)
  bool short_now = started_ && running_slots() < o_.min_np;
  if (short_now && !short_) {
    short_since_ = Clock::now();
    say(fmt::format("{} process{} on the listed hosts, fewer than --min-np {}: waiting up to {} (--elastic-timeout) "
                    "for the discovery script to list more",
                    running_slots(), running_slots() == 1 ? "" : "es", o_.min_np, env::format_seconds(o_.elastic_timeout_s)));
  }
  short_ = short_now;
}

void ElasticDriver::wait_for_store(const Agent& first) {
  // The first host's agent hosts the job's store; the others must find it listening, else they would
  // each try to host one (the agents of this machine all count as the master address's host).
  const double limit = o_.start_timeout ? std::stod(*o_.start_timeout) : o_.elastic_timeout_s;
  const Deadline deadline = Deadline::after(std::chrono::milliseconds(static_cast<int64_t>(limit * 1000)));
  const std::string host = is_local(first.host) ? "127.0.0.1" : master_addr_;
  while (true) {
    try {
      net::connect_tcp(net::resolve(host, static_cast<uint16_t>(master_port_)),
                       Deadline::after(std::chrono::milliseconds(500)));
      return;
    } catch (const Error&) {
    }
    int status = 0;
    if (waitpid(first.pid, &status, WNOHANG) == first.pid)
      throw Error(fmt::format("the agent of host {} (it hosts the job's store) ended before its store listened at "
                              "{}:{} (exit status {})",
                              first.host, master_addr_, master_port_, status));
    if (deadline.expired())
      throw Error(fmt::format("the job's store at {}:{} (host {}'s agent) did not listen within {} "
                              "(--start-timeout, else --elastic-timeout)",
                              master_addr_, master_port_, first.host, env::format_seconds(limit)));
    if (g_signal.load()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

bool ElasticDriver::reap() {
  for (auto it = agents_.begin(); it != agents_.end();) {
    int status = 0;
    if (waitpid(it->pid, &status, WNOHANG) != it->pid) {
      ++it;
      continue;
    }
    if (it->stdin_fd >= 0) close(it->stdin_fd);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (it->stopping) {
      say(fmt::format("host {}'s agent stopped", it->host));
    } else if (code == 0) {
      finished_ = true;
    } else {
      // Horovod blacklists a host whose workers failed; here the agent ended by itself with an error (its
      // job failed for good, or the job dropped it): its host is not started again.
      blacklist_.insert(it->host);
      say(fmt::format("host {}'s agent ended with exit code {}: host {} is blacklisted (not started again)", it->host,
                      code, it->host));
      if (!failure_code_) failure_code_ = code;
    }
    it = agents_.erase(it);
  }
  return !agents_.empty();
}

int ElasticDriver::stop_all(const std::string& why, int code) {
  if (!why.empty()) say(why);
  for (auto& a : agents_) {
    a.stopping = true;
    stop_agent(a, SIGTERM);
  }
  // The agents stop their workers within their --kill-grace (5 s); then they are killed.
  const Deadline deadline = Deadline::after(std::chrono::seconds(15));
  while (reap()) {
    if (deadline.expired()) {
      for (auto& a : agents_) kill(-a.pid, SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return code;
}

void ElasticDriver::remove_commit_files() const {
  // hvd.elastic writes each rank's commit to $TMPDIR/cohort-hvd-elastic-<uid>/<job id>/<host>.local<N>.pt
  // (integrations/python/wheel/cohort/horovod/torch/elastic) and removes it when the rank's training
  // returns; the ranks of a host the driver stopped never return, so their files of this machine go here,
  // with the job's folder, once the training is done.
  const char* tmp = getenv("TMPDIR");
  std::filesystem::path folder = std::filesystem::path(tmp && *tmp ? tmp : "/tmp") /
                                 fmt::format("cohort-hvd-elastic-{}", getuid()) / run_id_;
  std::error_code ec;
  std::filesystem::remove_all(folder, ec);
}

int ElasticDriver::run() {
  run_id_ = "hvd-elastic-" + launch::random_token(6);
  token_ = launch::random_token(32);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  // Wait for --min-np slots (Horovod: "Timed out waiting for minimum number of slots to become available").
  auto hosts = discover(true);
  const Deadline enough = Deadline::after(std::chrono::milliseconds(static_cast<int64_t>(o_.elastic_timeout_s * 1000)));
  auto available = [&] {
    int n = 0;
    for (const auto& [h, s] : hosts) n += s;
    return std::min(n, o_.max_np);
  };
  while (available() < o_.min_np) {
    if (enough.expired())
      throw Error(fmt::format("the discovery script listed {} slot{} within --elastic-timeout {}, fewer than "
                              "--min-np {}",
                              available(), available() == 1 ? "" : "s", env::format_seconds(o_.elastic_timeout_s),
                              o_.min_np));
    if (g_signal.load()) return 128 + g_signal.load();
    std::this_thread::sleep_for(kDiscoveryPeriod);
    hosts = discover(false);
  }

  // The job's store: on the first listed host, at a port free here (for this machine) or cohort's 29500,
  // under the name the script gives that host (the other hosts reach it so), except a loopback name
  // (localhost, 127.0.0.1, ::1), which only this machine's agents can reach: 127.0.0.1.
  const std::string& first = hosts.front().first;
  const bool loopback = first == "localhost" || first == "::1" || first.rfind("127.", 0) == 0;
  master_addr_ = loopback ? "127.0.0.1" : first;
  if (is_local(first)) {
    auto fd = net::listen_tcp("", 0, 1, false);
    master_port_ = net::local_address(fd.get()).port();
  } else {
    master_port_ = 29500;
  }
  say(fmt::format("elastic job {}: {} to {} processes; the job's store is host {}'s agent's, at {}:{}", run_id_,
                  o_.min_np, o_.max_np, first, master_addr_, master_port_));
  auto next_discovery = Clock::now() + kDiscoveryPeriod;
  try {
    reconcile({hosts.front()});
    wait_for_store(agents_.front());
    reconcile(hosts);
    started_ = true;
    while (reap()) {
      if (int sig = g_signal.load())
        return stop_all(fmt::format("got signal {}: stopping every host's agent", sig), 128 + sig);
      if (Clock::now() >= next_discovery) {
        next_discovery = Clock::now() + kDiscoveryPeriod;
        reconcile(discover(false));
        if (short_ && Clock::now() - short_since_ > std::chrono::duration<double>(o_.elastic_timeout_s))
          return stop_all(fmt::format("only {} process{} on the listed hosts for longer than --elastic-timeout {}, "
                                      "fewer than --min-np {}: stopping the job",
                                      running_slots(), running_slots() == 1 ? "" : "es",
                                      env::format_seconds(o_.elastic_timeout_s), o_.min_np),
                          1);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const Error& e) {
    return stop_all(e.what(), 1);
  }
  if (finished_) {
    remove_commit_files();
    return 0;
  }
  say(fmt::format("every host's agent has ended, and none finished the training (first failure: exit code {})",
                  failure_code_));
  return failure_code_ ? failure_code_ : 1;
}

// `cohort horovodrun-agent`: cohort run's flags, with Horovod's variables for every worker. With
// --from-stdin (an agent the driver started on another host over ssh), the first line of stdin is
// {"args": [...], "token": ..., "cwd": ..., "env": {...}} (the driver's environment, which this agent and so
// its workers take); the rest of stdin is the driver's hold on this agent.
int run_horovodrun_agent(std::vector<std::string> args) {
  if (args.size() == 2 && args[1] == "--from-stdin") {
    std::string first;
    char c;
    while (read(0, &c, 1) == 1 && c != '\n') first += c;
    nlohmann::json handoff;
    try {
      handoff = nlohmann::json::parse(first);
    } catch (const std::exception& e) {
      throw ConfigError(fmt::format("horovodrun-agent --from-stdin: expected the driver's first line on stdin, got "
                                    "'{}' ({})",
                                    first.substr(0, 80), e.what()));
    }
    args.resize(1);
    for (const auto& a : handoff.at("args")) args.push_back(a.get<std::string>());
    setenv("COHORT_JOB_TOKEN", handoff.at("token").get<std::string>().c_str(), 1);
    for (const auto& [name, value] : handoff.at("env").items()) setenv(name.c_str(), value.get<std::string>().c_str(), 1);
    // The driver's folder when this host has it (as a fan-out's agents do), else where ssh left us.
    if (chdir(handoff.at("cwd").get<std::string>().c_str()) != 0) { /* stay */ }
    std::thread([] {
      // Signals are the launcher's to handle, in its own threads: this one only reads.
      sigset_t all;
      sigfillset(&all);
      pthread_sigmask(SIG_BLOCK, &all, nullptr);
      char buf[256];
      while (true) {
        ssize_t n = read(0, buf, sizeof buf);
        if (n > 0 || (n < 0 && errno == EINTR)) continue;
        break;
      }
      kill(getpid(), SIGTERM);  // the driver let go of this host: stop as a scheduler's SIGTERM stops an agent
    }).detach();
  }
  return run_launcher_line(std::move(args), LaunchLine::kHorovodrun);
}

Registration reg_horovodrun_agent("horovodrun-agent",
                                  "one host's agent of horovodrun's elastic driver: cohort run's flags, with "
                                  "Horovod's variables for every worker",
                                  run_horovodrun_agent);

}  // namespace

std::vector<std::pair<std::string, int>> parse_discovered_hosts(const std::string& text, int slots_per_host) {
  std::vector<std::pair<std::string, int>> hosts;
  int number = 0;
  for (const auto& raw : str::split(text, '\n', true)) {
    ++number;
    std::string line(str::trim(raw));
    if (line.empty()) continue;
    std::string host = line;
    int slots = slots_per_host;
    if (auto colon = line.rfind(':'); colon != std::string::npos) {
      host = line.substr(0, colon);
      std::string n = line.substr(colon + 1);
      if (n.empty() || n.size() > 6 || n.find_first_not_of("0123456789") != std::string::npos || std::stoi(n) < 1)
        throw ConfigError(fmt::format("its line {} '{}': expected host:slots with slots a whole number of at least 1",
                                      number, line));
      slots = std::stoi(n);
    }
    if (host.empty() || host.find_first_of(" \t") != std::string::npos)
      throw ConfigError(fmt::format("its line {} '{}': expected host:slots", number, line));
    if (std::none_of(hosts.begin(), hosts.end(), [&](const auto& h) { return h.first == host; }))
      hosts.emplace_back(host, slots);
  }
  return hosts;
}

int run_elastic_driver(const ElasticDriverOptions& options) { return ElasticDriver(options).run(); }

}  // namespace cohort::tools
