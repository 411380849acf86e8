// Fan-out over ssh (-H / --hostfile) or srun (inside a Slurm allocation): the head starts `cohort agent`
// on every other host with the plan on its stdin, which then stays the control channel (signals
// forwarded as "sig N" lines; EOF means the head is gone); an agent that ends before the job is a
// failure of its host.
//
// Two objects (job_internal.h), one per side of the channel: Agents, the head's children, and
// ControlChannel, an agent's stdin. Neither needs more of the job than its end and the loop's attention
// for its descriptors (Supervisor), so their processes, pipes and buffers are theirs alone.
#include <poll.h>

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
#include "common/io.h"
#include "common/log.h"
#include "common/pipe.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/job_internal.h"

namespace cohort::launch::job_detail {

void Agents::start(const std::string& token, int torch_port, const std::string& self_exe) {
  // Fan-out: every host but this one runs `cohort agent` through the ssh command; the plan (with the
  // token, never on a command line) goes over the agent's stdin, which then stays open as the
  // control channel: "sig N" lines forward signals, EOF means the head is gone.
  auto ssh = str::split(plan_.ssh_command, ' ');
  const bool srun = plan_.agent_launcher == "srun";
  if (!srun && ssh.empty()) throw ConfigError("--ssh-command is empty");
  for (const auto& node : plan_.nodes) {
    if (node.local) continue;
    Child a;
    a.node = node;
    Plan remote = plan_;
    remote.this_node = node.node_rank;
    remote.host_store = false;
    for (auto& n : remote.nodes) n.local = n.node_rank == node.node_rank;
    nlohmann::json msg = {{"plan", nlohmann::json::parse(plan_to_json(remote))},
                          {"token", token},
                          {"torch_port", torch_port}};
    std::string line = msg.dump() + "\n";
    std::vector<std::string> argv;
    if (srun) {
      // One step per host, inside the allocation (docs/slurm.md): explicit node and task counts, since
      // srun would otherwise take the batch job's SLURM_NTASKS; --overlap so that the step shares the
      // node's CPUs with the batch step and with other cohort jobs of the allocation; no MPI plugin and
      // no CPU binding of the agent (its workers are bound by cohort, --bind-to).
      argv = {"srun", "--nodes=1", "--ntasks=1", "--nodelist=" + node.host, "--overlap", "--mpi=none",
              "--cpu-bind=none", "--kill-on-bad-exit=0", "--quiet", "--job-name=cohort-agent"};
    } else {
      argv = ssh;
      argv.push_back(node.host);
    }
    argv.push_back(self_exe);
    argv.push_back("agent");
    std::vector<char*> args;
    for (auto& s : argv) args.push_back(s.data());
    args.push_back(nullptr);
    pid_t parent = getpid();
    // Owned from their creation: a pipe or fork that fails closes the ones made before it.
    Pipe in, out, err;
    pid_t pid = -1;
    try {
      in = make_pipe("its stdin pipe");
      out = make_pipe("its stdout pipe");
      err = make_pipe("its stderr pipe");
      pid = fork();
      if (pid < 0) throw Error(net::errno_string("fork", errno));
    } catch (const Error& e) {
      // The agents started so far go too (their hosts' workers stop when the connection closes).
      stop_now();
      throw Error(fmt::format("cannot start the agent for host {} (node {}): {}", node.host, node.node_rank, e.what()));
    }
    const int in_r = in.read_end.get(), out_w = out.write_end.get(), err_w = err.write_end.get();
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      signal(SIGPIPE, SIG_DFL);
      dup2(in_r, 0);
      dup2(out_w, 1);
      dup2(err_w, 2);
      execvp(args[0], args.data());
      dprintf(2, "cannot run %s command '%s': %s\n", srun ? "srun" : "ssh", args[0], strerror(errno));
      _exit(127);
    }
    in.read_end.reset();  // the agent's ends
    out.write_end.reset();
    err.write_end.reset();
    a.pid = pid;
    a.running = true;
    a.in = std::move(in.write_end);
    a.out = std::move(out.read_end);
    a.err = std::move(err.read_end);
    // drain() reads until EAGAIN: blocking pipes would stall the event loop (and with it SIGTERM
    // handling) as soon as an agent's ssh session prints anything (found by tests/multihost).
    net::set_nonblocking(a.out.get(), true);
    net::set_nonblocking(a.err.get(), true);
    io::write_all(a.in.get(), line.data(), line.size());  // a failed ssh shows as the agent's exit
    OutputTargets t;
    t.line_mode = true;
    a.sink = std::make_unique<OutputSink>(std::move(t), 5);
    supervisor_.watch(a.out.get());
    supervisor_.watch(a.err.get());
    agents_.push_back(std::move(a));
  }
}

