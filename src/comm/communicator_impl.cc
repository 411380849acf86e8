#include "comm/communicator_impl.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <set>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cohort/error.h"
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

// True on the thread that runs the *_async operations: its waits spin only while data is flowing.
thread_local bool t_progress_thread = false;

const env::BoolSetting kShmCollectives(
    "COHORT_SHM_COLLECTIVES", true,
    "run allreduce/reduce_scatter/allgather/broadcast/barrier on the shared-memory group when ranks share a "
    "host (COHORT_TRANSPORT=tcp turns it off too; with 0 they run over the point-to-point transports)");
const env::BoolSetting kShmSharedBuffers(
    "COHORT_SHM_SHARED_BUFFERS", true,
    "allocate_shared gives memory the local peers map (DDP buckets reduced in place); 0: ordinary memory, staged");
const env::BoolSetting kShmProbe(
    "COHORT_SHM_PROBE", true,
    "measure the link between the local ranks when a shared-memory group starts (well under 1 ms; "
    "Communicator::link_report, the bench's header, debug log)");
// The cross-host communicators of the hierarchical path are children whose errors are rewritten to
// name world ranks (in_world_ranks), so a failure there names the lost rank as any other does.
const env::StringSetting kHierarchical(
    "COHORT_HIERARCHICAL", "auto",
    "allreduce across hosts: reduce inside each host over shared memory, one cross-host ring per local rank, "
    "finish inside each host. auto: when the ranks span several hosts with the same number (> 1) on each; "
    "1: required (an error if the layout does not allow it); 0: never");

constexpr uint32_t kP2PSeq = 0xFFFFFFFFu;

// How often a rank waiting for others to join reads the launcher's count of exits: a rank whose
// process ended is named within about this long (docs/errors.md, "Failure timing").
constexpr auto kExitPoll = std::chrono::seconds(1);
// How long a rank that lost a peer waits for the launcher's record of that peer's end before it fails
// without it: the launcher publishes within milliseconds of reaping the process, which the lost
// channel usually shows first. A peer on this host has this rank's launcher, alive (the rank would
// have died with it): its record comes. A peer on another host may have lost its launcher with it (a
// killed agent takes its ranks along), and then this rank's failure, and the ranks it tells, come this
// much later: a shorter wait.
constexpr auto kExitRecordWait = std::chrono::milliseconds(500);
constexpr auto kRemoteExitRecordWait = std::chrono::milliseconds(100);

uint32_t hash32(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return uint32_t(h ^ (h >> 32));
}

std::string seconds_text(std::chrono::nanoseconds d) {
  return fmt::format("{:.1f} s", std::chrono::duration<double>(d).count());
}

// Rethrows `e` as the same cohort error type with `prefix` in front of its message.
std::exception_ptr with_prefix(std::exception_ptr e, const std::string& prefix) {
  try {
    std::rethrow_exception(e);
  } catch (const AbortedError& x) {
    return std::make_exception_ptr(AbortedError(x.what()));
  } catch (const TimeoutError& x) {
    return std::make_exception_ptr(TimeoutError(prefix + x.what()));
  } catch (const PeerLostError& x) {
    return std::make_exception_ptr(PeerLostError(prefix + x.what()));
  } catch (const MismatchError& x) {
    return std::make_exception_ptr(MismatchError(prefix + x.what()));
  } catch (const Error& x) {
    return std::make_exception_ptr(Error(prefix + x.what()));
  } catch (const std::exception& x) {
    return std::make_exception_ptr(Error(prefix + x.what()));
  }
}

