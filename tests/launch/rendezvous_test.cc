// Elastic membership (launch/rendezvous.h): agents as threads meeting in rounds through a real TCP
// store. A gone agent is what its lease's will writes (the store's lease tests cover the will itself).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include "cohort/error.h"
#include "launch/counting_store.h"
#include "launch/rendezvous.h"
#include "store/tcp_store.h"
#include "support/test_support.h"

namespace cohort::launch {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Cluster {
  std::unique_ptr<StoreServer> server;
  Cluster() {
    StoreServerOptions o;
    o.host = "127.0.0.1";
    server = StoreServer::start(o);
  }
  std::shared_ptr<Store> client() const {
    StoreClientOptions o;
    o.host = "127.0.0.1";
    o.port = server->port();
    o.timeout = 5s;
    return make_prefix_store(connect_tcp_store(o), "cohort/launch/job");
  }
};

AgentInfo agent(const std::string& name, int nproc = 2) {
  AgentInfo a;
  a.id = "id-" + name;
  a.host = name;
  a.nproc = nproc;
  return a;
}

RendezvousSettings bounds(int min, int max, double timeout_s = 10, double last_call_s = 10) {
  RendezvousSettings s;
  s.min_nodes = min;
  s.max_nodes = max;
  s.timeout_s = timeout_s;
  s.last_call_s = last_call_s;
  s.slice = Millis(20);
  return s;
}

std::vector<std::string> hosts_of(const Membership& m) {
  std::vector<std::string> h;
  for (const auto& a : m.nodes) h.push_back(a.host);
  return h;
}

// Every agent of `names` joins generation `gen` on a thread of its own; their memberships by name.
std::map<std::string, Membership> join_all(const Cluster& c, const std::vector<std::string>& names, int gen,
                                           RendezvousSettings s,
                                           std::function<void(int, const std::string&)> end_generation = {}) {
  std::map<std::string, Membership> out;
  std::mutex m;
  std::atomic<bool> stop{false};
  test::run_ranks(static_cast<int>(names.size()), [&](int i) {
    Rendezvous r(c.client(), agent(names[static_cast<size_t>(i)]), s, end_generation);
    auto got = r.join(gen, stop);
    ASSERT_TRUE(got.has_value());
    std::lock_guard<std::mutex> g(m);
    out[names[static_cast<size_t>(i)]] = *got;
  });
  return out;
}

void end(const Cluster& c, int gen, const std::string& kind = "failure") {
  c.client()->set(attempt_end_key(gen), "{\"kind\":\"" + kind + "\"}");
}
void drop(const Cluster& c, const std::string& name) { c.client()->set(gone_key("id-" + name), name); }

TEST(Rendezvous, MaxAgentsCloseTheFirstRoundAtOnceWithDenseRanks) {
  Cluster c;
  auto start = Clock::now();
  auto got = join_all(c, {"h0", "h1", "h2", "h3"}, 0, bounds(2, 4));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);  // not the 10 s last call
  const Membership& m = got["h0"];
  ASSERT_EQ(m.nodes.size(), 4u);
  EXPECT_EQ(m.world_size(), 8);
  std::set<int> nodes;
  for (const auto& [name, mine] : got) {
    EXPECT_EQ(hosts_of(mine), hosts_of(m)) << "every agent sees the same membership";
    EXPECT_EQ(mine.nodes[static_cast<size_t>(mine.this_node)].host, name);
    EXPECT_EQ(mine.first_rank(mine.this_node), 2 * mine.this_node);
    nodes.insert(mine.this_node);
  }
  EXPECT_EQ(nodes, (std::set<int>{0, 1, 2, 3}));
}

