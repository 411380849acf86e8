#pragma once
// Elastic membership (`cohort run --nnodes MIN:MAX`, docs/launcher.md "Elastic jobs"): the agents of a
// job meet in numbered generations through the job's store, and each generation's workers run with
// ranks numbered densely over that generation's nodes.
//
// The protocol, all under the job's launch prefix (cohort/launch/<job id>/):
//   rdzv/config                   "MIN:MAX" of the first agent; an agent with other bounds is refused
//   rdzv/current                  the newest closed generation
//   rdzv/epoch                    the store's epoch (missing: 0): how many times the job's store moved.
//                                 Written once, when a standby store is promoted; the agents' connections
//                                 are fenced at it (docs/store.md "Epochs"): a write of an older epoch
//                                 is refused
//   rdzv/gen/<g>/count            arrivals in round g (add)
//   rdzv/gen/<g>/agent/<i>        the i-th arrival's AgentInfo (JSON)
//   rdzv/gen/<g>/progress         the round's last progress line (written by the agent that looks at it)
//   rdzv/gen/<g>/closed           generation g's membership (JSON), written once (compare_set: the
//                                 first closer wins, everyone reads the winner's); a round that must not
//                                 go on (too few of the last generation left) is closed with `failed` set
//   rdzv/gone/<agent id>          a will of the agent's store lease: set when the agent is gone
//                                 (killed, frozen or cut off longer than the lease)
//   rdzv/failover/<g>/vote/<id>   on a standby store: a member of generation g lost the store's host and
//   rdzv/failover/<g>/votes       votes to move the job's store here (the count: add); a member that
//                                 follows the move without voting writes its vote key too
//   rdzv/failover/<g>/store_gone  on a standby store: a voter found the old store's port closed
//   attempt/<g>/end               how generation g ended (job_end.cc, JSON with a "kind"); a round waits
//                                 for it, and counts a restart unless the kind is "membership"
// A round closes when MAX live agents joined, or when at least MIN did and either every live member
// of the previous generation is back or the last call (--rdzv-last-call) has passed since MIN were
// there. It never closes while the previous generation still runs: a newcomer first ends that
// generation (`end_generation`), when there is room for it. Below MIN the round fails after the
// rendezvous timeout, naming who joined and who did not come back.
//
// Partitions (docs/launcher.md "Partitions"): a round after a generation closes only with at least
// half of that generation's members back, and the job's store moves to a standby store only with the
// votes of more than half of them (fail_over below), so two sides of a partition never both go on.
//
// Load: one agent of a round looks at all of it (the first arrival that is not gone); the others watch
// the round's "closed" key and that agent's "gone" key, so a round costs the store a constant number of
// requests per agent and look (docs/performance.md, "the store's load during a rendezvous").
//
// Node order: the store's host first (rank 0 runs where MASTER_ADDR points), then the previous
// generation's members in their order, then newcomers in order of arrival; so ranks move as little as
// they can, and rank 0 stays on the store's host.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "cohort/store.h"

namespace cohort::launch {

struct AgentInfo {
  std::string id;    // unique per agent process (host, pid and random bits)
  std::string host;  // for messages and output tags
  int nproc = 1;     // workers it runs
  // It hosts the job's store, on the master address: it is always node 0, so that rank 0 runs where
  // MASTER_ADDR points (torch's env:// makes rank 0 host its own TCPStore there).
  bool store_host = false;
  // "address:port" of the store this agent keeps ready (empty on the store's host): when the store's
  // host is lost, the survivors move the job's store to the first live member's (docs/launcher.md).
  std::string standby;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(AgentInfo, id, host, nproc, store_host, standby)

struct Membership {
  int generation = 0;
  // Failure restarts before this generation: the previous one's, plus one when it ended by anything
  // but a membership change. Every agent reads it here, so newcomers decide restarts like the others.
  int restarts = 0;
  std::vector<AgentInfo> nodes;  // node rank = index
  int64_t epoch = 0;             // the epoch of the store it closed on (rdzv/epoch)
  // Set instead of nodes when the round must not go on (fewer than half of the previous generation
  // left): every agent of the round stops with this line.
  std::string failed;
  int this_node = -1;            // this agent's node rank (-1: not a member)
  int world_size() const;
  int first_rank(int node) const;
  // "h0, h1, h3"
  std::string hosts() const;
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE_WITH_DEFAULT(Membership, generation, restarts, nodes, epoch, failed)

struct RendezvousSettings {
  int min_nodes = 1;
  int max_nodes = 1;
  double timeout_s = 300;   // below MIN: how long a round waits before it fails
  double last_call_s = 5;   // after MIN joined: how long to wait for more (unless all expected are back)
  Millis slice{100};        // how often a waiting agent looks at the round again
  int64_t epoch = 0;        // the epoch of the store the agent is on (what a closed generation carries)
  // The first round after the store moved waits this long for members of the last generation that
  // neither voted for the move nor followed it (they may be on the old store's side of a cut, or
  // dead); then it marks them gone and goes on without them.
  double failover_grace_s = 10;
};

// An agent the job does not admit: it was dropped (its lease ended: the job went on without it), or
// it was started with other --nnodes bounds than the job's.
class RendezvousRefused : public Error {
 public:
  using Error::Error;
};

// A round that cannot go on without risking a second copy of the job: fewer than half of the previous
// generation's members are left (the others may be on the far side of a partition, going on there).
class RendezvousSplit : public RendezvousRefused {
 public:
  using RendezvousRefused::RendezvousRefused;
};

// A round below MIN at its deadline, or a newcomer that found no place in time.
class RendezvousTimeout : public TimeoutError {
 public:
  using TimeoutError::TimeoutError;
};

// Key names (relative to the job's launch prefix).
std::string gone_key(const std::string& agent_id);
std::string attempt_end_key(int generation);
std::string closed_key(int generation);
std::string epoch_key();  // "rdzv/epoch"

class Rendezvous {
 public:
  // `store`: the job's launch prefix. `end_generation(g, why)` ends the running generation g so that a
  // newcomer can be admitted (the job writes g's end record); it is called at most once per round.
  Rendezvous(std::shared_ptr<Store> store, AgentInfo self, RendezvousSettings settings,
             std::function<void(int generation, const std::string& why)> end_generation);

