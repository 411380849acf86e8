// Supervision: the launcher's event loop (signals, timers, the store watcher's events, output pipes,
// the control channel), one attempt after another until the job ends or its restarts are used up.
// See job_internal.h for where the other responsibilities live.
#include "launch/job.h"

#include <sys/signalfd.h>
#include <sys/timerfd.h>

#include <thread>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/console.h"
#include "common/build_info.h"
#include "common/log.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/job_internal.h"

namespace cohort::launch::job_detail {

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

void say(const std::string& line) {
  console::write(2, "cohort run: " + line + "\n");
}

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
  if (plan_.ray.enabled) {
    // Ray mode (job_ray.cc) starts this node's processes 0 and 1 as the cluster comes up.
    ray_ = std::make_unique<RayCluster>(plan_, distributed_, supervisor(), [this](size_t index, int attempt) {
      spawn_worker(workers_[index], *plan_.node(plan_.this_node), attempt, {}, {});
    });
    ray_->open();
  }
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

void Job::arm_time_limit() {
  if (plan_.timeout_s <= 0 || ctx_.agent_mode) return;  // a fan-out's agents follow the head's end
  limit_fd_.reset(timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK));
  if (!limit_fd_) throw Error(net::errno_string("timerfd_create", errno));
  itimerspec its{};
  auto ns = static_cast<long long>(plan_.timeout_s * 1e9);
  its.it_value.tv_sec = ns / 1000000000;
  its.it_value.tv_nsec = ns % 1000000000;
  timerfd_settime(limit_fd_.get(), 0, &its, nullptr);
  epoll_add(limit_fd_.get());
}

void Job::on_time_limit() {
  uint64_t ticks;
  [[maybe_unused]] auto r = ::read(limit_fd_.get(), &ticks, sizeof ticks);
  if (end_) return;  // the job is ending anyway
  // Published like any end: every other node adopts it from the store and stops its workers the same
  // way (SIGTERM at once, SIGKILL after --kill-grace).
  publish_end(EndInfo{"timeout", kTimeLimitExitCode,
                      fmt::format("the wall-clock limit of {:g} s ({}) was reached; every worker was stopped",
                                  plan_.timeout_s, plan_.timeout_flag)});
}

void Job::on_signal(int sig) {
  if (sig == SIGCHLD) {
    reap();
    return;
  }
  // Forward to every worker's process group, and to remote agents over their control channel.
  for (auto& w : workers_)
    if (w.running) {
      int to_send = stopping_ && !reporting_ && is_terminating(sig) && sig == SIGINT ? SIGKILL : sig;
      w.sigkill_sent = w.sigkill_sent || to_send == SIGKILL;
      kill(-w.pid, to_send);
    }
  // The forwarded signal is the workers' stop signal: the stop that follows must not send a second
  // one (a shell that traps TERM would run its trap twice).
  if (is_terminating(sig)) stop_signal_sent_ = true;
  agents_.forward(sig);
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
  if (!end_) {
    EndInfo interrupted{"interrupted", 128 + sig,
                        fmt::format("interrupted by {}{}", signal_name(sig),
                                    plan_.nnodes > 1 || plan_.elastic
                                        ? fmt::format(" on node {} ({})", plan_.this_node, net::hostname())
                                        : "")};
    if (plan_.elastic && plan_.min_nodes < plan_.max_nodes) {
      elastic_->leave(sig, joined_);  // this agent leaves; the job goes on without it
      adopt_end(interrupted);
    } else if (plan_.elastic) {
      if (!joined_)
        interrupted.summary =
            fmt::format("interrupted by {} on {} before the job started", signal_name(sig), net::hostname());
      elastic_->end_everywhere(interrupted, joined_);
      adopt_end(interrupted);
    } else {
      publish_end(interrupted);
    }
  }
  // The signal itself was the SIGTERM; SIGKILL follows after the grace.
  if (!stopping_) {
    stopping_ = true;
    if (running_workers() > 0) arm_timer(plan_.kill_grace_s);
  }
}