TEST(Rendezvous, TheStoresHostIsNodeZeroWhateverTheOrderOfArrival) {
  Cluster c;
  std::map<std::string, Membership> got;
  std::mutex m;
  std::atomic<bool> stop{false};
  test::run_ranks(3, [&](int i) {
    // h2 hosts the store and arrives last.
    if (i == 2) std::this_thread::sleep_for(100ms);
    AgentInfo self = agent("h" + std::to_string(i));
    self.store_host = i == 2;
    Rendezvous r(c.client(), self, bounds(3, 3), {});
    auto mine = r.join(0, stop);
    ASSERT_TRUE(mine);
    std::lock_guard<std::mutex> g(m);
    got[self.host] = *mine;
  });
  EXPECT_EQ(got["h2"].this_node, 0);
  EXPECT_EQ(got["h0"].nodes.front().host, "h2");
}

TEST(Rendezvous, BelowMaxTheFirstRoundClosesAfterTheLastCall) {
  Cluster c;
  auto start = Clock::now();
  auto got = join_all(c, {"h0", "h1"}, 0, bounds(2, 4, 10, 0.3));
  double took = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_GE(took, 0.3);
  EXPECT_LT(took, 5.0);
  EXPECT_EQ(got["h0"].nodes.size(), 2u);
}

TEST(Rendezvous, SurvivorsOfALossCloseAtOnceInTheirOldOrder) {
  Cluster c;
  auto first = join_all(c, {"h0", "h1", "h2", "h3"}, 0, bounds(2, 4));
  const auto order = hosts_of(first["h0"]);
  drop(c, order[1]);  // its agent's lease ended
  end(c, 0);
  auto start = Clock::now();
  auto next = join_all(c, {order[3], order[0], order[2]}, 1, bounds(2, 4));  // back in another order
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);  // no last call after a generation
  const Membership& m = next[order[0]];
  EXPECT_EQ(m.generation, 1);
  EXPECT_EQ(hosts_of(m), (std::vector<std::string>{order[0], order[2], order[3]}));
  EXPECT_EQ(m.world_size(), 6);
  EXPECT_EQ(m.restarts, 1) << "a generation lost to a failure counts as a restart";
}

TEST(Rendezvous, ANewcomerEndsTheRunningGenerationAndIsAdmittedToTheNext) {
  Cluster c;
  auto first = join_all(c, {"h0", "h1"}, 0, bounds(2, 3, 10, 0.1));
  ASSERT_EQ(first["h0"].nodes.size(), 2u);
  std::atomic<int> ended{-1};
  std::string why;
  std::thread newcomer([&] {
    std::atomic<bool> stop{false};
    Rendezvous r(c.client(), agent("h9"), bounds(2, 3, 10, 0.1), [&](int gen, const std::string& w) {
      why = w;
      ended = gen;
      end(c, gen, "membership");  // what the job does: write generation gen's end record
    });
    EXPECT_EQ(r.first_open_generation(), 1);
    auto m = r.join(r.first_open_generation(), stop);
    ASSERT_TRUE(m);
    EXPECT_EQ(m->this_node, 2);
  });
  while (ended < 0) std::this_thread::sleep_for(5ms);  // the running members notice the end record...
  EXPECT_EQ(ended.load(), 0);
  EXPECT_NE(why.find("h9 joins the job"), std::string::npos) << why;
  auto next = join_all(c, {"h1", "h0"}, 1, bounds(2, 3, 10, 0.1));  // ... and meet it at generation 1
  newcomer.join();
  EXPECT_EQ(hosts_of(next["h0"]), (std::vector<std::string>{first["h0"].nodes[0].host, first["h0"].nodes[1].host, "h9"}));
  EXPECT_EQ(next["h0"].restarts, 0) << "a membership change is no restart";
}

TEST(Rendezvous, BeyondMaxAnAgentWaitsForAPlaceAndSaysSoAtTheTimeout) {
  Cluster c;
  join_all(c, {"h0", "h1"}, 0, bounds(1, 2));
  std::atomic<bool> stop{false};
  bool asked = false;
  Rendezvous r(c.client(), agent("h2"), bounds(1, 2, 0.4), [&](int, const std::string&) { asked = true; });
  try {
    r.join(r.first_open_generation(), stop);
    FAIL() << "expected a timeout";
  } catch (const TimeoutError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("runs generation 0 with 2 of at most 2 nodes"), std::string::npos) << m;
    EXPECT_NE(m.find("waits for a place"), std::string::npos) << m;
  }
  EXPECT_FALSE(asked) << "a full generation is not ended for a newcomer";
}

