// The conformance suite (see conformance.h) and its TCP and shared-memory instantiations.
#include "conformance.h"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "cohort/error.h"
#include "common/host_identity.h"
#include "support/test_support.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace cohort::test {
namespace {

using transport::Envelope;
using transport::RequestId;
using transport::Transport;

// Builds `world` connected transports (construct, exchange descriptors, connect concurrently).
std::vector<std::unique_ptr<Transport>> make_world(const TransportParam& p, int world, const std::string& scope,
                                                   size_t max_unexpected_bytes = SIZE_MAX) {
  std::vector<std::unique_ptr<Transport>> ts(static_cast<size_t>(world));
  std::vector<transport::PeerInfo> peers(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    transport::TransportOptions o{r, world, scope, Deadline::after(std::chrono::seconds(20))};
    o.max_unexpected_bytes = max_unexpected_bytes;
    ts[size_t(r)] = p.make(o);
    peers[size_t(r)] = {"localhost", ts[size_t(r)]->descriptor()};
  }
  run_ranks(world, [&](int r) {
    std::vector<bool> use(static_cast<size_t>(world), true);
    use[size_t(r)] = false;
    for (int q = 0; q < world; ++q) ASSERT_TRUE(q == r || ts[size_t(r)]->can_reach(peers[size_t(q)].descriptor));
    ts[size_t(r)]->connect(peers, use, Deadline::after(std::chrono::seconds(20)));
  });
  return ts;
}

Envelope env(uint64_t tag, uint64_t sub = 0, uint64_t count = 0) {
  Envelope e;
  e.tag = tag;
  e.sub = sub;
  e.signature.op = 1;
  e.signature.count = count;
  return e;
}

// Drives `t` until `id` completes (rethrows its error); fails the test after `seconds`.
void wait(Transport& t, RequestId id, double seconds = 20) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!t.test(id)) {
    if (std::chrono::steady_clock::now() > end) throw TimeoutError("conformance wait timed out");
    t.poll(1);
  }
}

TEST_P(TransportConformance, SendToSelf) {
  auto ts = make_world(GetParam(), 1, "self");
  std::vector<int> a(100), b(100, 0);
  std::iota(a.begin(), a.end(), 0);
  auto s = ts[0]->isend(0, env(1), a.data(), a.size() * 4);
  auto r = ts[0]->irecv(0, env(1), b.data(), b.size() * 4);
  wait(*ts[0], s);
  wait(*ts[0], r);
  EXPECT_EQ(a, b);
}

TEST_P(TransportConformance, PingPongInOrderAndZeroBytes) {
  auto ts = make_world(GetParam(), 2, "pingpong");
  run_ranks(2, [&](int rank) {
    Transport& t = *ts[size_t(rank)];
    int peer = 1 - rank;
    for (int i = 0; i < 200; ++i) {
      uint64_t v = uint64_t(i), got = 0;
      if ((i + rank) % 2 == 0) {
        wait(t, t.isend(peer, env(7, uint64_t(i)), &v, 8));
      } else {
        wait(t, t.irecv(peer, env(7, uint64_t(i)), &got, 8));
        ASSERT_EQ(got, v);
      }
    }
    // zero-byte messages complete too
    auto s = t.isend(peer, env(8), nullptr, 0);
    auto r = t.irecv(peer, env(8), nullptr, 0);
    wait(t, s);
    wait(t, r);
  });
}

TEST_P(TransportConformance, UnexpectedMessagesAreBufferedAndMatchedBySub) {
  auto ts = make_world(GetParam(), 2, "unexpected");
  run_ranks(2, [&](int rank) {
    Transport& t = *ts[size_t(rank)];
    const int n = 16;
    if (rank == 0) {
      std::vector<std::vector<char>> bufs(n);
      std::vector<RequestId> ids;
      for (int i = 0; i < n; ++i) {
        bufs[size_t(i)].assign(size_t(1000 + i * 4099), char('a' + i));
        ids.push_back(t.isend(1, env(3, uint64_t(i)), bufs[size_t(i)].data(), bufs[size_t(i)].size()));
      }
      for (auto id : ids) wait(t, id);
    } else {
      // Let everything arrive first, then post the receives in reverse order.
      auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
      while (std::chrono::steady_clock::now() < end) t.poll(5);
      for (int i = n - 1; i >= 0; --i) {
        std::vector<char> b(size_t(1000 + i * 4099), 0);
        wait(t, t.irecv(0, env(3, uint64_t(i)), b.data(), b.size()));
        ASSERT_EQ(b, std::vector<char>(b.size(), char('a' + i))) << i;
      }
    }
  });
}

