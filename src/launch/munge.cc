#include "launch/munge.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <vector>

#include <fmt/core.h>

#include "common/deadline.h"
#include "common/env.h"
#include "common/pipe.h"
#include "common/strings.h"
#include "launch/job.h"

extern char** environ;

namespace cohort::launch::munge {
namespace {

constexpr const char* kDefaultSocket = "/run/munge/munge.socket.2";  // munge's compiled-in default

// Read from the launcher's environment map (socket_path), like every setting of the plan; declared
// here so that `cohort env` lists it.
const env::StringSetting kMungeSocket("COHORT_MUNGE_SOCKET", "",
                                      "munged's socket for the Slurm job token (default: slurm.conf's AuthInfo "
                                      "socket=, else munge's own default)");

struct CommandRun {
  bool started = false;
  bool timed_out = false;
  int status = 0;
  std::string out, err;
  std::string why_not_started;
};

// Runs argv (found on PATH) with `input` on its stdin and collects its stdout and stderr, killing it
// at the deadline. The token travels on stdin, never on a command line that `ps` would show.
CommandRun run_with_input(const std::vector<std::string>& argv, const std::string& input, Deadline deadline) {
  CommandRun r;
  Pipe in = make_pipe("munge: stdin"), out = make_pipe("munge: stdout"), err = make_pipe("munge: stderr");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in.read_end.get(), 0);
  posix_spawn_file_actions_adddup2(&fa, out.write_end.get(), 1);
  posix_spawn_file_actions_adddup2(&fa, err.write_end.get(), 2);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The launcher blocks the signals it reads through its signalfd and ignores SIGPIPE: the command
  // starts with neither, as from a shell.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, pipe_only;
  sigemptyset(&none);
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &pipe_only);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, args[0], &fa, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    r.why_not_started = fmt::format("cannot run {}: {}", argv[0], std::strerror(rc));
    return r;
  }
  r.started = true;
  in.read_end.reset();
  out.write_end.reset();
  err.write_end.reset();
  // A credential or a token is a few hundred bytes: well under a pipe's buffer, so one write. (The
  // launcher ignores SIGPIPE, job.cc: a command that died first gives EPIPE, and its status says why.)
  [[maybe_unused]] ssize_t written = ::write(in.write_end.get(), input.data(), input.size());
  in.write_end.reset();
  pollfd fds[2] = {{out.read_end.get(), POLLIN, 0}, {err.read_end.get(), POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_ends = 2;
  while (open_ends > 0) {
    if (deadline.expired()) {
      r.timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    const int n = ::poll(fds, 2, static_cast<int>(std::max<int64_t>(1, deadline.remaining().count())));
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t got = ::read(fds[i].fd, buf, sizeof buf);
      if (got > 0) {
        if (sinks[i]->size() < (1 << 16)) sinks[i]->append(buf, static_cast<size_t>(got));
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        fds[i].fd = -1;
        --open_ends;
      }
    }
  }
  while (waitpid(pid, &r.status, 0) < 0 && errno == EINTR) {
  }
  return r;
}

std::string last_line(const std::string& text) {
  std::string last;
  for (const auto& line : str::split(text, '\n'))
    if (!str::trim(line).empty()) last = std::string(str::trim(line));
  return last;
}

// "munge (socket S) ..." and why it failed, in one line.
std::string failure(const std::string& what, const std::string& socket, const CommandRun& r,
                    std::chrono::milliseconds timeout) {
  const std::string where = socket.empty() ? std::string("munged's default socket") : "socket " + socket;
  if (!r.started) return fmt::format("{} ({}): {}", what, where, r.why_not_started);
  if (r.timed_out) return fmt::format("{} ({}) did not answer within {} ms", what, where, timeout.count());
  const std::string said = last_line(r.err);
  return fmt::format("{} ({}) {}{}", what, where, describe_status(r.status), said.empty() ? "" : ": " + said);
}

std::vector<std::string> with_socket(std::vector<std::string> argv, const std::string& socket) {
  if (!socket.empty()) argv.push_back("--socket=" + socket);
  return argv;
}

}  // namespace