TEST(Rendezvous, BelowMinTheRoundFailsAtTheTimeoutNamingWhoCameAndWhoIsGone) {
  Cluster c;
  auto first = join_all(c, {"h0", "h1", "h2"}, 0, bounds(3, 3));
  drop(c, "h2");
  end(c, 0);
  auto start = Clock::now();
  try {
    join_all(c, {"h0", "h1"}, 1, bounds(3, 3, 0.5));
    FAIL() << "expected a timeout";
  } catch (const std::exception& e) {  // run_ranks passes the TimeoutError's text on, naming the rank
    std::string m = e.what();
    EXPECT_NE(m.find("generation 1: 2 of at least 3 nodes joined within 0.5 s"), std::string::npos) << m;
    EXPECT_NE(m.find("gone since generation 0: h2"), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 3.0);
}

TEST(Rendezvous, ADroppedAgentIsRefusedWithOneLine) {
  Cluster c;
  join_all(c, {"h0", "h1"}, 0, bounds(1, 2));
  drop(c, "h1");
  std::atomic<bool> stop{false};
  Rendezvous r(c.client(), agent("h1"), bounds(1, 2), {});
  try {
    r.join(1, stop);
    FAIL() << "expected a refusal";
  } catch (const RendezvousRefused& e) {
    EXPECT_NE(std::string(e.what()).find("the job dropped this agent (h1)"), std::string::npos) << e.what();
  }
}

TEST(Rendezvous, AnAgentWithOtherBoundsIsRefused) {
  Cluster c;
  std::atomic<bool> stop{false};
  Rendezvous first(c.client(), agent("h0"), bounds(2, 4), {});
  first.check_admission();
  Rendezvous other(c.client(), agent("h1"), bounds(2, 5), {});
  try {
    other.join(0, stop);
    FAIL() << "expected a refusal";
  } catch (const RendezvousRefused& e) {
    EXPECT_NE(std::string(e.what()).find("--nnodes 2:5 but the job's agents use --nnodes 2:4"), std::string::npos)
        << e.what();
  }
}

TEST(Rendezvous, AStopFlagEndsTheWaitAtOnce) {
  Cluster c;
  std::atomic<bool> stop{false};
  Rendezvous r(c.client(), agent("h0"), bounds(2, 2), {});
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    stop = true;
  });
  auto start = Clock::now();
  EXPECT_FALSE(r.join(0, stop).has_value());
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0);
  t.join();
}

// ---- Partitions: a round after a generation needs half of it back ---------------------------------

TEST(Rendezvous, WithFewerThanHalfOfTheLastGenerationLeftTheRoundStopsAtOnceSayingWhy) {
  Cluster c;
  auto first = join_all(c, {"h0", "h1", "h2", "h3"}, 0, bounds(1, 4));
  for (const char* lost : {"h1", "h2", "h3"}) drop(c, lost);  // three leases ran out: a cut, or three deaths
  end(c, 0);
  auto start = Clock::now();
  std::atomic<bool> stop{false};
  Rendezvous r(c.client(), agent("h0"), bounds(1, 4, 30), {});
  try {
    r.join(1, stop);
    FAIL() << "the store's side of a cut went on with 1 of 4 nodes";
  } catch (const RendezvousSplit& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("generation 1: only 1 of the 4 nodes of generation 0 are left (gone: "), std::string::npos) << m;
    for (const char* lost : {"h1", "h2", "h3"}) EXPECT_NE(m.find(lost), std::string::npos) << m;
    EXPECT_NE(m.find("), fewer than half"), std::string::npos) << m;
    EXPECT_NE(m.find("stopping so that one copy of the job runs"), std::string::npos) << m;
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0) << "not the 30 s rendezvous timeout";
  // Whoever comes later reads the same verdict.
  Rendezvous late(c.client(), agent("h9"), bounds(1, 4, 30), {});
  EXPECT_THROW(late.join(1, stop), RendezvousSplit);
}

