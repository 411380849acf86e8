// This node's workers: started with the plan's environment, CPU binding and GPU, stopped (report
// window, SIGTERM, SIGKILL after the grace), and their exits turned into the job's end.
#include <sched.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <set>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/log.h"
#include "common/proc_stat.h"
#include "common/pipe.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/job_internal.h"

extern char** environ;

namespace cohort::launch::job_detail {

namespace {

// torchrun's layout: DIR/<run id>/attempt_<n>/<rank>/{stdout,stderr}.log (torchrun names the rank
// folder by local rank; the global rank keeps several nodes' files apart on a shared filesystem).
std::string rank_log_dir(const Plan& plan, int attempt, int process) {
  return fmt::format("{}/attempt_{}/{}", plan.logs.dir, attempt, plan.process_tag(process));
}

// The streams (bit 1 stdout, bit 2 stderr) process `process` writes to its torchrun-style log files.
int log_file_streams(const Plan& plan, int process) {
  if (plan.logs.dir.empty()) return 0;
  const int local = plan.local_rank_of(process);
  return std_streams("--redirects", plan.logs.redirects, local) | std_streams("--tee", plan.logs.tee, local);
}

}  // namespace

void Job::spawn_worker(Worker& w, const NodePlan& node, int attempt, const std::vector<int>& cpus,
                       const GpuAssignment& gpu) {
  WorkerSlot slot{w.rank, w.local_rank, node.nproc, node.node_rank, gpu, ray_ ? ray_->gcs() : std::string()};
  auto vars = worker_env(plan_, slot, store_.addr, store_.torch_port, ctx_.token, attempt, ctx_.env);
  const ProcessRole role = plan_.role_of(w.rank);
  if (!role.server) prepare_trace(w, node, vars);  // a server runs no collectives to record
  int ring_fd = w.ring.valid() ? w.ring.fd() : -1;
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
  auto [path, args] = process_command(w);
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);

  OutputTargets t;
  t.tag = plan_.tag_output ? fmt::format("[{}:{}] ", node.host, plan_.process_tag(w.rank)) : "";
  t.timestamp = plan_.timestamp_output;
  t.merge_stderr = plan_.merge_stderr;
  t.to_console = plan_.all_ranks_to_console || std::find(plan_.ranks_to_console.begin(), plan_.ranks_to_console.end(),
                                                          w.rank) != plan_.ranks_to_console.end();
  const int local_rank = plan_.local_rank_of(w.rank);
  if (!plan_.logs.all_local_ranks &&
      std::find(plan_.logs.console_local_ranks.begin(), plan_.logs.console_local_ranks.end(), local_rank) ==
          plan_.logs.console_local_ranks.end())
    t.to_console = false;
  if (!plan_.output_dir.empty()) {
    std::string dir = fmt::format("{}/rank.{}", plan_.output_dir, plan_.process_tag(w.rank));
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
  if (const int streams = log_file_streams(plan_, w.rank); streams != 0) {
    // torchrun's --redirects (the files only) and --tee (the files and the console). Merged, the one
    // stream is stdout's.
    std::string dir = rank_log_dir(plan_, attempt, w.rank);
    auto open_file = [&](const char* name) {
      std::string p = dir + "/" + name;
      UniqueFd fd(::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_APPEND, 0644));
      if (!fd) throw ConfigError(net::errno_string("--log-dir: open " + p, errno));
      return fd;
    };
    const int redirected = std_streams("--redirects", plan_.logs.redirects, local_rank);
    if (streams & 1) t.file_out = open_file("stdout.log");
    if ((streams & 2) && !plan_.merge_stderr) t.file_err = open_file("stderr.log");
    t.redirect_out = (redirected & 1) != 0;
    t.redirect_err = (redirected & 2) != 0;
  }
  // stdout goes straight to the console when nothing needs to see it; stderr is always piped for
  // the failure summary's last lines. --stats needs to see it: its table is redrawn in place only
  // while nothing else was written to the terminal (common/console.h).
  // With --merge-stderr-to-stdout both descriptors share one pipe, so the order of lines is kept.
  bool merge = plan_.merge_stderr;
  bool pipe_stdout = merge || plan_.tag_output || plan_.timestamp_output || t.file_out || !t.to_console || plan_.stats;
  // Owned from their creation: a pipe or fork that fails (the open-file limit, RLIMIT_NPROC) closes
  // the ones made before it; the launcher may go on (a restart, an elastic agent) and must not leak.
  Pipe out, err;
  if (pipe_stdout) out = make_pipe("its stdout pipe");
  if (!merge) err = make_pipe("its stderr pipe");
  Pipe exec_err = make_pipe("its exec-status pipe");
  const int out_w = out.write_end.get(), err_w = err.write_end.get(), exec_err_w = exec_err.write_end.get();
  cpu_set_t cpuset;
  CPU_ZERO(&cpuset);
  for (int c : cpus) CPU_SET(c, &cpuset);
  bool stdin_null = ctx_.agent_mode;
  pid_t parent = getpid();

