// Elastic membership in the job (`cohort run --nnodes MIN:MAX`, docs/launcher.md "Elastic jobs"):
// each attempt is a generation. Its watcher thread joins the generation's round (launch/rendezvous.h)
// and reports the membership; the main loop then lays the generation out (nodes, dense ranks, the
// world size), points the agent's lease wills at the generation's end record and starts the workers.
// A generation ends like any attempt (a worker's failure, all done, an interrupt), or because a
// member's lease ended (its will, or the watcher seeing its "gone" key), or because a newcomer asked
// for a place ("membership"). The agents that are left meet again at the next generation; failures
// count against --max-restarts, membership changes do not. When the store's host itself is lost
// ("store"), the survivors vote at the first member's standby store that answers; with more than half
// of the last generation there, the job's store moves to it (fail_over_store) and they meet there.
// A minority stops, and so does a store's host left with fewer than half of its generation
// (launch/rendezvous.h), so a partition never runs two copies of the job.
//
// Why an object of its own (ElasticMember, job_internal.h): an agent's identity, lease, standby store,
// generation and epoch are membership's alone; the supervisor only asks it what a watcher's news means and
// what comes after a generation. What membership changes of the job is named in its constructor: the plan
// (the generation's layout) and the store links (a failover moves the job's store).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/log.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/job_internal.h"

namespace cohort::launch::job_detail {

namespace {

std::string launch_prefix(const Plan& plan) { return "cohort/launch/" + plan.job_id + "/"; }

// After a lost store's lease has run out, how long the voters of a failover wait for a majority.
constexpr Millis kFailoverWindow{5000};

// What one connection attempt says about the lost store.
enum class OldStore {
  kAnswers,  // it takes a connection and answers the handshake: this agent lost only its own connections
  kRefused,  // its host resets the connection: nothing listens on the port, the store's process is gone
  kSilent,   // no answer (host gone, link cut, process frozen): it may still run for others
};

OldStore probe_old_store(const StoreClientOptions& options) {
  try {
    const net::Address a = net::resolve(options.host, options.port);
    UniqueFd fd(::socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) return OldStore::kSilent;
    int err = 0;
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.storage), a.length) != 0) {
      err = errno;
      if (err == EINPROGRESS) {
        pollfd p{fd.get(), POLLOUT, 0};
        if (::poll(&p, 1, 1000) <= 0) return OldStore::kSilent;
        socklen_t len = sizeof err;
        getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      }
    }
    if (err == ECONNREFUSED) return OldStore::kRefused;
    if (err != 0) return OldStore::kSilent;
  } catch (const Error&) {
    return OldStore::kSilent;
  }
  // Something listens: a store that answers a new connection is alive for the others too.
  try {
    StoreClientOptions o = options;
    o.timeout = Millis(1000);
    o.fence_key.clear();
    connect_tcp_store(o);
    return OldStore::kAnswers;
  } catch (const Error&) {
    return OldStore::kSilent;
  }
}

// Watches this agent's standby store for its promotion (rdzv/epoch appearing there): the others may
// move the job's store to it while this agent still reaches the old one. One parked wait per second.
void standby_watch_main(StoreClientOptions options, std::string key, std::shared_ptr<EventQueue> events) {
  try {
    auto standby = connect_tcp_store(options);
    for (;;) {
      try {
        standby->wait({key}, Millis(1000));
        events->push({WatchEvent::kStoreMoved, standby->get(key), kAnyAttempt});
        return;
      } catch (const TimeoutError&) {
      }
    }
  } catch (const Error&) {
    // The standby store stopped with the job: nothing to watch.
  }
}

}  // namespace

RendezvousSettings rendezvous_settings(const Plan& plan, int64_t epoch) {
  RendezvousSettings s;
  s.epoch = epoch;
  s.min_nodes = plan.min_nodes;
  s.max_nodes = plan.max_nodes;
  s.timeout_s = plan.join_timeout_s;
  s.last_call_s = plan.rdzv_last_call_s;
  // The voters of a move are all in within a lease and the vote window; a few seconds more for the
  // ones that follow it.
  s.failover_grace_s = plan.agent_lease_s + std::chrono::duration<double>(kFailoverWindow).count() + 3;
  return s;
}