std::string socket_path(const EnvMap& env, std::string* source) {
  if (auto it = env.find(kMungeSocket.name()); it != env.end() && !it->second.empty()) {
    *source = kMungeSocket.name();
    return it->second;
  }
  const auto conf_it = env.find("SLURM_CONF");
  const std::string conf = conf_it != env.end() && !conf_it->second.empty() ? conf_it->second : "/etc/slurm/slurm.conf";
  std::ifstream in(conf);
  std::string line;
  while (std::getline(in, line)) {
    // AuthInfo=socket=/path[,ttl=...]: the options are comma-separated, keys case-insensitive.
    std::string_view l = str::trim(line);
    if (l.size() < 9 || strncasecmp(l.data(), "AuthInfo=", 9) != 0) continue;
    for (const auto& part : str::split(std::string(l.substr(9)), ',')) {
      std::string_view p = str::trim(part);
      if (p.size() > 7 && strncasecmp(p.data(), "socket=", 7) == 0) {
        *source = "AuthInfo in " + conf;
        return std::string(p.substr(7));
      }
    }
  }
  *source = "munge's default";
  return "";
}

bool available(const std::string& socket, std::string* why) {
  for (const char* command : {"munge", "unmunge"}) {
    bool found = false;
    const char* path = std::getenv("PATH");
    for (const auto& dir : str::split(path ? path : "/usr/bin:/bin", ':'))
      if (::access((dir + "/" + command).c_str(), X_OK) == 0) found = true;
    if (!found) {
      *why = fmt::format("{} is not installed here (Debian: the munge package)", command);
      return false;
    }
  }
  const std::string path = socket.empty() ? std::string(kDefaultSocket) : socket;
  if (::access(path.c_str(), F_OK) != 0) {
    *why = fmt::format("munged is not running here (no socket {}: {})", path, std::strerror(errno));
    return false;
  }
  return true;
}

std::string notice_name(int node) { return fmt::format("cohort/munge-credential/node/{}", node); }

Outcome encode(const std::string& payload, uid_t uid, const std::string& socket, std::chrono::milliseconds timeout) {
  // --ttl=-1: munged's longest (the other nodes may start minutes after node 0).
  auto r = run_with_input(with_socket({"munge", "--restrict-uid=" + std::to_string(uid), "--ttl=-1"}, socket),
                          payload, Deadline::after(timeout));
  Outcome o;
  if (!r.started || r.timed_out || !WIFEXITED(r.status) || WEXITSTATUS(r.status) != 0) {
    o.why = failure("munge", socket, r, timeout);
    return o;
  }
  o.value = std::string(str::trim(r.out));
  o.ok = !o.value.empty();
  if (!o.ok) o.why = "munge printed no credential";
  return o;
}

Outcome decode(const std::string& credential, uid_t encoder_uid, const std::string& socket,
               std::chrono::milliseconds timeout) {
  // Metadata (only the encoder's UID, as a number), a blank line, then the payload.
  auto r = run_with_input(with_socket({"unmunge", "--keys=UID", "--numeric"}, socket), credential,
                          Deadline::after(timeout));
  Outcome o;
  if (!r.started || r.timed_out || !WIFEXITED(r.status) || WEXITSTATUS(r.status) != 0) {
    o.why = failure("unmunge", socket, r, timeout);
    return o;
  }
  const size_t blank = r.out.find("\n\n");
  const std::string meta = r.out.substr(0, blank);
  const size_t colon = meta.find(':');
  if (blank == std::string::npos || colon == std::string::npos) {
    o.why = "unmunge's output is not metadata and a payload";
    return o;
  }
  const std::string uid_text(str::trim(meta.substr(colon + 1)));
  if (uid_text != std::to_string(encoder_uid)) {
    o.why = fmt::format("the credential was encoded by uid {}, not by this job's uid {}", uid_text, encoder_uid);
    return o;
  }
  o.value = r.out.substr(blank + 2);
  o.ok = !o.value.empty();
  if (!o.ok) o.why = "the credential holds no token";
  return o;
}

}  // namespace cohort::launch::munge