// Rethrows `e` as the same cohort error type with its message passed through `rename`.
template <typename F>
std::exception_ptr renamed(std::exception_ptr e, F rename) {
  try {
    std::rethrow_exception(e);
  } catch (const AbortedError& x) {
    return std::make_exception_ptr(AbortedError(rename(x.what())));
  } catch (const TimeoutError& x) {
    return std::make_exception_ptr(TimeoutError(rename(x.what())));
  } catch (const PeerLostError& x) {
    return std::make_exception_ptr(PeerLostError(rename(x.what())));
  } catch (const MismatchError& x) {
    return std::make_exception_ptr(MismatchError(rename(x.what())));
  } catch (const std::exception& x) {
    return std::make_exception_ptr(Error(rename(x.what())));
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Work

class WorkImpl final : public Work {
 public:
  // `help` runs queued operations on the calling thread when no other thread is driving (see wait()).
  WorkImpl(std::chrono::milliseconds default_timeout, std::function<void()> help)
      : default_timeout_(default_timeout), help_(std::move(help)) {}
  void complete(std::exception_ptr e) {
    std::lock_guard<std::mutex> g(m_);
    done_ = true;
    error_ = e;
    cv_.notify_all();
  }
  void wait(std::chrono::milliseconds timeout) override {
    if (timeout.count() <= 0) timeout = default_timeout_;
    const auto until = std::chrono::steady_clock::now() + timeout;
    // Not started yet and the progress thread is idle (or not woken yet): run it here rather than
    // hand it over and sleep. On a busy core (a DDP rank whose compute thread shares its core with
    // the progress thread) that saves two thread switches per operation and a thread competing for
    // the core. The communicator outlives every unfinished Work (its destructor drains the queue), and
    // a finished one never gets here.
    if (!test() && help_) help_();
    std::unique_lock<std::mutex> lk(m_);
    if (!cv_.wait_until(lk, until, [&] { return done_; })) {
      throw TimeoutError(fmt::format("asynchronous operation did not finish within {}", seconds_text(timeout)));
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool test() override {
    std::lock_guard<std::mutex> g(m_);
    return done_;
  }
  std::exception_ptr exception() override {
    std::lock_guard<std::mutex> g(m_);
    return error_;
  }

 private:
  std::chrono::milliseconds default_timeout_;
  std::function<void()> help_;
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

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

// ------------------------------------------------------------------------------------------------
// Running operations

void CommunicatorImpl::check_usable() const {
  if (failed_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(fail_mutex_);
    throw AbortedError(fmt::format("communicator failed earlier: {}", root_cause_));
  }
}

namespace {
// How a failure notice classifies `e` (the peers rethrow it as the same class).
transport::Transport::ErrorClass error_class(std::exception_ptr e) {
  using EC = transport::Transport::ErrorClass;
  try {
    std::rethrow_exception(e);
  } catch (const TimeoutError&) {
    return EC::kTimeout;
  } catch (const PeerLostError&) {
    return EC::kPeerLost;
  } catch (const MismatchError&) {
    return EC::kMismatch;
  } catch (...) {
  }
  return EC::kOther;
}
}  // namespace

void CommunicatorImpl::fail_and_throw(std::exception_ptr error) {
  error = explain_exit(error);
  std::string prefix = op_.kind == OpKind::kSendRecv
                           ? fmt::format("{} on rank {} ({}): ", op_kind_name(op_.kind), rank_, host_of(rank_))
                           : fmt::format("{} #{} ({}) on rank {} ({}): ", op_kind_name(op_.kind), seq_,
                                         format_bytes(op_.bytes), rank_, host_of(rank_));
  std::exception_ptr e = with_prefix(error, prefix);
  if (!world_ranks_.empty()) e = renamed(e, [this](const std::string& m) { return in_world_ranks(m); });
  std::string message;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    message = x.what();
  }
  bool first = false;
  {
    std::lock_guard<std::mutex> g(fail_mutex_);
    if (!failed_.load()) {
      root_cause_ = message;
      failed_.store(true, std::memory_order_release);
      first = true;
    }
  }
  if (first) recorder_.dump_on_failure(message);
  // The root cause is passed on to every peer that did not tell it to this rank, also when it came
  // in a peer's notice: once this rank exits, a peer that heard nothing else would see only its
  // closed connections and name this rank instead of the one that died (each rank passes it on once).
  if (first) {
    for (auto& t : transports_) t->notify_peers(error_class(e), message);
  }
  for (auto& t : transports_) t->fail(std::make_exception_ptr(AbortedError("communicator failed: " + root_cause_)));
  // The cross-host communicator's peers (the same local rank on the other hosts) may be blocked in
  // it: they hear of this failure through it, not as "rank N left" once this process exits.
  if (cross_host_) static_cast<CommunicatorImpl&>(*cross_host_).fail_from_parent(message, error_class(e));
  std::rethrow_exception(e);
}

void CommunicatorImpl::fail_from_parent(const std::string& message, transport::Transport::ErrorClass cls) {
  {
    std::lock_guard<std::mutex> g(fail_mutex_);
    if (failed_.load()) return;  // it failed first (the parent's failure came from here)
    root_cause_ = message;
    failed_.store(true, std::memory_order_release);
  }
  for (auto& t : transports_) t->notify_peers(cls, message);
  for (auto& t : transports_) t->fail(std::make_exception_ptr(AbortedError("communicator failed: " + message)));
}

void CommunicatorImpl::execute_locked(const OpDesc& desc, const Body& body) {
  check_usable();
  op_ = desc;
  if (desc.kind != OpKind::kSendRecv) {
    do ++seq_;
    while (wire_seq() == 0 || wire_seq() == kP2PSeq);
  }
  op_sig_ = desc.signature();
  op_start_ = Deadline::Clock::now();
  op_deadline_ = Deadline(op_start_ + options_.timeout);
  next_warning_ = op_start_ + options_.slow_warning;
  warning_interval_ = options_.slow_warning;
  send_index_.clear();
  recv_index_.clear();
  pending_.clear();
  trace::OpBegin rec{comm_id_, desc.kind == OpKind::kSendRecv ? 0 : seq_, desc.kind, uint8_t(desc.dtype),
                     uint8_t(desc.redop), desc.kind == OpKind::kSendRecv ? desc.peer : coll::is_rooted(desc.kind) ? desc.root : -1,
                     desc.count, desc.bytes, desc.queued_ns,
                     std::chrono::duration_cast<std::chrono::nanoseconds>(op_start_.time_since_epoch()).count()};
  trace::Recorder::Handle recorded = recorder_.op_begin(rec);
  try {
    body();
    recorder_.op_end(recorded, rec, true, timeline_run_);
  } catch (const InvalidArgument&) {
    recorder_.op_end(recorded, rec, false, timeline_run_);
    throw;
  } catch (...) {
    recorder_.op_end(recorded, rec, false, timeline_run_);
    fail_and_throw(std::current_exception());
  }
}

void CommunicatorImpl::drain_queue_locked() {
  for (;;) {
    std::shared_ptr<WorkImpl> work;
    std::pair<OpDesc, Body> job;
    {
      std::lock_guard<std::mutex> g(queue_mutex_);
      if (queue_.empty()) return;
      work = std::move(queue_.front().first);
      job = std::move(queue_.front().second);
      queue_.pop_front();
    }
    try {
      execute_locked(job.first, job.second);
      work->complete(nullptr);
    } catch (...) {
      work->complete(std::current_exception());
    }
  }
}

void CommunicatorImpl::run_blocking(const OpDesc& desc, const Body& body) {
  std::lock_guard<std::mutex> g(drive_);
  drain_queue_locked();
  execute_locked(desc, body);
}

std::shared_ptr<Work> CommunicatorImpl::run_async(OpDesc desc, Body body) {
  check_usable();
  if (recorder_.timing()) desc.queued_ns = trace::monotonic_ns();
  auto work = std::make_shared<WorkImpl>(options_.timeout, [this] {
    std::unique_lock<std::mutex> g(drive_, std::try_to_lock);
    if (g.owns_lock()) drain_queue_locked();
  });
  {
    std::lock_guard<std::mutex> g(queue_mutex_);
    queue_.emplace_back(work, std::make_pair(desc, std::move(body)));
    if (!progress_.joinable()) progress_ = std::thread([this] { progress_thread_main(); });
  }
  queue_cv_.notify_one();
  return work;
}

void CommunicatorImpl::progress_thread_main() {
  t_progress_thread = true;
  // Its shm waits yield even where every rank has a core of its own: the caller's compute threads
  // run on that core too (shm::PeerSync::set_thread_always_yields).
  shm::PeerSync::set_thread_always_yields(true);
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(queue_mutex_);
      queue_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (stop_ && queue_.empty()) return;
    }
    std::lock_guard<std::mutex> g(drive_);
    drain_queue_locked();
  }
}

// ------------------------------------------------------------------------------------------------
// coll::Context

coll::RequestId CommunicatorImpl::isend(int peer, const void* data, size_t bytes, uint32_t slot) {
  transport::Transport* t = route(peer);
  uint32_t index = send_index_[(uint64_t(uint32_t(peer)) << 32) | slot]++;
  transport::Envelope env{(uint64_t(comm_id_) << 32) | wire_seq(), (uint64_t(slot) << 32) | index, op_sig_};
  transport::RequestId tid = t->isend(peer, env, data, bytes);
  pending_.push_back({next_id_, tid, t, peer});
  return next_id_++;
}

coll::RequestId CommunicatorImpl::irecv(int peer, void* data, size_t bytes, uint32_t slot) {
  transport::Transport* t = route(peer);
  uint32_t index = recv_index_[(uint64_t(uint32_t(peer)) << 32) | slot]++;
  transport::Envelope env{(uint64_t(comm_id_) << 32) | wire_seq(), (uint64_t(slot) << 32) | index, op_sig_};
  transport::RequestId tid = t->irecv(peer, env, data, bytes);
  pending_.push_back({next_id_, tid, t, peer});
  return next_id_++;
}

void* CommunicatorImpl::scratch(size_t bytes, int index) {
  if (index < 0) throw std::logic_error("negative scratch index");
  if (scratch_.size() <= size_t(index)) {
    scratch_.resize(size_t(index) + 1);
    scratch_size_.resize(size_t(index) + 1, 0);
  }
  if (scratch_size_[size_t(index)] < bytes || !scratch_[size_t(index)]) {
    scratch_[size_t(index)].reset(new char[std::max<size_t>(bytes, 64)]);
    scratch_size_[size_t(index)] = std::max<size_t>(bytes, 64);
  }
  return scratch_[size_t(index)].get();
}

void CommunicatorImpl::wait(coll::RequestId id) {
  auto it = std::find_if(pending_.begin(), pending_.end(), [&](const Pending& p) { return p.id == id; });
  if (it == pending_.end()) throw std::logic_error("coll::Context::wait on an unknown or completed request");
  Pending p = *it;
  auto finish = [&] {
    auto pos = std::find_if(pending_.begin(), pending_.end(), [&](const Pending& q) { return q.id == p.id; });
    if (pos != pending_.end()) pending_.erase(pos);
  };
  if (p.transport->test(p.tid)) return finish();
  drive_until([&] { return p.transport->test(p.tid); });
  finish();
}

// Drives every transport until done() (each request's completion, or a message's arrival), under the
// operation's deadline, abort and slow warnings. done() is asked after each round of polls.
template <typename Done>
void CommunicatorImpl::drive_until(Done done) {
  // Busy-poll only while data is moving: the budget restarts whenever a poll moved something, and
  // once it runs out the thread sleeps in epoll_wait (no CPU until a socket is ready). A blocking
  // caller keeps a generous budget (small-message latency); the progress thread of the *_async
  // operations a short one, so that it does not take cores from the caller's compute threads.
  const auto budget = t_progress_thread ? progress_spin_ : spin_;
  auto spin_until = Deadline::Clock::now() + budget;
  for (;;) {
    auto now = Deadline::Clock::now();
    if (now < spin_until) {
      bool progressed = false;
      for (auto& t : transports_) progressed = t->poll(0) || progressed;
      if (progressed) {
        spin_until = Deadline::Clock::now() + budget;
      } else {
        // Nothing ready: let another runnable thread (the peer rank, when ranks share cores; the
        // caller's compute threads, on the progress thread) have the core. Not where every local rank
        // has cores of its own: the yield would hand ours to an unrelated process for its time slice.
        if (yield_in_waits_ || t_progress_thread) sched_yield();
      }
    } else {
      auto until = std::min(op_deadline_.at(), next_warning_);
      long ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count();
      int timeout = int(std::clamp<long>(ms, 0, 100));
      bool woke = false;
      if (transports_.size() == 1) {
        woke = transports_.front()->poll(timeout);
      } else {
        for (auto& t : transports_) woke = t->poll(0) || woke;
        if (!woke)
          for (auto& t : transports_) woke = t->poll(std::min(timeout, 1)) || woke;
      }
      // Data is flowing again (a pipelined transfer): poll without sleeping for a while.
      if (woke) spin_until = Deadline::Clock::now() + budget;
    }
    if (done()) return;
    if (abort_requested_.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> g(fail_mutex_);
      throw AbortedError(fmt::format("aborted: {}", abort_reason_));
    }
    now = Deadline::Clock::now();
    if (now >= op_deadline_.at()) throw_timeout();
    if (now >= next_warning_) {
      warn_slow(now - op_start_);
      warning_interval_ *= 2;
      next_warning_ = now + warning_interval_;
    }
  }
}

std::string CommunicatorImpl::waiting_for_text() {
  if (!shm_waiting_.empty()) return shm_waiting_text();
  if (any_source_tag_) {
    std::vector<int> others;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) others.push_back(world_rank(r));
    return fmt::format("a message with tag {} from any of rank(s) {} (recv from any source)", *any_source_tag_,
                       str::format_ranges(others));
  }
  std::set<int> peers;
  for (const auto& p : pending_)
    if (!p.transport->peek(p.tid)) peers.insert(p.peer);
  std::vector<std::string> parts;
  std::vector<int> list(peers.begin(), peers.end());
  for (int peer : list) {
    if (parts.size() >= 8) {
      parts.push_back(fmt::format("and {} more", list.size() - 8));
      break;
    }
    auto seen = route(peer)->last_seen(peer);
    std::string last = "no message from it yet";
    if (seen.seen) {
      uint32_t s = uint32_t(seen.tag);
      last = s == kP2PSeq ? fmt::format("last message was point-to-point ({})", describe_signature(seen.signature))
                          : fmt::format("last seen in operation #{} {}", full_seq(s), describe_signature(seen.signature));
    }
    parts.push_back(fmt::format("{}: {}", peer_text(peer), last));
  }
  std::vector<int> named;  // the list in world ranks; the details are renamed with the whole message
  for (int peer : list) named.push_back(world_rank(peer));
  std::sort(named.begin(), named.end());
  return fmt::format("rank(s) {} [{}]", str::format_ranges(named), str::join(parts, "; "));
}

void CommunicatorImpl::warn_slow(std::chrono::nanoseconds waited) {
  std::string mine = op_.kind == OpKind::kSendRecv
                         ? fmt::format("{} ({})", op_kind_name(op_.kind), format_bytes(op_.bytes))
                         : fmt::format("operation #{} {} ({})", seq_, describe_signature(op_sig_), format_bytes(op_.bytes));
  std::string waiting = waiting_for_text();
  // Reports of the ranks we wait for, published only by ranks that are themselves slow.
  std::string reports;
  try {
    store_->set("status/" + std::to_string(rank_),
                fmt::format("waiting {} in {} for {}", seconds_text(waited), mine, waiting));
    std::set<int> peers;
    for (const auto& p : pending_)
      if (!p.transport->peek(p.tid)) peers.insert(p.peer);
    int shown = 0;
    for (int peer : peers) {
      if (++shown > 4) break;
      std::string key = "status/" + std::to_string(peer);
      if (store_->check({key})) reports += fmt::format("; rank {} reports: {}", peer, store_->get(key));
    }
  } catch (const std::exception& e) {
    reports = fmt::format("; (store unavailable for status reports: {})", e.what());
  }
  log::warn("{} has waited {} for {}{}", mine, seconds_text(waited), waiting, reports);
}

void CommunicatorImpl::throw_timeout() {
  // "its timeout (...)": torch's suite and scripts look for " timeout " or " Timed out " in a timeout's
  // message (gloo's "Timed out waiting 1000ms for ...").
  throw TimeoutError(fmt::format("timed out after {}, its timeout ({}), waiting for {}", seconds_text(options_.timeout),
                                 timeout_source(), waiting_for_text()));
}

std::string CommunicatorImpl::timeout_source() const {
  return options_.timeout_source.empty() ? "COHORT_TIMEOUT" : options_.timeout_source;
}

// ------------------------------------------------------------------------------------------------
// Exits the launcher published (comm/peer_exits.h)

std::optional<ExitRecord> CommunicatorImpl::read_exit(int rank, std::chrono::milliseconds wait) {
  if (!exits_) return std::nullopt;
  const std::string key = exit_key(exit_rank(rank));
  try {
    if (wait.count() > 0) {
      try {
        exits_->store->wait({key}, wait);
      } catch (const TimeoutError&) {
        return std::nullopt;
      }
    } else if (!exits_->store->check({key})) {
      return std::nullopt;
    }
    return exit_record_from_json(exits_->store->get(key));
  } catch (const std::exception& e) {
    // Only an explanation: without it the error or wait goes on as it would without a launcher.
    log::debug("communicator '{}': no exit record of rank {}: {}", prefix_, rank, e.what());
    return std::nullopt;
  }
}

void CommunicatorImpl::check_exits_while_joining(int64_t& seen, Deadline::Clock::time_point start) {
  int64_t count = 0;
  try {
    count = exits_->store->add(kExitCountKey, 0);
  } catch (const std::exception& e) {
    log::debug("communicator '{}': cannot read the launcher's count of exits: {}", prefix_, e.what());
    return;
  }
  if (count <= seen) return;
  seen = count;
  // Somebody's process ended (once per new exit, not per wait step): is it one we wait for?
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || store_->check({"peer/" + std::to_string(r)})) continue;
    if (std::optional<ExitRecord> gone = read_exit(r, std::chrono::milliseconds(0)))
      throw_exited_before_joining(r, *gone, start);
  }
}

