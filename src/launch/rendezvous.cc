// Elastic membership: rounds of the rendezvous protocol described in rendezvous.h.
#include "launch/rendezvous.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <unordered_set>

#include <fmt/core.h>

#include "common/strings.h"

namespace cohort::launch {

namespace {

using Clock = std::chrono::steady_clock;

std::string gen_key(int gen, const std::string& rest) { return fmt::format("rdzv/gen/{}/{}", gen, rest); }

}  // namespace

std::string gone_key(const std::string& agent_id) { return "rdzv/gone/" + agent_id; }
std::string attempt_end_key(int generation) { return fmt::format("attempt/{}/end", generation); }
std::string closed_key(int generation) { return gen_key(generation, "closed"); }

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
  std::vector<std::optional<AgentInfo>> slots;  // arrivals (nullopt: counted, description not there yet)
  std::set<std::string> gone;                   // ids known to be gone (a lease never comes back)
  Clock::time_point deadline;
  std::optional<Clock::time_point> min_since;  // when MIN live agents were first seen
  bool asked_end = false;                      // end_generation(gen - 1) was called
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
  return nlohmann::json::parse(store_->get(gen_key(gen, "closed"))).get<Membership>();
}

bool Rendezvous::is_gone(const std::string& id) { return store_->check({gone_key(id)}); }

bool Rendezvous::generation_ended(int gen) { return store_->check({attempt_end_key(gen)}); }

std::optional<std::string> Rendezvous::gone_member(const Membership& m) {
  for (size_t i = 0; i < m.nodes.size(); ++i) {
    if (m.nodes[i].id == self_.id) continue;
    if (is_gone(m.nodes[i].id))
      return fmt::format("node {} ({}): its agent's store lease ended (killed, frozen or cut off)", i, m.nodes[i].host);
  }
  return std::nullopt;
}

void Rendezvous::evaluate(Round& r) {
  const auto now = Clock::now();
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

  // Behind a running generation: it must end first. A newcomer ends it when there is room.
  if (r.previous && !generation_ended(r.gen - 1)) {
    const bool member = std::any_of(r.previous->nodes.begin(), r.previous->nodes.end(),
                                    [&](const AgentInfo& a) { return a.id == self_.id; });
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

  // Who is expected back: the previous generation's members that are not gone.
  std::vector<std::string> missing;
  if (r.previous) {
    for (const auto& a : r.previous->nodes) {
      if (live_ids.count(a.id)) continue;
      if (r.gone.count(a.id) || (a.id != self_.id && is_gone(a.id))) {
        r.gone.insert(a.id);
        continue;
      }
      missing.push_back(a.host);
    }
  }
  bool close = false;
  if (n >= max) {
    close = true;
  } else if (n >= min) {
    if (!r.min_since) r.min_since = now;
    // After a generation, every live member is waited for (they are on their way: their leases hold);
    // the first round waits the last call for agents that may still be starting.
    if (r.previous) close = missing.empty() || now >= r.deadline;
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
      r.next_report = now + std::chrono::seconds(3);
      std::vector<std::string> hosts;
      for (const auto& a : live) hosts.push_back(a.host);
      if (on_progress_)
        on_progress_(fmt::format("generation {}: {} of {}..{} nodes here ({}){}", r.gen, n, min, max,
                                 hosts.empty() ? "none" : str::join(hosts, ", "),
                                 missing.empty() ? "" : fmt::format("; waiting for {}", str::join(missing, ", "))));
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
    r.next_report = Clock::now() + std::chrono::seconds(3);
    const int64_t slot = store_->add(gen_key(gen, "count"), 1) - 1;
    store_->set(gen_key(gen, fmt::format("agent/{}", slot)), nlohmann::json(self_).dump());
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

}  // namespace cohort::launch
