// The processes that hold a shard's locks (table.h: holders): a worker killed holding a row's lock or
// the lock that creates rows stalls nobody and leaves no half update; a wait on a live holder times out
// naming it; only the job's own processes may attach to a server's socket. Where a process must die or
// belong to another user, it is a real one (ps_worker, or a forked child), meeting the test's threads
// through a file store.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <poll.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cohort/error.h"
#include "cohort/ps.h"
#include "common/fd.h"
#include "common/handoff.h"
#include "common/socket.h"
#include "ps/config_json.h"
#include "ps/table.h"
#include "ps/wire.h"
#include "ps_test_util.h"
#include "store/memory_store.h"
#include "store/tcp_store.h"
#include "support/test_support.h"

extern char** environ;

namespace cohort::ps {
namespace {

using test_util::kTimeout;
using test_util::pull_rows;
using test_util::run_job;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A ps_worker process (tests/ps/ps_worker.cc) with its output in `log`; SIGKILLed and reaped when
// the object goes, unless kill() did it.
class Child {
 public:
  Child(const std::vector<std::string>& args, std::string log) : log_(std::move(log)) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    const int rc = posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) throw std::runtime_error("posix_spawn " + args[0] + ": " + std::strerror(rc));
  }
  ~Child() { kill(); }
  int pid() const { return pid_; }
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  std::string output() const { return test::read_file(log_); }
  // Waits (at most 60 s) until its output holds `what`.
  void wait_for(const std::string& what) const {
    for (auto until = Clock::now() + std::chrono::seconds(60); Clock::now() < until;) {
      if (output().find(what) != std::string::npos) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    throw std::runtime_error("the child never printed '" + what + "': " + output());
  }

 private:
  std::string log_;
  pid_t pid_ = -1;
};

// This process's own mapping of a shard's memfd named `name` ("cohort-ps-rows", "cohort-ps-header"),
// found among its descriptors (the server, a thread here, holds it) once the file has `bytes`:
// the test reads the shared memory as another process of the job would.
class Peek {
 public:
  Peek(const std::string& name, size_t bytes) : size_(bytes) {
    const std::string want = "/memfd:" + name + " (deleted)";
    for (auto until = Clock::now() + std::chrono::seconds(60); Clock::now() < until;
         std::this_thread::sleep_for(std::chrono::milliseconds(5))) {
      for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
        std::error_code ec;
        if (std::filesystem::read_symlink(e.path(), ec).string() != want) continue;
        UniqueFd fd(::open(e.path().c_str(), O_RDONLY | O_CLOEXEC));
        struct stat st {};
        if (!fd || ::fstat(fd.get(), &st) != 0 || size_t(st.st_size) < bytes) continue;
        void* p = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd.get(), 0);
        if (p == MAP_FAILED) continue;
        base_ = static_cast<const uint8_t*>(p);
        return;
      }
    }
    throw std::runtime_error("no memfd '" + name + "' of " + std::to_string(bytes) + " bytes appeared");
  }
  ~Peek() { ::munmap(const_cast<uint8_t*>(base_), size_); }
  const uint8_t* at(size_t offset) const { return base_ + offset; }
  uint64_t word(size_t offset) const {
    return __atomic_load_n(reinterpret_cast<const uint64_t*>(base_ + offset), __ATOMIC_ACQUIRE);
  }
  uint32_t word32(size_t offset) const {
    return __atomic_load_n(reinterpret_cast<const uint32_t*>(base_ + offset), __ATOMIC_ACQUIRE);
  }

 private:
  const uint8_t* base_ = nullptr;
  size_t size_;
};