void CommunicatorImpl::throw_exited_before_joining(int r, const ExitRecord& gone, Deadline::Clock::time_point start) {
  int joined = 0;  // the others as the store has them now (a failure path: one check each)
  for (int q = 0; q < size_; ++q) {
    if (q == r) continue;
    try {
      joined += store_->check({"peer/" + std::to_string(q)});
    } catch (const std::exception&) {
    }
  }
  throw PeerLostError(fmt::format(
      "rank {}{} {} before joining communicator '{}' (it ran {:.1f} s on {} as pid {}; its launcher saw it end); "
      "{} of {} ranks joined after {}",
      world_rank(r), exits_ && exit_rank(r) != world_rank(r) ? fmt::format(" (job rank {})", exit_rank(r)) : "",
      exit_text(gone), prefix_, gone.seconds, gone.host, gone.pid, joined, size_,
      seconds_text(Deadline::Clock::now() - start)));
}

std::exception_ptr CommunicatorImpl::explain_exit(std::exception_ptr error) {
  if (!exits_) return error;
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const PeerLostError& e) {
    message = e.what();
  } catch (...) {
    return error;
  }
  // Only a peer that is gone, as the transports and the shm group say it, naming it first: "lost rank N
  // (host): ...", "rank N (host) left ...", "shm: rank N (host) (pid P) exited during ...". A peer's
  // notice ("rank N (host) failed: ...") was explained by the rank that sent it, a child communicator's
  // error by the child; a peer that failed may well live on (no record would come).
  const bool gone_peer = message.find("lost rank ") != std::string::npos ||
                         message.find(") left ") != std::string::npos ||
                         message.find(") exited during ") != std::string::npos;
  if (!gone_peer || message.find(") failed: ") != std::string::npos ||
      message.find(" exited (code ") != std::string::npos || message.find(" exited (killed by ") != std::string::npos)
    return error;
  const auto mentions = str::rank_mentions(message);
  if (mentions.empty()) return error;
  const long peer = mentions.front().rank;
  if (peer < 0 || peer >= size_ || peer == rank_) return error;
  const bool same_host = size_t(peer) < topology_.identity.size() &&
                         topology_.identity[size_t(peer)].shm_key() == topology_.identity[size_t(rank_)].shm_key();
  std::optional<ExitRecord> gone = read_exit(int(peer), same_host ? kExitRecordWait : kRemoteExitRecordWait);
  if (!gone) return error;
  return std::make_exception_ptr(PeerLostError(fmt::format(
      "rank {}{} {} {}: {}", world_rank(int(peer)),
      exit_rank(int(peer)) != world_rank(int(peer)) ? fmt::format(" (job rank {})", exit_rank(int(peer))) : "",
      exit_text(*gone), exit_point(*gone, comm_id_, seq_), message)));
}

