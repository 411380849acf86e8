// Hostile tests of the shared-memory handoffs (common/handoff.h, docs/security.md "Shared memory on
// one host"): while a job bootstraps, processes that are not part of it (one of another uid, started
// with setpriv, one of the job's own uid) find its abstract sockets in /proc/net/unix and try to get
// in with plausible hellos (shm_intruder). They must get nothing, and the job must complete with
// correct sums. And the checks themselves: a memfd shorter than its peer claims is refused before it
// is mapped, not found by a SIGBUS.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cohort/error.h"
#include "cohort/store.h"
#include "collectives/shm/group.h"
#include "common/fd.h"
#include "common/handoff.h"
#include "common/socket.h"
#include "store/tcp_store.h"
#include "support/fork_ranks.h"
#include "support/test_support.h"
#include "transport/shm/segment.h"
#include "transport/shm/shm_transport.h"

extern char** environ;

namespace cohort {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr int kOtherUid = 65534;  // nobody: needs no account of its own

// Starts argv (PATH lookup for argv[0]) with this environment less `drop` (names), stdout and stderr
// to `out`. Returns the pid.
pid_t spawn(const std::vector<std::string>& args, const std::string& out, const std::vector<std::string>& drop = {}) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string v(*e);
    bool keep = true;
    for (const auto& d : drop) keep = keep && v.rfind(d + "=", 0) != 0;
    if (keep) env.push_back(v);
  }
  std::vector<std::string> a = args;
  std::vector<char*> argv, envp;
  for (auto& s : a) argv.push_back(s.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) ADD_FAILURE() << "cannot start " << args[0] << ": " << std::strerror(rc);
  return rc == 0 ? pid : -1;
}

// Waits until `file` contains `text` (true), or `pid` ends or 10 s pass (false).
bool wait_for_text(const std::string& file, const std::string& text, pid_t pid) {
  const auto end = Clock::now() + 10s;
  while (Clock::now() < end) {
    if (test::read_file(file).find(text) != std::string::npos) return true;
    if (!test::process_alive(pid)) return test::read_file(file).find(text) != std::string::npos;
    std::this_thread::sleep_for(2ms);
  }
  return false;
}

// The intruders of one test: one of another uid (only where this test may change uid: root) and one
// of this uid that is not part of the job.
struct Intruder {
  std::string who;
  pid_t pid = -1;
  std::string out;
};

// shm_intruder with `other` as another uid, and with `same` as this uid.
std::vector<Intruder> start_intruders(const test::TempDir& dir, const std::vector<std::string>& other,
                                      const std::vector<std::string>& same) {
  std::vector<Intruder> all;
  if (::geteuid() == 0) {
    std::vector<std::string> a = {"setpriv", "--reuid=" + std::to_string(kOtherUid),
                                  "--regid=" + std::to_string(kOtherUid), "--clear-groups", SHM_INTRUDER};
    a.insert(a.end(), other.begin(), other.end());
    all.push_back({"uid " + std::to_string(kOtherUid), spawn(a, dir.file("intruder-uid")), dir.file("intruder-uid")});
  } else {
    std::printf("not root: no intruder of another uid (setpriv needs root)\n");
  }
  std::vector<std::string> a = {SHM_INTRUDER};
  a.insert(a.end(), same.begin(), same.end());
  all.push_back({"same uid", spawn(a, dir.file("intruder-same")), dir.file("intruder-same")});
  return all;
}

void expect_refused(const std::vector<Intruder>& intruders) {
  for (const auto& i : intruders) {
    const int status = test::wait_for_exit(i.pid, Clock::now() + 15s);
    const std::string out = test::read_file(i.out);
    EXPECT_TRUE(test::exited_zero(status)) << "intruder of " << i.who << ": " << out;
    EXPECT_NE(out.find("refused"), std::string::npos) << "intruder of " << i.who << ": " << out;
  }
}

// ---------------------------------------------------------------------------------- the transport

