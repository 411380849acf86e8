// Elastic membership: rounds of the rendezvous protocol described in rendezvous.h.
#include "launch/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <unordered_set>

#include <fmt/core.h>

#include "common/strings.h"
#include "store/tcp_store.h"

namespace cohort::launch {

namespace {

using Clock = std::chrono::steady_clock;

std::string gen_key(int gen, const std::string& rest) { return fmt::format("rdzv/gen/{}/{}", gen, rest); }

}  // namespace

std::string gone_key(const std::string& agent_id) { return "rdzv/gone/" + agent_id; }
std::string attempt_end_key(int generation) { return fmt::format("attempt/{}/end", generation); }
std::string closed_key(int generation) { return gen_key(generation, "closed"); }
std::string epoch_key() { return "rdzv/epoch"; }

int Membership::world_size() const {
  int n = 0;
  for (const auto& a : nodes) n += a.nproc;
  return n;
}

int Membership::first_rank(int node) const {
  int n = 0;
  for (int i = 0; i < node; ++i) n += nodes[static_cast<size_t>(i)].nproc;
  return n;
}

std::string Membership::hosts() const {
  std::vector<std::string> h;
  for (const auto& a : nodes) h.push_back(a.host);
  return str::join(h, ", ");
}

// What one agent knows about the round it waits in.
struct Rendezvous::Round {
  int gen = 0;
  std::optional<Membership> previous;           // generation gen - 1, when there is one
  bool previous_ended = false;                  // its end record is there
  int64_t slot = 0;                             // this agent's arrival
  std::vector<std::optional<AgentInfo>> slots;  // arrivals (nullopt: counted, description not there yet)
  std::set<std::string> gone;                   // ids known to be gone (a lease never comes back)
  Clock::time_point deadline;
  std::optional<Clock::time_point> min_since;  // when MIN live agents were first seen
  bool asked_end = false;                      // end_generation(gen - 1) was called
  std::optional<bool> after_failover;           // the store moved after generation gen - 1
  Clock::time_point started;
  Clock::time_point next_report;
};

Rendezvous::Rendezvous(std::shared_ptr<Store> store, AgentInfo self, RendezvousSettings settings,
                       std::function<void(int, const std::string&)> end_generation)
    : store_(std::move(store)),
      self_(std::move(self)),
      settings_(settings),
      end_generation_(std::move(end_generation)) {}

void Rendezvous::check_admission() {
  const std::string mine = fmt::format("{}:{}", settings_.min_nodes, settings_.max_nodes);
  const std::string job = store_->compare_set("rdzv/config", "", mine);
  if (job != mine)
    throw RendezvousRefused(fmt::format("this agent was started with --nnodes {} but the job's agents use --nnodes {}; "
                                        "start every agent with the same bounds",
                                        mine, job));
  if (is_gone(self_.id))
    throw RendezvousRefused(fmt::format(
        "the job dropped this agent ({}): its store lease ended (the agent was frozen or cut off for longer than "
        "the lease) and the job went on without it; start a new agent to join again",
        self_.host));
}

int Rendezvous::first_open_generation() {
  if (!store_->check({"rdzv/current"})) return store_->check({gen_key(0, "closed")}) ? 1 : 0;
  int current = std::stoi(store_->get("rdzv/current"));
  // A generation may have closed after `current` was written: skip every closed one.
  int g = current + 1;
  while (store_->check({gen_key(g, "closed")})) ++g;
  return g;
}

std::optional<Membership> Rendezvous::closed(int gen) {
  if (gen < 0 || !store_->check({gen_key(gen, "closed")})) return std::nullopt;
  Membership m = nlohmann::json::parse(store_->get(gen_key(gen, "closed"))).get<Membership>();
  if (!m.failed.empty()) throw RendezvousSplit(m.failed);
  return m;
}

bool Rendezvous::is_gone(const std::string& id) { return store_->check({gone_key(id)}); }

bool Rendezvous::generation_ended(int gen) { return store_->check({attempt_end_key(gen)}); }

std::optional<std::string> Rendezvous::gone_successor(const Membership& m) {
  const size_t n = m.nodes.size();
  for (size_t i = 0; i < n; ++i) {
    if (m.nodes[i].id != self_.id) continue;
    const size_t next = (i + 1) % n;
    if (next == i || !is_gone(m.nodes[next].id)) return std::nullopt;
    return fmt::format("node {} ({}): its agent's store lease ended (killed, frozen or cut off)", next,
                       m.nodes[next].host);
  }
  return std::nullopt;
}

bool Rendezvous::looks_at_round(Round& r) {
  for (int64_t i = 0; i < r.slot; ++i) {
    if (static_cast<int64_t>(r.slots.size()) <= i) r.slots.resize(static_cast<size_t>(i) + 1);
    auto& s = r.slots[static_cast<size_t>(i)];
    if (!s) {
      const std::string key = gen_key(r.gen, fmt::format("agent/{}", i));
      if (!store_->check({key})) return false;  // counted, not described yet: it looks itself
      s = nlohmann::json::parse(store_->get(key)).get<AgentInfo>();
    }
    if (s->id == self_.id) return true;
    if (r.gone.count(s->id)) continue;
    if (!is_gone(s->id)) return false;
    r.gone.insert(s->id);
  }
  return true;
}

void Rendezvous::report(Round& r, const std::string& line) {
  r.next_report = Clock::now() + std::chrono::seconds(3);
  if (on_progress_) on_progress_(line);
}

void Rendezvous::evaluate(Round& r) {
  const auto now = Clock::now();
  // Behind a running generation: it must end first. A newcomer ends it when there is room.
  if (r.previous && !r.previous_ended) r.previous_ended = generation_ended(r.gen - 1);
  if (r.previous && !r.previous_ended) {
    const bool member = std::any_of(r.previous->nodes.begin(), r.previous->nodes.end(),
                                    [&](const AgentInfo& a) { return a.id == self_.id; });
    const int max = settings_.max_nodes;
    if (!member && !r.asked_end && static_cast<int>(r.previous->nodes.size()) < max && end_generation_) {
      r.asked_end = true;
      end_generation_(r.gen - 1, fmt::format("{} joins the job (generation {} has {} of at most {} nodes)",
                                              self_.host, r.gen - 1, r.previous->nodes.size(), max));
    }
    if (now >= r.deadline) {
      throw RendezvousTimeout(fmt::format(
          "generation {} did not open within {:g} s (--rdzv-timeout): the job runs generation {} with {} of at most "
          "{} nodes ({}), and this agent waits for a place",
          r.gen, settings_.timeout_s, r.gen - 1, r.previous->nodes.size(), max, r.previous->hosts()));
    }
    return;
  }
  // One agent looks at the whole round; the others only check that it is still there (and pass on
  // its progress lines), so that the round costs the store O(1) requests per agent and look instead
  // of one per arrival. At its own deadline every agent looks itself (to close, or to say why not).
  if (now < r.deadline && !looks_at_round(r)) {
    if (now >= r.next_report) {
      const std::string key = gen_key(r.gen, "progress");
      if (store_->check({key})) report(r, store_->get(key));
      else r.next_report = now + std::chrono::seconds(3);
    }
    return;
  }
  // New arrivals (a slot is counted before its description is written: look again next time).
  const int64_t count = store_->add(gen_key(r.gen, "count"), 0);
  if (static_cast<int64_t>(r.slots.size()) < count) r.slots.resize(static_cast<size_t>(count));
  for (size_t i = 0; i < r.slots.size(); ++i) {
    if (r.slots[i]) continue;
    const std::string key = gen_key(r.gen, fmt::format("agent/{}", i));
    if (store_->check({key})) r.slots[i] = nlohmann::json::parse(store_->get(key)).get<AgentInfo>();
  }
  // Live arrivals: each agent once, the gone ones left out.
  std::vector<AgentInfo> live;
  std::unordered_set<std::string> live_ids;
  for (const auto& s : r.slots) {
    if (!s || live_ids.count(s->id) || r.gone.count(s->id)) continue;
    if (s->id != self_.id && is_gone(s->id)) {
      r.gone.insert(s->id);
      continue;
    }
    live.push_back(*s);
    live_ids.insert(s->id);
  }
  const int n = static_cast<int>(live.size());
  const int max = settings_.max_nodes, min = settings_.min_nodes;

  // Who is expected back: the previous generation's members that are not gone. After the store
  // moved, the members that neither voted for it nor followed it are waited for only so long.
  std::vector<std::string> missing;
  if (r.previous) {
    const std::string failover = fmt::format("rdzv/failover/{}/", r.gen - 1);
    if (!r.after_failover) r.after_failover = store_->check({failover + "votes"});
    const bool grace_over =
        *r.after_failover && now - r.started >= std::chrono::duration<double>(settings_.failover_grace_s);
    for (const auto& a : r.previous->nodes) {
      if (live_ids.count(a.id)) continue;
      if (r.gone.count(a.id) || (a.id != self_.id && is_gone(a.id))) {
        r.gone.insert(a.id);
        continue;
      }
      if (grace_over && !store_->check({failover + "vote/" + a.id})) {
        store_->compare_set(gone_key(a.id), "", a.host + " (did not follow the job's store when it moved)");
        r.gone.insert(a.id);
        continue;
      }
      missing.push_back(a.host);
    }
  }
  // Partitions: after a generation, at least half of its members must be back. The others are gone
  // for this store (their leases ran out): they may be alive on the far side of a cut, and there,
  // with more than half of the generation, they move the job's store and go on. With fewer than
  // half left this side can never close the round: it stops at once (everyone reads why).
  int back = 0;
  if (r.previous) {
    for (const auto& a : r.previous->nodes) back += live_ids.count(a.id) ? 1 : 0;
    // At the deadline the members that did not come back count as lost too.
    const int members = static_cast<int>(r.previous->nodes.size());
    const int left = back + (now >= r.deadline ? 0 : static_cast<int>(missing.size()));
    if (2 * left < members) {
      std::vector<std::string> gone_hosts;
      for (const auto& a : r.previous->nodes)
        if (r.gone.count(a.id)) gone_hosts.push_back(a.host);
      std::string lost = "gone: " + (gone_hosts.empty() ? std::string("none") : str::join(gone_hosts, ", "));
      if (now >= r.deadline && !missing.empty())
        lost += fmt::format("; not back within {:g} s: {}", settings_.timeout_s, str::join(missing, ", "));
      Membership failed;
      failed.generation = r.gen;
      failed.epoch = settings_.epoch;
      failed.failed = fmt::format(
          "generation {}: only {} of the {} nodes of generation {} are left ({}), fewer than half: the others may "
          "be cut off from this store and go on without it; stopping so that one copy of the job runs",
          r.gen, left, members, r.gen - 1, lost);
      store_->compare_set(gen_key(r.gen, "closed"), "", nlohmann::json(failed).dump());
      throw RendezvousSplit(failed.failed);
    }
  }
  const bool half_back = !r.previous || 2 * back >= static_cast<int>(r.previous->nodes.size());
  bool close = false;
  if (n >= max) {
    close = half_back;
  } else if (n >= min) {
    if (!r.min_since) r.min_since = now;
    // After a generation, every live member is waited for (they are on their way: their leases hold);
    // the first round waits the last call for agents that may still be starting.
    if (r.previous) close = half_back && (missing.empty() || now >= r.deadline);
    else close = now - *r.min_since >= std::chrono::duration<double>(settings_.last_call_s);
  } else {
    r.min_since.reset();
    if (now >= r.deadline) {
      std::vector<std::string> hosts;
      for (const auto& a : live) hosts.push_back(a.host);
      std::string lost;
      if (r.previous) {
        std::vector<std::string> gone_hosts;
        for (const auto& a : r.previous->nodes)
          if (r.gone.count(a.id)) gone_hosts.push_back(a.host);
        if (!gone_hosts.empty()) lost = fmt::format("; gone since generation {}: {}", r.gen - 1, str::join(gone_hosts, ", "));
        if (!missing.empty()) lost += fmt::format("; not back from generation {}: {}", r.gen - 1, str::join(missing, ", "));
      }
      throw RendezvousTimeout(fmt::format("generation {}: {} of at least {} nodes joined within {:g} s (--rdzv-timeout; "
                                     "--nnodes {}:{}): {}{}",
                                     r.gen, n, min, settings_.timeout_s, min, max,
                                     hosts.empty() ? "none" : str::join(hosts, ", "), lost));
    }
  }
  if (!close) {
    if (now >= r.next_report) {
      std::vector<std::string> hosts;
      for (const auto& a : live) hosts.push_back(a.host);
      const std::string line =
          fmt::format("generation {}: {} of {}..{} nodes here ({}){}", r.gen, n, min, max,
                      hosts.empty() ? "none" : str::join(hosts, ", "),
                      missing.empty() ? "" : fmt::format("; waiting for {}", str::join(missing, ", ")));
      store_->set(gen_key(r.gen, "progress"), line);  // the round's other agents print it too
      report(r, line);
    }
    return;
  }
  // Node order: the store's host, the previous generation's members as they were, newcomers by arrival.
  // Each agent as it joined this round (its flags may have changed: the store may have moved to it).
  std::vector<AgentInfo> nodes;
  auto added = [&](const std::string& id) {
    return std::any_of(nodes.begin(), nodes.end(), [&](const AgentInfo& b) { return b.id == id; });
  };
  for (const auto& a : live)
    if (a.store_host) nodes.push_back(a);
  if (r.previous)
    for (const auto& p : r.previous->nodes)
      for (const auto& a : live)
        if (a.id == p.id && !added(a.id)) nodes.push_back(a);
  for (const auto& a : live)
    if (!added(a.id)) nodes.push_back(a);
  if (static_cast<int>(nodes.size()) > max) nodes.resize(static_cast<size_t>(max));
  Membership m;
  m.generation = r.gen;
  m.epoch = settings_.epoch;
  m.nodes = std::move(nodes);
  if (r.previous) {
    std::string kind;
    try {
      kind = nlohmann::json::parse(store_->get(attempt_end_key(r.gen - 1))).value("kind", "");
    } catch (const nlohmann::json::exception&) {
    }
    m.restarts = r.previous->restarts + (kind == "membership" ? 0 : 1);
  }
  store_->compare_set(gen_key(r.gen, "closed"), "", nlohmann::json(m).dump());
}

std::optional<Membership> Rendezvous::join(int gen, const std::atomic<bool>& stop) {
  check_admission();
  for (;; ++gen) {
    if (auto done = closed(gen)) {
      // Closed before this agent arrived: the next round (unless it was admitted to it already).
      for (size_t i = 0; i < done->nodes.size(); ++i)
        if (done->nodes[i].id == self_.id) done->this_node = static_cast<int>(i);
      if (done->this_node >= 0) return done;
      continue;
    }
    Round r;
    r.gen = gen;
    r.previous = closed(gen - 1);
    r.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(settings_.timeout_s));
    r.started = Clock::now();
    r.next_report = r.started + std::chrono::seconds(3);
    r.slot = store_->add(gen_key(gen, "count"), 1) - 1;
    store_->set(gen_key(gen, fmt::format("agent/{}", r.slot)), nlohmann::json(self_).dump());
    for (;;) {
      if (stop) return std::nullopt;
      evaluate(r);
      try {
        store_->wait({gen_key(gen, "closed")}, settings_.slice);
        break;
      } catch (const TimeoutError&) {
      }
    }
    Membership m = *closed(gen);
    for (size_t i = 0; i < m.nodes.size(); ++i)
      if (m.nodes[i].id == self_.id) m.this_node = static_cast<int>(i);
    if (m.this_node < 0) continue;  // late, or beyond MAX: the next round
    store_->set("rdzv/current", std::to_string(gen));
    return m;
  }
}