// ------------------------------------------------------------------------------------------------
// Validation (before anything is sent; InvalidArgument leaves the communicator usable)

void CommunicatorImpl::validate_dtype_op(DataType dtype, ReduceOp op, bool needs_op) const {
  if (uint8_t(dtype) >= kNumDataTypes) throw InvalidArgument(fmt::format("unknown dtype {}", int(dtype)));
  if (!needs_op) return;
  if (uint8_t(op) >= kNumReduceOps) throw InvalidArgument(fmt::format("unknown reduce op {}", int(op)));
  if (!op_supported(dtype, op)) {
    throw InvalidArgument(fmt::format("reduce op {} is not defined on dtype {} (avg needs a floating type)",
                                      reduce_op_name(op), dtype_name(dtype)));
  }
}

void CommunicatorImpl::validate_buffer(const void* p, size_t count, const char* what) const {
  if (p == nullptr && count > 0) throw InvalidArgument(fmt::format("{} buffer is null with count {}", what, count));
}

void CommunicatorImpl::validate_root(int root) const {
  if (root < 0 || root >= size_) throw InvalidArgument(fmt::format("root {} out of range [0, {})", root, size_));
}

// ------------------------------------------------------------------------------------------------
// Collectives

void CommunicatorImpl::allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAllreduce, dtype, op, 0, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::allreduce(*this, send, recv, count, dtype, op); });
}

