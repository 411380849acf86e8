// Shared-memory transport specifics (the common semantics are in the conformance suite): selection by
// host identity, failure notices through the control socket, and a peer process killed with SIGKILL
// in the middle of a transfer (the survivor fails within 2 s, nothing is left in /dev/shm).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cohort/error.h"
#include "common/host_identity.h"
#include "support/test_support.h"
#include "transport/shm/shm_transport.h"

namespace cohort::test {
namespace {

using transport::Envelope;
using transport::RequestId;
using transport::Transport;

Envelope env(uint64_t tag, uint64_t sub = 0) {
  Envelope e;
  e.tag = tag;
  e.sub = sub;
  e.signature.op = 1;
  return e;
}

void wait(Transport& t, RequestId id, double seconds = 20) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!t.test(id)) {
    if (std::chrono::steady_clock::now() > end) throw TimeoutError("shm transport test wait timed out");
    t.poll(10);
  }
}

std::set<std::string> dev_shm_entries() {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm", ec)) out.insert(e.path().filename().string());
  return out;
}

TEST(ShmTransport, ReachesOnlyPeersWithTheSameHostIdentity) {
  auto a = transport::make_shm_transport({0, 2, "reach", Deadline::after(std::chrono::seconds(5))});
  std::unique_ptr<Transport> other_host;
  {
    ScopedHostIdOverride elsewhere("another-host");
    other_host = transport::make_shm_transport({1, 2, "reach", Deadline::after(std::chrono::seconds(5))});
  }
  EXPECT_EQ(a->descriptor().rfind("shm;", 0), 0u);
  EXPECT_TRUE(a->can_reach(a->descriptor()));
  EXPECT_FALSE(a->can_reach(other_host->descriptor()));
  EXPECT_FALSE(other_host->can_reach(a->descriptor()));
  EXPECT_FALSE(a->can_reach("tcp;whatever;1;127.0.0.1"));
}

TEST(ShmTransport, FailureNoticeReachesThePeerWithItsClass) {
  const int world = 2;
  std::vector<std::unique_ptr<Transport>> ts(world);
  std::vector<transport::PeerInfo> peers(world);
  for (int r = 0; r < world; ++r) {
    ts[size_t(r)] = transport::make_shm_transport({r, world, "notice", Deadline::after(std::chrono::seconds(10))});
    peers[size_t(r)] = {"host-" + std::to_string(r), ts[size_t(r)]->descriptor()};
  }
  run_ranks(world, [&](int r) {
    std::vector<bool> use{r != 0, r != 1};
    ts[size_t(r)]->connect(peers, use, Deadline::after(std::chrono::seconds(10)));
  });
  uint64_t v = 0;
  auto rid = ts[1]->irecv(0, env(4), &v, 8);
  ts[0]->notify_peers(Transport::ErrorClass::kMismatch, "mismatched calls: boom");
  auto start = std::chrono::steady_clock::now();
  try {
    wait(*ts[1], rid, 5);
    ADD_FAILURE() << "the receive completed";
  } catch (const MismatchError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 (host-0) failed: mismatched calls: boom"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

// Reads exactly n bytes from a pipe (the test's side channel for descriptors).
bool read_exact(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = ::read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= size_t(r);
  }
  return true;
}
void write_string(int fd, const std::string& s) {
  uint32_t n = uint32_t(s.size());
  (void)!::write(fd, &n, sizeof n);
  (void)!::write(fd, s.data(), s.size());
}
std::string read_string(int fd) {
  uint32_t n = 0;
  if (!read_exact(fd, &n, sizeof n)) return {};
  std::string s(n, '\0');
  if (!read_exact(fd, s.data(), n)) return {};
  return s;
}

TEST(ShmTransport, SigkillOfThePeerMidTransferFailsTheSurvivorWithinTwoSecondsAndLeavesNothing) {
  const auto before = dev_shm_entries();
  int to_child[2], to_parent[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(to_parent), 0);
  const size_t bytes = 64u << 20;
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Rank 1: connects, says it started, then streams a large message slowly (the ring fills and
    // it sleeps between polls) until it is killed.
    int rc = 1;
    try {
      auto t = transport::make_shm_transport({1, 2, "sigkill", Deadline::after(std::chrono::seconds(10))});
      write_string(to_parent[1], t->descriptor());
      std::string d0 = read_string(to_child[0]);
      t->connect({{"survivor-host", d0}, {"victim-host", t->descriptor()}}, {true, false},
                 Deadline::after(std::chrono::seconds(10)));
      std::vector<char> big(bytes, 'x');
      uint64_t hello = 42;
      wait(*t, t->isend(0, env(1), &hello, 8));
      auto id = t->isend(0, env(2), big.data(), bytes);
      while (!t->test(id)) {
        t->poll(0);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      rc = 0;  // not expected: the parent kills it first
    } catch (...) {
    }
    ::_exit(rc);
  }
  auto t = transport::make_shm_transport({0, 2, "sigkill", Deadline::after(std::chrono::seconds(10))});
  std::string d1 = read_string(to_parent[0]);
  ASSERT_FALSE(d1.empty());
  write_string(to_child[1], t->descriptor());
  t->connect({{"survivor-host", t->descriptor()}, {"victim-host", d1}}, {false, true},
             Deadline::after(std::chrono::seconds(10)));
  uint64_t hello = 0;
  wait(*t, t->irecv(1, env(1), &hello, 8));
  ASSERT_EQ(hello, 42u);
  std::vector<char> big(bytes);
  auto id = t->irecv(1, env(2), big.data(), bytes);
  // Let some of it arrive, then kill the sender mid-transfer.
  for (int i = 0; i < 5; ++i) t->poll(5);
  ASSERT_FALSE(t->peek(id)) << "the transfer finished before the kill; the test needs a slower sender";
  ::kill(child, SIGKILL);
  auto start = std::chrono::steady_clock::now();
  try {
    wait(*t, id, 10);
    ADD_FAILURE() << "the receive completed although the sender was killed";
  } catch (const PeerLostError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 (victim-host)"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status));
  t.reset();
  for (int fd : {to_child[0], to_child[1], to_parent[0], to_parent[1]}) ::close(fd);
  const auto after = dev_shm_entries();
  for (const auto& name : after) EXPECT_TRUE(before.count(name)) << "/dev/shm/" << name << " appeared";
}

}  // namespace
}  // namespace cohort::test
