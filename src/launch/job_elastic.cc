// Elastic membership in the job (`cohort run --nnodes MIN:MAX`, docs/launcher.md "Elastic jobs"):
// each attempt is a generation. Its watcher thread joins the generation's round (launch/rendezvous.h)
// and reports the membership; the main loop then lays the generation out (nodes, dense ranks, the
// world size), points the agent's lease wills at the generation's end record and starts the workers.
// A generation ends like any attempt (a worker's failure, all done, an interrupt), or because a
// member's lease ended (its will, or the watcher seeing its "gone" key), or because a newcomer asked
// for a place ("membership"). The agents that are left meet again at the next generation; failures
// count against --max-restarts, membership changes do not. When the store's host itself is lost
// ("store"), the survivors first move the job's store to the first member whose standby store answers
// (fail_over_store) and meet there.
#include <unistd.h>

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

}  // namespace

RendezvousSettings rendezvous_settings(const Plan& plan) {
  RendezvousSettings s;
  s.min_nodes = plan.min_nodes;
  s.max_nodes = plan.max_nodes;
  s.timeout_s = plan.join_timeout_s;
  s.last_call_s = plan.rdzv_last_call_s;
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
      // moment between the round's closing and the wills) is seen here. After the first seconds
      // every member's will is in place, and the scan (one request per member) stops: it would cost
      // the store members^2 requests per slice on a big job.
      if (std::chrono::steady_clock::now() - joined < std::chrono::seconds(5))
        if (auto gone = r.gone_member(*m)) store->compare_set(end_key, "", end_to_string(EndInfo{"node", 1, "lost " + *gone}));
    }
  } catch (const RendezvousRefused& e) {
    if (!*stop) events->push({WatchEvent::kRefused, e.what(), generation});
  } catch (const RendezvousTimeout& e) {
    if (!*stop) events->push({WatchEvent::kJoinTimeout, e.what(), generation});
  } catch (const Error& e) {
    if (!*stop) events->push({WatchEvent::kLost, e.what(), generation});
  }
}

void Job::open_lease() {
  const NodePlan* node = plan_.node(plan_.this_node);
  self_ = AgentInfo{fmt::format("{}-{}-{}", net::hostname(), getpid(), random_token(4)), net::hostname(),
                    node ? node->nproc : 0, plan_.host_store, standby_address_};
  take_lease();
}

void Job::take_lease() {
  auto events = events_;
  const int number = ++lease_number_;
  lease_ = StoreLease::open(client_options_, Millis(static_cast<int64_t>(plan_.agent_lease_s * 1000)),
                            [events, number](const std::string& why) {
                              events->push({WatchEvent::kLeaseLost, why, kAnyAttempt, number});
                            });
  lease_->set_wills({{launch_prefix(plan_) + gone_key(self_.id), self_.host}});
}

int Job::first_generation() {
  Rendezvous r(base_store_, self_, rendezvous_settings(plan_), {});
  r.check_admission();
  return r.first_open_generation();
}