void CommunicatorImpl::allreduce_update(float* grads, float* params, size_t count, ReduceOp op,
                                        const ParameterUpdate& update) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg)
    throw InvalidArgument(fmt::format("allreduce_update: op {} (sum or avg only)", reduce_op_name(op)));
  if (!update) throw InvalidArgument("allreduce_update: update is empty");
  validate_buffer(grads, count, "grads");
  validate_buffer(params, count, "params");
  OpDesc d{OpKind::kAllreduce, DataType::kFloat32, op, 0, count, count * sizeof(float)};
  d.flags = coll::kOpFlagParameterUpdate;  // a peer calling a plain allreduce here mismatches
  run_blocking(d, [&] { algo::allreduce_update(*this, grads, params, count, op, update); });
}

std::shared_ptr<void> CommunicatorImpl::allreduce_shareable(void* buf, size_t count, DataType dtype, ReduceOp op,
                                                           bool want_shared) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(buf, count, "buf");
  OpDesc d{OpKind::kAllreduce, dtype, op, 0, count, count * dtype_size(dtype)};
  d.flags = coll::kOpFlagShareable;  // a peer calling a plain allreduce here mismatches
  // The request is only worth passing on where allocate_shared gives memory the peers map.
  want_shared = want_shared && one_pass_update();
  std::shared_ptr<void> memory;
  run_blocking(d, [&] { memory = algo::allreduce_shareable(*this, buf, count, dtype, op, want_shared); });
  return memory;
}

bool CommunicatorImpl::one_pass_update() const {
  // What allocate_shared needs to hand out memory the peers map (the group's allreduce_update).
  return shm_group_ != nullptr && kShmSharedBuffers.get();
}

void CommunicatorImpl::reduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op, int root) {
  validate_dtype_op(dtype, op, true);
  validate_root(root);
  validate_buffer(send, count, "send");
  if (rank_ == root) validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kReduce, dtype, op, root, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::reduce(*this, send, recv, count, dtype, op, root); });
}

void CommunicatorImpl::broadcast(void* buf, size_t count, DataType dtype, int root) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_root(root);
  validate_buffer(buf, count, "broadcast");
  OpDesc d{OpKind::kBroadcast, dtype, ReduceOp::kSum, root, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::broadcast(*this, buf, count, dtype, root); });
}

void CommunicatorImpl::allgather(const void* send, void* recv, size_t count, DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAllgather, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype) * size_t(size_)};
  run_blocking(d, [&] { algo::allgather(*this, send, recv, count, dtype); });
}

void CommunicatorImpl::allgatherv(const void* send, size_t send_count, void* recv,
                                  const std::vector<size_t>& recv_counts, DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  if (recv_counts.size() != size_t(size_)) {
    throw InvalidArgument(fmt::format("allgatherv: recv_counts has {} entries, expected {}", recv_counts.size(), size_));
  }
  if (recv_counts[size_t(rank_)] != send_count) {
    throw InvalidArgument(fmt::format("allgatherv: send_count {} differs from recv_counts[{}] = {}", send_count, rank_,
                                      recv_counts[size_t(rank_)]));
  }
  size_t total = 0;
  for (size_t c : recv_counts) total += c;
  validate_buffer(send, send_count, "send");
  validate_buffer(recv, total, "recv");
  OpDesc d{OpKind::kAllgatherv, dtype, ReduceOp::kSum, 0, total, total * dtype_size(dtype)};
  run_blocking(d, [&] { algo::allgatherv(*this, send, send_count, recv, recv_counts.data(), dtype); });
}

void CommunicatorImpl::gather(const void* send, void* recv, size_t count, DataType dtype, int root) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_root(root);
  validate_buffer(send, count, "send");
  if (rank_ == root) validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kGather, dtype, ReduceOp::kSum, root, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::gather(*this, send, recv, count, dtype, root); });
}

void CommunicatorImpl::scatter(const void* send, void* recv, size_t count, DataType dtype, int root) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_root(root);
  if (rank_ == root) validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kScatter, dtype, ReduceOp::kSum, root, count, count * dtype_size(dtype)};
  run_blocking(d, [&] { algo::scatter(*this, send, recv, count, dtype, root); });
}