// Drives `t` until `done()`; fails the test after 20 s.
template <typename Done>
void poll_until(Transport& t, Done done, const char* what) {
  for (auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20); !done(); t.poll(1))
    ASSERT_LT(std::chrono::steady_clock::now(), end) << "no " << what << " within 20 s";
}

// A message its receiver discards is freed: at once when it came whole, else once it is. One
// discarded before it comes is read and thrown away, never buffered, and the stream goes on (the
// message after it arrives intact). Messages of 1 MiB: split across TCP's connections, so the one
// after it, received, comes after every byte of it.
TEST_P(TransportConformance, ADiscardedMessageIsFreedAndOneDiscardedBeforeItComesIsNeverBuffered) {
  auto ts = make_world(GetParam(), 2, "discard");
  const size_t bytes = 1u << 20;
  run_ranks(2, [&](int rank) {
    Transport& t = *ts[size_t(rank)];
    std::vector<char> out(bytes), in(bytes, 0);
    for (size_t i = 0; i < bytes; ++i) out[i] = char(i % 251);
    char go = 0;
    if (rank == 0) {
      wait(t, t.isend(1, env(20, 0), out.data(), bytes));  // comes first, never received
      wait(t, t.irecv(1, env(21), &go, 1));
      auto dropped = t.isend(1, env(20, 1), out.data(), bytes);  // discarded before it comes
      auto received = t.isend(1, env(20, 2), out.data(), bytes);
      wait(t, dropped);
      wait(t, received);
      return;
    }
    poll_until(t, [&] { return t.arrived(0, env(20, 0)); }, "early message");
    EXPECT_EQ(t.buffered_bytes(), bytes);
    t.discard(0, env(20, 0));
    poll_until(t, [&] { return t.buffered_bytes() == 0; }, "freeing of the discarded message");
    EXPECT_FALSE(t.arrived(0, env(20, 0)));

    t.discard(0, env(20, 1));
    auto r = t.irecv(0, env(20, 2), in.data(), bytes);
    auto g = t.isend(0, env(21), &go, 1);
    size_t most = 0;
    poll_until(t, [&] { most = std::max(most, t.buffered_bytes()); return t.test(r); }, "message after the discarded one");
    wait(t, g);
    EXPECT_EQ(most, 0u) << "the message discarded before it came was buffered";
    EXPECT_EQ(t.buffered_bytes(), 0u);
    EXPECT_FALSE(t.arrived(0, env(20, 1)));
    for (size_t i = 0; i < bytes; i += 4097) ASSERT_EQ(in[i], char(i % 251)) << i;
  });
}

// With max_unexpected_bytes, a larger message that comes before its receive is never buffered: its
// receive, posted later, fails naming the sender and the sizes, and the transport serves on (a
// receive posted first takes a large message as ever; a small early one is buffered as ever).
TEST_P(TransportConformance, AMessageOverTheLimitThatComesBeforeItsReceiveIsDroppedAndTheReceiveFails) {
  auto ts = make_world(GetParam(), 2, "overlimit", /*max_unexpected_bytes=*/64 << 10);
  const size_t big = 1u << 20, small = 1000;
  run_ranks(2, [&](int rank) {
    Transport& t = *ts[size_t(rank)];
    std::vector<char> out(big, 'x'), in(big, 0);
    char go = 0;
    if (rank == 0) {
      wait(t, t.irecv(1, env(31), &go, 1));
      auto early = t.isend(1, env(30, 0), out.data(), big);
      auto posted = t.isend(1, env(30, 1), out.data(), big);
      auto little = t.isend(1, env(30, 2), out.data(), small);
      wait(t, early);
      wait(t, posted);
      wait(t, little);
      return;
    }
    auto r = t.irecv(0, env(30, 1), in.data(), big);
    auto g = t.isend(0, env(31), &go, 1);
    size_t most = 0;
    poll_until(t, [&] { most = std::max(most, t.buffered_bytes()); return t.test(r); }, "posted large message");
    wait(t, g);
    EXPECT_LE(most, small) << "the early message over the limit was buffered";
    EXPECT_EQ(in, out);
    try {
      wait(t, t.irecv(0, env(30, 0), in.data(), big));
      ADD_FAILURE() << "a receive of a dropped message completed";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 (localhost) sent a message of 1048576 bytes before its receive "
                                           "was posted, more than the 65536 bytes this rank buffers"),
                std::string::npos)
          << e.what();
    }
    std::vector<char> little(small, 0);
    wait(t, t.irecv(0, env(30, 2), little.data(), small));
    EXPECT_EQ(little, std::vector<char>(small, 'x'));
    EXPECT_EQ(t.buffered_bytes(), 0u);
  });
}

