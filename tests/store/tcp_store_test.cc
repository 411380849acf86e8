// Tests of the TCP store against a real server on a real socket (port 0: chosen by the OS).
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "cohort/error.h"
#include "common/socket.h"
#include "store/protocol.h"
#include "store/tcp_store.h"
#include "support/test_support.h"

namespace cohort {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::unique_ptr<StoreServer> start_server(const std::string& token = "", Millis handshake = Millis(10000)) {
  StoreServerOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.token = token;
  o.handshake_timeout = handshake;
  o.frame_timeout = Millis(1000);
  o.max_frame = 1 << 20;
  return StoreServer::start(o);
}

// How a client (a store connection, a lease) reaches `server`.
StoreClientOptions client_options(const StoreServer& server, const std::string& token = "", Millis timeout = 5s) {
  StoreClientOptions o;
  o.host = "127.0.0.1";
  o.port = server.port();
  o.token = token;
  o.timeout = timeout;
  return o;
}

std::shared_ptr<Store> connect(const StoreServer& server, const std::string& token = "", Millis timeout = 5s) {
  return connect_tcp_store(client_options(server, token, timeout));
}

template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return "";
}

TEST(TcpStore, EveryOperation) {
  auto server = start_server();
  auto s = connect(*server);
  s->set("a", "1");
  EXPECT_EQ(s->get("a"), "1");
  s->set("a", std::string("bin\0ary", 7));
  EXPECT_EQ(s->get("a"), std::string("bin\0ary", 7));
  EXPECT_EQ(s->add("n", 5), 5);
  EXPECT_EQ(s->add("n", -2), 3);
  EXPECT_EQ(s->get("n"), "3");
  // compare_set: missing key + empty expected sets it; a mismatch returns the current value.
  EXPECT_EQ(s->compare_set("c", "", "x"), "x");
  EXPECT_EQ(s->compare_set("c", "y", "z"), "x");
  EXPECT_EQ(s->compare_set("c", "x", "z"), "z");
  EXPECT_EQ(s->compare_set("missing", "e", "d"), "e");
  EXPECT_FALSE(s->check({"missing"}));
  EXPECT_TRUE(s->check({"a", "n", "c"}));
  EXPECT_FALSE(s->check({"a", "nope"}));
  EXPECT_EQ(s->num_keys(), 3);
  EXPECT_TRUE(s->remove("c"));
  EXPECT_FALSE(s->remove("c"));
  EXPECT_EQ(s->num_keys(), 2);
  s->multi_set({"k1", "k2", "k3"}, {"v1", "v2", ""});
  EXPECT_EQ(s->multi_get({"k3", "k1", "k2"}), (std::vector<std::string>{"", "v1", "v2"}));
  s->wait({"k1", "k2"}, 1s);
  EXPECT_THROW(s->multi_set({"a"}, {}), InvalidArgument);
  // add on a non-integer is the caller's mistake: InvalidArgument, and the connection stays usable.
  s->set("text", "abc");
  EXPECT_THROW(s->add("text", 1), InvalidArgument);
  EXPECT_EQ(s->get("a").size(), 7u);
  // A large value travels intact.
  std::string big(300000, 'q');
  s->set("big", big);
  EXPECT_EQ(s->get("big"), big);
}

TEST(TcpStore, GetAndWaitAreAnsweredWhenAnotherClientSets) {
  auto server = start_server();
  auto waiter = connect(*server);
  auto setter = connect(*server);
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    setter->set("late", "v");
    std::this_thread::sleep_for(50ms);
    setter->multi_set({"m1", "m2"}, {"a", "b"});
  });
  auto start = Clock::now();
  EXPECT_EQ(waiter->get("late"), "v");
  EXPECT_GE(seconds_since(start), 0.05);
  EXPECT_EQ(waiter->multi_get({"m1", "m2"}), (std::vector<std::string>{"a", "b"}));
  t.join();
}