// Stops process `pid` (SIGSTOP) once `held()` and `part_written()` hold while it is stopped: it
// holds a lock and is in the middle of its writes. Tries again (SIGCONT) for up to 60 s.
void stop_while(int pid, const std::function<bool()>& held, const std::function<bool()>& part_written) {
  for (auto until = Clock::now() + std::chrono::seconds(60); Clock::now() < until;) {
    while (!held() && Clock::now() < until) std::this_thread::yield();
    ::kill(pid, SIGSTOP);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, WUNTRACED), pid);
    ASSERT_TRUE(WIFSTOPPED(status)) << "status " << status;
    if (held() && part_written()) return;
    ::kill(pid, SIGCONT);
  }
  FAIL() << "never stopped process " << pid << " while it held the lock";
}

// Waits (at most 20 s) until `n` threads of this process wait for a shard's lock (table.h), so that
// a test ends the holder only once its waiters are caught in the wait it is about. On failure the
// test goes on, so that the holder is still killed and nothing waits for it.
void wait_for_lock_waits(int n) {
  for (auto until = Clock::now() + std::chrono::seconds(20); lock_waits_in_process() < n;) {
    ASSERT_LT(Clock::now(), until) << lock_waits_in_process() << " of " << n << " threads wait for the lock";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ps_worker hold: worker 1 of 1 server and `workers` workers pushes to row 7 of "big" (one row of
// 2^20 float32 values, SGD, lr 1), which lives at the start of the server's rows file.
constexpr uint32_t kBigDim = 1u << 20;
constexpr size_t kBigRow = 16 + size_t(kBigDim) * 4;  // version, id, values (table.h: row layout)

float value_at(const Peek& rows, uint32_t j) {
  float v;
  std::memcpy(&v, rows.at(16 + size_t(j) * 4), 4);
  return v;
}

// A worker process stopped while it writes a row in place, then SIGKILLed: the server and the other
// workers waiting for that row (a push on the shared row, a save that reads every row) go on within
// a moment of the death, not after COHORT_TIMEOUT; the row comes back unlocked and whole, as before
// the dead worker's update, plus the push that waited; one warning names the worker; the server
// fails at once naming the worker it lost (the launcher would end the job on it).
TEST(PsShared, AWorkerKilledHoldingARowsLockStallsNobodyAndItsHalfUpdateIsUndone) {
  test::TempDir dir;
  const std::string store_path = dir.file("store");
  auto store = make_file_store(store_path);
  const Roles roles{1, 3};
  constexpr std::chrono::milliseconds kLong{20000};  // COHORT_TIMEOUT here: no wait may come near it
  std::string server_error;
  Clock::time_point server_end;
  std::jthread server([&] {
    try {
      serve(store, 0, roles, {}, kLong);
    } catch (const std::exception& e) {
      server_error = e.what();
    }
    server_end = Clock::now();
  });
  // Declared after the server: on an early return it is killed before the server is joined.
  Child holder({COHORT_PS_WORKER, "hold", store_path, "1", "1", "3"}, dir.file("holder.log"));
  std::unique_ptr<Client> w0, w2;
  std::jthread join2([&] { w2 = Client::create(store, 2, roles, kLong); });
  w0 = Client::create(store, 0, roles, kLong);
  join2.join();
  holder.wait_for("holding row 7");
  Peek rows("cohort-ps-rows", kBigRow);
  // Worker 0 maps the shard now, through another row (a pull of row 7 would rarely find it unlocked
  // for the whole copy while worker 1 pushes to it without a pause).
  pull_rows(*w0, "big", {8});
  stop_while(
      holder.pid(), [&] { return (rows.word(0) & 1) != 0; },
      [&] { return value_at(rows, 0) != value_at(rows, kBigDim - 1); });
  if (HasFatalFailure()) return;
  const float before = value_at(rows, kBigDim - 1), after = value_at(rows, 0);
  ASSERT_EQ(after, before - 1.0f);

  testing::internal::CaptureStderr();
  const uint64_t id = 7;
  std::vector<float> ones(kBigDim, 1.0f);
  std::string push_error, save_error;
  Clock::time_point pushed, saved;
  std::jthread pusher([&] {  // on the shared row: waits for its lock
    try {
      w0->push("big", &id, 1, ones.data());
    } catch (const std::exception& e) {
      push_error = e.what();
    }
    pushed = Clock::now();
  });
  std::jthread saver([&] {  // the server reads every row: it waits for that lock too
    try {
      w2->save(dir.file("saved"));
    } catch (const std::exception& e) {
      save_error = e.what();
    }
    saved = Clock::now();
  });
  wait_for_lock_waits(2);  // the push and the save's read of row 7
  const Clock::time_point killed = Clock::now();
  const int dead = holder.pid();
  holder.kill();
  pusher.join();
  saver.join();
  server.join();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_LT(seconds_since(killed, pushed), 3.0) << push_error;
  EXPECT_EQ(push_error, "");
  EXPECT_LT(seconds_since(killed, saved), 5.0) << save_error;  // answered, or failed on the lost server
  EXPECT_LT(seconds_since(killed, server_end), 5.0) << server_error;
  EXPECT_NE(server_error.find("lost worker 1"), std::string::npos) << server_error;
  // Unlocked, and whole: the dead worker's half-written update is gone, worker 0's push is in.
  EXPECT_EQ(rows.word(0) & 1, 0u);
  for (uint32_t j = 0; j < kBigDim; ++j) ASSERT_EQ(value_at(rows, j), before - 1.0f) << "column " << j;
  EXPECT_EQ(count_of(err, "died holding the lock of row 7"), 1u) << err;
  EXPECT_NE(err.find("table 'big': worker 1 (pid " + std::to_string(dead) +
                     ") died holding the lock of row 7; its unfinished update was discarded"),
            std::string::npos)
      << err;
}

// A lock held past COHORT_TIMEOUT by a live process (stopped here): the waiter's error names the
// row's holder, whether it writes the row (push) or reads it (pull). Once the holder is dead, the
// same push goes through.
TEST(PsShared, ALockWaitThatTimesOutNamesTheRowsHolder) {
  test::TempDir dir;
  const std::string store_path = dir.file("store");
  auto store = make_file_store(store_path);
  const Roles roles{1, 2};
  std::jthread server([&] {
    try {
      serve(store, 0, roles, {}, std::chrono::seconds(20));
    } catch (const std::exception& e) {  // worker 1 is killed below
      EXPECT_NE(std::string(e.what()).find("lost worker 1"), std::string::npos) << e.what();
    }
  });
  Child holder({COHORT_PS_WORKER, "hold", store_path, "1", "1", "2"}, dir.file("holder.log"));
  holder.wait_for("worker 1 starting");
  auto w0 = Client::create(store, 0, roles, std::chrono::seconds(2));  // its lock waits end after 2 s
  holder.wait_for("holding row 7");
  Peek rows("cohort-ps-rows", kBigRow);
  stop_while(
      holder.pid(), [&] { return (rows.word(0) & 1) != 0; }, [] { return true; });
  if (HasFatalFailure()) return;
  const std::string holder_named = "by worker 1 (pid " + std::to_string(holder.pid()) + "), which is alive";
  const uint64_t id = 7;
  std::vector<float> row(kBigDim, 1.0f);
  for (bool push : {true, false}) {
    const auto t0 = Clock::now();
    try {
      if (push) w0->push("big", &id, 1, row.data());
      else w0->pull("big", &id, 1, row.data());
      ADD_FAILURE() << "a " << (push ? "push" : "pull") << " went through a row locked by a stopped process";
    } catch (const TimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("table 'big': the lock of row 7 was held for more than 2 s (COHORT_TIMEOUT)"),
                std::string::npos) << what;
      EXPECT_NE(what.find(holder_named), std::string::npos) << what;
    }
    EXPECT_LT(seconds_since(t0, Clock::now()), 10.0);
  }
  // Waiting when the holder dies (after the death, the server fails on its lost worker and retires
  // the table, so a call that starts then is refused): it goes through within its 2 s.
  std::fill(row.begin(), row.end(), 1.0f);
  std::string push_error;
  std::jthread pusher([&] {
    try {
      w0->push("big", &id, 1, row.data());
    } catch (const std::exception& e) {
      push_error = e.what();
    }
  });
  wait_for_lock_waits(1);
  holder.kill();
  pusher.join();
  EXPECT_EQ(push_error, "");
  EXPECT_EQ(rows.word(0) & 1, 0u);
  // The server fails on its lost worker 1 by itself; joined first, so that it and worker 0's
  // closing do not format their errors at once (libstdc++'s regex has a benign race TSan reports).
  server.join();
  w0.reset();
}

// A worker process stopped while it holds the lock that creates rows, then SIGKILLed: a worker that
// creates rows goes on within a moment, one warning names the dead worker, and no id got two rows
// (the row count is that of the distinct ids created).
TEST(PsShared, AWorkerKilledHoldingTheLockThatCreatesRowsStallsNobody) {
  test::TempDir dir;
  const std::string store_path = dir.file("store");
  auto store = make_file_store(store_path);
  const Roles roles{1, 2};
  constexpr std::chrono::milliseconds kLong{20000};
  std::jthread server([&] {
    try {
      serve(store, 0, roles, {}, kLong);
    } catch (const std::exception& e) {  // worker 1 is killed below
      EXPECT_NE(std::string(e.what()).find("lost worker 1"), std::string::npos) << e.what();
    }
  });
  Child creator({COHORT_PS_WORKER, "create-rows", store_path, "1", "1", "2"}, dir.file("creator.log"));
  auto w0 = Client::create(store, 0, roles, kLong);
  creator.wait_for("creating rows");
  pull_rows(*w0, "fresh", {0});  // worker 0 maps the shard now (attaching takes a message to the server)
  Peek header("cohort-ps-header", header_rows_offset() + 8);
  // Only worker 1 creates rows meanwhile: the insert lock is its while it is not 0.
  stop_while(
      creator.pid(), [&] { return header.word32(header_insert_lock_offset()) != 0; }, [] { return true; });
  if (HasFatalFailure()) return;
  const uint64_t created = header.word(header_rows_offset());
  ASSERT_GT(created, 1u);

  // Worker 0 pushes to every id worker 1 has created (2^40, 2^40 + 1, ... in order, one row each,
  // id 0 aside), and to 100 new ones. Worker 1's last counted row may lack its index entry: then the
  // waiter that takes the lock over enters it, and no id gets a second row.
  testing::internal::CaptureStderr();
  std::vector<uint64_t> ids;
  for (uint64_t i = 0; i < created - 1; ++i) ids.push_back((uint64_t(1) << 40) + i);
  for (uint64_t i = 1; i <= 100; ++i) ids.push_back(i);
  std::vector<float> g(ids.size() * 4, 1.0f);
  std::string push_error;
  Clock::time_point pushed;
  std::jthread pusher([&] {
    try {
      w0->push("fresh", ids.data(), ids.size(), g.data());
    } catch (const std::exception& e) {
      push_error = e.what();
    }
    pushed = Clock::now();
  });
  wait_for_lock_waits(1);  // for the insert lock
  const Clock::time_point killed = Clock::now();
  const int dead = creator.pid();
  creator.kill();
  pusher.join();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_LT(seconds_since(killed, pushed), 3.0) << push_error;
  EXPECT_EQ(push_error, "");
  EXPECT_EQ(header.word(header_rows_offset()), created + 100) << "an id got a second row, or a row was lost";
  EXPECT_EQ(header.word32(header_insert_lock_offset()), 0u);
  EXPECT_EQ(count_of(err, "died holding the lock that creates rows"), 1u) << err;
  EXPECT_NE(err.find("table 'fresh': worker 1 (pid " + std::to_string(dead) +
                     ") died holding the lock that creates rows"),
            std::string::npos)
      << err;
  server.join();  // it fails on its lost worker 1 by itself; before worker 0 closes, as above
}

// A process that is not the worker asking to attach (another user's, or another process of this
// user's), listening on the socket named in the request: the server checks the socket's owner
// (SO_PEERCRED) before it sends the table's memory, refuses with one line, and serves on. The
// asking worker speaks the wire protocol itself here, as a worker that names a socket it does not own.
TEST(PsShared, AnAttachToASocketOfAnotherUserOrProcessIsRefusedAndTheServerServesOn) {
  const bool root = ::geteuid() == 0;
  // The owners: forked before any thread starts. Each listens, takes one connection, and exits 0 when
  // it got no descriptors, 1 when it got some, 2 when nobody connected within 30 s.
  struct Owner {
    std::string socket;
    int pid = -1;
    bool other_user = false;
  };
  std::vector<Owner> owners;
  for (bool other_user : {true, false}) {
    if (other_user && !root) continue;  // starting a process of another user takes root
    Owner o;
    o.other_user = other_user;
    o.socket = "cohort-ps-test-owner-" + std::to_string(::getpid()) + (other_user ? "-nobody" : "-same-user");
    socklen_t len = 0;
    const sockaddr_un addr = net::abstract_address(o.socket, &len);
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    o.pid = ::fork();
    ASSERT_GE(o.pid, 0);
    if (o.pid == 0) {
      if (other_user && ::syscall(SYS_setuid, 65534) != 0) ::_exit(3);  // nobody
      const int l = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
      if (l < 0 || ::bind(l, reinterpret_cast<const sockaddr*>(&addr), len) != 0 || ::listen(l, 4) != 0) ::_exit(4);
      (void)!::write(ready[1], "r", 1);
      pollfd p{l, POLLIN, 0};
      if (::poll(&p, 1, 30000) != 1) ::_exit(2);
      const int c = ::accept(l, nullptr, nullptr);
      char tag;
      alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
      iovec iov{&tag, 1};
      msghdr m{};
      m.msg_iov = &iov;
      m.msg_iovlen = 1;
      m.msg_control = control;
      m.msg_controllen = sizeof control;
      pollfd q{c, POLLIN, 0};
      if (::poll(&q, 1, 2000) == 1 && ::recvmsg(c, &m, 0) > 0 && m.msg_controllen > 0) ::_exit(1);
      ::_exit(0);
    }
    ::close(ready[1]);
    char r;
    ASSERT_EQ(::read(ready[0], &r, 1), 1) << "the socket owner did not start";
    ::close(ready[0]);
    owners.push_back(o);
  }

  auto store = make_memory_store();
  const Roles roles{1, 2};
  TableConfig cfg;
  cfg.dim = 4;
  cfg.lr = 1.0f;
  std::barrier created(2);
  testing::internal::CaptureStderr();
  std::vector<std::string> whys;
  test::run_ranks(3, [&](int r) {
    if (r == 0) return serve(store, 0, roles, {}, kTimeout);
    if (r == 1) {  // worker 0: a client as any
      auto c = Client::create(store, 0, roles, kTimeout);
      c->create_table("t", cfg);
      created.arrive_and_wait();
      created.arrive_and_wait();  // worker 1's attaches were refused
      const std::vector<uint64_t> ids = {1, 2, 3};
      std::vector<float> g(12, 1.0f);
      c->push("t", ids.data(), ids.size(), g.data());
      EXPECT_EQ(pull_rows(*c, "t", ids), std::vector<float>(12, -1.0f));
      EXPECT_EQ(c->stats("t").direct_applied_rows, 3u);  // worker 0 itself attached
      return;
    }
    // Worker 1, by hand: the requests of include/cohort/ps.h's client, one at a time.
    Endpoint ep(store, "ps", roles.worker_rank(1), {true, false, false}, kTimeout);
    uint64_t seq = 0;
    auto call = [&](Op op, const std::string& table, const std::string& payload) {
      RequestHeader h;
      h.op = op;
      if (!table.empty()) set_table_name(h, table);
      h.payload = payload.size();
      ReplyHeader reply;
      std::string body;
      Posted sends[2] = {ep.isend(0, Msg::kRequest, seq, &h, sizeof h),
                         payload.empty() ? Posted{}
                                         : ep.isend(0, Msg::kRequestPayload, seq, payload.data(), payload.size())};
      Posted got = ep.irecv(0, Msg::kReply, seq, &reply, sizeof reply);
      while (!ep.test(got)) ep.poll(10);
      if (reply.payload > 0) {
        body.resize(reply.payload);
        Posted rest = ep.irecv(0, Msg::kReplyPayload, seq, body.data(), body.size());
        while (!ep.test(rest)) ep.poll(10);
      }
      for (auto& p : sends)
        while (p && !ep.test(p)) ep.poll(10);
      ++seq;
      EXPECT_EQ(reply.status, Status::kOk) << reply.message;
      return body;
    };
    call(Op::kHello, "", "");
    created.arrive_and_wait();
    for (const Owner& o : owners) {
      const std::string request = nlohmann::json{{"socket", o.socket}, {"pid", ::getpid()}}.dump();
      const auto j = nlohmann::json::parse(call(Op::kAttach, "t", request));
      EXPECT_FALSE(j.at("attached").get<bool>()) << j.dump();
      whys.push_back(j.value("why", ""));
    }
    created.arrive_and_wait();
    call(Op::kBye, "", "");
  });
  const std::string err = testing::internal::GetCapturedStderr();
  size_t k = 0;
  for (const Owner& o : owners) {
    int status = 0;
    ASSERT_EQ(::waitpid(o.pid, &status, 0), o.pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << (o.other_user ? "another user's" : "another process's") << " socket got the table's memory, or no "
        << "connection (status " << status << ")";
    const std::string expected =
        o.other_user
            ? fmt::format("its socket '{}' is held by another process: pid {} runs as uid 65534, not as this job's "
                          "uid 0", o.socket, o.pid)
            : fmt::format("its socket '{}' is held by another process: pid {} is not worker 1 (pid {})", o.socket,
                          o.pid, ::getpid());
    EXPECT_NE(whys[k].find(expected), std::string::npos) << whys[k];
    EXPECT_EQ(count_of(err, "parameter server 0: refused worker 1's attach of table 't': will not connect to worker 1: " +
                                expected),
              1u)
        << err;
    ++k;
  }
  EXPECT_EQ(count_of(err, "refused worker 1's attach"), owners.size()) << err;
  if (!root) GTEST_SKIP() << "the other user's half needs root; another process's half ran";
}

// Another process connects to a worker's attach socket before the server does (the socket's name is
// no secret) and offers memory of its own: the worker ignores it with one warning (SO_PEERCRED: not
// the server's pid) and maps the server's table. The server here is the test speaking the wire
// protocol, so that the other process's connection comes first for certain.
TEST(PsShared, AWorkerTakesOnlyTheServersConnectionToItsAttachSocket) {
  auto store = make_memory_store();
  const Roles roles{1, 1};
  TableConfig cfg;
  cfg.dim = 4;
  TableShard shard("t", cfg, 0, 0, kTimeout);
  const std::vector<float> values = {1, 2, 3, 4}, state;
  shard.put(5, values.data(), state.data());
  int intruder = -1;
  testing::internal::CaptureStderr();
  test::run_ranks(2, [&](int r) {
    if (r == 1) {  // worker 0
      auto c = Client::create(store, 0, roles, kTimeout);
      EXPECT_EQ(pull_rows(*c, "t", {5}), values);
      EXPECT_EQ(c->stats("t").rows, 1u);
      return;
    }
    Endpoint ep(store, "ps", 0, {false, true}, kTimeout);
    for (uint64_t seq = 0;; ++seq) {
      RequestHeader h;
      Posted got = ep.irecv(1, Msg::kRequest, seq, &h, sizeof h);
      while (!ep.test(got)) ep.poll(10);
      std::string payload(h.payload, '\0');
      if (h.payload > 0) {
        Posted rest = ep.irecv(1, Msg::kRequestPayload, seq, payload.data(), payload.size());
        while (!ep.test(rest)) ep.poll(10);
      }
      std::string body;
      if (h.op == Op::kHello) {
        body = nlohmann::json{{"mode", "async"}, {"max_request", 1 << 20}}.dump();
      } else if (h.op == Op::kDescribe) {
        body = config_to_json(cfg).dump();
      } else if (h.op == Op::kStats) {
        const uint64_t st[4] = {shard.rows(), shard.bytes(), shard.applied(), shard.direct_applied()};
        body.assign(reinterpret_cast<const char*>(st), sizeof st);
      } else if (h.op == Op::kAttach) {
        const auto req = nlohmann::json::parse(payload);
        socklen_t len = 0;
        const sockaddr_un addr = net::abstract_address(req.at("socket").get<std::string>(), &len);
        int done[2];
        ASSERT_EQ(::pipe(done), 0);
        intruder = ::fork();  // offers three memfds of its own, before the server's connection
        ASSERT_GE(intruder, 0);
        if (intruder == 0) {
          const int fds[3] = {int(::memfd_create("intruder", 0)), int(::memfd_create("intruder", 0)),
                              int(::memfd_create("intruder", 0))};
          for (int fd : fds)
            if (fd < 0 || ::ftruncate(fd, 1 << 20) != 0) ::_exit(2);
          const int sock = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
          if (sock < 0 || ::connect(sock, reinterpret_cast<const sockaddr*>(&addr), len) != 0) ::_exit(3);
          char tag = 'T';
          iovec iov{&tag, 1};
          alignas(cmsghdr) char control[CMSG_SPACE(sizeof fds)] = {};
          msghdr m{};
          m.msg_iov = &iov;
          m.msg_iovlen = 1;
          m.msg_control = control;
          m.msg_controllen = sizeof control;
          cmsghdr* cm = CMSG_FIRSTHDR(&m);
          cm->cmsg_level = SOL_SOCKET;
          cm->cmsg_type = SCM_RIGHTS;
          cm->cmsg_len = CMSG_LEN(sizeof fds);
          std::memcpy(CMSG_DATA(cm), fds, sizeof fds);
          if (::sendmsg(sock, &m, 0) != 1) ::_exit(4);
          (void)!::write(done[1], "s", 1);
          ::_exit(0);
        }
        ::close(done[1]);
        char sent;
        EXPECT_EQ(::read(done[0], &sent, 1), 1) << "the other process did not connect";
        // The server's side of the memfd handoff (common/handoff.h), as ps/server_tables.cc does it.
        const std::string socket = req.at("socket").get<std::string>();
        UniqueFd sock = handoff::connect(socket, ::getpid(), "worker 0", Deadline::after(kTimeout));
        handoff::send(sock.get(), handoff::make_hello(handoff::scope_of(socket), 0), shard.fds(),
                      Deadline::after(kTimeout), "worker 0");
        body = nlohmann::json{{"attached", true}, {"pid", ::getpid()}, {"holder", shard.register_holder(0, ::getpid())},
                              {"first_row", 0}, {"rows", 0}, {"config", config_to_json(cfg)}}
                   .dump();
        ::close(done[0]);
      }
      ReplyHeader reply;
      reply.payload = body.size();
      Posted a = ep.isend(1, Msg::kReply, seq, &reply, sizeof reply);
      Posted b = body.empty() ? Posted{} : ep.isend(1, Msg::kReplyPayload, seq, body.data(), body.size());
      while (!ep.test(a) || (b && !ep.test(b))) ep.poll(10);
      if (h.op == Op::kBye) return;
    }
  });
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_GT(intruder, 0);
  int status = 0;
  EXPECT_EQ(::waitpid(intruder, &status, 0), intruder);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(count_of(err, "refused a connection to its socket"), 1u) << err;
  EXPECT_NE(err.find(fmt::format("(pid {}): pid {} is none of the parameter servers awaited (0)", intruder, intruder)),
            std::string::npos)
      << err;
}

}  // namespace
}  // namespace cohort::ps