TEST_P(TransportConformance, LargeFullDuplexNeverDeadlocks) {
  // Both ranks send 48 MiB before posting their receive: only a transport that keeps reading while
  // it writes (buffering the unexpected message) gets through.
  auto ts = make_world(GetParam(), 2, "duplex");
  run_ranks(2, [&](int rank) {
    Transport& t = *ts[size_t(rank)];
    const size_t bytes = 48u << 20;
    std::vector<uint32_t> out(bytes / 4), in(bytes / 4, 0);
    for (size_t i = 0; i < out.size(); ++i) out[i] = uint32_t(i * 2654435761u) ^ uint32_t(rank);
    auto s = t.isend(1 - rank, env(5), out.data(), bytes);
    // drive the send for a while before the receive exists
    auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);
    while (std::chrono::steady_clock::now() < end) t.poll(1);
    auto r = t.irecv(1 - rank, env(5), in.data(), bytes);
    wait(t, s, 60);
    wait(t, r, 60);
    for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(in[i], uint32_t(i * 2654435761u) ^ uint32_t(1 - rank)) << i;
  });
}

TEST_P(TransportConformance, LargeReceivePostedFirstLandsInPlace) {
  auto ts = make_world(GetParam(), 2, "direct");
  run_ranks(2, [&](int rank) {
    Transport& t = *ts[size_t(rank)];
    const size_t bytes = (8u << 20) + 13;
    std::vector<char> buf(bytes);
    if (rank == 1) {
      auto r = t.irecv(0, env(9), buf.data(), bytes);
      wait(t, r);
      for (size_t i = 0; i < bytes; i += 4097) ASSERT_EQ(buf[i], char(i % 251)) << i;
    } else {
      for (size_t i = 0; i < bytes; ++i) buf[i] = char(i % 251);
      wait(t, t.isend(1, env(9), buf.data(), bytes));
    }
  });
}

TEST_P(TransportConformance, AllPairsOnFourRanks) {
  auto ts = make_world(GetParam(), 4, "allpairs");
  run_ranks(4, [&](int rank) {
    Transport& t = *ts[size_t(rank)];
    std::vector<uint64_t> out(4), in(4, 99);
    std::vector<RequestId> ids;
    for (int p = 0; p < 4; ++p) {
      out[size_t(p)] = uint64_t(rank * 10 + p);
      ids.push_back(t.irecv(p, env(11), &in[size_t(p)], 8));
    }
    for (int p = 0; p < 4; ++p) ids.push_back(t.isend(p, env(11), &out[size_t(p)], 8));
    for (auto id : ids) wait(t, id);
    for (int p = 0; p < 4; ++p) EXPECT_EQ(in[size_t(p)], uint64_t(p * 10 + rank));
  });
}

TEST_P(TransportConformance, SizeAndSignatureMismatchesAreErrors) {
  auto ts = make_world(GetParam(), 2, "mismatch");
  run_ranks(2, [&](int rank) {
    Transport& t = *ts[size_t(rank)];
    uint64_t v[2] = {1, 2};
    if (rank == 0) {
      wait(t, t.isend(1, env(1, 0, /*count=*/2), v, 16));
    } else {
      EXPECT_THROW(wait(t, t.irecv(0, env(1, 0, /*count=*/1), v, 8)), MismatchError);
      // the transport stays failed
      EXPECT_THROW(t.irecv(0, env(2), v, 8), MismatchError);
    }
  });
}