void elastic_watcher_main(std::shared_ptr<Store> store, std::shared_ptr<EventQueue> events,
                          std::shared_ptr<std::atomic<bool>> stop, AgentInfo self, RendezvousSettings settings,
                          int generation) {
  try {
    Rendezvous r(store, self, settings, [store](int g, const std::string& why) {
      store->compare_set(attempt_end_key(g), "", end_to_string(EndInfo{"membership", 0, why}));
    });
    r.on_progress([](const std::string& line) { say(line); });
    auto m = r.join(generation, *stop);
    if (!m) return;
    events->push({WatchEvent::kJoined, nlohmann::json(*m).dump(), generation});
    const std::string end_key = attempt_end_key(m->generation);
    const auto joined = std::chrono::steady_clock::now();
    for (;;) {
      if (*stop) return;
      try {
        store->wait({end_key}, Millis(500));
        events->push({WatchEvent::kEnd, store->get(end_key), generation});
        return;
      } catch (const TimeoutError&) {
      }
      // A member whose lease ended before its will pointed at this generation's end record (the
      // moment between the round's closing and the wills) is seen here: each member watches the
      // next one (one request per member and slice). After the first seconds every member's will
      // is in place, and the watch stops.
      if (std::chrono::steady_clock::now() - joined < std::chrono::seconds(5))
        if (auto gone = r.gone_successor(*m))
          store->compare_set(end_key, "", end_to_string(EndInfo{"node", 1, "lost " + *gone}));
    }
  } catch (const RendezvousRefused& e) {
    if (!*stop) events->push({WatchEvent::kRefused, e.what(), generation});
  } catch (const RendezvousTimeout& e) {
    if (!*stop) events->push({WatchEvent::kJoinTimeout, e.what(), generation});
  } catch (const Error& e) {
    if (!*stop) events->push({WatchEvent::kLost, e.what(), generation});
  }
}

void ElasticMember::open_standby(const std::string& token) {
  StoreServerOptions so;
  so.port = 0;
  so.token = token;
  standby_ = StoreServer::start(so);
  const std::string here = net::route_address_to(plan_.master_addr);
  standby_address_ = here.find(':') != std::string::npos ? fmt::format("[{}]:{}", here, standby_->port())
                                                          : fmt::format("{}:{}", here, standby_->port());
}

void ElasticMember::join_round(int round, std::shared_ptr<std::atomic<bool>> stop) {
  round_ = round;
  store_.attempt = make_prefix_store(store_.base, fmt::format("attempt/{}", round));
  store_.watch_base = make_prefix_store(connect_tcp_store(store_.client_options), "cohort/launch/" + plan_.job_id);
  std::thread(elastic_watcher_main, store_.watch_base, events_, stop, self_, rendezvous_settings(plan_, store_epoch_),
              round)
      .detach();
}

std::optional<EndInfo> ElasticMember::on_lease_lost(int lease, const std::string& why) const {
  if (lease != lease_number_) return std::nullopt;  // a lease that was replaced (the store moved)
  if (why.find("lease ran out") != std::string::npos)
    // The store ended this agent's lease (it was frozen or cut off): the job goes on without it.
    return EndInfo{"lost", 1,
                   fmt::format("the job dropped this agent ({}): {}; the other nodes go on without it, start a new "
                               "agent to join again",
                               self_.host, why)};
  // The store itself is gone: an elastic job moves it (after: fail_over_store).
  return EndInfo{"store", 1, fmt::format("lost the job's store at {}: {}", store_.addr, why)};
}

std::optional<EndInfo> ElasticMember::on_store_moved(const std::string& epoch) {
  // This agent's standby store was promoted by the others: it follows (after: fail_over_store), unless it
  // moved the store there itself.
  if (std::stoll(epoch) <= store_epoch_) return std::nullopt;
  standby_promoted_ = true;
  return EndInfo{"store", 1,
                 fmt::format("the job's store moved to this agent's standby store at {} (epoch {})", standby_address_,
                             epoch)};
}