TEST(Rendezvous, HalfOfTheLastGenerationGoesOn) {
  Cluster c;
  join_all(c, {"h0", "h1", "h2", "h3"}, 0, bounds(1, 4));
  drop(c, "h2");
  drop(c, "h3");
  end(c, 0);
  // Two of four: the far side cannot have more than half, so it cannot move the store (a tie goes to
  // the store's side).
  auto next = join_all(c, {"h0", "h1"}, 1, bounds(1, 4));
  auto hosts = hosts_of(next["h0"]);
  EXPECT_EQ(std::set<std::string>(hosts.begin(), hosts.end()), (std::set<std::string>{"h0", "h1"}));
}

// ---- Load: O(1) store requests per agent and look -------------------------------------------------

// The store requests per agent and look while `n` agents wait in an open round, counted over the
// looks from each agent's 5th to its 25th (the arrivals are read by then).
double requests_per_agent_and_look(int n) {
  Cluster c;
  std::vector<std::shared_ptr<CountingStore>> stores;
  for (int i = 0; i < n; ++i) {
    StoreClientOptions o;
    o.host = "127.0.0.1";
    o.port = c.server->port();
    o.timeout = 30s;
    stores.push_back(std::make_shared<CountingStore>(connect_tcp_store(o)));
  }
  std::atomic<bool> stop{false};
  std::vector<std::thread> agents;
  for (int i = 0; i < n; ++i)
    agents.emplace_back([&, i] {
      // Up to 2n nodes and a long last call: the round stays open until `stop`.
      Rendezvous r(make_prefix_store(stores[static_cast<size_t>(i)], "cohort/launch/job"),
                   agent("h" + std::to_string(i)), bounds(1, 2 * n, 60, 60), {});
      r.join(0, stop);
    });
  auto every_agent_looked = [&](uint64_t looks) {
    const auto deadline = Clock::now() + 60s;
    while (Clock::now() < deadline) {
      bool all = true;
      for (const auto& st : stores) all = all && st->looks >= looks;
      if (all) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  };
  auto totals = [&] {
    std::pair<uint64_t, uint64_t> t{0, 0};
    for (const auto& st : stores) t.first += st->calls, t.second += st->looks;
    return t;
  };
  EXPECT_TRUE(every_agent_looked(5));
  auto a = totals();
  EXPECT_TRUE(every_agent_looked(25));
  auto b = totals();
  stop = true;
  for (auto& t : agents) t.join();
  return static_cast<double>(b.first - a.first) / static_cast<double>(b.second - a.second);
}

TEST(Rendezvous, AWaitingRoundCostsTheStoreTheSameRequestsPerAgentWhateverItsSize) {
  // Before: each agent checked every arrival's "gone" key at every look (8 agents: ~10 requests per
  // agent and look, 32: ~34), so the store's load grew with the square of the nodes.
  const double small = requests_per_agent_and_look(8);
  const double large = requests_per_agent_and_look(32);
  EXPECT_LT(large, small + 1.0) << "8 agents: " << small << " requests per agent and look, 32 agents: " << large;
  EXPECT_LT(large, 5.0);
}

// ---- Moving the store: votes at a standby store -------------------------------------------------------

Membership generation_of(int n) {
  Membership m;
  m.generation = 3;
  for (int i = 0; i < n; ++i) m.nodes.push_back(agent("h" + std::to_string(i)));
  m.nodes[0].store_host = true;
  return m;
}

// A voter's connection to the candidate, fenced at the lost store's epoch (0), as job_elastic.cc makes it.
std::shared_ptr<Store> fenced_client(const Cluster& c, int64_t epoch = 0) {
  StoreClientOptions o;
  o.host = "127.0.0.1";
  o.port = c.server->port();
  o.timeout = 5s;
  o.fence_key = "cohort/launch/job/" + epoch_key();
  o.fence_epoch = epoch;
  return make_prefix_store(connect_tcp_store(o), "cohort/launch/job");
}

FailoverVote vote_of(int members, bool store_gone, Millis window) {
  FailoverVote v;
  v.last = generation_of(members);
  v.store_gone = store_gone;
  v.lease_over = Clock::now() + (store_gone ? 60s : Millis(0));
  v.deadline = Clock::now() + window;
  v.slice = Millis(20);
  return v;
}

TEST(StoreFailover, MoreThanHalfOfTheGenerationPromoteTheStandbyOnce) {
  Cluster c;
  std::atomic<bool> stop{false};
  auto late = fenced_client(c);  // connected before the promotion, voting after it
  std::vector<int64_t> epochs(3, -1);
  // h1..h3 of 4 (h0 hosted the lost store); one of them found its port closed.
  test::run_ranks(3, [&](int i) {
    epochs[static_cast<size_t>(i)] = vote_for_store(*fenced_client(c), agent("h" + std::to_string(i + 1)),
                                                    vote_of(4, i == 2, 10s), "h1's standby store", stop);
  });
  EXPECT_EQ(epochs, (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(c.client()->get(epoch_key()), "1");
  // A voter that comes after the promotion: its vote is refused as stale, and it follows.
  EXPECT_EQ(vote_for_store(*late, agent("h9"), vote_of(4, false, 5s), "h1's standby store", stop), 1);
  EXPECT_THROW(fenced_client(c), StaleEpochError) << "a connection for the old epoch is refused at once";
  EXPECT_EQ(c.client()->add("rdzv/failover/3/votes", 0), 3) << "the late vote was not counted";
}

TEST(StoreFailover, AMinorityOfTheGenerationStopsWithOneLine) {
  for (int voters : {1, 2}) {  // of 4: more than 2 are needed
    Cluster c;
    std::atomic<bool> stop{false};
    auto start = Clock::now();
    std::vector<std::string> errors(static_cast<size_t>(voters));
    test::run_ranks(voters, [&](int i) {
      try {
        vote_for_store(*fenced_client(c), agent("h" + std::to_string(i + 1)), vote_of(4, true, Millis(600)),
                       "h1's standby store", stop);
      } catch (const FailoverRefused& e) {
        errors[static_cast<size_t>(i)] = e.what();
      }
    });
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
    for (const auto& e : errors) {
      EXPECT_NE(e.find("generation 3: lost the store's host and could not reach a majority of the last generation (" +
                       std::to_string(voters) + " of 4 voted at h1's standby store within"),
                std::string::npos)
          << e;
      EXPECT_NE(e.find("more than 2 needed); stopping so that one copy of the job runs"), std::string::npos) << e;
    }
    EXPECT_FALSE(c.client()->check({epoch_key()})) << voters << " of 4 promoted the standby";
  }
}

TEST(StoreFailover, WithoutProofThatTheOldStoreIsGoneAMajorityWaitsOutItsLease) {
  Cluster c;
  std::atomic<bool> stop{false};
  // Every voter's old store only went silent; their leases there run out in 60 s. With the votes all
  // in, the standby must not be promoted before: the old store's side may still run generation 3.
  std::atomic<int> refused{0};
  test::run_ranks(3, [&](int i) {
    FailoverVote v = vote_of(4, false, Millis(600));
    v.lease_over = Clock::now() + 60s;
    try {
      vote_for_store(*fenced_client(c), agent("h" + std::to_string(i + 1)), v, "h1's standby store", stop);
    } catch (const FailoverRefused&) {
      ++refused;
    }
  });
  EXPECT_EQ(refused.load(), 3);
  EXPECT_FALSE(c.client()->check({epoch_key()}));
  // Once the lease has run out, the same majority promotes it.
  test::run_ranks(3, [&](int i) {
    FailoverVote v = vote_of(4, false, 10s);
    v.last.generation = 4;
    EXPECT_EQ(vote_for_store(*fenced_client(c), agent("h" + std::to_string(i + 1)), v, "h1's standby store", stop), 1);
  });
}

}  // namespace
}  // namespace cohort::launch