// A job of 4 ranks (real processes, a file store) whose ranks 1 and 2 wait for rank 0 with their shm
// transport's sockets open. An intruder claiming to be rank 0 says hello to each, then rank 0 starts:
// before the check, rank 1 took the intruder for rank 0, handed it its rings and mapped the
// intruder's 4 KiB memfd as its megabyte ring; the real rank 0 was turned away and the job timed out.
TEST(ShmHandoff, IntrudersAtTheTransportsSocketsAreRefusedAndTheJobCompletes) {
  test::TempDir dir;
  const std::string store = dir.file("store");
  const int world = 4;
  const std::vector<std::string> drop = {"COHORT_HOST_ID", "COHORT_TRANSPORT", "COHORT_SHM_COLLECTIVES",
                                         "COHORT_HIERARCHICAL"};
  auto rank_args = [&](int r) {
    return std::vector<std::string>{SHM_HIER_WORKER, store, std::to_string(r), std::to_string(world), "expect-flat"};
  };
  std::vector<pid_t> ranks(world, -1);
  for (int r = 1; r < world; ++r) ranks[r] = spawn(rank_args(r), dir.file("rank" + std::to_string(r)), drop);
  // Each intruder has its own victim, so that each refusal is seen: rank 1 (another uid), rank 2 (this uid).
  std::vector<Intruder> intruders = start_intruders(dir, {"p2p", std::to_string(ranks[1]), "1", "0"},
                                                    {"p2p", std::to_string(ranks[2]), "2", "0"});
  for (const auto& i : intruders)
    ASSERT_TRUE(wait_for_text(i.out, "sent", i.pid)) << "intruder of " << i.who << ": " << test::read_file(i.out);
  ranks[0] = spawn(rank_args(0), dir.file("rank0"), drop);

  const auto end = Clock::now() + 60s;
  for (int r = 0; r < world; ++r) {
    const int status = test::wait_for_exit(ranks[r], end);
    const std::string out = test::read_file(dir.file("rank" + std::to_string(r)));
    EXPECT_TRUE(test::exited_zero(status)) << "rank " << r << ": " << out;
    EXPECT_NE(out.find("ok"), std::string::npos) << "rank " << r << ": " << out;
  }
  expect_refused(intruders);
  // One warning each, naming why.
  if (::geteuid() == 0) {
    EXPECT_NE(test::read_file(dir.file("rank1")).find("runs as uid " + std::to_string(kOtherUid)), std::string::npos)
        << test::read_file(dir.file("rank1"));
  }
  EXPECT_NE(test::read_file(dir.file("rank2")).find("is none of the ranks awaited"), std::string::npos)
      << test::read_file(dir.file("rank2"));
}

// ------------------------------------------------------------------------------------ the segment

// The shm collectives' group of 4 ranks (real processes, a file store, the pids from the store as
// the communicator gives them). Local rank 0 offers the segment while the other ranks wait for "go";
// two intruders claiming to be local rank 1 say hello first. Before the check, local rank 0 handed
// the first its segment and then failed the job on the real local rank 1 ("joined twice").
TEST(ShmHandoff, IntrudersAtTheSegmentsSocketAreRefusedAndTheGroupSumsRight) {
  test::TempDir dir;
  const std::string path = dir.file("store");
  const int world = 4;
  const size_t bytes = shm::Group::segment_bytes(world, shm::GroupOptions::from_env(world));
  auto err_file = [&](int r) { return dir.file("err" + std::to_string(r)); };  // each rank's stderr
  auto pids = test::fork_ranks(world, [&](int r) {
    auto store = make_file_store(path);
    store->set("pid/" + std::to_string(r), std::to_string(::getpid()));
    if (r > 0) store->wait({"go"}, 30s);
    std::vector<std::string> keys;
    for (int q = 0; q < world; ++q) keys.push_back("pid/" + std::to_string(q));
    store->wait(keys, 30s);
    std::vector<int> local_pids;
    for (const auto& v : store->multi_get(keys)) local_pids.push_back(std::stoi(v));
    auto group = shm::Group::create(*store, r, world, "hostile", 30000ms, local_pids);
    std::vector<double> x(1001, r + 1.0);
    group->allreduce(x.data(), x.data(), x.size(), DataType::kFloat64, ReduceOp::kSum);
    for (double v : x)
      if (v != world * (world + 1) / 2.0) return 1;
    // A later segment of the group (allocate_shared) goes to the same processes.
    auto shared = group->allocate_shared(4096);
    group->barrier();
    return shared ? 0 : 2;
  }, err_file);
  const std::vector<std::string> args = {"segment", std::to_string(pids[0]), std::to_string(world),
                                         std::to_string(bytes)};
  std::vector<Intruder> intruders = start_intruders(dir, args, args);
  for (const auto& i : intruders)
    ASSERT_TRUE(wait_for_text(i.out, "sent", i.pid)) << "intruder of " << i.who << ": " << test::read_file(i.out);
  make_file_store(path)->set("go", "1");

  const auto end = Clock::now() + 60s;
  for (int r = 0; r < world; ++r) {
    const int status = test::wait_for_exit(pids[r], end);
    EXPECT_TRUE(test::exited_zero(status)) << "rank " << r << ": " << test::read_file(err_file(r));
  }
  expect_refused(intruders);
  const std::string log0 = test::read_file(dir.file("err0"));
  if (::geteuid() == 0) {
    EXPECT_NE(log0.find("runs as uid " + std::to_string(kOtherUid)), std::string::npos) << log0;
  }
  EXPECT_NE(log0.find("is none of the local ranks awaited"), std::string::npos) << log0;
}