void ElasticMember::end_everywhere(const EndInfo& interrupted, bool joined) {
  // The others must learn it now, not at their rendezvous timeout: before the round closes, the
  // round fails with this line (they read it as a refusal); after, the generation ends with it and,
  // not being restartable, ends the job. Either way this agent is marked gone.
  try {
    store_.base->set(gone_key(self_.id), self_.host + " (interrupted)");
    if (!joined || !membership_) {
      Membership failed;
      failed.generation = round_;
      failed.failed = interrupted.summary;
      const std::string mine = nlohmann::json(failed).dump();
      const std::string now = store_.base->compare_set(closed_key(round_), "", mine);
      if (now == mine) return;
      // The round closed just before: end the generation it started.
    }
    const int generation = membership_ ? membership_->generation : round_;
    store_.base->compare_set(attempt_end_key(generation), "", end_to_string(interrupted));
  } catch (const Error& e) {
    log::warn("could not tell the job's store that this node was interrupted: {}", e.what());
  }
}

std::optional<int> ElasticMember::after(EndInfo& e, bool joined, bool head_lost) {
  // A round stopped on this side of a partition may be the side that loses: if the other side is
  // moving the job's store to this agent's standby store, this agent goes with it.
  if (e.kind == "refused" && !standby_promoted_ && standby_promotion_pending()) standby_promoted_ = true;
  if ((e.kind == "store" || standby_promoted_) && !head_lost && membership_ &&
      membership_->restarts < plan_.max_restarts) {
    if (standby_promoted_)
      say(fmt::format("generation {} ended: the others moved the job's store to this agent's standby store; "
                      "following it",
                      membership_->generation));
    else
      say(fmt::format("generation {} ended: {}; moving the job's store to a surviving member", membership_->generation,
                      e.summary));
    std::string why;
    if (fail_over_store(joined, &why)) return membership_->generation + 1;
    if (!why.empty()) e = EndInfo{"store", 1, why};
  }
  if (auto next = next_generation(e, head_lost)) {
    say(fmt::format("generation {} ended: {}; the agents meet again for generation {}{}", membership_->generation,
                    e.summary, *next, e.kind == "membership" ? " (a membership change: no restart counted)" : ""));
    return next;
  }
  return std::nullopt;
}

bool ElasticMember::node_gone(int node_rank) const {
  return membership_ && member_gone(membership_->nodes[static_cast<size_t>(node_rank)]);
}

void ElasticMember::open_lease() {
  const NodePlan* node = plan_.node(plan_.this_node);
  self_ = AgentInfo{fmt::format("{}-{}-{}", net::hostname(), getpid(), random_token(4)), net::hostname(),
                    node ? node->nproc : 0, plan_.host_store, standby_address_};
  take_lease();
  if (standby_) {
    StoreClientOptions o = store_.client_options;
    o.host = "127.0.0.1";
    o.port = standby_->port();
    std::thread(standby_watch_main, o, launch_prefix(plan_) + epoch_key(), events_).detach();
  }
}

void ElasticMember::take_lease() {
  auto events = events_;
  const int number = ++lease_number_;
  lease_ = StoreLease::open(store_.client_options, Millis(static_cast<int64_t>(plan_.agent_lease_s * 1000)),
                            [events, number](const std::string& why) {
                              events->push({WatchEvent::kLeaseLost, why, kAnyAttempt, number});
                            });
  lease_->set_wills({{launch_prefix(plan_) + gone_key(self_.id), self_.host}});
}

int ElasticMember::first_generation() {
  Rendezvous r(store_.base, self_, rendezvous_settings(plan_), {});
  r.check_admission();
  return r.first_open_generation();
}