void CommunicatorImpl::reduce_scatter(const void* send, void* recv, size_t recv_count, DataType dtype, ReduceOp op) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(send, recv_count, "send");
  validate_buffer(recv, recv_count, "recv");
  OpDesc d{OpKind::kReduceScatter, dtype, op, 0, recv_count, recv_count * dtype_size(dtype) * size_t(size_)};
  run_blocking(d, [&] { algo::reduce_scatter(*this, send, recv, recv_count, dtype, op); });
}

void CommunicatorImpl::alltoall(const void* send, void* recv, size_t count, DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAlltoall, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype) * size_t(size_)};
  run_blocking(d, [&] { algo::alltoall(*this, send, recv, count, dtype); });
}

void CommunicatorImpl::alltoallv(const void* send, const std::vector<size_t>& send_counts,
                                 const std::vector<size_t>& send_displs, void* recv,
                                 const std::vector<size_t>& recv_counts, const std::vector<size_t>& recv_displs,
                                 DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  for (auto* v : {&send_counts, &send_displs, &recv_counts, &recv_displs}) {
    if (v->size() != size_t(size_)) {
      throw InvalidArgument(fmt::format("alltoallv: a count/displacement vector has {} entries, expected {}",
                                        v->size(), size_));
    }
  }
  size_t sent = 0, received = 0;
  for (int r = 0; r < size_; ++r) {
    sent += send_counts[size_t(r)];
    received += recv_counts[size_t(r)];
  }
  if (send != recv) validate_buffer(send, sent, "send");
  validate_buffer(recv, received, "recv");
  OpDesc d{OpKind::kAlltoallv, dtype, ReduceOp::kSum, 0, 0, sent * dtype_size(dtype)};
  run_blocking(d, [&] {
    algo::alltoallv(*this, send, send_counts.data(), send_displs.data(), recv, recv_counts.data(),
                    recv_displs.data(), dtype);
  });
}

void CommunicatorImpl::barrier() {
  OpDesc d{OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0, 0};
  run_blocking(d, [&] { algo::barrier(*this); });
}

// ------------------------------------------------------------------------------------------------
// Point to point: not collective, so no sequence number; (peer, tag) streams are matched in order.

void CommunicatorImpl::send(const void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  if (peer < 0 || peer >= size_) throw InvalidArgument(fmt::format("send: peer {} out of range [0, {})", peer, size_));
  validate_buffer(buf, count, "send");
  OpDesc d{OpKind::kSendRecv, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype), peer};
  run_blocking(d, [&] {
    transport::Transport* t = route(peer);
    uint32_t index = p2p_send_index_[(uint64_t(uint32_t(peer)) << 32) | tag]++;
    transport::Envelope env{(uint64_t(comm_id_) << 32) | kP2PSeq, (uint64_t(tag) << 32) | index, op_sig_};
    transport::RequestId tid = t->isend(peer, env, buf, count * dtype_size(dtype));
    pending_.push_back({next_id_, tid, t, peer});
    wait(next_id_++);
  });
}

void CommunicatorImpl::recv(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  if (peer < 0 || peer >= size_) throw InvalidArgument(fmt::format("recv: peer {} out of range [0, {})", peer, size_));
  validate_buffer(buf, count, "recv");
  OpDesc d{OpKind::kSendRecv, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype), peer};
  run_blocking(d, [&] {
    transport::Transport* t = route(peer);
    uint32_t index = p2p_recv_index_[(uint64_t(uint32_t(peer)) << 32) | tag]++;
    transport::Envelope env{(uint64_t(comm_id_) << 32) | kP2PSeq, (uint64_t(tag) << 32) | index, op_sig_};
    transport::RequestId tid = t->irecv(peer, env, buf, count * dtype_size(dtype));
    pending_.push_back({next_id_, tid, t, peer});
    wait(next_id_++);
  });
}

int CommunicatorImpl::recv_any(void* buf, size_t count, DataType dtype, uint32_t tag) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_buffer(buf, count, "recv");
  if (size_ == 1) throw InvalidArgument("recv from any source: this rank is alone in its group, no rank can send to it");
  OpDesc d{OpKind::kSendRecv, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype), -1};
  int source = -1;
  run_blocking(d, [&] {
    // The next message of each peer's (peer, tag) stream is the one this receive may take. Whichever
    // has begun to arrive is taken, asking the peers round-robin from the one after the last taken, so
    // that a chatty low rank cannot starve the others. Nothing is posted until one has arrived:
    // a receive posted on every peer would take one message from each.
    auto envelope = [&](int peer) {
      uint32_t index = p2p_recv_index_[(uint64_t(uint32_t(peer)) << 32) | tag];
      return transport::Envelope{(uint64_t(comm_id_) << 32) | kP2PSeq, (uint64_t(tag) << 32) | index, op_sig_};
    };
    auto first_arrived = [&] {
      for (int i = 0; i < size_; ++i) {
        int peer = (any_source_next_ + i) % size_;
        if (peer != rank_ && route(peer)->arrived(peer, envelope(peer))) return peer;
      }
      return -1;
    };
    any_source_tag_ = tag;
    struct Clear {
      std::optional<uint32_t>& tag;
      ~Clear() { tag.reset(); }
    } clear{any_source_tag_};
    source = first_arrived();
    if (source < 0) {
      for (auto& t : transports_) t->poll(0);
      source = first_arrived();
    }
    if (source < 0) drive_until([&] { return (source = first_arrived()) >= 0; });
    any_source_tag_.reset();
    any_source_next_ = (source + 1) % size_;
    op_.peer = source;
    transport::Transport* t = route(source);
    transport::Envelope env = envelope(source);
    ++p2p_recv_index_[(uint64_t(uint32_t(source)) << 32) | tag];
    transport::RequestId tid = t->irecv(source, env, buf, count * dtype_size(dtype));
    pending_.push_back({next_id_, tid, t, source});
    wait(next_id_++);
  });
  return source;
}