// ------------------------------------------------------------------------------ the checks alone

TEST(ShmHandoff, RefusalNamesTheUidOrThePidThatDoNotMatch) {
  int sv[2];
  ASSERT_EQ(0, ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv));
  UniqueFd a(sv[0]), b(sv[1]);
  const handoff::Credentials me = handoff::peer_of(a.get());
  EXPECT_EQ(me.pid, ::getpid());
  EXPECT_EQ(me.uid, ::geteuid());
  EXPECT_EQ("", handoff::refusal(me, ::getpid(), "rank 1"));
  EXPECT_EQ("", handoff::refusal(me, 0, "rank 1"));
  EXPECT_NE(handoff::refusal(me, ::getpid() + 1, "rank 1").find("is not rank 1"), std::string::npos);
  handoff::Credentials other = me;
  other.uid = me.uid + 1;
  EXPECT_NE(handoff::refusal(other, ::getpid(), "rank 1").find("runs as uid"), std::string::npos);
}

TEST(ShmHandoff, AMemfdShorterThanClaimedIsRefusedBeforeItIsMapped) {
  UniqueFd m(::memfd_create("short", MFD_CLOEXEC));
  ASSERT_TRUE(m);
  ASSERT_EQ(0, ::ftruncate(m.get(), 4096));
  EXPECT_EQ("", handoff::too_small(m.get(), 4096, "it"));
  EXPECT_NE(handoff::too_small(m.get(), 4097, "it").find("it holds 4096 bytes; 4097 are needed"), std::string::npos);
}

// A "local rank 0" of this very process (so every credential check passes) that sends a 4 KiB memfd
// for a 1 MiB segment: local rank 1 refuses it with a MismatchError. Before, it mapped it, and its
// first touch past 4 KiB was a SIGBUS.
TEST(ShmHandoff, ASegmentShorterThanAgreedIsRefusedNotABusError) {
  const std::string address = shm::random_address("short-segment");
  const size_t bytes = size_t{1} << 20;
  std::thread fake_rank0([&] {
    handoff::Listener listener(address, 1, "fake local rank 0");
    auto got = listener.accept(handoff::Expect{handoff::scope_of(address), {{1, 0}}, "local rank", 0}, Deadline::after(10s));
    ASSERT_TRUE(got);
    UniqueFd m(::memfd_create("short", MFD_CLOEXEC));
    ASSERT_EQ(0, ::ftruncate(m.get(), 4096));
    handoff::Hello reply = handoff::make_hello(handoff::scope_of(address), 0);
    reply.sizes[0] = bytes;  // a lie: the memfd holds 4 KiB
    handoff::send(got->sock.get(), reply, {m.get()}, Deadline::after(10s), "local rank 1");
    char end;
    (void)::recv(got->sock.get(), &end, 1, 0);  // until local rank 1 closes its end
  });
  try {
    shm::Segment seg = shm::Segment::establish(address, 1, 2, bytes, Deadline::after(10s), shm::SegmentRange{0, 0});
    static_cast<volatile char*>(seg.data())[bytes - 1] = 1;  // SIGBUS, had it been mapped
    ADD_FAILURE() << "a 4096-byte segment was taken for a " << bytes << "-byte one";
  } catch (const MismatchError& e) {
    EXPECT_NE(std::string(e.what()).find("holds 4096 bytes"), std::string::npos) << e.what();
  }
  fake_rank0.join();
}

}  // namespace
}  // namespace cohort
