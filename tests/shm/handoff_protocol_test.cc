// The memfd handoff itself (common/handoff.h), as the collectives' segment, the shm transport and the
// parameter server use it: a listener that waits for two roles, with the real peers as a thread
// (role 1) and a forked process (role 2), and hostile peers of this uid that come first: a process
// none of the roles', role 2's process claiming role 1, a hello of the wrong size, a memfd shorter
// than its hello says, and one that connects and never speaks. Each is refused with one log line,
// and both real peers are served before the deadline. And the connect side: a listener that is not
// the expected process is refused.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/core.h>
#include <gtest/gtest.h>

#include "cohort/error.h"
#include "common/handoff.h"
#include "common/socket.h"
#include "transport/shm/segment.h"

namespace cohort {
namespace {

using namespace std::chrono_literals;

UniqueFd memfd_of(size_t bytes) {
  UniqueFd m(::memfd_create("handoff-test", MFD_CLOEXEC));
  if (!m || ::ftruncate(m.get(), off_t(bytes)) != 0) return {};
  return m;
}

// Whether the listener closed `sock` without handing anything over (waiting up to 10 s).
bool refused(int sock) {
  pollfd p{sock, POLLIN, 0};
  if (::poll(&p, 1, 10000) != 1) return false;
  char buf[128];
  std::vector<UniqueFd> fds;
  return net::recv_with_fds(sock, buf, sizeof buf, &fds, MSG_DONTWAIT) <= 0 && fds.empty();
}

// Exit status of a forked child, waiting up to 20 s (then it is killed).
int exit_status(pid_t pid) {
  const auto end = std::chrono::steady_clock::now() + 20s;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > end) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(2ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A forked process that runs `body` (its exit code) and nothing else of the test.
pid_t fork_child(const std::function<int()>& body) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    int code = 99;
    try {
      code = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child %d: %s\n", int(::getpid()), e.what());
    }
    ::_exit(code);
  }
  return pid;
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST(HandoffProtocol, IntrudersAreRefusedOneLineEachAndTheRealPeersAreServed) {
  const std::string name = shm::random_address("handoff-protocol-test");
  const uint64_t scope = handoff::scope_of(name);
  const size_t kBytes = size_t{1} << 20;
  const auto deadline = Deadline::after(10s);
  testing::internal::CaptureStderr();
  std::optional<handoff::Listener> listener;
  listener.emplace(name, 8, "test listener");
  const pid_t me = ::getpid();
  auto hello_of = [&](uint32_t role) {
    handoff::Hello h = handoff::make_hello(scope, role);
    h.sizes[0] = kBytes;
    return h;
  };

  // Forked before any thread of this test starts. A process that is none of the roles' (of this
  // uid), claiming role 1:
  const pid_t stranger = fork_child([&] {
    UniqueFd s = handoff::connect(name, me, "the listener", deadline);
    UniqueFd m = memfd_of(kBytes);
    try {
      handoff::send(s.get(), hello_of(1), {m.get()}, deadline, "the listener");
    } catch (const PeerLostError&) {
      return 0;  // refused before its hello went out (the listener looks at who connects first)
    }
    return refused(s.get()) ? 0 : 3;
  });
  // Role 2's process says, through this pipe, when its first try was refused: role 1 is awaited until then.
  int pipe_fds[2];
  ASSERT_EQ(0, ::pipe2(pipe_fds, O_CLOEXEC));
  UniqueFd liar_done(pipe_fds[0]), liar_done_w(pipe_fds[1]);
  // Role 2's process: first it claims role 1 (refused: the pid is not role 1's), then it says who it is.
  const pid_t role2 = fork_child([&] {
    UniqueFd m = memfd_of(kBytes);
    UniqueFd liar = handoff::connect(name, me, "the listener", deadline);
    handoff::send(liar.get(), hello_of(1), {m.get()}, deadline, "the listener");
    if (!refused(liar.get())) return 4;
    if (::write(liar_done_w.get(), "r", 1) != 1) return 6;
    UniqueFd s = handoff::connect(name, me, "the listener", deadline);
    handoff::send(s.get(), hello_of(2), {m.get()}, deadline, "the listener");
    auto reply = handoff::receive(s.get(), handoff::Expect{scope, {{0, me}}, "rank", 1}, deadline, "the listener");
    return reply && reply->fds.size() == 1 ? 0 : 5;
  });

  // The listener: waits for roles 1 (this process) and 2 (that child), answers each with a memfd.
  std::vector<uint32_t> served;
  std::string serve_error;
  std::jthread serve([&] {
    handoff::Expect expect{scope, {{1, me}, {2, role2}}, "rank", 1};
    UniqueFd mine = memfd_of(kBytes);
    try {
      while (!expect.pids.empty()) {
        auto got = listener->accept(expect, deadline);
        if (!got) return;  // the deadline: `served` says who was missing
        served.push_back(got->hello.role);
        expect.pids.erase(got->hello.role);
        handoff::Hello reply = handoff::make_hello(scope, 0);
        reply.sizes[0] = kBytes;
        handoff::send(got->sock.get(), reply, {mine.get()}, deadline, "a peer");
      }
    } catch (const std::exception& e) {
      serve_error = e.what();
    }
  });

  // Peers of this process (its pid is role 1's), one after the other, each until it is refused.
  {
    UniqueFd s = handoff::connect(name, me, "the listener", deadline);
    const char runt[10] = {};
    ASSERT_EQ(ssize_t(sizeof runt), ::send(s.get(), runt, sizeof runt, MSG_NOSIGNAL));
    EXPECT_TRUE(refused(s.get())) << "a hello of 10 bytes";
  }
  {
    UniqueFd s = handoff::connect(name, me, "the listener", deadline);
    UniqueFd small = memfd_of(4096);
    handoff::send(s.get(), hello_of(1), {small.get()}, deadline, "the listener");  // says 1 MiB
    EXPECT_TRUE(refused(s.get())) << "a memfd of 4 KiB for 1 MiB";
  }
  UniqueFd silent = handoff::connect(name, me, "the listener", deadline);  // never speaks
  EXPECT_EQ(0, exit_status(stranger));

  liar_done_w.reset();
  pollfd liar{liar_done.get(), POLLIN, 0};
  EXPECT_EQ(1, ::poll(&liar, 1, 10000)) << "role 2's process did not say that its claim of role 1 was refused";

  // The real role 1, after all of them.
  UniqueFd s = handoff::connect(name, me, "the listener", deadline);
  UniqueFd m = memfd_of(kBytes);
  handoff::send(s.get(), hello_of(1), {m.get()}, deadline, "the listener");
  std::optional<handoff::Received> reply;
  std::string role1_error;
  try {
    reply = handoff::receive(s.get(), handoff::Expect{scope, {{0, me}}, "rank", 1}, deadline, "the listener");
  } catch (const Error& e) {
    role1_error = e.what();
  }
  const int role2_status = exit_status(role2);
  serve.join();
  const bool in_time = !deadline.expired();
  listener.reset();  // the silent peer is refused now
  const std::string log = testing::internal::GetCapturedStderr();

  EXPECT_TRUE(reply && reply->fds.size() == 1) << "role 1 was not served: " << role1_error;
  EXPECT_EQ(0, role2_status) << "role 2's process (4: taken for role 1; 5: not served; 6: no pipe)";
  EXPECT_EQ("", serve_error);
  EXPECT_TRUE(in_time);

  std::sort(served.begin(), served.end());
  EXPECT_EQ((std::vector<uint32_t>{1, 2}), served);
  EXPECT_EQ(5u, count(log, "refused a connection")) << log;
  EXPECT_EQ(1u, count(log, fmt::format("(pid {}): pid {} is none of the ranks awaited (", stranger, stranger))) << log;
  EXPECT_EQ(1u, count(log, fmt::format("(pid {}): pid {} is not rank 1 (pid {})", role2, role2, me))) << log;
  EXPECT_EQ(1u, count(log, "a hello of 10 bytes (expected 64)")) << log;
  EXPECT_EQ(1u, count(log, "the memory of descriptor 0 holds 4096 bytes; 1048576 are needed")) << log;
  EXPECT_EQ(1u, count(log, "it connected but never said hello")) << log;
}

// The side that connects checks who listens: a name held by another process than the one expected
// gets nothing sent to it.
TEST(HandoffProtocol, AListenerThatIsNotTheExpectedProcessIsRefused) {
  const std::string name = shm::random_address("handoff-protocol-squatter");
  handoff::Listener squatter(name, 1, "squatter");
  try {
    handoff::connect(name, 1, "local rank 0", Deadline::after(5s));
    ADD_FAILURE() << "connected to a socket held by pid " << ::getpid() << " as if it were pid 1's";
  } catch (const PeerLostError& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("is held by another process: pid {} is not local rank 0 (pid 1)",
                                                     ::getpid())),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace cohort