TEST(TcpStore, WaitSeesAKeyDeletedAfterItCameAsMissingAgain) {
  auto server = start_server();
  auto waiter = connect(*server);
  auto setter = connect(*server);
  std::atomic<bool> released{false};
  std::thread t([&] {
    waiter->wait({"a", "b"}, 10s);
    released = true;
  });
  std::this_thread::sleep_for(50ms);
  setter->set("a", "1");
  setter->remove("a");
  setter->set("b", "1");  // "a" is gone again: the wait must not be released yet
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(released.load());
  setter->set("a", "2");
  t.join();
  EXPECT_TRUE(released.load());
}

TEST(TcpStore, WaitTimesOutNamingTheMissingKeys) {
  auto server = start_server();
  auto s = connect(*server);
  s->set("job/rank/0", "1");
  s->set("job/rank/1", "1");
  auto start = Clock::now();
  std::string msg = error_of<TimeoutError>([&] { s->wait({"job/rank/0", "job/rank/1", "job/rank/2"}, 200ms); });
  double took = seconds_since(start);
  EXPECT_GE(took, 0.19);
  EXPECT_LT(took, 2.0);
  EXPECT_NE(msg.find("job/rank/2"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("job/rank/1"), std::string::npos) << msg;
  // get uses the store's default timeout.
  s->set_timeout(150ms);
  msg = error_of<TimeoutError>([&] { s->get("never"); });
  EXPECT_NE(msg.find("never"), std::string::npos) << msg;
  // The connection is still good after timeouts.
  EXPECT_EQ(s->get("job/rank/0"), "1");
}

TEST(TcpStore, OneClientSharedByThreads) {
  auto server = start_server();
  auto s = connect(*server);
  test::run_ranks(8, [&](int) {
    for (int i = 0; i < 100; ++i) s->add("shared", 1);
  });
  EXPECT_EQ(s->add("shared", 0), 800);
}

TEST(TcpStore, AuthenticationAcceptsTheRightTokenAndRefusesOthers) {
  auto server = start_server("s3cret-token");
  auto ok = connect(*server, "s3cret-token");
  ok->set("k", "v");
  EXPECT_EQ(ok->get("k"), "v");

  auto start = Clock::now();
  std::string none = error_of<AuthError>([&] { connect(*server, ""); });
  EXPECT_NE(none.find("store at 127.0.0.1:" + std::to_string(server->port()) + " refused the job token"),
            std::string::npos)
      << none;
  EXPECT_NE(none.find("no job token"), std::string::npos) << none;
  std::string wrong = error_of<AuthError>([&] { connect(*server, "guess"); });
  EXPECT_NE(wrong.find("refused the job token"), std::string::npos) << wrong;
  EXPECT_NE(wrong.find("does not match"), std::string::npos) << wrong;
  EXPECT_LT(seconds_since(start), 2.0);  // refusal is final: no back-off retries
  // The refused clients did not disturb the accepted one.
  EXPECT_EQ(ok->get("k"), "v");
}

TEST(TcpStore, ClientBacksOffUntilAServerStartedLateIsUp) {
  int port = test::free_port();
  std::shared_ptr<Store> client;
  std::string error;
  std::thread t([&] {
    try {
      StoreClientOptions o;
      o.host = "127.0.0.1";
      o.port = static_cast<uint16_t>(port);
      o.timeout = 10s;
      client = connect_tcp_store(o);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(300ms);
  StoreServerOptions so;
  so.host = "127.0.0.1";
  so.port = static_cast<uint16_t>(port);
  auto server = StoreServer::start(so);
  t.join();
  ASSERT_TRUE(client) << error;
  client->set("x", "y");
  EXPECT_EQ(client->get("x"), "y");
}

TEST(TcpStore, NoServerMeansUnreachableAtTheDeadline) {
  int port = test::free_port();
  StoreClientOptions o;
  o.host = "127.0.0.1";
  o.port = static_cast<uint16_t>(port);
  o.timeout = 500ms;
  auto start = Clock::now();
  std::string msg = error_of<PeerLostError>([&] { connect_tcp_store(o); });
  EXPECT_GE(seconds_since(start), 0.45);
  EXPECT_LT(seconds_since(start), 3.0);
  EXPECT_NE(msg.find("store at 127.0.0.1:" + std::to_string(port) + " unreachable"), std::string::npos) << msg;
}

TEST(TcpStore, StoppedServerMakesTheNextCallFailWithinItsDeadline) {
  auto server = start_server();
  auto s = connect(*server, "", 2s);
  auto idle = connect(*server, "", 2s);
  s->set("k", "v");
  std::thread waiter([&] {
    std::string msg = error_of<PeerLostError>([&] { idle->wait({"never"}, 30s); });
    EXPECT_NE(msg.find("unreachable"), std::string::npos) << msg;
  });
  std::this_thread::sleep_for(100ms);
  server->stop();
  auto start = Clock::now();
  std::string msg = error_of<PeerLostError>([&] { s->get("k"); });
  EXPECT_LT(seconds_since(start), 2.0);
  EXPECT_NE(msg.find("store at 127.0.0.1:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unreachable"), std::string::npos) << msg;
  // And every call after that fails at once with the same cause.
  EXPECT_THROW(s->set("a", "b"), PeerLostError);
  waiter.join();
}

void barrier_with(int world) {
  auto server = start_server("tok");
  test::run_ranks(world, [&](int rank) {
    auto s = connect(*server, "tok", 20s);
    s->barrier("b", rank, world, 20s);
    s->barrier("b2", rank, world, 20s);  // twice in a row: the second must not pass early
    EXPECT_EQ(s->add("b2/count", 0), world);
  });
}

TEST(TcpStore, BarrierOfOne) { barrier_with(1); }
TEST(TcpStore, BarrierOfTwo) { barrier_with(2); }
TEST(TcpStore, BarrierOfSixtyFour) { barrier_with(64); }

TEST(TcpStore, BarrierTimeoutNamesTheMissingRanks) {
  auto server = start_server();
  std::vector<std::string> messages(2);
  test::run_ranks(2, [&](int rank) {
    auto s = connect(*server);
    messages[rank] = error_of<TimeoutError>([&] { s->barrier("late", rank, 4, 300ms); });
  });
  for (const auto& m : messages) {
    EXPECT_NE(m.find("2 of 4 ranks arrived"), std::string::npos) << m;
    EXPECT_NE(m.find("missing rank(s) 2-3"), std::string::npos) << m;
  }
}

// ---- malformed input from raw sockets --------------------------------------------------------

struct Raw {
  UniqueFd fd;
  explicit Raw(const StoreServer& server)
      : fd(net::connect_tcp(net::resolve("127.0.0.1", server.port()), Deadline::after(5s))) {}
  void send(const std::string& bytes) { net::send_all(fd.get(), bytes.data(), bytes.size(), Deadline::after(5s), "store"); }
  // Reads frames until the reply to request `id` (skipping the handshake's and other replies);
  // returns its op, or nothing when none came within `limit` or the connection ended first.
  std::optional<proto::Op> reply_to(uint32_t id, Millis limit) {
    Deadline d = Deadline::after(limit);
    for (;;) {
      proto::FrameView frame;
      auto r = proto::decode_frame(pending.data(), pending.size(), proto::kDefaultMaxFrame, &frame);
      if (r.status == proto::DecodeStatus::kBad) return std::nullopt;
      if (r.status == proto::DecodeStatus::kFrame) {
        bool match = frame.id == id && frame.op != proto::Op::kChallenge && frame.op != proto::Op::kWelcome;
        proto::Op op = frame.op;
        pending.erase(0, r.consumed);
        if (match) return op;
        continue;
      }
      pollfd p{fd.get(), POLLIN, 0};
      if (::poll(&p, 1, d.poll_ms()) <= 0) return std::nullopt;
      char buf[4096];
      ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
      if (n <= 0) return std::nullopt;
      pending.append(buf, static_cast<size_t>(n));
    }
  }
  std::string pending;  // bytes read by reply_to that are not yet a whole frame
  // Reads until the server closes the connection; returns what came, or "<open>" if it stays open.
  std::string until_closed(Millis limit) {
    std::string got;
    Deadline d = Deadline::after(limit);
    for (;;) {
      pollfd p{fd.get(), POLLIN, 0};
      if (::poll(&p, 1, d.poll_ms()) <= 0) return "<open>";
      char buf[4096];
      ssize_t n = ::recv(fd.get(), buf, sizeof buf, 0);
      if (n <= 0) return got;
      got.append(buf, static_cast<size_t>(n));
    }
  }
};

std::string hello_frame() {
  std::string out;
  proto::encode_hello(out, "");
  return out;
}

void expect_others_still_served(const StoreServer& server, Store& before) {
  before.set("still", "here");
  auto after = connect(server);
  EXPECT_EQ(after->get("still"), "here");
}

TEST(TcpStoreMalformed, GarbageClosesTheConnection) {
  auto server = start_server();
  auto other = connect(*server);
  Raw raw(*server);
  raw.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  std::string got = raw.until_closed(3s);
  ASSERT_NE(got, "<open>");
  EXPECT_NE(got.find("exceeds the limit"), std::string::npos);  // the reason travels in a Closing frame
  expect_others_still_served(*server, *other);
}

TEST(TcpStoreMalformed, HugeLengthClosesTheConnection) {
  auto server = start_server();
  auto other = connect(*server);
  Raw raw(*server);
  std::string frame = hello_frame();
  std::string huge("\xff\xff\xff\x7f", 4);
  raw.send(frame + huge + std::string(16, 'x'));
  std::string got = raw.until_closed(3s);
  ASSERT_NE(got, "<open>");
  EXPECT_NE(got.find("exceeds the limit"), std::string::npos);
  expect_others_still_served(*server, *other);
}

TEST(TcpStoreMalformed, UnknownOperationClosesTheConnection) {
  auto server = start_server();
  auto other = connect(*server);
  Raw raw(*server);
  std::string out = hello_frame();
  proto::Writer(out).begin(static_cast<proto::Op>(99), 7).u32(1).end();
  raw.send(out);
  std::string got = raw.until_closed(3s);
  ASSERT_NE(got, "<open>");
  EXPECT_NE(got.find("unknown operation 99"), std::string::npos);
  expect_others_still_served(*server, *other);
}

TEST(TcpStoreMalformed, TruncatedPayloadClosesTheConnection) {
  auto server = start_server();
  Raw raw(*server);
  std::string out = hello_frame();
  proto::Writer(out).begin(proto::Op::kSet, 1).u32(1000).end();  // key length 1000, no bytes
  raw.send(out);
  std::string got = raw.until_closed(3s);
  ASSERT_NE(got, "<open>");
  EXPECT_NE(got.find("malformed set request"), std::string::npos);
}

TEST(TcpStoreMalformed, RequestBeforeHandshakeClosesTheConnection) {
  auto server = start_server("tok");
  Raw raw(*server);
  std::string out;
  proto::encode_set(out, 1, "k", "v");
  raw.send(out);
  std::string got = raw.until_closed(3s);
  ASSERT_NE(got, "<open>");
  EXPECT_NE(got.find("expected the handshake"), std::string::npos);
  auto ok = connect(*server, "tok");
  EXPECT_FALSE(ok->check({"k"}));  // the set before the handshake never happened
}

// A Slurm per-node job's node 0 serves munge credentials as notices (src/launch/munge.h): anyone may read
// one before authenticating, and doing so gives no access to the store itself.
TEST(TcpStore, NoticesAreServedBeforeAuthenticationAndOpenNothingElse) {
  StoreServerOptions so;
  so.host = "127.0.0.1";
  so.token = "s3cret-token";
  so.notices["cohort/munge-credential/node/1"] = "MUNGE:credential-of-node-1:";
  auto server = StoreServer::start(so);
  auto ok = connect(*server, "s3cret-token");
  ok->set("k", "v");
  const StoreClientOptions co = client_options(*server);  // no token
  EXPECT_EQ(fetch_store_notice(co, "cohort/munge-credential/node/1"), "MUNGE:credential-of-node-1:");
  EXPECT_EQ(fetch_store_notice(co, "cohort/munge-credential/node/2"), std::nullopt);
  // A notice then a request on the same connection: the request is still before the handshake.
  Raw raw(*server);
  std::string out;
  proto::encode_notice(out, "cohort/munge-credential/node/1");
  proto::encode_set(out, 1, "k", "stolen");
  raw.send(out);
  std::string got = raw.until_closed(3s);
  ASSERT_NE(got, "<open>");
  EXPECT_NE(got.find("MUNGE:credential-of-node-1:"), std::string::npos) << got;
  EXPECT_NE(got.find("expected the handshake"), std::string::npos) << got;
  EXPECT_EQ(ok->get("k"), "v");
  EXPECT_EQ(server->requests(), 2u);  // the set and the get of the authenticated client only
}

TEST(TcpStoreMalformed, SilentClientIsClosedAtTheHandshakeDeadline) {
  auto server = start_server("", Millis(300));
  auto other = connect(*server);
  Raw raw(*server);
  auto start = Clock::now();
  std::string got = raw.until_closed(5s);
  ASSERT_NE(got, "<open>");
  EXPECT_GE(seconds_since(start), 0.25);
  EXPECT_NE(got.find("no handshake"), std::string::npos);
  expect_others_still_served(*server, *other);  // authenticated idle clients are not affected
}

TEST(TcpStoreMalformed, StalledHalfFrameIsClosed) {
  auto server = start_server();
  auto other = connect(*server);
  Raw raw(*server);
  std::string out = hello_frame();
  std::string set;
  proto::encode_set(set, 1, "key", "value");
  raw.send(out + set.substr(0, set.size() / 2));  // half a frame, then nothing (frame_timeout 1 s)
  std::string got = raw.until_closed(5s);
  ASSERT_NE(got, "<open>");
  EXPECT_NE(got.find("incomplete frame"), std::string::npos);
  expect_others_still_served(*server, *other);
}

TEST(TcpStoreMalformed, ClientVanishingWhileWaitingDoesNotDisturbOthers) {
  auto server = start_server();
  {
    Raw raw(*server);
    std::string out = hello_frame();
    proto::encode_keys(out, proto::Op::kWait, 1, {"gone"}, 60000);
    raw.send(out);
    std::this_thread::sleep_for(50ms);
  }  // closed with its wait parked
  auto s = connect(*server);
  s->set("gone", "1");  // wakes nobody alive; must not touch the closed connection
  EXPECT_EQ(s->get("gone"), "1");
}

// ---- leases: wills set when a connection ends -----------------------------------------------

std::string lease_frame(uint32_t lease_ms, const std::vector<std::string>& keys, const std::vector<std::string>& values) {
  std::string out = hello_frame();
  proto::encode_lease(out, 1, lease_ms, keys, values);
  return out;
}

TEST(TcpStoreLease, AConnectionThatEndsWithoutReleaseSetsItsWills) {
  auto server = start_server();
  auto s = connect(*server);
  {
    Raw raw(*server);
    raw.send(lease_frame(0, {"gone/a", "end"}, {"agent a", "lost agent a"}));
    std::this_thread::sleep_for(50ms);
    EXPECT_FALSE(s->check({"gone/a"}));  // nothing while it is connected
  }  // closed without a release (a killed process looks the same to the server)
  auto start = Clock::now();
  s->wait({"gone/a", "end"}, 3s);
  EXPECT_LT(seconds_since(start), 1.0);
  EXPECT_EQ(s->get("gone/a"), "agent a");
  EXPECT_EQ(s->get("end"), "lost agent a");
}

TEST(TcpStoreLease, AWillNeverOverwritesAKeySetBefore) {
  auto server = start_server();
  auto s = connect(*server);
  {
    Raw raw(*server);
    raw.send(lease_frame(0, {"end", "gone/b"}, {"lost agent b", "b"}));
    std::this_thread::sleep_for(50ms);
    s->set("end", "failure of rank 3");
  }
  s->wait({"gone/b"}, 3s);
  EXPECT_EQ(s->get("end"), "failure of rank 3");
}

TEST(TcpStoreLease, ASilentHolderLosesItsLeaseAndItsWillsFire) {
  auto server = start_server();
  auto s = connect(*server);
  Raw raw(*server);
  auto start = Clock::now();
  raw.send(lease_frame(300, {"gone/c"}, {"c"}));
  s->wait({"gone/c"}, 5s);  // no request for 300 ms: a frozen holder or a cut link
  double took = seconds_since(start);
  EXPECT_GE(took, 0.25);
  EXPECT_LT(took, 2.0);
  std::string got = raw.until_closed(2s);
  ASSERT_NE(got, "<open>");
  EXPECT_NE(got.find("lease ran out"), std::string::npos);
}

TEST(TcpStoreLease, AHeldLeaseStaysAndAReleasedOneAnnouncesNothing) {
  auto server = start_server();
  auto s = connect(*server);
  const StoreClientOptions o = client_options(*server);
  std::atomic<int> lost_calls{0};
  {
    auto lease = StoreLease::open(o, Millis(200), [&](const std::string&) { ++lost_calls; });
    lease->set_wills({{"gone/d", "d"}});
    // Several lease periods: the lease's own thread keeps it alive.
    EXPECT_THROW(s->wait({"gone/d"}, Millis(900)), TimeoutError);
    EXPECT_EQ(lease->lost(), "");
  }  // released
  EXPECT_THROW(s->wait({"gone/d"}, Millis(500)), TimeoutError);
  EXPECT_EQ(lost_calls.load(), 0);
}

TEST(TcpStoreLease, ADroppedLeaseEndsItsConnectionAndItsWillsFire) {
  auto server = start_server();
  auto s = connect(*server);
  const StoreClientOptions o = client_options(*server);
  std::atomic<int> lost_calls{0};
  auto lease = StoreLease::open(o, Millis(5000), [&](const std::string&) { ++lost_calls; });
  lease->set_wills({{"gone/h", "h"}});
  auto start = Clock::now();
  lease->drop();  // no release: the store sees the connection end (at once here: the close reaches it)
  s->wait({"gone/h"}, 3s);
  EXPECT_LT(seconds_since(start), 2.0) << "not the 5 s lease";
  EXPECT_THROW(lease->set_wills({}), PeerLostError);
  lease.reset();
  EXPECT_EQ(lost_calls.load(), 0) << "a dropped lease is not a lost one";
}

TEST(TcpStoreLease, TheHolderHearsWhenTheStoreGoes) {
  auto server = start_server();
  const StoreClientOptions o = client_options(*server);
  std::mutex m;
  std::condition_variable cv;
  std::string why;
  auto lease = StoreLease::open(o, Millis(200), [&](const std::string& w) {
    std::lock_guard<std::mutex> g(m);
    why = w;
    cv.notify_all();
  });
  auto start = Clock::now();
  server->stop();
  std::unique_lock<std::mutex> lk(m);
  ASSERT_TRUE(cv.wait_for(lk, 3s, [&] { return !why.empty(); }));
  EXPECT_LT(seconds_since(start), 1.0);
  EXPECT_NE(why.find("store at 127.0.0.1"), std::string::npos) << why;
  EXPECT_EQ(lease->lost(), why);
}

// ---- epochs: fenced connections ---------------------------------------------------------------

StoreClientOptions fenced(const StoreServer& server, int64_t epoch) {
  StoreClientOptions o = client_options(server);
  o.fence_key = "job/epoch";
  o.fence_epoch = epoch;
  return o;
}

TEST(TcpStoreEpoch, AFencedConnectionsWritesAreRefusedOnceTheStoresEpochIsNewer) {
  auto server = start_server();
  auto s = connect(*server);  // not fenced: never checked
  auto f = connect_tcp_store(fenced(*server, 0));
  f->set("a", "1");  // no epoch key yet: epoch 0
  s->set("job/epoch", "0");
  EXPECT_EQ(f->add("n", 2), 2);
  s->set("job/epoch", "1");
  std::string why = error_of<StaleEpochError>([&] { f->set("b", "2"); });
  EXPECT_NE(why.find("this connection writes for epoch 0 but the store is at epoch 1 ('job/epoch')"),
            std::string::npos)
      << why;
  EXPECT_THROW(f->add("n", 1), StaleEpochError);
  EXPECT_THROW(f->compare_set("a", "1", "x"), StaleEpochError);
  EXPECT_THROW(f->remove("a"), StaleEpochError);
  EXPECT_THROW(f->multi_set({"c"}, {"3"}), StaleEpochError);
  // Nothing of it was done, reads still work, and the connection stays usable.
  EXPECT_FALSE(s->check({"b"}));
  EXPECT_FALSE(s->check({"c"}));
  EXPECT_EQ(s->get("a"), "1");
  EXPECT_EQ(s->get("n"), "2");
  EXPECT_EQ(f->get("a"), "1");
  // Connecting for the old epoch is refused at once; for the current one it writes.
  EXPECT_THROW(connect_tcp_store(fenced(*server, 0)), StaleEpochError);
  auto now = connect_tcp_store(fenced(*server, 1));
  now->set("b", "2");
  s->set("d", "4");
  EXPECT_EQ(s->get("b"), "2");
}

TEST(TcpStoreEpoch, AStaleConnectionsWillsAreNotSet) {
  auto server = start_server();
  auto s = connect(*server);
  auto will_fires = [&](const std::string& key, bool raise_epoch) {
    {
      Raw raw(*server);
      std::string frames = hello_frame();
      proto::encode_fence(frames, 1, "job/epoch", 3);
      proto::encode_lease(frames, 2, 0, {key}, {"gone"});
      raw.send(frames);
      // The server has taken the fence and the will (it answers in order) before the epoch rises. A
      // fence it read only after the rise would itself be refused as stale, and the will would stay
      // unset for that reason rather than because a will of an older epoch is dropped at the end.
      EXPECT_EQ(raw.reply_to(1, 5s), proto::Op::kOk) << "the fence at epoch 3";
      EXPECT_EQ(raw.reply_to(2, 5s), proto::Op::kOk) << "the lease with the will " << key;
      if (raise_epoch) s->set("job/epoch", "4");
    }  // ends without a release
    try {
      s->wait({key}, Millis(700));
      return true;
    } catch (const TimeoutError&) {
      return false;
    }
  };
  EXPECT_TRUE(will_fires("gone/f", false));
  EXPECT_FALSE(will_fires("gone/g", true)) << "a will for epoch 3 on a store at epoch 4";
}

TEST(TcpStore, TheServerCountsTheRequestsItExecutes) {
  auto server = start_server();
  auto s = connect(*server);
  uint64_t before = server->requests();
  s->set("a", "1");
  s->get("a");
  s->check({"a", "b"});
  EXPECT_THROW(s->wait({"b"}, Millis(10)), TimeoutError);
  s->add("n", 1);
  EXPECT_EQ(server->requests() - before, 5u);
}

// ---- the command-line tools ------------------------------------------------------------------

TEST(StoreTools, ServeAnswersClientsAndStopsOnSigterm) {
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    setenv("COHORT_JOB_TOKEN", "tool-token", 1);
    std::string tool = test::cohort_tool();
    execl(tool.c_str(), "cohort", "store", "serve", "--host", "127.0.0.1", "--port", "0", nullptr);
    _exit(127);
  }
  close(out[1]);
  std::string line;
  char ch;
  while (line.find('\n') == std::string::npos) {
    pollfd p{out[0], POLLIN, 0};
    if (poll(&p, 1, 10000) <= 0 || read(out[0], &ch, 1) != 1) break;
    line.push_back(ch);
  }
  auto at = line.find("serving at ");
  ASSERT_NE(at, std::string::npos) << line;
  std::string address = line.substr(at + 11);
  address = address.substr(0, address.find(' '));
  auto [host, port] = net::split_host_port(address);
  StoreClientOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.token = "tool-token";
  o.timeout = 5s;
  auto s = connect_tcp_store(o);
  s->set("k", "v");
  EXPECT_EQ(s->get("k"), "v");
  o.token = "wrong";
  EXPECT_THROW(connect_tcp_store(o), AuthError);
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  close(out[0]);
}

TEST(StoreTools, BenchStoreRunsSmallJoins) {
  auto r = test::run_process({test::cohort_tool(), "bench", "store", "--clients", "8,64", "--reps", "2"}, {}, 60);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("clients"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("      64     2"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace cohort