int Job::pending_interrupt() {
  int interrupt = 0;
  signalfd_siginfo si;
  while (::read(signal_fd_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    const int sig = static_cast<int>(si.ssi_signo);
    if (sig == SIGCHLD) reap();
    else if (!is_terminating(sig)) on_signal(sig);  // forwarded as in the loop (USR1, USR2)
    else if (!interrupt) interrupt = sig;
  }
  return interrupt;
}

void Job::reap() {
  for (;;) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) return;
    if (ray_ && ray_->on_exit(pid, status)) continue;
    bool known = false;
    for (auto& w : workers_)
      if (w.running && w.pid == pid) {
        on_worker_exit(w, status);
        known = true;
        break;
      }
    if (known) continue;
    agents_.on_exit(pid, status);
  }
}

EndInfo Job::run_attempt(int attempt) {
  stopping_ = reporting_ = killed_ = done_reported_ = stop_signal_sent_ = false;
  end_.reset();
  first_failure_.reset();
  stop_inspector();
  workers_.clear();
  watcher_stop_ = std::make_shared<std::atomic<bool>>(false);
  if (distributed_ && elastic_) {
    // The generation's round runs on the watcher thread; kJoined brings its membership.
    joined_ = false;
    elastic_->join_round(attempt, watcher_stop_);
  } else if (distributed_) {
    store_.attempt = make_prefix_store(store_.base, fmt::format("attempt/{}", attempt));
    // Each attempt's watcher gets a connection of its own (the previous one may still be finishing
    // its last wait slice on the old one).
    if (attempt > 0)
      store_.watch_base = make_prefix_store(connect_tcp_store(store_.client_options), "cohort/launch/" + plan_.job_id);
    auto watch_store = make_prefix_store(store_.watch_base, fmt::format("attempt/{}", attempt));
    if (plan_.this_node >= 0) store_.attempt->set(node_key(plan_.this_node), net::hostname());
    // An uncounted Ray job's nodes come as they start: node 0 learns how many to wait for at the end
    // (settle_end_with_store) from this count, and each node waits for node 0 and itself only.
    if (plan_.ray.open_membership) store_.attempt->add("joined", 1);
    // Joined: only short requests from here.
    if (store_.base_client) store_.base_client->set_timeout(kStoreCallTimeout);
    joined_ = false;
    WatchParams params{{}, plan_.this_node, plan_.join_timeout_s, store_.addr};
    if (plan_.ray.open_membership)
      params.nodes = plan_.this_node == 0 ? std::vector<int>{0} : std::vector<int>{0, plan_.this_node};
    else
      for (int r = 0; r < plan_.nnodes; ++r) params.nodes.push_back(r);
    std::thread(watcher_main, watch_store, events_, watcher_stop_, params, attempt).detach();
    if (!plan_.node(plan_.this_node)) start_inspector(attempt);  // a fan-out head: the other nodes' rings
  } else {
    joined_ = true;
    spawn_workers(attempt);
    if (workers_.empty()) adopt_end(EndInfo{"done", 0, ""});
  }

  std::vector<epoll_event> evs(64);
  for (;;) {
    bool local_done = running_workers() == 0 && (joined_ || end_);
    bool agents_done = agents_.running() == 0;
    if (end_ && local_done && (agents_done || !plan_.host_store)) break;
    if (control_.head_lost() && running_workers() == 0) break;
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
          agents_.kill_all(SIGKILL);
        }
      } else if (fd == events_->fd()) {
        for (auto& ev : events_->take()) {
          if (ev.attempt != attempt && ev.attempt != kAnyAttempt) continue;  // from an earlier attempt's watcher
          switch (ev.kind) {
            case WatchEvent::kJoined:
              if (end_) break;
              if (elastic_) {
                try {
                  elastic_->apply_membership(nlohmann::json::parse(ev.text).get<Membership>());
                } catch (const Error& e) {
                  adopt_end(EndInfo{"lost", 1, fmt::format("lost the job's store at {}: {}", store_.addr, e.what())});
                  break;
                }
              }
              joined_ = true;
              spawn_workers(elastic_ ? elastic_->membership()->generation : attempt);
              break;
            case WatchEvent::kRefused:
              adopt_end(EndInfo{"refused", 1, ev.text});
              break;
            case WatchEvent::kLeaseLost:  // elastic jobs only (job_elastic.cc)
              if (auto end = elastic_->on_lease_lost(ev.lease, ev.text)) adopt_end(*end);
              break;
            case WatchEvent::kEnd:
              adopt_end(end_from_string(ev.text));
              break;
            case WatchEvent::kStoreMoved:  // elastic jobs only (job_elastic.cc)
              if (auto end = elastic_->on_store_moved(ev.text)) adopt_end(*end);
              break;
            case WatchEvent::kLost:
              // An elastic job moves its store when it can (ElasticMember::after, job_elastic.cc).
              adopt_end(EndInfo{plan_.elastic ? "store" : "lost", 1,
                                fmt::format("lost the job's store at {} (its host, {}, is gone?): {}", store_.addr,
                                            plan_.mode == Mode::kFanOut ? "the head launcher" : "node 0", ev.text)});
              break;
            case WatchEvent::kJoinTimeout:
              adopt_end(EndInfo{"join", 1, ev.text});
              break;
            case WatchEvent::kRayHead:
              if (ray_) ray_->on_head(ev.text);
              break;
            case WatchEvent::kRayHeadTimeout:
              if (ray_) ray_->fail("join", ev.text);
              break;
          }
        }
      } else if (limit_fd_ && fd == limit_fd_.get()) {
        on_time_limit();
      } else if (ray_ && ray_->on_readable(fd)) {
        // its timer or its probe's output (job_ray.cc)
      } else if (control_.on_readable(fd)) {
        // a forwarded signal, or the head is gone (job_fanout.cc)
      } else if (agents_.on_readable(fd)) {
        // an agent's output (job_fanout.cc)
      } else {
        bool handled = false;
        for (auto& w : workers_) {
          if (w.out && fd == w.out.get()) drain(fd, *w.sink, false, w.out), handled = true;
          else if (w.err && fd == w.err.get()) drain(fd, *w.sink, true, w.err), handled = true;
          if (handled) break;
        }
        if (!handled) epoll_del(fd);
      }
    }
  }
  disarm_timer();
  *watcher_stop_ = true;
  stop_inspector();
  if (ray_) ray_->stop();
  // Whatever the workers left behind in their process groups goes too (a Ray job's driver may never have
  // started: no pid, no group).
  for (auto& w : workers_) {
    if (w.pid > 0) kill(-w.pid, SIGKILL);
    if (w.out) drain(w.out.get(), *w.sink, false, w.out);
    if (w.err) drain(w.err.get(), *w.sink, true, w.err);
  }
  if (end_->code != 0) publish_final_trace();
  // And what they left outside them (after the rings are published: the head gathers them meanwhile).
  end_adopted_children();
  settle_end_with_store();
  if (end_->code != 0) record_failure(attempt);
  return *end_;
}