int64_t vote_for_store(Store& candidate, const AgentInfo& self, const FailoverVote& v,
                       const std::string& candidate_name, const std::atomic<bool>& stop) {
  const int g = v.last.generation;
  const int members = static_cast<int>(v.last.nodes.size());
  const std::string votes_key = fmt::format("rdzv/failover/{}/votes", g);
  const std::string gone_key_ = fmt::format("rdzv/failover/{}/store_gone", g);
  auto promoted = [&]() -> std::optional<int64_t> {
    if (!candidate.check({epoch_key()})) return std::nullopt;
    return std::stoll(candidate.get(epoch_key()));
  };
  // The vote, once: a voter that votes here never votes elsewhere, so no two standby stores can
  // both count more than half of the generation. Refused as stale: the candidate was promoted.
  int64_t votes = 0;
  const auto voted_at = std::chrono::steady_clock::now();
  try {
    candidate.set(fmt::format("rdzv/failover/{}/vote/{}", g, self.id), self.host);
    if (v.store_gone) candidate.set(gone_key_, self.host);
    votes = candidate.add(votes_key, 1);
  } catch (const StaleEpochError&) {
    if (auto e = promoted()) return *e;
    throw;
  }
  for (bool first = true;; first = false) try {
    // Reading the count is an add of 0, a write: after the promotion it is refused as stale too.
    if (!first) votes = candidate.add(votes_key, 0);
    if (auto e = promoted()) return *e;
    const auto now = std::chrono::steady_clock::now();
    const bool majority = 2 * votes > members;
    // The lost store cannot end a generation for its side any more: its process is gone, or this
    // voter's lease there has run out (so its will ended generation g there).
    const bool old_store_done = now >= v.lease_over || candidate.check({gone_key_});
    if (majority && old_store_done)
      return std::stoll(candidate.compare_set(epoch_key(), "", std::to_string(v.epoch + 1)));
    if (now >= v.deadline || stop) {
      throw FailoverRefused(fmt::format(
          "generation {}: lost the store's host and could not reach a majority of the last generation ({} of {} "
          "voted at {} within {:.1f} s, more than {} needed); stopping so that one copy of the job runs",
          g, votes, members, candidate_name, std::chrono::duration<double>(now - voted_at).count(), members / 2));
    }
    try {
      candidate.wait({epoch_key()}, v.slice);
    } catch (const TimeoutError&) {
    }
  } catch (const StaleEpochError&) {
    if (auto e = promoted()) return *e;
    throw;
  } catch (const PeerLostError& e) {
    // The candidate went away after this agent voted there (its agent stopped, or the link went).
    throw FailoverRefused(fmt::format(
        "generation {}: lost the store's host and could not reach a majority of the last generation ({} of {} voted "
        "at {}, which then stopped answering: {}); stopping so that one copy of the job runs",
        g, votes, members, candidate_name, e.what()));
  }
}

}  // namespace cohort::launch