  // Refuses an agent with other bounds than the job's, or one that was dropped. Throws
  // RendezvousRefused.
  void check_admission();
  // The round a fresh agent joins: one past the newest closed generation (0 for the first agent).
  int first_open_generation();
  // Joins round `gen` and blocks until this agent is a member of a closed generation (a late agent,
  // or one beyond MAX, moves on to later rounds) or `stop` is set (nullopt). Throws RendezvousTimeout
  // below MIN after the timeout, RendezvousRefused for a dropped agent, store errors as they come.
  std::optional<Membership> join(int gen, const std::atomic<bool>& stop);
  // The member after this agent in `m`'s node order (wrapping around), described, when its lease
  // ended; nullopt if it holds (or this agent is alone). Each member watches its successor, so
  // the generation costs the store one request per member and look, and every member is watched.
  std::optional<std::string> gone_successor(const Membership& m);

  // Where "generation 3: 2 of 2..4 nodes here (h0, h1); waiting for h2" lines go (every 3 s of waiting).
  void on_progress(std::function<void(const std::string&)> f) { on_progress_ = std::move(f); }

  const AgentInfo& self() const { return self_; }
  const RendezvousSettings& settings() const { return settings_; }

 private:
  struct Round;
  std::optional<Membership> closed(int gen);
  bool is_gone(const std::string& id);
  bool generation_ended(int gen);
  // Looks at round `r` once: the whole round when this agent is the one that looks (or at its
  // deadline), else only whether that agent is still there. Closes it when the rule says so. Throws
  // TimeoutError below MIN.
  void evaluate(Round& r);
  // Whether this agent is the first arrival of round `r` that is not gone.
  bool looks_at_round(Round& r);
  void report(Round& r, const std::string& line);

  std::shared_ptr<Store> store_;
  AgentInfo self_;
  RendezvousSettings settings_;
  std::function<void(int, const std::string&)> end_generation_;
  std::function<void(const std::string&)> on_progress_;
};

// ---- Moving the job's store (docs/launcher.md "Elastic jobs", "Partitions") -----------------------
//
// When the store's host is lost, each member of the last generation g that lost it votes at the first
// standby store (in g's node order) that answers, and nowhere else. A standby is promoted (its
// rdzv/epoch set to the old epoch + 1, once, by compare-and-set) when more than half of g's members
// (the store's host counted, which never votes) voted there, and the old store can no longer end a
// generation for its side: either a voter found its port closed (its process is gone), or this
// voter's own lease on it has run out (its will has ended generation g there, and with more than half
// of g gone that side cannot close another round).

// A member of the last generation that lost the store's host, voting at a candidate standby store.
struct FailoverVote {
  Membership last;                 // the last generation this agent was a member of
  int64_t epoch = 0;               // the lost store's epoch
  bool store_gone = false;         // this agent found the lost store's port closed
  std::chrono::steady_clock::time_point lease_over;  // this agent's lease on the lost store has run out by then
  std::chrono::steady_clock::time_point deadline;    // no majority by then: give up
  Millis slice{100};
};

// No majority of the last generation voted for the candidate in time: this side stops.
class FailoverRefused : public Error {
 public:
  using Error::Error;
};

// Votes at `candidate` (the job's launch prefix on the candidate's standby store; a connection fenced
// at v.epoch) for `self` and waits until the candidate is promoted, by this agent or another voter.
// Returns the candidate's epoch then (a vote that comes after the promotion is refused as stale:
// the voter then just follows). Throws FailoverRefused naming the votes at the deadline, store errors
// as they come. `candidate_name` names it in messages ("h1's standby store").
int64_t vote_for_store(Store& candidate, const AgentInfo& self, const FailoverVote& v,
                       const std::string& candidate_name, const std::atomic<bool>& stop);

}  // namespace cohort::launch
