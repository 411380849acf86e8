#include "comm/communicator_impl.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cohort/error.h"
#include "comm/communicator_internal.h"
#include "collectives/collectives.h"
#include "collectives/shm/group.h"
#include "common/affinity.h"
#include "comm/shm_path.h"
#include "common/env.h"
#include "common/handoff.h"
#include "common/log.h"
#include "common/strings.h"

namespace cohort::comm {

// The collective algorithms (src/collectives/), selected by size and world (coll::select_algorithm,
// COHORT_ALGO_<OP>), with the intra-host shared-memory fast path in front (comm/shm_path.h).
namespace algo = cohort::comm::shm_path;

namespace {

const env::IntSetting kSpinUs("COHORT_SPIN_US", 200,
                              "microseconds a blocking call busy-polls its sockets after the last data moved "
                              "before sleeping in epoll_wait");
const env::IntSetting kProgressSpinUs(
    "COHORT_PROGRESS_SPIN_US", 20,
    "microseconds the asynchronous progress thread busy-polls after the last data moved before sleeping in "
    "epoll_wait (kept short: the progress thread shares the cores with the caller's compute threads)");

const env::BoolSetting kShmCollectives(
    "COHORT_SHM_COLLECTIVES", true,
    "run allreduce/reduce_scatter/allgather/broadcast/barrier on the shared-memory group when ranks share a "
    "host (COHORT_TRANSPORT=tcp turns it off too; with 0 they run over the point-to-point transports)");
// The cross-host communicators of the hierarchical path are children whose errors are rewritten to
// name world ranks (in_world_ranks), so a failure there names the lost rank as any other does.
const env::StringSetting kHierarchical(
    "COHORT_HIERARCHICAL", "auto",
    "allreduce across hosts: reduce inside each host over shared memory, one cross-host ring per local rank, "
    "finish inside each host. auto: when the ranks span several hosts with the same number (> 1) on each; "
    "1: required (an error if the layout does not allow it); 0: never");

}  // namespace

// ------------------------------------------------------------------------------------------------
// Construction and bootstrap

CommunicatorImpl::CommunicatorImpl(CommSetup s)
    : root_store_(std::move(s.root_store)),
      store_(make_prefix_store(root_store_, s.prefix)),
      prefix_(s.prefix),
      rank_(s.rank),
      size_(s.size),
      options_(std::move(s.options)),
      comm_id_(hash32(s.prefix)),
      spin_(std::chrono::microseconds(std::max<int64_t>(0, kSpinUs.get()))),
      progress_spin_(std::chrono::microseconds(std::max<int64_t>(0, kProgressSpinUs.get()))),
      world_ranks_(std::move(s.world_ranks)),
      child_(s.child),
      connections_only_(s.connections_only),
      connect_to_(std::move(s.connect_to)),
      max_unexpected_bytes_(s.max_unexpected_bytes),
      exits_(std::move(s.exits)) {
  if (!connect_to_.empty() && connect_to_.size() != size_t(size_))
    throw std::logic_error("CommSetup::connect_to must name every rank");
  if (!world_ranks_.empty() && world_ranks_.size() != size_t(size_))
    throw std::logic_error("CommSetup::world_ranks must name every rank");
  if (exits_ && !exits_->ranks.empty() && exits_->ranks.size() != size_t(size_))
    throw std::logic_error("ExitWatch::ranks must name every rank");
  store_->set_timeout(options_.timeout);
  options_.store_prefix = prefix_;
}

CommunicatorImpl::~CommunicatorImpl() {
  {
    std::lock_guard<std::mutex> g(queue_mutex_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  if (progress_.joinable()) progress_.join();
  if (shm_group_) {
    // A rank whose last calls were broadcasts it rooted without waiting has not yet seen its receivers
    // arrive (docs/algorithms-shm.md, "Small messages"): what its next call would have checked is checked
    // here, so a mismatched last broadcast is named even when nothing follows it. A destructor cannot
    // throw: the line is the report.
    try {
      shm_group_->confirm_early_broadcasts();
    } catch (const std::exception& e) {
      log::error("communicator '{}' ending: {}", prefix_, e.what());
    }
  }
  recorder_.close_run(timeline_run_);
}

void CommunicatorImpl::bootstrap() {
  Deadline deadline = Deadline::after(options_.timeout);
  transport::TransportOptions topts{rank_, size_, prefix_, deadline, options_.slow_warning};
  topts.token = root_store_->auth_token();
  std::vector<std::string> available;
  topts.max_unexpected_bytes = max_unexpected_bytes_;
  for (const auto& f : transport::factories()) {
    available.push_back(f.name);
    // "auto": every transport, each peer served by the best one both sides accept (shm on the same
    // host, else tcp); "tcp" or "shm": that one only (a peer it cannot reach is a ConfigError below).
    if (options_.transport == "auto" || options_.transport == f.name)
      transports_.push_back(f.make(topts));
  }
  if (transports_.empty()) {
    throw ConfigError(fmt::format("COHORT_TRANSPORT={}: no such transport (available: auto, shm, {})",
                                  options_.transport, str::join(available, ", ")));
  }

  // Publish this rank: host identity and one descriptor per transport.
  HostIdentity me = local_host_identity();
  nlohmann::json mine;
  mine["host"] = me.serialize();
  // Whether waits may yield (common/affinity.h). As ranges ("0-63,128-191"): a few bytes per rank in the
  // store, not a list of every CPU.
  mine["cpus"] = str::format_ranges(affinity::allowed_cpus());
  for (auto& t : transports_) mine["transports"][t->name()] = t->descriptor();
  // This rank's process, which peers on its host check before they hand it memory or take theirs
  // (common/handoff.h). A pid names a process only in its pid namespace, so that goes with it.
  mine["pid"] = ::getpid();
  mine["pidns"] = handoff::pid_namespace();
  store_->set("peer/" + std::to_string(rank_), mine.dump());

  // Read everyone, in batches; while waiting, say who is missing (after COHORT_SLOW_WARNING, then at a
  // doubling interval) and, where the launcher publishes exits, fail as soon as a missing rank's
  // process is known to have ended: it never joins. The launcher puts a record of the end in place of
  // a world communicator's missing entry, which ends the wait at once; a child communicator (whose
  // keys the launcher does not know) reads the launcher's count of exits every kExitPoll instead.
  std::vector<std::string> values;
  values.reserve(static_cast<size_t>(size_));
  const int kBatch = 1024;
  auto start = Deadline::Clock::now();
  auto warning_interval = std::chrono::duration_cast<Deadline::Clock::duration>(options_.slow_warning);
  auto next_warning = start + warning_interval;
  int64_t exits_seen = 0;
  for (int first = 0; first < size_; first += kBatch) {
    std::vector<std::string> keys;
    for (int r = first; r < std::min(size_, first + kBatch); ++r) keys.push_back("peer/" + std::to_string(r));
    for (;;) {
      auto until = std::min(next_warning, deadline.at());
      const bool poll_exits = exits_ && child_;
      if (poll_exits) until = std::min(until, Deadline::Clock::now() + kExitPoll);
      auto step = std::chrono::ceil<std::chrono::milliseconds>(until - Deadline::Clock::now());
      try {
        store_->wait(keys, std::max(step, std::chrono::milliseconds(1)));
        break;
      } catch (const TimeoutError&) {
        if (poll_exits) check_exits_while_joining(exits_seen, start);
        const auto now = Deadline::Clock::now();
        if (now < next_warning && !deadline.expired()) continue;
        std::vector<int> missing;
        for (int r = first; r < std::min(size_, first + kBatch); ++r)
          if (!store_->check({"peer/" + std::to_string(r)})) missing.push_back(r);
        for (int r = first + kBatch; r < size_; ++r)  // beyond this batch: only count them
          if (!store_->check({"peer/" + std::to_string(r)})) missing.push_back(r);
        std::string text = fmt::format("communicator '{}': {} of {} ranks joined after {}; missing rank(s) {}", prefix_,
                                       size_ - int(missing.size()), size_,
                                       seconds_text(Deadline::Clock::now() - start), str::format_ranges(missing));
        if (deadline.expired()) throw TimeoutError(fmt::format("{} ({})", text, timeout_source()));
        log::warn("{}", text);
        warning_interval *= 2;
        next_warning = now + warning_interval;
      }
    }
    auto got = store_->multi_get(keys);
    for (size_t i = 0; i < got.size(); ++i) {
      // A record of the rank's end in place of its entry (comm/peer_exits.h); the entries it
      // publishes itself hold no "exited".
      if (got[i].find("\"exited\"") == std::string::npos) continue;
      std::optional<ExitRecord> gone;
      try {
        gone = exit_record_from_json(nlohmann::json::parse(got[i]).at("exited").dump());
      } catch (const std::exception&) {
        continue;  // not one: the entry is checked with the others below
      }
      throw_exited_before_joining(first + int(i), *gone, start);
    }
    for (auto& v : got) values.push_back(std::move(v));
  }

  std::vector<HostIdentity> ids(static_cast<size_t>(size_));
  std::vector<nlohmann::json> published(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    try {
      published[size_t(r)] = nlohmann::json::parse(values[size_t(r)]);
      ids[size_t(r)] = HostIdentity::parse(published[size_t(r)].at("host").get<std::string>());
    } catch (const std::exception& e) {
      throw ConfigError(fmt::format("communicator '{}': rank {} published an unreadable entry ({}); is another job "
                                    "using the same store prefix?",
                                    prefix_, r, e.what()));
    }
  }
  topology_ = Topology::build(rank_, ids);
  // Each rank's process as it published it; 0 where it cannot be checked from here (another pid
  // namespace, or an entry without one): then any process of this user may stand for it.
  std::vector<int> pids(static_cast<size_t>(size_), 0);
  const std::string my_pidns = handoff::pid_namespace();
  for (int r = 0; r < size_; ++r) {
    const nlohmann::json& e = published[size_t(r)];
    if (e.contains("pid") && e["pid"].is_number_integer() && e.value("pidns", std::string()) == my_pidns &&
        !my_pidns.empty())
      pids[size_t(r)] = e["pid"].get<int>();
  }
  auto local_pids = [&](const std::vector<int>& host_ranks) {
    std::vector<int> out;
    for (int r : host_ranks) out.push_back(pids[size_t(r)]);
    return out;
  };
  {
    // Waits yield only where the ranks on this machine share CPUs (an entry without "cpus": unknown,
    // shares). This machine: the same boot id, so the hosts that tests simulate in network namespaces
    // on one machine count together: their ranks do share its CPUs.
    std::vector<std::vector<int>> local_sets;
    for (int r = 0; r < size_; ++r) {
      if (ids[size_t(r)].boot_id != ids[size_t(rank_)].boot_id) continue;
      const auto it = published[size_t(r)].find("cpus");
      std::vector<int> cpus;
      if (it != published[size_t(r)].end() && it->is_string() && !it->get<std::string>().empty()) {
        try {
          cpus = str::parse_int_list(it->get<std::string>(), "cpus");
        } catch (const std::exception&) {
          cpus.clear();  // unreadable: counts as sharing (waits yield, as they always did)
        }
      }
      local_sets.push_back(std::move(cpus));
    }
    yield_choice_ = affinity::choose_yield(local_sets);
    yield_in_waits_ = yield_choice_.yield;
    link_report_ = yield_choice_.why;
  }
  if (!child_) recorder_.set_identity(rank_, size_, host_of(rank_));
  // Route every peer through the first transport (by priority) that both sides have and that
  // accepts the peer's descriptor.
  route_.assign(static_cast<size_t>(size_), transports_.front().get());
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    transport::Transport* chosen = nullptr;
    for (auto& t : transports_) {
      auto& tr = published[size_t(r)]["transports"];
      if (!tr.contains(t->name())) continue;
      if (t->can_reach(tr[t->name()].get<std::string>())) {
        chosen = t.get();
        break;
      }
    }
    if (!chosen) {
      throw ConfigError(fmt::format("COHORT_TRANSPORT={}: rank {} ({}) cannot be reached from rank {} ({}) by {}{}", options_.transport, r,
                                    host_of(r), rank_, host_of(rank_), options_.transport == "auto" ? "any transport" : options_.transport,
                                    options_.transport == "shm" ? " (shm only connects ranks on one host; use auto)" : ""));
    }
    route_[size_t(r)] = chosen;
  }
  for (auto& t : transports_) {
    std::vector<transport::PeerInfo> peers(static_cast<size_t>(size_));
    std::vector<bool> use(static_cast<size_t>(size_), false);
    for (int r = 0; r < size_; ++r) {
      peers[size_t(r)].host = ids[size_t(r)].hostname;
      auto& tr = published[size_t(r)]["transports"];
      if (tr.contains(t->name())) peers[size_t(r)].descriptor = tr[t->name()].get<std::string>();
      peers[size_t(r)].pid = pids[size_t(r)];
      use[size_t(r)] = r != rank_ && route_[size_t(r)] == t.get() && (connect_to_.empty() || connect_to_[size_t(r)]);
    }
    t->connect(peers, use, deadline);
    t->set_mismatch_formatter([this](int peer, const transport::Signature& theirs, const transport::Signature& ours,
                                     const transport::Envelope& env) {
      uint32_t seq = uint32_t(env.tag);
      std::string where =
          seq == kP2PSeq ? "as a point-to-point message" : fmt::format("as operation #{}", full_seq(seq));
      return fmt::format("mismatched calls: rank {} ({}) called {} {} but rank {} called {}", peer, host_of(peer),
                         describe_signature(theirs), where, rank_, describe_signature(ours));
    });
  }
  if (connections_only_) return;
  const bool shm_collectives =
      kShmCollectives.get() && options_.transport != "tcp";
  if (size_ > 1 && topology_.all_local() && shm_collectives) {
    shm_group_ = shm::Group::create(*store_, topology_.local_rank, topology_.local_size, "shm-group", options_.timeout,
                                    local_pids(topology_.hosts.front()));
    probe_link(*shm_group_);  // before the communicator's watch: no operation of its own runs yet
    install_shm_semantics(*shm_group_, topology_.hosts.front());
    log::debug("communicator '{}': all {} ranks on one host, collectives over shared memory", prefix_, size_);
  }
  const std::string hierarchical = kHierarchical.get();
  if (hierarchical != "auto" && hierarchical != "0" && hierarchical != "1")
    throw ConfigError(fmt::format("COHORT_HIERARCHICAL={}: expected auto, 0 or 1", hierarchical));
  // Hierarchical allreduce needs the same number (> 1) of ranks on every host (one ring per local rank).
  bool even = topology_.hosts.size() > 1 && topology_.local_size > 1;
  for (const auto& h : topology_.hosts) even = even && h.size() == topology_.hosts.front().size();
  // "1" is a requirement on the communicator the user made; its children (a cross-host ring has one rank
  // per host) use the path where their layout allows it.
  if (hierarchical == "1" && !child_ && (!even || !shm_collectives)) {
    std::vector<std::string> layout;
    for (const auto& h : topology_.hosts)
      layout.push_back(fmt::format("{}: {}", topology_.identity[size_t(h.front())].hostname, h.size()));
    throw ConfigError(fmt::format(
        "COHORT_HIERARCHICAL=1 needs several hosts with the same number (> 1) of ranks each and shared memory "
        "allowed (COHORT_TRANSPORT not tcp, COHORT_SHM_COLLECTIVES not 0); ranks per host: {}",
        str::join(layout, ", ")));
  }
  if (even && shm_collectives && hierarchical != "0") {
    {
      const int host = topology_.host_of_rank[size_t(rank_)];
      host_group_ = shm::Group::create(*store_, topology_.local_rank, topology_.local_size,
                                       fmt::format("shm-group/host{}", host), options_.timeout,
                                       local_pids(topology_.hosts[size_t(host)]));
      probe_link(*host_group_);
      install_shm_semantics(*host_group_, topology_.hosts[size_t(host)]);
      std::vector<int> members, ring;  // the rank with my local rank on every host, in host order
      for (const auto& h : topology_.hosts) members.push_back(h[size_t(topology_.local_rank)]);
      for (int m : members) ring.push_back(world_rank(m));
      cross_host_ = create_child(fmt::format("{}/cross/local{}", prefix_, topology_.local_rank), host,
                                 int(topology_.hosts.size()), members, ring);
      log::debug("communicator '{}': {} hosts x {} ranks, hierarchical allreduce (shm inside hosts, {} rings across)",
                 prefix_, topology_.hosts.size(), topology_.local_size, topology_.local_size);
    }
  }
  log::info("communicator '{}' ready: rank {} of {}, {} host(s), local rank {} of {}, {:.3f} s", prefix_, rank_, size_,
            topology_.hosts.size(), topology_.local_rank, topology_.local_size,
            std::chrono::duration<double>(Deadline::Clock::now() - start).count());
}

std::string CommunicatorImpl::host_of(int rank) const {
  if (rank < 0 || rank >= size_ || size_t(rank) >= topology_.identity.size()) return "?";
  return topology_.identity[size_t(rank)].hostname;
}

std::string CommunicatorImpl::in_world_ranks(const std::string& text) const {
  if (world_ranks_.empty()) return text;
  // Every message names a peer as "rank N (host)" (peer_text, the transports, the shm group), and
  // this rank as "on rank N (host)": rename N, and nothing else. A peer's failure notice ("rank N
  // (host) failed: <its message>") carries a message its sender already wrote in world ranks: only
  // the part up to it is renamed.
  static constexpr std::string_view kNotice = ") failed: ";
  const size_t cut = text.find(kNotice);
  const auto head_end = cut == std::string::npos ? text.cend() : text.cbegin() + long(cut + kNotice.size());
  std::string out;
  size_t last = 0;
  for (const auto& m : str::rank_mentions(std::string_view(text).substr(0, size_t(head_end - text.cbegin())))) {
    out.append(text, last, m.pos - last);
    out += m.rank >= 0 && m.rank < size_ ? fmt::format("rank {} (", world_ranks_[size_t(m.rank)])
                                         : text.substr(m.pos, m.len);
    last = m.pos + m.len;
  }
  out.append(text, last, std::string::npos);
  return out;
}

std::string CommunicatorImpl::peer_text(int peer) const { return fmt::format("rank {} ({})", peer, host_of(peer)); }

}  // namespace cohort::comm