  pid_t pid = fork();
  if (pid < 0) throw Error(net::errno_string("fork", errno));
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec (and no destructors: it execs or _exits).
    // A session of its own, which is also a process group of its own (the group the launcher signals).
    // Why a session: where the scheduler groups tasks by session (autogroup, sched_autogroup_enabled=1,
    // as Debian's kernels ship) all the workers of one session share one session's weight, split over
    // the CPUs they run on: next to any other busy session each of 2 bound ranks got about half the
    // CPU an independent process gets, and a data-parallel job goes at its slowest rank's pace
    // (docs/performance.md, "Data-parallel training", issue 51). The parent does not
    // setpgid() it as well: that would make the child a group leader, which setsid() refuses; no
    // signal can miss the group meanwhile, since the launcher knows the pid only once exec succeeded.
    setsid();
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);  // the launcher died before prctl took effect
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    signal(SIGPIPE, SIG_DFL);
    if (!cpus.empty()) sched_setaffinity(0, sizeof cpuset, &cpuset);
    if (ring_fd >= 0) fcntl(ring_fd, F_SETFD, 0);  // the one descriptor the worker inherits on purpose
    if (stdin_null) {
      int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) dup2(devnull, 0);
    }
    if (out_w >= 0) dup2(out_w, 1);
    dup2(merge ? out_w : err_w, 2);
    execve(path.c_str(), argv.data(), envp.data());
    int e = errno;
    [[maybe_unused]] auto r = ::write(exec_err_w, &e, sizeof e);
    _exit(127);
  }
  w.ring.close_fd();  // the worker has it; the launcher keeps its mapping
  out.write_end.reset();
  err.write_end.reset();
  exec_err.write_end.reset();
  int child_errno = 0;
  ssize_t got;
  do got = ::read(exec_err.read_end.get(), &child_errno, sizeof child_errno);
  while (got < 0 && errno == EINTR);
  exec_err.read_end.reset();
  w.pid = pid;
  w.running = true;
  w.started = Clock::now();
  w.out = std::move(out.read_end);
  w.err = std::move(err.read_end);
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

std::pair<std::string, std::vector<std::string>> Job::process_command(const Worker& w) {
  if (plan_.role_of(w.rank).server && !plan_.ps_server_program) {
    // The built-in server is this very tool (the same build as the launcher).
    std::error_code ec;
    std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    if (ec) throw Error(fmt::format("cannot find the cohort executable for the parameter server: {}", ec.message()));
    return {self, {"cohort", "ps", "serve"}};
  }
  if (plan_.ray.enabled && !plan_.is_ray_driver(w.rank))
    return {plan_.ray.command_path, ray_->node_argv()};
  return {plan_.program_path, worker_argv(plan_, w.rank)};
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
      std::string dir = fmt::format("{}/rank.{}", plan_.output_dir, plan_.process_tag(node->rank_of(l)));
      std::error_code ec;
      std::filesystem::create_directories(dir, ec);
      if (ec) throw ConfigError(fmt::format("--output-filename: cannot create {}: {}", dir, ec.message()));
    }
  }
  for (int l = 0; l < node->nproc; ++l) {
    if (log_file_streams(plan_, node->rank_of(l)) == 0) continue;
    std::string dir = rank_log_dir(plan_, attempt, node->rank_of(l));
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw ConfigError(fmt::format("--log-dir: cannot create {}: {}", dir, ec.message()));
  }
  stop_inspector();
  exits_.open(attempt, distributed_, store_.base_client, store_.server.get(), ctx_.token, store_.addr);
  workers_.clear();
  workers_.resize(static_cast<size_t>(node->nproc));
  oom_at_start_ = read_oom_counter();  // a SIGKILLed worker is blamed on memory only if this count grows
  for (int l = 0; l < node->nproc; ++l) {
    workers_[l].rank = node->rank_of(l);
    workers_[l].local_rank = l;
  }
  if (plan_.ray.enabled) {
    // This node's Ray starts (the head at once, the others once it answers), the driver once all joined.
    ray_->start(attempt, store_.attempt, store_.client_options, store_.addr, events_, watcher_stop_);
    return;
  }
  for (int l = 0; l < node->nproc; ++l) {
    if (end_) break;  // a signal arrived meanwhile
    try {
      spawn_worker(workers_[l], *node, attempt, bindings[l], gpus_.empty() ? GpuAssignment{} : gpus_[l]);
    } catch (const ConfigError&) {
      throw;  // a flag's file or folder that cannot be made: said before the job, as any configuration error
    } catch (const Error& e) {
      // Out of descriptors or processes: the job ends here, as at a failure, and the workers started
      // so far are stopped like any others (nothing is left running when the launcher ends).
      publish_end(EndInfo{"spawn", 1, fmt::format("cannot start {} on {}: {}", plan_.process_name(workers_[l].rank),
                                                  node->host, e.what())});
      break;
    }
    if (plan_.report_bindings) {
      // mpirun's --report-bindings: one line per rank, on the launcher's stderr (an agent's reaches
      // the head's).
      std::vector<int> mine = bindings[l];
      std::sort(mine.begin(), mine.end());
      say(fmt::format("{} on {} (local rank {}, pid {}): {}", plan_.process_name(workers_[l].rank), node->host,
                      plan_.local_rank_of(workers_[l].rank), workers_[l].pid,
                      mine.empty() ? "not bound (may run on any of CPUs " + str::format_ranges(cpus) + ")"
                                   : "bound to CPUs " + str::format_ranges(mine)));
    }
  }
  start_inspector(attempt);
}