// Non-blocking point to point. The request is posted to the transport at once, under the drive lock;
// it then completes whenever the transports are driven (by any operation's wait, by test()'s poll, by
// its own wait). Its state is read under the Work's own mutex and written under the drive lock.
class P2PWork final : public Work {
 public:
  P2PWork(std::weak_ptr<CommunicatorImpl> comm, bool is_send, OpDesc desc, transport::Transport* t,
          transport::RequestId tid, Deadline::Clock::time_point deadline)
      : is_send(is_send), desc(desc), transport(t), tid(tid), deadline(deadline), comm_(std::move(comm)) {}

  void wait(std::chrono::milliseconds timeout) override {
    if (!finished()) {
      if (auto comm = comm_.lock()) {
        comm->p2p_wait(*this, timeout);
      } else {
        gone();
      }
    }
    if (auto e = exception()) std::rethrow_exception(e);
  }
  bool test() override {
    if (finished()) return true;
    if (auto comm = comm_.lock()) {
      comm->p2p_test(*this);
    } else {
      gone();
    }
    return finished();
  }
  std::exception_ptr exception() override {
    std::lock_guard<std::mutex> g(m_);
    return error_;
  }
  bool finished() {
    std::lock_guard<std::mutex> g(m_);
    return done_;
  }
  void finish(std::exception_ptr error) {
    std::lock_guard<std::mutex> g(m_);
    done_ = true;
    error_ = error;
  }

  // Set when posted; used under the communicator's drive lock.
  const bool is_send;
  const OpDesc desc;
  transport::Transport* const transport;
  const transport::RequestId tid;
  const Deadline::Clock::time_point deadline;

 private:
  void gone() {
    finish(std::make_exception_ptr(AbortedError(fmt::format(
        "{} rank {}: the communicator was destroyed before it completed", is_send ? "send to" : "recv from", desc.peer))));
  }
  std::weak_ptr<CommunicatorImpl> comm_;
  std::mutex m_;
  bool done_ = false;
  std::exception_ptr error_;
};

std::shared_ptr<Work> CommunicatorImpl::post_p2p(bool is_send, void* buf, size_t count, DataType dtype, int peer,
                                                 uint32_t tag) {
  const char* what = is_send ? "send" : "recv";
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  if (peer < 0 || peer >= size_) throw InvalidArgument(fmt::format("{}: peer {} out of range [0, {})", what, peer, size_));
  validate_buffer(buf, count, what);
  OpDesc d{OpKind::kSendRecv, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype), peer};
  std::lock_guard<std::mutex> g(drive_);
  check_usable();
  transport::Transport* t = route(peer);
  auto& indices = is_send ? p2p_send_index_ : p2p_recv_index_;
  uint32_t index = indices[(uint64_t(uint32_t(peer)) << 32) | tag]++;
  // The signature blocking send/recv give their messages, so that the two forms match each other.
  transport::Envelope env{(uint64_t(comm_id_) << 32) | kP2PSeq, (uint64_t(tag) << 32) | index, d.signature()};
  transport::RequestId tid = is_send ? t->isend(peer, env, buf, count * dtype_size(dtype))
                                     : t->irecv(peer, env, buf, count * dtype_size(dtype));
  return std::make_shared<P2PWork>(weak_from_this(), is_send, d, t, tid, Deadline::Clock::now() + options_.timeout);
}

std::shared_ptr<Work> CommunicatorImpl::send_async(const void* buf, size_t count, DataType dtype, int peer,
                                                   uint32_t tag) {
  return post_p2p(true, const_cast<void*>(buf), count, dtype, peer, tag);
}

std::shared_ptr<Work> CommunicatorImpl::recv_async(void* buf, size_t count, DataType dtype, int peer, uint32_t tag) {
  return post_p2p(false, buf, count, dtype, peer, tag);
}

void CommunicatorImpl::p2p_test(P2PWork& work) {
  std::unique_lock<std::mutex> g(drive_, std::try_to_lock);
  if (!g.owns_lock() || work.finished()) return;  // another thread drives (and will move the bytes)
  if (failed_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> f(fail_mutex_);
    return work.finish(std::make_exception_ptr(AbortedError(fmt::format("communicator failed earlier: {}", root_cause_))));
  }
  try {
    for (auto& t : transports_) t->poll(0);
    if (work.transport->test(work.tid)) return work.finish(nullptr);
  } catch (...) {
    return work.finish(std::current_exception());
  }
  if (Deadline::Clock::now() < work.deadline) return;
  // Past its deadline: fail the communicator as a blocking receive's timeout does (its buffer may be
  // released once the Work fails, so the transport must forget the request), naming the peer.
  const OpDesc& d = work.desc;
  try {
    execute_locked(d, [&] {
      pending_.push_back({next_id_++, work.tid, work.transport, d.peer});
      throw_timeout();
    });
  } catch (...) {
    work.finish(std::current_exception());
  }
}

void CommunicatorImpl::p2p_wait(P2PWork& work, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> g(drive_);
  if (work.finished()) return;
  const OpDesc& d = work.desc;
  try {
    execute_locked(d, [&] {
      // The deadline counts from the post; a shorter one given to wait() applies too.
      auto until = work.deadline;
      if (timeout.count() > 0) until = std::min(until, Deadline::Clock::now() + timeout);
      op_deadline_ = Deadline(until);
      pending_.push_back({next_id_, work.tid, work.transport, d.peer});
      wait(next_id_++);
    });
    work.finish(nullptr);
  } catch (...) {
    work.finish(std::current_exception());
  }
}

// ------------------------------------------------------------------------------------------------
// Asynchronous variants

std::shared_ptr<Work> CommunicatorImpl::allreduce_async(const void* send, void* recv, size_t count, DataType dtype,
                                                        ReduceOp op) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAllreduce, dtype, op, 0, count, count * dtype_size(dtype)};
  return run_async(d, [=, this] { algo::allreduce(*this, send, recv, count, dtype, op); });
}

std::shared_ptr<Work> CommunicatorImpl::broadcast_async(void* buf, size_t count, DataType dtype, int root) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_root(root);
  validate_buffer(buf, count, "broadcast");
  OpDesc d{OpKind::kBroadcast, dtype, ReduceOp::kSum, root, count, count * dtype_size(dtype)};
  return run_async(d, [=, this] { algo::broadcast(*this, buf, count, dtype, root); });
}