void Agents::stop_now() {
  for (auto& a : agents_) {
    if (!a.running) continue;
    a.in.reset();  // EOF: the agent stops its workers
    kill(-a.pid, SIGKILL);  // the ssh or srun client's group (it may not have made it yet: the pid too)
    kill(a.pid, SIGKILL);
    int status = 0;
    while (waitpid(a.pid, &status, 0) < 0 && errno == EINTR) {
    }
    a.running = false;
  }
  agents_.clear();
}

int Agents::running() const {
  int n = 0;
  for (const auto& a : agents_) n += a.running;
  return n;
}

bool Agents::is_child(pid_t pid) const {
  for (const auto& a : agents_)
    if (a.running && a.pid == pid) return true;
  return false;
}

void Agents::forward(int sig) {
  const std::string line = fmt::format("sig {}\n", sig);
  for (auto& a : agents_)
    if (a.running && a.in) io::write_all(a.in.get(), line.data(), line.size());  // an agent gone: its exit says so
}

void Agents::kill_all(int sig) {
  for (auto& a : agents_)
    if (a.running) kill(-a.pid, sig);
}

void Agents::close_channels() {
  for (auto& a : agents_) a.in.reset();
}

bool Agents::on_readable(int fd) {
  for (auto& a : agents_) {
    if (a.out && fd == a.out.get()) {
      drain_output(fd, *a.sink, false, a.out, supervisor_);
      return true;
    }
    if (a.err && fd == a.err.get()) {
      drain_output(fd, *a.sink, true, a.err, supervisor_);
      return true;
    }
  }
  return false;
}

bool Agents::on_exit(pid_t pid, int status) {
  for (auto& a : agents_)
    if (a.running && a.pid == pid) {
      a.running = false;
      a.status = status;
      if (a.err) drain_output(a.err.get(), *a.sink, true, a.err, supervisor_);
      if (a.out) drain_output(a.out.get(), *a.sink, false, a.out, supervisor_);
      if (!supervisor_.ended()) {
        std::string s = fmt::format("the agent for host {} (node {}, ranks {}) {} before the job ended", a.node.host,
                                    a.node.node_rank, a.node.ranks_text(), describe_status(status));
        auto tail = a.sink->stderr_tail();
        if (!tail.empty()) s += "; its last stderr lines:";
        for (const auto& l : tail) s += "\n    | " + l;
        int code = exit_code_of(status);
        supervisor_.publish_end(EndInfo{"agent", code == 0 ? 1 : code, s});
      }
      return true;
    }
  return false;
}

void ControlChannel::open(int this_node) {
  this_node_ = this_node;
  net::set_nonblocking(0, true);
  supervisor_.watch(0);
  open_ = true;
}

bool ControlChannel::on_readable(int fd) {
  if (fd != 0 || !open_) return false;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(0, buf, sizeof buf);
    if (n > 0) {
      buf_.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) break;
    // EOF: the head launcher (or the ssh connection to it) is gone. Stop everything here.
    supervisor_.unwatch(0);
    open_ = false;
    head_lost_ = true;
    if (!supervisor_.ended())
      supervisor_.adopt_end(EndInfo{"lost", 1,
                                    fmt::format("node {}: lost the connection to the head launcher; stopping this "
                                                "node's workers",
                                                this_node_)});
    stop_workers_();
    break;
  }
  size_t nl;
  while ((nl = buf_.find('\n')) != std::string::npos) {
    std::string line = buf_.substr(0, nl);
    buf_.erase(0, nl + 1);
    if (line.rfind("sig ", 0) == 0) {
      int sig = std::atoi(line.c_str() + 4);
      for (int s : kForwarded)
        if (s == sig) on_signal_(sig);
    }
  }
  return true;
}

}  // namespace cohort::launch::job_detail

namespace cohort::launch {

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
  // As mpirun: the workers run in the head's folder when this host has it (else in the agent's own), so
  // a relative PROGRAM or script means the same file on every host.
  if (ctx.plan.form.working_dir_required && chdir(ctx.plan.form.working_dir.c_str()) != 0)
    throw ConfigError(fmt::format("--wdir {}: cannot enter it on host {}: {}", ctx.plan.form.working_dir,
                                  net::hostname(), strerror(errno)));
  if (!ctx.plan.form.working_dir.empty() && chdir(ctx.plan.form.working_dir.c_str()) != 0)
    log::info("agent: the head's folder {} is not here ({}); the workers run in this agent's folder",
              ctx.plan.form.working_dir, strerror(errno));
  // The program (or the Python interpreter of a script) is resolved again here: this host's PATH decides.
  resolve_worker_command(ctx.plan, &resolve_program);
  log::set_identity(fmt::format("agent node {}", ctx.plan.this_node));
  return run_job(std::move(ctx));
}

}  // namespace cohort::launch