void ElasticMember::apply_membership(const Membership& joined) {
  Membership m = joined;
  for (size_t i = 0; i < m.nodes.size(); ++i)
    if (m.nodes[i].id == self_.id) m.this_node = static_cast<int>(i);
  membership_ = m;
  plan_.nnodes = static_cast<int>(m.nodes.size());
  plan_.this_node = m.this_node;
  plan_.world_size = m.world_size();
  plan_.nodes.clear();
  for (int i = 0; i < plan_.nnodes; ++i) {
    const AgentInfo& a = m.nodes[static_cast<size_t>(i)];
    plan_.nodes.push_back(NodePlan{i, a.host, i == m.this_node, m.first_rank(i), a.nproc});
  }
  store_.attempt = make_prefix_store(store_.base, fmt::format("attempt/{}", m.generation));
  if (torch_port_from_store_) {
    // The store moved to another node, which picked its torch port before it joined this round.
    store_.torch_port = std::stoi(store_.base->get("torch_port"));
    torch_port_from_store_ = false;
  }
  // From now on this agent's end is this generation's end: the others stop at once and meet again.
  const std::string lost = end_to_string(EndInfo{
      "node", 1,
      fmt::format("lost node {} ({}): its agent's store lease ended (killed, frozen or cut off)", m.this_node, self_.host)});
  lease_->set_wills({{launch_prefix(plan_) + gone_key(self_.id), self_.host},
                     {launch_prefix(plan_) + attempt_end_key(m.generation), lost}});
  const int first = m.first_rank(m.this_node);
  say(fmt::format("generation {}: {} node(s) ({}), world size {}; this is node {} with ranks {}-{}{}", m.generation,
                  m.nodes.size(), m.hosts(), m.world_size(), m.this_node, first, first + self_.nproc - 1,
                  m.restarts > 0 ? fmt::format(" (restart {} of {})", m.restarts, plan_.max_restarts) : ""));
}

std::optional<int> ElasticMember::next_generation(const EndInfo& e, bool head_lost) const {
  if (head_lost || !membership_) return std::nullopt;
  if (e.kind == "membership") return membership_->generation + 1;
  if (e.restartable() && membership_->restarts < plan_.max_restarts) return membership_->generation + 1;
  return std::nullopt;
}

void ElasticMember::leave(int sig, bool joined) {
  // An interrupted agent (Ctrl-C, a scheduler's or a spot instance's SIGTERM) leaves: the others end
  // this generation and go on without it, as they would after a loss.
  try {
    store_.base->set(gone_key(self_.id), self_.host + " (left)");
    if (joined && membership_)
      store_.attempt->compare_set("end", "",
                                  end_to_string(EndInfo{"node", 1,
                                                        fmt::format("node {} ({}) left the job: its agent got {}",
                                                                    membership_->this_node, self_.host,
                                                                    signal_name(sig))}));
  } catch (const Error& e) {
    log::warn("could not tell the job's store that this agent leaves: {}", e.what());
  }
}