void Job::apply_membership(const Membership& joined) {
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
  attempt_store_ = make_prefix_store(base_store_, fmt::format("attempt/{}", m.generation));
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

std::optional<int> Job::next_generation(const EndInfo& e) const {
  if (head_lost_ || !membership_) return std::nullopt;
  if (e.kind == "membership") return membership_->generation + 1;
  if (e.restartable() && membership_->restarts < plan_.max_restarts) return membership_->generation + 1;
  return std::nullopt;
}

void Job::leave_elastic_job(int sig) {
  // An interrupted agent (Ctrl-C, a scheduler's or a spot instance's SIGTERM) leaves: the others end
  // this generation and go on without it, as they would after a loss.
  try {
    base_store_->set(gone_key(self_.id), self_.host + " (left)");
    if (joined_ && membership_)
      attempt_store_->compare_set("end", "",
                                  end_to_string(EndInfo{"node", 1,
                                                        fmt::format("node {} ({}) left the job: its agent got {}",
                                                                    membership_->this_node, self_.host,
                                                                    signal_name(sig))}));
  } catch (const Error& e) {
    log::warn("could not tell the job's store that this agent leaves: {}", e.what());
  }
}

bool Job::fail_over_store() {
  if (!membership_) return false;
  const Membership m = *membership_;  // the last generation this agent was a member of
  // Only a store that is really gone is moved: if it takes a new connection, this agent lost its own
  // connections (a hiccup, a slow answer), not the store, and the others may well be fine with it.
  // This agent then stops; the others see its lease end and go on without it.
  try {
    StoreClientOptions old = client_options_;
    old.timeout = std::chrono::milliseconds(1000);
    connect_tcp_store(old);
    say(fmt::format("the job's store at {} still answers: this agent lost its connection to it, not the store; "
                    "stopping (the other nodes go on without it)",
                    store_addr_));
    return false;
  } catch (const Error&) {
  }
  std::vector<const AgentInfo*> lost;
  for (const auto& a : m.nodes)
    if (a.store_host) lost.push_back(&a);
  // The candidates, in the generation's order (every survivor tries the same list): the first
  // standby store that answers is the job's store from now on.
  for (const auto& c : m.nodes) {
    if (c.store_host || c.standby.empty()) continue;
    const bool mine = c.id == self_.id;
    auto [host, port] = net::split_host_port(c.standby);
    StoreClientOptions co = client_options_;
    co.host = mine ? "127.0.0.1" : host;
    co.port = port;
    co.timeout = std::chrono::milliseconds(1500);
    std::shared_ptr<Store> base;
    try {
      base = connect_tcp_store(co);
    } catch (const Error& e) {
      say(fmt::format("the standby store of {} at {} did not answer ({}); trying the next member", c.host, c.standby,
                      e.what()));
      continue;
    }
    try {
      co.timeout = kStoreCallTimeout;
      base->set_timeout(kStoreCallTimeout);
      client_options_ = co;
      base_client_ = base;
      base_store_ = make_prefix_store(base, "cohort/launch/" + plan_.job_id);
      watch_base_ = make_prefix_store(connect_tcp_store(client_options_), "cohort/launch/" + plan_.job_id);
      store_addr_ = c.standby;
      plan_.master_addr = host;
      plan_.master_port = port;
      if (mine) {
        server_ = std::move(standby_);
        plan_.host_store = true;
        self_.store_host = true;
        self_.standby.clear();
        torch_port_ = pick_free_port("");
      } else {
        plan_.host_store = false;
      }
      // Seed the new store with what the lost one knew that the next round needs: the bounds, the
      // last generation and its end, and the lost host's agents as gone. Every survivor writes the
      // same (compare-and-set: the first one's stays).
      base_store_->compare_set("rdzv/config", "", fmt::format("{}:{}", plan_.min_nodes, plan_.max_nodes));
      base_store_->compare_set(closed_key(m.generation), "", nlohmann::json(m).dump());
      std::vector<std::string> hosts;
      for (const auto* a : lost) {
        base_store_->set(gone_key(a->id), a->host);
        hosts.push_back(a->host);
      }
      base_store_->compare_set(attempt_end_key(m.generation), "",
                               end_to_string(EndInfo{"node", 1,
                                                     fmt::format("lost node 0 ({}), the job's store's host",
                                                                 str::join(hosts, ", "))}));
      base_store_->compare_set("rdzv/current", "", std::to_string(m.generation));
      if (mine) base_store_->set("torch_port", std::to_string(torch_port_));
      else torch_port_ = std::stoi(base_store_->get("torch_port"));
      // A lease on the new store (the old one went with the old store).
      lease_.reset();
      take_lease();
    } catch (const Error& e) {
      say(fmt::format("moving the job's store to {} at {} failed: {}", c.host, c.standby, e.what()));
      return false;
    }
    say(fmt::format("the job's store moved to {} ({}{}); the agents meet again for generation {}; a new agent joins "
                    "with --rdzv-endpoint {}",
                    c.standby, c.host, mine ? ", this agent" : "", m.generation + 1, c.standby));
    return true;
  }
  say("no member's standby store answered: the job cannot go on without its store");
  return false;
}

bool Job::member_gone(const AgentInfo& a) const {
  try {
    return base_store_->check({gone_key(a.id)});
  } catch (const Error&) {
    return true;  // the store is gone: nobody will report to it
  }
}

void Job::settle_elastic_end() {
  if (!membership_ || head_lost_ || !attempt_store_ || end_->kind == "lost" || end_->kind == "store") return;
  try {
    attempt_store_->add("exited", 1);
    // The store's host stays until every member that is still alive has seen the end of a job that
    // is over (their last store calls come after it); between generations nobody waits.
    if (!plan_.host_store || next_generation(*end_)) return;
    auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(plan_.kill_grace_s + 10));
    while (Clock::now() < deadline) {
      int alive = 0;
      for (const auto& a : membership_->nodes) alive += a.id == self_.id || !member_gone(a);
      if (attempt_store_->add("exited", 0) >= alive) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    log::warn("not every node of generation {} reported its workers stopped", membership_->generation);
  } catch (const Error& e) {
    log::warn("not every node reported its workers stopped: {}", e.what());
  }
}

}  // namespace cohort::launch::job_detail