TEST_P(TransportConformance, PeerThatLeavesFailsPendingReceives) {
  auto ts = make_world(GetParam(), 2, "leave");
  uint64_t v = 0;
  auto r = ts[0]->irecv(1, env(1), &v, 8);
  ts[1].reset();  // orderly destruction
  auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(wait(*ts[0], r, 5), PeerLostError);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST_P(TransportConformance, PollIsBoundedAndConnectTimesOutNamingTheMissingRank) {
  const int world = 2;
  std::vector<std::unique_ptr<Transport>> ts(world);
  std::vector<transport::PeerInfo> peers(world);
  for (int r = 0; r < world; ++r) {
    ts[size_t(r)] = GetParam().make({r, world, "timeouts", Deadline::after(std::chrono::seconds(5))});
    peers[size_t(r)] = {"host-" + std::to_string(r), ts[size_t(r)]->descriptor()};
  }
  // Rank 0 never connects: rank 1 gives up at its deadline, naming rank 0 and its host.
  auto start = std::chrono::steady_clock::now();
  try {
    ts[1]->connect(peers, {true, false}, Deadline::after(std::chrono::milliseconds(300)));
    ADD_FAILURE() << "connect succeeded without rank 0";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("rank(s) 0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("host-0"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
}

TEST_P(TransportConformance, IdlePollReturnsWithinItsTimeoutAndAPendingReceiveStaysPending) {
  auto ts = make_world(GetParam(), 2, "idle");
  uint64_t v = 0;
  auto r = ts[0]->irecv(1, env(1), &v, 8);
  for (int i = 0; i < 3; ++i) {
    auto start = std::chrono::steady_clock::now();
    ts[0]->poll(50);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1000));
  }
  EXPECT_FALSE(ts[0]->peek(r));
  EXPECT_FALSE(ts[0]->test(r));
  // and it still completes when the message comes
  uint64_t one = 1;
  auto s = ts[1]->isend(0, env(1), &one, 8);
  run_ranks(2, [&](int rank) { wait(*ts[size_t(rank)], rank == 0 ? r : s); });
  EXPECT_EQ(v, 1u);
}

// Rank 0 fails and tells rank 1; rank 1 fails by that notice and passes it on to rank 2 (not
// connected to rank 0), but not back to rank 0. So when a rank that only heard of a failure exits, its
// peers already know the root cause instead of seeing its connections close and naming it.
TEST_P(TransportConformance, AFailureNoticeIsPassedOnToEveryPeerButTheOneThatToldIt) {
  const int world = 3;
  std::vector<std::unique_ptr<Transport>> ts(world);
  std::vector<transport::PeerInfo> peers(world);
  for (int r = 0; r < world; ++r) {
    ts[size_t(r)] = GetParam().make({r, world, "passon", Deadline::after(std::chrono::seconds(20))});
    peers[size_t(r)] = {"host-" + std::to_string(r), ts[size_t(r)]->descriptor()};
  }
  const std::vector<std::vector<bool>> use = {{false, true, false}, {true, false, true}, {false, true, false}};
  run_ranks(world, [&](int r) { ts[size_t(r)]->connect(peers, use[size_t(r)], Deadline::after(std::chrono::seconds(20))); });
  uint64_t v0 = 0, v1 = 0, v2 = 0;
  auto r0 = ts[0]->irecv(1, env(1), &v0, 8);
  auto r1 = ts[1]->irecv(0, env(1), &v1, 8);
  auto r2 = ts[2]->irecv(1, env(1), &v2, 8);
  ts[0]->notify_peers(Transport::ErrorClass::kPeerLost, "lost rank 9 (host-9): killed");
  std::string heard;
  try {
    wait(*ts[1], r1, 5);
    ADD_FAILURE() << "rank 1's receive completed";
  } catch (const PeerLostError& e) {
    heard = e.what();
  }
  EXPECT_NE(heard.find("rank 0 (host-0) failed: lost rank 9 (host-9)"), std::string::npos) << heard;
  ts[1]->notify_peers(Transport::ErrorClass::kPeerLost, heard);
  try {
    wait(*ts[2], r2, 5);
    ADD_FAILURE() << "rank 2's receive completed";
  } catch (const PeerLostError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 (host-1) failed: rank 0 (host-0) failed: lost rank 9 (host-9)"),
              std::string::npos)
        << e.what();
  }
  // Rank 0 told rank 1: nothing comes back to it.
  for (int i = 0; i < 10; ++i) ts[0]->poll(20);
  EXPECT_FALSE(ts[0]->test(r0));
}

INSTANTIATE_TEST_SUITE_P(Tcp, TransportConformance,
                         ::testing::Values(TransportParam{"tcp", transport::make_tcp_transport}),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Shm, TransportConformance,
                         ::testing::Values(TransportParam{"shm", transport::make_shm_transport}),
                         [](const auto& info) { return info.param.name; });

// TCP only: several connections per peer are used for large messages (configured before the
// transports are built, read once per process, so this checks the default of 2).
TEST(TcpTransport, DescriptorNamesPortAndLoopbackKey) {
  auto t = transport::make_tcp_transport({0, 1, "desc", Deadline::after(std::chrono::seconds(5))});
  EXPECT_EQ(t->descriptor().rfind("tcp;", 0), 0u);
  EXPECT_TRUE(t->can_reach(t->descriptor()));
  EXPECT_FALSE(t->can_reach("shm;whatever"));
}

}  // namespace
}  // namespace cohort::test