bool ElasticMember::fail_over_store(bool joined, std::string* why) {
  if (!membership_) return false;
  const Membership m = *membership_;  // the last generation this agent was a member of
  const int64_t old_epoch = store_epoch_;
  // This agent's lease on the old store ends now, without a release: if that store still runs for
  // others, its wills mark this agent gone and end generation m there, within the lease.
  if (lease_) lease_->drop();
  const auto lease_over = Clock::now() + Millis(static_cast<int64_t>(plan_.agent_lease_s * 1000));
  bool store_gone = false;
  if (!joined && !standby_promoted_) {
    // Lost while waiting in the next round: that round may have closed with this agent in it, and the
    // old store's side may go on with it counted. A vote for moving the store after generation m would
    // count this agent a second time; so it does not vote.
    *why = fmt::format("generation {}: lost the job's store at {} while its round was open: this agent cannot tell "
                       "whether the round closed with it (and the store's side went on), so it does not vote to move "
                       "the store; stopping so that one copy of the job runs",
                       m.generation + 1, store_.addr);
    return false;
  }
  if (standby_promoted_) {
    // The others moved the job's store to this agent's standby while this agent still reached the
    // old one: it leaves the old store (marked gone there) and follows.
    try {
      store_.base->set(gone_key(self_.id), self_.host + " (moved with the job's store)");
    } catch (const Error&) {
    }
  } else {
    switch (probe_old_store(store_.client_options)) {
      case OldStore::kAnswers:
        // Only a store that is really gone is moved: this agent lost its own connections (a hiccup,
        // a slow answer), not the store, and the others may well be fine with it. This agent stops;
        // the others see its lease end and go on without it.
        *why = fmt::format("the job's store at {} still answers: this agent lost its connection to it, not the store; "
                           "stopping (the other nodes go on without it)",
                           store_.addr);
        return false;
      case OldStore::kRefused:
        store_gone = true;
        break;
      case OldStore::kSilent:
        break;
    }
  }
  std::vector<const AgentInfo*> lost;
  for (const auto& a : m.nodes)
    if (a.store_host) lost.push_back(&a);
  const std::string epoch_full_key = launch_prefix(plan_) + epoch_key();
  // The candidates, in the generation's order (every survivor tries the same list): this agent votes
  // at the first standby store that answers, and only there.
  for (const auto& c : m.nodes) {
    if (c.store_host || c.standby.empty()) continue;
    const bool mine = c.id == self_.id;
    if (standby_promoted_ && !mine) continue;
    auto [host, port] = net::split_host_port(c.standby);
    StoreClientOptions co = store_.client_options;
    co.host = mine ? "127.0.0.1" : host;
    co.port = port;
    co.timeout = std::chrono::milliseconds(1500);
    co.fence_key = epoch_full_key;
    co.fence_epoch = old_epoch;
    std::shared_ptr<Store> candidate;
    try {
      try {
        candidate = connect_tcp_store(co);
      } catch (const StaleEpochError&) {
        co.fence_key.clear();  // promoted already: read its epoch and follow
        candidate = connect_tcp_store(co);
      }
    } catch (const Error& e) {
      say(fmt::format("the standby store of {} at {} did not answer ({}); trying the next member", c.host, c.standby,
                      e.what()));
      continue;
    }
    int64_t epoch = 0;
    try {
      candidate->set_timeout(kStoreCallTimeout);
      auto prefixed = make_prefix_store(candidate, "cohort/launch/" + plan_.job_id);
      if (standby_promoted_ || co.fence_key.empty()) {
        epoch = std::stoll(prefixed->get(epoch_key()));
      } else {
        FailoverVote v;
        v.last = m;
        v.epoch = old_epoch;
        v.store_gone = store_gone;
        v.lease_over = lease_over;
        v.deadline = lease_over + kFailoverWindow;
        say(fmt::format("voting to move the job's store to {} at {} ({} of generation {}'s {} nodes must agree)",
                        mine ? "this agent's standby store" : c.host + "'s standby store", c.standby,
                        m.nodes.size() / 2 + 1, m.generation, m.nodes.size()));
        const std::atomic<bool> never{false};
        epoch = vote_for_store(*prefixed, self_, v, mine ? "this agent's standby store" : c.host + "'s standby store",
                               never);
      }
    } catch (const FailoverRefused& e) {
      *why = e.what();
      return false;
    } catch (const Error& e) {
      *why = fmt::format("moving the job's store to {} at {} failed: {}", c.host, c.standby, e.what());
      return false;
    }
    try {
      co.fence_key = epoch_full_key;
      co.fence_epoch = epoch;
      co.timeout = kStoreCallTimeout;
      auto base = connect_tcp_store(co);
      base->compare_set(kJobIdKey, "", plan_.job_id);  // newcomers check which job a store serves
      store_.client_options = co;
      store_.base_client = base;
      store_.base = make_prefix_store(base, "cohort/launch/" + plan_.job_id);
      store_.watch_base = make_prefix_store(connect_tcp_store(store_.client_options), "cohort/launch/" + plan_.job_id);
      store_epoch_ = epoch;
      store_.addr = c.standby;
      // Voted or not, this agent follows: the first round does not drop it for having no vote.
      store_.base->set(fmt::format("rdzv/failover/{}/vote/{}", m.generation, self_.id), self_.host);
      plan_.master_addr = host;
      plan_.master_port = port;
      if (mine) {
        store_.server = std::move(standby_);
        plan_.host_store = true;
        self_.store_host = true;
        self_.standby.clear();
        store_.torch_port = pick_free_port("");
      } else {
        plan_.host_store = false;
      }
      // Seed the new store with what the lost one knew that the next round needs: the bounds, the
      // last generation and its end, and the lost host's agents as gone. Every survivor writes the
      // same (compare-and-set: the first one's stays).
      store_.base->compare_set("rdzv/config", "", fmt::format("{}:{}", plan_.min_nodes, plan_.max_nodes));
      store_.base->compare_set(closed_key(m.generation), "", nlohmann::json(m).dump());
      std::vector<std::string> hosts;
      for (const auto* a : lost) {
        store_.base->set(gone_key(a->id), a->host);
        hosts.push_back(a->host);
      }
      store_.base->compare_set(attempt_end_key(m.generation), "",
                               end_to_string(EndInfo{"node", 1,
                                                     fmt::format("lost node 0 ({}), the job's store's host",
                                                                 str::join(hosts, ", "))}));
      store_.base->compare_set("rdzv/current", "", std::to_string(m.generation));
      // The new store's host picks its torch port before it joins the next round; the others read it
      // when that round closes (the host may still be stopping its workers now).
      if (mine) store_.base->set("torch_port", std::to_string(store_.torch_port));
      else torch_port_from_store_ = true;
      // A lease on the new store.
      lease_.reset();
      take_lease();
    } catch (const Error& e) {
      *why = fmt::format("moving the job's store to {} at {} failed: {}", c.host, c.standby, e.what());
      return false;
    }
    standby_promoted_ = false;
    say(fmt::format("the job's store moved to {} ({}{}) at epoch {}; the agents meet again for generation {}; a new "
                    "agent joins with --rdzv-endpoint {}",
                    c.standby, c.host, mine ? ", this agent" : "", epoch, m.generation + 1, c.standby));
    return true;
  }
  *why = "no member's standby store answered: the job cannot go on without its store";
  return false;
}