int Job::running_workers() const {
  int n = 0;
  for (const auto& w : workers_) n += w.running;
  return n;
}

void Job::kill_all(int sig) {
  for (auto& w : workers_)
    if (w.running) {
      w.sigkill_sent = w.sigkill_sent || sig == SIGKILL;
      kill(-w.pid, sig);
    }
}

void Job::become_subreaper() {
  // A worker's descendant that leaves its process group (setsid: a daemonised data loader, `nohup
  // cmd &` under a shell with job control) escapes the group kill. As the subreaper, the launcher
  // becomes the parent of every such orphan instead of init, so it can find them and end them.
  subreaper_ = prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;
  if (!subreaper_)
    log::warn("cannot become the child subreaper ({}): a process a worker starts in a session of its own may "
              "outlive the job",
              strerror(errno));
}

std::vector<Job::Adopted> Job::adopted_children() const {
  // The launcher's live children that are neither a worker nor an agent: orphans the kernel handed to
  // it.
  std::vector<Adopted> out;
  const pid_t self = getpid();
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    const pid_t pid = static_cast<pid_t>(std::atol(name.c_str()));
    const auto stat = read_proc_stat(pid);
    if (!stat) continue;  // gone meanwhile
    const char state = stat->state;
    if (stat->ppid != self || state == 'Z') continue;  // a zombie is over: reap() collects it
    bool ours = false;
    for (const auto& w : workers_) ours = ours || (w.running && w.pid == pid);
    ours = ours || agents_.is_child(pid);
    if (!ours) out.push_back({pid, stat->name, state == 'T' || state == 't'});
  }
  return out;
}