std::shared_ptr<Work> CommunicatorImpl::allgather_async(const void* send, void* recv, size_t count, DataType dtype) {
  validate_dtype_op(dtype, ReduceOp::kSum, false);
  validate_buffer(send, count, "send");
  validate_buffer(recv, count, "recv");
  OpDesc d{OpKind::kAllgather, dtype, ReduceOp::kSum, 0, count, count * dtype_size(dtype) * size_t(size_)};
  return run_async(d, [=, this] { algo::allgather(*this, send, recv, count, dtype); });
}

std::shared_ptr<Work> CommunicatorImpl::reduce_scatter_async(const void* send, void* recv, size_t recv_count,
                                                             DataType dtype, ReduceOp op) {
  validate_dtype_op(dtype, op, true);
  validate_buffer(send, recv_count, "send");
  validate_buffer(recv, recv_count, "recv");
  OpDesc d{OpKind::kReduceScatter, dtype, op, 0, recv_count, recv_count * dtype_size(dtype) * size_t(size_)};
  return run_async(d, [=, this] { algo::reduce_scatter(*this, send, recv, recv_count, dtype, op); });
}

std::shared_ptr<Work> CommunicatorImpl::barrier_async() {
  OpDesc d{OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, 0, 0, 0};
  return run_async(d, [this] { algo::barrier(*this); });
}

// ------------------------------------------------------------------------------------------------
// Groups and abort

std::shared_ptr<Communicator> CommunicatorImpl::create_child(const std::string& prefix, int rank, int size,
                                                           const std::vector<int>& members,
                                                           std::vector<int> world_ranks) {
  CommSetup s{root_store_, prefix, rank, size, options_, std::move(world_ranks), /*child=*/true, false, {}, nullptr};
  if (exits_) {
    auto exits = std::make_shared<ExitWatch>();
    exits->store = exits_->store;
    for (int m : members) exits->ranks.push_back(exit_rank(m));
    s.exits = std::move(exits);
  }
  auto child = std::make_shared<CommunicatorImpl>(std::move(s));
  child->bootstrap();
  return child;
}

std::shared_ptr<Communicator> CommunicatorImpl::split(int color, int key) {
  int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * size_t(size_));
  OpDesc d{OpKind::kSplit, DataType::kInt64, ReduceOp::kSum, 0, 2, 16};
  run_blocking(d, [&] { algo::allgather(*this, mine, all.data(), 2, DataType::kInt64); });
  int n = split_counter_++;
  if (color < 0) return nullptr;
  std::vector<std::pair<int64_t, int>> members;
  for (int r = 0; r < size_; ++r)
    if (all[2 * size_t(r)] == color) members.emplace_back(all[2 * size_t(r) + 1], r);
  std::sort(members.begin(), members.end());
  int new_rank = 0;
  std::vector<int> ranks;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i].second == rank_) new_rank = int(i);
    ranks.push_back(members[i].second);
  }
  return create_child(fmt::format("{}/split{}/color{}", prefix_, n, color), new_rank, int(members.size()), ranks);
}

std::shared_ptr<Communicator> CommunicatorImpl::subgroup(const std::vector<int>& ranks) {
  std::set<int> seen;
  int new_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    int r = ranks[i];
    if (r < 0 || r >= size_) throw InvalidArgument(fmt::format("subgroup: rank {} out of range [0, {})", r, size_));
    if (!seen.insert(r).second) throw InvalidArgument(fmt::format("subgroup: rank {} listed twice", r));
    if (r == rank_) new_rank = int(i);
  }
  if (new_rank < 0) throw InvalidArgument(fmt::format("subgroup: this rank ({}) is not in the list", rank_));
  std::vector<std::string> parts;
  for (int r : ranks) parts.push_back(std::to_string(r));
  std::string list = str::join(parts, ",");
  int n = subgroup_counter_[list]++;
  return create_child(fmt::format("{}/sub{:08x}/{}", prefix_, hash32(list), n), new_rank, int(ranks.size()), ranks);
}

std::string CommunicatorImpl::link_report() const {
  // The group's line changes when a slow allreduce has it probe the link again.
  // Which copy the collectives that only move data take at large sizes (the bench prints this line).
  const std::string copies = shm_group_ ? fmt::format("; large transfers: {}", shm_group_->single_copy_why()) : "";
  if (probed_group_)
    return fmt::format("{}; shm group: {}{}", probed_group_->link_line(), probed_group_->wait_policy(), copies);
  return link_report_ + copies;
}

void CommunicatorImpl::probe_link(shm::Group& group) {
  // The group saw only its own members' CPUs; the communicator saw every rank on this machine.
  group.set_wait_policy(yield_choice_);
  if (!kShmProbe.get()) {
    link_report_ = fmt::format("no link probe (COHORT_SHM_PROBE=0); shm group: {}", group.wait_policy());
    return;
  }
  group.probe();  // also chooses how the group writes its slots
  probed_group_ = &group;
  log::debug("communicator '{}': shm link: {}", prefix_, link_report());
}

std::shared_ptr<void> CommunicatorImpl::allocate_shared(size_t bytes) {
  // Only a communicator whose collectives all run on one shm group can reduce the peers' memory
  // directly; a hierarchical one stages (its host group's allreduce is one step of several).
  if (!shm_group_ || !kShmSharedBuffers.get()) return Communicator::allocate_shared(bytes);
  // The segment's handshake only knows its deadline; a barrier first gives the usual errors at once
  // (a lost peer within ~50 ms, abort, a peer in another operation) instead of a wait until then.
  barrier();
  return shm_group_->allocate_shared(bytes);
}

void CommunicatorImpl::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> g(fail_mutex_);
    abort_reason_ = reason;
    if (!failed_.load()) root_cause_ = fmt::format("aborted on rank {}: {}", rank_, reason);
    failed_.store(true, std::memory_order_release);
  }
  abort_requested_.store(true);
}

}  // namespace cohort::comm