int Job::run() {
  distributed_ = plan_.nnodes > 1 || plan_.elastic || plan_.mode == Mode::kFanOut || ctx_.agent_mode ||
                 plan_.ray.open_membership;  // node 0 of an uncounted Ray job hosts the store the others join
  // A GPU job: this node's GPUs are checked before anything starts (an agent of a fan-out sees its
  // own host's GPUs here for the first time).
  if (const NodePlan* node = plan_.node(plan_.this_node); node && !plan_.gpus_per_node_spec.empty()) {
    if (!ctx_.gpus) ctx_.gpus = detect_gpus(ctx_.env);
    // A Ray node gets all of them (--num-gpus) and shares them out itself.
    if (!plan_.ray.enabled)
      gpus_ = assign_gpus(plan_.gpus_per_node_spec, plan_.gpu_share, node->nproc, *ctx_.gpus, net::hostname());
    if (plan_.gpus_per_node == 0)
      plan_.gpus_per_node = resolve_gpus_per_node(plan_.gpus_per_node_spec, *ctx_.gpus, net::hostname());
  }
  setup_signals();
  // Elastic membership (job_elastic.cc) takes part from the store's set-up on.
  if (plan_.elastic) elastic_ = std::make_unique<ElasticMember>(plan_, store_, events_);
  arm_time_limit();
  become_subreaper();
  trace_folder_.open();
  if (ctx_.agent_mode) control_.open(plan_.this_node);
  // Every worker and agent connects to the store's address. A name that does not resolve on the
  // store's own host (a fresh root whose /etc/hosts lacks the host's name) would leave them retrying
  // until the store's deadline, minutes, without a word: one line now instead.
  if (plan_.mode == Mode::kFanOut && plan_.host_store && !ctx_.agent_mode) {
    try {
      net::resolve(plan_.master_addr, 0);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("the job's store address '{}' ({}) does not resolve on this host: {}; add it to "
                                    "/etc/hosts or DNS, or give --master-addr ADDRESS that every host reaches",
                                    plan_.master_addr, plan_.source_of("store address"), e.what()));
    }
  }
  try {
    start_store();
  } catch (const Interrupted& e) {
    // Nothing started yet: no worker, no other node that counts on this one.
    say(fmt::format("job stopped (exit {}): {}", 128 + e.sig(), e.what()));
    if (store_.server) store_.server->stop();
    trace_folder_.close(128 + e.sig(), !ctx_.agent_mode);
    return 128 + e.sig();
  }
  if (plan_.mode == Mode::kFanOut && plan_.host_store) agents_.start(ctx_.token, store_.torch_port, ctx_.self_exe);
  // Once per job: by the launcher that hosts the job's store (node 0's, or the only one), not by every
  // node's launcher of a per-node job. A job without a token (per-node, none given: tools/cmd_run.cc)
  // is open to anyone who reaches it: say so, and how to close it (docs/security.md).
  if (ctx_.token.empty() && plan_.host_store && !ctx_.agent_mode)
    say(fmt::format("warning: this job is open: anyone who reaches node 0's store ({}) or a rank's port can join "
                    "it; {}give every node the same --token-file PATH (mode 0600) or COHORT_JOB_TOKEN "
                    "(docs/security.md)",
                    store_.addr, open_reason_.empty() ? "" : open_reason_ + "; "));
  if (plan_.set_omp_threads && plan_.this_node >= 0 && plan_.host_store && !ctx_.agent_mode)
    say(fmt::format("setting OMP_NUM_THREADS=1 for each worker (it was unset and {} processes share a node); set "
                    "it yourself to choose another value",
                    plan_.node(plan_.this_node)->nproc));
  int attempt = 0;
  if (elastic_) {
    try {
      attempt = elastic_->first_generation();
    } catch (const RendezvousRefused& e) {
      say(fmt::format("job stopped (exit 1): {}", e.what()));
      if (store_.server) store_.server->stop();
      trace_folder_.close(1, !ctx_.agent_mode);
      return 1;
    }
  }
  for (;;) {
    EndInfo e = run_attempt(attempt);
    bool print = !ctx_.agent_mode;
    if (elastic_) {
      // The next generation (after moving the job's store when its host is lost), or the job's end.
      if (auto next = elastic_->after(e, joined_, control_.head_lost())) {
        attempt = *next;
        continue;
      }
    } else if (e.restartable() && attempt < plan_.max_restarts && !control_.head_lost()) {
      ++attempt;
      if (print)
        say(fmt::format("restarting every worker (restart {} of {}) after: {}", attempt, plan_.max_restarts,
                        e.summary));
      continue;
    }
    // A fan-out's agent that stopped on its own because it lost the head's store: the head prints the
    // job's summary, but only this agent knows why it stopped, and the head quotes its last stderr lines.
    if (ctx_.agent_mode && e.kind == "lost" && !control_.head_lost())
      say(fmt::format("node {} ({}): {}; this node's workers were stopped (exit {})", plan_.this_node,
                      net::hostname(), e.summary, e.code));
    if (print && e.code != 0) {
      // The summary's first line names the build, so that a pasted failure says which cohort ran.
      console::write(2, fmt::format("cohort run {}: job {} (exit {}): {}\n", build::version_text(),
                                    e.kind == "failure" || e.kind == "done" ? "failed" : "stopped", e.code,
                                    e.summary));
    }
    // The flight recorders' account: the head's covers every node (it gathered their rings).
    if (print && e.code != 0)
      for (const auto& line : diagnosis_) say("flight recorder: " + line);
    merge_timeline();
    trace_folder_.close(e.code, print);
    agents_.close_channels();
    if (store_.server) store_.server->stop();
    return e.code;
  }
}

}  // namespace cohort::launch::job_detail

namespace cohort::launch {

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
  job_detail::Job job(std::move(ctx));
  return job.run();
}

}  // namespace cohort::launch