bool ElasticMember::standby_promotion_pending() {
  if (!standby_ || !membership_) return false;
  try {
    StoreClientOptions o = store_.client_options;
    o.host = "127.0.0.1";
    o.port = standby_->port();
    o.fence_key.clear();
    o.timeout = kStoreCallTimeout;
    auto standby = make_prefix_store(connect_tcp_store(o), "cohort/launch/" + plan_.job_id);
    if (standby->add(fmt::format("rdzv/failover/{}/votes", membership_->generation), 0) == 0) return false;
    // The voters promote it once more than half of them voted and their leases on the old store ran
    // out: within a lease and the vote window of their losing it, which was before this round stopped.
    const auto limit = Millis(static_cast<int64_t>(plan_.agent_lease_s * 1000)) + kFailoverWindow;
    say(fmt::format("members of generation {} voted to move the job's store to this agent's standby store; waiting up "
                    "to {:.0f} s for the vote's outcome",
                    membership_->generation, std::chrono::duration<double>(limit).count()));
    standby->wait({epoch_key()}, limit);
    return true;
  } catch (const Error&) {
    return false;
  }
}

bool ElasticMember::member_gone(const AgentInfo& a) const {
  try {
    return store_.base->check({gone_key(a.id)});
  } catch (const Error&) {
    return true;  // the store is gone: nobody will report to it
  }
}

void ElasticMember::settle_end(const EndInfo& e, bool head_lost, const std::function<int()>& pending_interrupt) {
  if (!membership_ || head_lost || !store_.attempt || e.kind == "lost" || e.kind == "store") return;
  try {
    store_.attempt->add("exited", 1);
    // The store's host stays until every member that is still alive has seen the end of a job that
    // is over (their last store calls come after it); between generations nobody waits.
    if (!plan_.host_store || next_generation(e, head_lost)) return;
    auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(plan_.kill_grace_s + 10));
    while (Clock::now() < deadline) {
      int alive = 0;
      for (const auto& a : membership_->nodes) alive += a.id == self_.id || !member_gone(a);
      if (store_.attempt->add("exited", 0) >= alive) return;
      if (pending_interrupt()) return;  // a second interrupt: stop waiting for the others at once
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    log::warn("not every node of generation {} reported its workers stopped", membership_->generation);
  } catch (const Error& e) {
    log::warn("not every node reported its workers stopped: {}", e.what());
  }
}

}  // namespace cohort::launch::job_detail