void Job::end_adopted_children() {
  if (!subreaper_) return;
  reap();  // orphans that already ended
  std::vector<Adopted> left = adopted_children();
  if (left.empty()) return;
  std::vector<std::string> named;
  for (const auto& a : left) named.push_back(fmt::format("pid {} ({})", a.pid, a.name));
  say(fmt::format("{} left by the workers outside their process groups: {}; sending SIGTERM{}",
                  left.size() == 1 ? "a process was" : fmt::format("{} processes were", left.size()),
                  str::join(named, ", "),
                  plan_.kill_grace_s > 0 ? fmt::format(", SIGKILL after --kill-grace {:g} s", plan_.kill_grace_s) : ""));
  // The same stop as the workers': SIGTERM (and SIGCONT to a stopped one), SIGKILL after the grace or
  // a second Ctrl-C. A process and, when it leads one (setsid), its process group: its own children
  // go with it. Children of theirs that end up here (their parent died) are found on the next round.
  const auto grace_end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(std::max(0.0, plan_.kill_grace_s)));
  const auto give_up = grace_end + std::chrono::seconds(2);  // SIGKILL takes effect in milliseconds
  const pid_t own_group = getpgrp();
  auto send = [own_group](const Adopted& a, int sig) {
    kill(a.pid, sig);
    if (getpgid(a.pid) == a.pid && a.pid != own_group) kill(-a.pid, sig);
  };
  std::set<pid_t> terminated;
  bool no_grace = plan_.kill_grace_s <= 0 || killed_;
  // Signals to the launcher read here are raised again at the end, for the supervision loop (a Ctrl-C
  // between two attempts must still stop the job).
  std::set<int> seen;
  struct Reraise {
    std::set<int>& seen;
    ~Reraise() {
      for (int sig : seen) kill(getpid(), sig);
    }
  } reraise{seen};
  for (;;) {
    const bool kill_now = no_grace || Clock::now() >= grace_end;
    for (const auto& a : left) {
      if (kill_now) {
        send(a, SIGKILL);
      } else if (terminated.insert(a.pid).second) {
        send(a, SIGTERM);
        if (a.stopped) send(a, SIGCONT);
      }
    }
    // Wait a little for SIGCHLD (reaped below) or a signal to the launcher: a terminating one ends the
    // grace, as a second Ctrl-C does for the workers.
    pollfd p{signal_fd_.get(), POLLIN, 0};
    if (poll(&p, 1, 20) > 0) {
      signalfd_siginfo si;
      while (::read(signal_fd_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
        const int sig = static_cast<int>(si.ssi_signo);
        if (sig == SIGCHLD) continue;
        seen.insert(sig);
        if (is_terminating(sig)) no_grace = true;
      }
    }
    reap();
    left = adopted_children();
    if (left.empty()) return;
    if (Clock::now() >= give_up) {
      std::vector<std::string> pids;
      for (const auto& a : left) pids.push_back(std::to_string(a.pid));
      say(fmt::format("process(es) {} did not end after SIGKILL (in uninterruptible sleep?): left running",
                      str::join(pids, ", ")));
      return;
    }
  }
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
  // A failure elsewhere (a worker, an agent): the workers here are most likely blocked on the lost
  // peer and about to fail on their own, naming it. An interruption, the time limit, a membership change, a lost
  // store and an elastic job's lost node are signalled at once: there is nothing for the workers to
  // name (the end record names the node), or nobody to hear it, and a new generation waits for them.
  if (end_ && end_->kind != "interrupted" && end_->kind != "done" && end_->kind != "membership" &&
      end_->kind != "lost" && end_->kind != "store" && end_->kind != "node" && end_->kind != "timeout") {
    reporting_ = true;
    arm_timer(std::min(kReportWindowS, plan_.kill_grace_s));
    return;
  }
  send_stop_signal();
}

void Job::send_stop_signal() {
  reporting_ = false;
  if (!stop_signal_sent_) kill_all(SIGTERM);
  stop_signal_sent_ = true;
  // A stopped worker (SIGSTOP, ^Z) handles its SIGTERM only once continued: without this it would hold
  // the job until the SIGKILL after the grace. Only stopped ones: a running shell that traps TERM
  // and also sees a SIGCONT may run its trap twice.
  for (auto& w : workers_)
    if (w.running && process_state(w.pid).rfind("stopped", 0) == 0) kill(-w.pid, SIGCONT);
  arm_timer(plan_.kill_grace_s);
}

void Job::on_worker_exit(Worker& w, int status) {
  w.running = false;
  w.status = status;
  w.ended = Clock::now();
  // Collect what the worker wrote before it died (the summary needs its last stderr lines).
  if (w.err) drain(w.err.get(), *w.sink, true, w.err);
  if (w.out) drain(w.out.get(), *w.sink, false, w.out);
  // First, before the job reacts: the ranks waiting for this one learn of its end from the store.
  // (Exits while the job stops are the stop's own doing.)
  if (!stopping_ && !control_.head_lost()) exits_.publish(w);
  // In a Ray job only the driver ends by itself: a node's `ray start --block` that ends before the job does
  // has lost that node's Ray, whatever its exit code.
  const bool ray_node = plan_.ray.enabled && !plan_.is_ray_driver(w.rank);
  bool failed = status != 0 || ray_node;
  const int code = std::max(1, exit_code_of(status));
  // A failure caused by a peer that exited with code 0 names that peer first (job_exits.cc).
  if (failed && end_ && plan_.abort_on_failure)
    upgrade_end(EndInfo{"failure", code, exits_.early_exit_cause(w, workers_) + failure_summary(w)});
  // A Ray job's driver that ends well ends the job well: every node stops its Ray (adopt_end).
  if (plan_.is_ray_driver(w.rank) && !failed && !stopping_ && !end_) publish_end(EndInfo{"done", 0, ""});
  if (failed && !stopping_ && !end_) {
    EndInfo e{"failure", code, exits_.early_exit_cause(w, workers_) + failure_summary(w)};
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
            adopt_end(EndInfo{"lost", 1, fmt::format("lost the job's store at {}: {}", store_.addr, err.what())});
          }
        }
      }
    }
  }
  if (running_workers() == 0) {
    reporting_ = false;
    if (stopping_) {
      if (agents_.running() > 0 && plan_.host_store) arm_timer(plan_.kill_grace_s + 10);
      else disarm_timer();
    }
    if (!done_reported_) {
      done_reported_ = true;
      report_node_done();
    }
  }
}

}  // namespace cohort::launch::job_detail
