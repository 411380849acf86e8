#include "launch/doctor_child.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "cohort/error.h"
#include "common/socket.h"
#include "common/strings.h"

namespace cohort::doctor {

Child::Child(const std::vector<std::string>& argv) {
  if (argv.empty()) throw InvalidArgument("doctor: empty command");
  int in[2], out[2], err[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
    throw Error(net::errno_string("doctor: pipe2", errno));
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  pid_ = ::fork();
  if (pid_ < 0) throw Error(net::errno_string("doctor: fork", errno));
  if (pid_ == 0) {
    ::setpgid(0, 0);  // its own group, so a kill reaches whatever it started locally
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    ::execvp(cargv[0], cargv.data());
    std::string msg = std::string("exec ") + argv[0] + ": " + std::strerror(errno) + "\n";
    (void)!::write(2, msg.data(), msg.size());
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  ::close(err[1]);
  in_ = in[1];
  out_fd_ = out[0];
  err_fd_ = err[0];
}

Child::~Child() {
  if (!exited_ && pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    int st;
    ::waitpid(pid_, &st, 0);
  }
  for (int fd : {in_, out_fd_, err_fd_})
    if (fd >= 0) ::close(fd);
}

void Child::pump(int timeout_ms) {
  pollfd fds[2];
  int n = 0;
  int idx_out = -1, idx_err = -1;
  if (out_fd_ >= 0) { idx_out = n; fds[n++] = {out_fd_, POLLIN, 0}; }
  if (err_fd_ >= 0) { idx_err = n; fds[n++] = {err_fd_, POLLIN, 0}; }
  if (n == 0) {
    if (timeout_ms > 0) ::usleep(static_cast<useconds_t>(std::min(timeout_ms, 20)) * 1000);
    return;
  }
  int r = ::poll(fds, static_cast<nfds_t>(n), timeout_ms);
  if (r <= 0) return;
  char buf[65536];
  auto drain = [&](int idx, int& fd, std::string& into) {
    if (idx < 0 || !(fds[idx].revents & (POLLIN | POLLHUP | POLLERR))) return;
    ssize_t got = ::read(fd, buf, sizeof buf);
    if (got > 0) {
      into.append(buf, static_cast<size_t>(got));
    } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
      ::close(fd);
      fd = -1;
    }
  };
  drain(idx_out, out_fd_, out_);
  drain(idx_err, err_fd_, err_);
}

std::optional<std::string> Child::read_line(Deadline deadline) {
  for (;;) {
    auto nl = out_.find('\n');
    if (nl != std::string::npos) {
      std::string line = out_.substr(0, nl);
      out_.erase(0, nl + 1);
      return line;
    }
    if (out_fd_ < 0 || deadline.expired()) return std::nullopt;
    pump(deadline.poll_ms(100));
  }
}

void Child::close_stdin() {
  if (in_ >= 0) ::close(in_);
  in_ = -1;
}

int Child::wait(Deadline deadline) {
  while (!exited_) {
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      status_ = st;
      break;
    }
    if (deadline.expired()) {
      timed_out_ = true;
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &st, 0);
      exited_ = true;
      status_ = st;
      break;
    }
    pump(20);
  }
  // Whatever is still buffered in the pipes (bounded: the writers are gone or killed).
  for (int i = 0; i < 100 && (out_fd_ >= 0 || err_fd_ >= 0); ++i) pump(10);
  if (WIFEXITED(status_)) return WEXITSTATUS(status_);
  if (WIFSIGNALED(status_)) return 128 + WTERMSIG(status_);
  return -1;
}

std::string Child::last_err_line() const {
  auto lines = str::split(err_, '\n');
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    auto t = str::trim(*it);
    if (!t.empty()) return std::string(t);
  }
  return "";
}

ChildResult run_child(const std::vector<std::string>& argv, Deadline deadline) {
  Child c(argv);
  c.close_stdin();
  ChildResult r;
  r.exit_code = c.wait(deadline);
  r.timed_out = c.timed_out();
  r.out = c.out();
  r.err = c.err();
  return r;
}

}  // namespace cohort::doctor
