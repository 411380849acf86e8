// The store protocol of a job's end (docs/launcher.md, "Multi-node coordination"): the head hosts the
// job's store and the others join it; a watcher thread waits for every node and then for the attempt's
// "end" record; the first node to fail claims the root cause with compare_set (a reported consequence
// gives way to the failure it reports); nodes count themselves done and exited.
#include <algorithm>
#include <thread>

#include "store/memory_store.h"
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/core.h>

#include "cohort/error.h"
#include "common/log.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/job_internal.h"
#include "launch/munge.h"

namespace cohort::launch::job_detail {

std::string end_to_string(const EndInfo& e) { return nlohmann::json(e).dump(); }

EndInfo end_from_string(const std::string& s) {
  try {
    return nlohmann::json::parse(s).get<EndInfo>();
  } catch (const std::exception&) {
    return EndInfo{"lost", 1, "malformed end record in the store: " + s};
  }
}

bool is_consequence(const EndInfo& e) {
  // A worker that only reports a lost peer (communicator: "lost rank N"; parameter-server jobs name
  // roles: "lost parameter server N", "lost worker N"), a peer's failure notice, or a peer that left in
  // order while this rank still needed it (that peer stopped because of something else: a parameter
  // server that lost a worker to the real failure shuts down, and its other workers say it left).
  return e.kind == "failure" && e.summary.find(" exited with code ") != std::string::npos &&
         (e.summary.find("lost rank ") != std::string::npos || e.summary.find(") failed: ") != std::string::npos ||
          e.summary.find("lost parameter server ") != std::string::npos ||
          e.summary.find("lost worker ") != std::string::npos ||
          e.summary.find(" left (destroyed its communicator)") != std::string::npos ||
          // a peer whose end its launcher published (comm/peer_exits.h; job_exits.cc)
          e.summary.find(" exited (code ") != std::string::npos ||
          e.summary.find(" exited (killed by ") != std::string::npos);
}

bool is_root_cause_of(const EndInfo& e, const EndInfo& current) {
  return e.kind == "failure" && !is_consequence(e) && is_consequence(current);
}

void watcher_main(std::shared_ptr<Store> store, std::shared_ptr<EventQueue> events,
                  std::shared_ptr<std::atomic<bool>> stop, WatchParams p, int attempt) {
  // For the line that says the store is lost: when it last answered, and when every node had joined.
  auto last_answer = Clock::now();
  std::optional<Clock::time_point> joined;
  const auto seconds_since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  try {
    auto started = Clock::now();
    auto deadline =
        started + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(p.join_timeout_s));
    std::vector<std::string> keys;
    for (int r : p.nodes) keys.push_back(node_key(r));
    auto missing_nodes = [&] {
      std::vector<int> missing;
      for (int r : p.nodes)
        if (!store->check({node_key(r)})) missing.push_back(r);
      return missing;
    };
    auto next_note = started + std::chrono::seconds(3);
    for (;;) {
      if (*stop) return;
      auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
      if (left <= Millis(0)) {
        events->push({WatchEvent::kJoinTimeout,
                      fmt::format("node ranks {} did not join within {} s (--join-timeout; store at {})",
                                  str::format_ranges(missing_nodes()), p.join_timeout_s, p.store_addr),
                      attempt});
        return;
      }
      try {
        store->wait(keys, std::min(left, Millis(500)));
        break;
      } catch (const TimeoutError&) {
        last_answer = Clock::now();
        // A node that joined may end the job before the others came (an interrupt, a failure).
        if (store->check({"end"})) {
          events->push({WatchEvent::kEnd, store->get("end"), attempt});
          return;
        }
        if (Clock::now() < next_note) continue;
        next_note = Clock::now() + std::chrono::seconds(3);
        auto missing = missing_nodes();
        if (!missing.empty() && !*stop)
          say(fmt::format("{}waiting for node ranks {} to join ({:.0f} s of {} s){}",
                          p.this_node >= 0 ? fmt::format("node {}: ", p.this_node) : "",
                          str::format_ranges(missing), std::chrono::duration<double>(Clock::now() - started).count(),
                          p.join_timeout_s, attempt > 0 ? fmt::format(", restart {}", attempt) : ""));
      }
    }
    events->push({WatchEvent::kJoined, "", attempt});
    joined = last_answer = Clock::now();
    for (;;) {
      if (*stop) return;
      try {
        // Short slices: the wait's answer (or its absence, kStoreReplyGrace after the slice) is how a
        // node cut off from the store learns it within about a second.
        store->wait({"end"}, Millis(500));
        events->push({WatchEvent::kEnd, store->get("end"), attempt});
        return;
      } catch (const TimeoutError&) {
        last_answer = Clock::now();  // the store said "not yet": it is there
      }
    }
  } catch (const Error& e) {
    // How long the store was silent tells a cut link or a dead host (about a slice and the reply grace)
    // from a store that refused at once; it is the line a fan-out's head shows for this agent.
    if (!*stop)
      events->push({WatchEvent::kLost,
                    fmt::format("{:.1f} s without an answer ({}): {}", seconds_since(last_answer),
                                joined ? fmt::format("{:.1f} s after every node had joined", seconds_since(*joined))
                                       : "while the nodes were joining",
                                e.what()),
                    attempt});
  }
}

int pick_free_port(const std::string& host) {
  auto fd = net::listen_tcp(host, 0, 1, false);
  return static_cast<int>(net::local_address(fd.get()).port());
}

void Job::start_store() {
  // The port workers hand to torch's env:// (its rank 0 hosts a TCPStore there) must differ from
  // the cohort store's port, so the store host picks a second free port.
  bool local = plan_.mode == Mode::kLocal;
  if (plan_.host_store) {
    StoreServerOptions so;
    so.host = local ? "127.0.0.1" : "";
    so.port = static_cast<uint16_t>(plan_.master_port);
    if (ctx_.munge.enabled && ctx_.token.empty()) {
      so.notices = make_munge_credentials();
      require_settled_token();  // before anything listens
    }
    so.token = ctx_.token;
    try {
      store_.server = StoreServer::start(so);
    } catch (const ConfigError& e) {
      // One piece of advice, the one that holds for this job: a job of one node (or one that starts the
      // others itself) can take any free port, but the nodes of a per-node job each meet at the same
      // fixed port, 29500 when none is given.
      if (!plan_.elastic && plan_.mode == Mode::kPerNode)
        throw ConfigError(fmt::format("cannot host the job's store: {} (store port from {}); give every node's "
                                      "cohort run the same free port with --master-port PORT",
                                      e.what(), plan_.source_of("store port")));
      if (!plan_.elastic)
        throw ConfigError(fmt::format("cannot host the job's store: {} (store port from {}); choose another, or "
                                      "leave --master-port and MASTER_PORT unset so the OS picks a free one",
                                      e.what(), plan_.source_of("store port")));
      // Elastic: another agent on this host holds the port (it hosts the store); join it as a client.
      log::info("elastic job: the store's port is taken here ({}); joining it as a client", e.what());
      plan_.host_store = false;
      // A token made here for a store that others host is nobody's: take theirs (munge) instead.
      if (!so.notices.empty()) ctx_.token.clear();
    }
  }
  if (plan_.host_store) {
    store_.addr = fmt::format("{}:{}", plan_.master_addr, store_.server->port());
    plan_.master_port = store_.server->port();
    store_.torch_port = pick_free_port(local ? "127.0.0.1" : "");
  } else {
    store_.addr = fmt::format("{}:{}", plan_.master_addr, plan_.master_port);
    store_.torch_port = ctx_.torch_port;
  }
  if (!distributed_) {
    store_.base = make_memory_store();
    require_settled_token();
    return;
  }
  StoreClientOptions co;
  co.host = plan_.master_addr;
  co.port = static_cast<uint16_t>(plan_.master_port);
  co.token = ctx_.token;
  // Our own server runs in this process, so no answer from it means this process was paused (SIGSTOP, a
  // debugger, a descheduled guest), not a lost store: with the short grace, the watcher woken first
  // after a pause called the job's own store lost before the server thread could answer.
  co.reply_grace = plan_.host_store ? kOwnStoreReplyGrace : kStoreReplyGrace;
  if (plan_.host_store) co.host = "127.0.0.1";  // our own server listens on every interface
  // Joining nodes may start long before node 0: keep trying for the join timeout, saying so every few
  // seconds of real time. Each try is short (kConnectSlice) so that a Ctrl-C between tries ends the
  // wait within a second; nothing has started here yet, so there is nothing else to stop.
  constexpr Millis kConnectSlice{250};
  const auto started = Clock::now();
  const auto deadline = started + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(plan_.join_timeout_s));
  auto next_note = started + std::chrono::seconds(5);
  const std::string whose = plan_.elastic ? "the job's store" : "node 0's store";
  bool need_munge = ctx_.munge.enabled && ctx_.token.empty() && !plan_.host_store;
  // A node that cannot decode need not ask node 0 (and --require-auth refuses at once, not after node 0
  // answers): if node 0 made a token, its store refuses this node with the usual line.
  if (need_munge && !munge_usable_here()) {
    need_munge = false;
    require_settled_token();
  }
  for (;;) {
    if (int sig = pending_interrupt())
      throw Interrupted(sig, fmt::format("interrupted by {} while waiting for {} at {} ({:.0f} s of {:g} s)",
                                         signal_name(sig), whose, store_.addr,
                                         std::chrono::duration<double>(Clock::now() - started).count(),
                                         plan_.join_timeout_s));
    const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
    co.timeout = std::clamp(left, Millis(1), kConnectSlice);
    try {
      if (need_munge) {
        take_munge_token(co);  // retried like the connection until node 0's store answers
        need_munge = false;
      }
      store_.base = connect_tcp_store(co);
      co.timeout = Millis(5000);  // it answered: the second connection is quick
      store_.watch_base = connect_tcp_store(co);
      break;
    } catch (const AuthError&) {
      throw;
    } catch (const Error& e) {
      const auto now = Clock::now();
      if (now >= deadline)
        throw TimeoutError(fmt::format("node {}: {} at {} did not answer within {:g} s (--join-timeout); last try: {}",
                                       plan_.this_node, whose, store_.addr, plan_.join_timeout_s, e.what()));
      if (now >= next_note) {
        next_note = now + std::chrono::seconds(5);
        say(fmt::format("node {}: waiting for {} at {} ({:.0f} s of {:g} s)", plan_.this_node, whose, store_.addr,
                        std::chrono::duration<double>(now - started).count(), plan_.join_timeout_s));
      }
    }
  }
  require_settled_token();
  // An elastic agent is joined from the start: its calls are all short ones (the rendezvous waits in
  // slices). The others wait long for node 0 while they join, then switch to kStoreCallTimeout.
  const Millis call_timeout = plan_.elastic ? kStoreCallTimeout : Millis(60000);
  co.timeout = call_timeout;
  store_.client_options = co;
  store_.base_client = store_.base;
  store_.base->set_timeout(call_timeout);
  store_.watch_base->set_timeout(call_timeout);
  if (plan_.mode == Mode::kPerNode) check_job_id();
  store_.base = make_prefix_store(store_.base, "cohort/launch/" + plan_.job_id);
  store_.watch_base = make_prefix_store(store_.watch_base, "cohort/launch/" + plan_.job_id);
  if (plan_.mode == Mode::kPerNode) {
    if (plan_.host_store) store_.base->set("torch_port", std::to_string(store_.torch_port));
    else store_.torch_port = std::stoi(store_.base->get("torch_port"));
  }
  if (elastic_) {
    // The standby store: idle until the store's host is lost and the survivors pick this one.
    if (!plan_.host_store) elastic_->open_standby(ctx_.token);
    elastic_->open_lease();
  }
}

std::map<std::string, std::string> Job::make_munge_credentials() {
  if (!munge_usable_here()) return {};  // the job runs open, as before, and the warning says why
  const std::string token = random_token(32);
  std::map<std::string, std::string> credentials;
  for (int node = 0; node < ctx_.munge.nodes; ++node) {
    if (node == ctx_.munge.node) continue;
    auto made = munge::encode(token, geteuid(), ctx_.munge.socket, kMungeTimeout);
    if (!made.ok) {
      open_reason_ = fmt::format("no munge token: {} (socket from {})", made.why, ctx_.munge.socket_source);
      return {};
    }
    credentials[munge::notice_name(node)] = made.value;
  }
  ctx_.token = token;
  log::info("job token made here; {} munge credential(s) for the other nodes, restricted to uid {}",
            credentials.size(), geteuid());
  return credentials;
}

bool Job::munge_usable_here() {
  std::string why;
  if (munge::available(ctx_.munge.socket, &why)) return true;
  open_reason_ = fmt::format("no munge token: {} (socket from {})", why, ctx_.munge.socket_source);
  return false;
}

void Job::take_munge_token(StoreClientOptions& co) {
  auto credential = fetch_store_notice(co, munge::notice_name(ctx_.munge.node));
  if (!credential) {
    open_reason_ = "no munge token: node 0's store has no munge credential for this node (node 0 could not make one)";
    return;
  }
  auto token = munge::decode(*credential, geteuid(), ctx_.munge.socket, kMungeTimeout);
  if (!token.ok)
    throw AuthError(fmt::format("node {} ({}): cannot read the job token from the munge credential that node 0's "
                                "store at {} serves: {} (socket from {})",
                                ctx_.munge.node, net::hostname(), store_.addr, token.why, ctx_.munge.socket_source));
  ctx_.token = token.value;
  co.token = token.value;
}

void Job::require_settled_token() {
  if (ctx_.require_auth && ctx_.token.empty())
    throw ConfigError(fmt::format("node {} ({}): this per-node job has no job token{}, and --require-auth "
                                  "(COHORT_REQUIRE_AUTH=1) refuses to start it open: give every node's launcher the "
                                  "same --token-file PATH (mode 0600) or COHORT_JOB_TOKEN",
                                  plan_.this_node, net::hostname(), open_reason_.empty() ? "" : ": " + open_reason_));
}

void Job::check_job_id() {
  // Several jobs may be pointed at one endpoint (torchrun's --rdzv-id tells them apart): the store
  // serves the job of the agent that hosts it, which writes its id first thing; an agent of another
  // job is refused with one line instead of waiting in a job that is not its own.
  if (plan_.host_store) {
    store_.base->compare_set(kJobIdKey, "", plan_.job_id);
    return;
  }
  try {
    store_.base->wait({kJobIdKey}, Millis(10000));
  } catch (const TimeoutError&) {
    throw TimeoutError(fmt::format("the store at {} does not say which job it serves (no {} within 10 s): is it a "
                                   "cohort job's store?",
                                   store_.addr, kJobIdKey));
  }
  const std::string theirs = store_.base->get(kJobIdKey);
  if (theirs != plan_.job_id)
    throw ConfigError(fmt::format("the store at {} serves job '{}', not this node's job '{}' ({}): give every node of a "
                                  "job the same --rdzv-id, and another job its own endpoint",
                                  store_.addr, theirs, plan_.job_id, plan_.source_of("job id")));
}

void Job::publish_end(const EndInfo& e) {
  if (end_) return;
  if (distributed_ && !control_.head_lost()) {
    try {
      // Another node may have won the race: theirs is the root cause, unless it only reports ours.
      adopt_end(end_from_string(claim_root_cause("end", e)));
      return;
    } catch (const Error& err) {
      log::warn("could not publish the job's end to the store: {}", err.what());
    }
  }
  adopt_end(e);
}

std::string Job::claim_root_cause(const std::string& key, const EndInfo& e) {
  const std::string mine = end_to_string(e);
  auto now = store_.attempt->compare_set(key, "", mine);
  // Compared with what the store holds (not a re-serialised copy), so a lost race is seen as such.
  if (now != mine && is_root_cause_of(e, end_from_string(now))) now = store_.attempt->compare_set(key, now, mine);
  return now;
}

void Job::upgrade_end(const EndInfo& e) {
  // Only in the report window: no worker here has been signalled, so a death by signal is genuine.
  if (!end_ || !reporting_ || !is_root_cause_of(e, *end_)) return;
  if (distributed_ && !control_.head_lost()) {
    try {
      end_ = end_from_string(claim_root_cause("end", e));  // ours, or another node's root cause that came first
      return;
    } catch (const Error& err) {
      log::warn("could not publish the job's root cause to the store: {}", err.what());
    }
  }
  end_ = e;
}

void Job::adopt_end(const EndInfo& e) {
  if (end_) return;
  end_ = e;
  end_seen_ = Clock::now();
  *watcher_stop_ = true;
  // "done" finds this node's workers finished, except in a Ray job: its driver's end is the job's, and
  // every node's Ray still runs then.
  if (e.kind != "done" || running_workers() > 0) begin_stop();
  if (!agents_.empty() && plan_.host_store) {
    // Remote agents stop their workers on their own (they watch the store); give them the grace
    // plus a margin before the head kills the ssh connections.
    if (!stopping_ || running_workers() == 0) arm_timer(plan_.kill_grace_s + 10);
  }
}

void Job::report_node_done() {
  if (!distributed_) {
    if (!end_) adopt_end(first_failure_ ? EndInfo{"done", first_failure_->code, first_failure_->summary}
                                        : EndInfo{"done", 0, ""});
  } else if (!end_ && !control_.head_lost()) {
    try {
      int64_t finished = store_.attempt->add("done", 1);
      if (finished == plan_.nnodes) {
        EndInfo done{"done", 0, ""};
        std::vector<std::string> ff{"first_failure"};
        if (store_.attempt->check(ff)) {
          auto f = end_from_string(store_.attempt->get("first_failure"));
          done = EndInfo{"done", f.code, f.summary};
        }
        publish_end(done);
      }
    } catch (const Error& err) {
      adopt_end(EndInfo{"lost", 1, fmt::format("lost the job's store at {}: {}", store_.addr, err.what())});
    }
  }
}

void Job::settle_end_with_store() {
  if (elastic_) {
    elastic_->settle_end(*end_, control_.head_lost(), [this] { return pending_interrupt(); });
    return;
  }
  // Per-node mode: node 0 keeps the store up until every node has seen the outcome.
  if (distributed_ && plan_.mode == Mode::kPerNode && !control_.head_lost() && end_->kind != "lost") {
    try {
      store_.attempt->add("exited", 1);
      // Only the nodes that joined will report (one that never came, or a lost store, will not): the
      // store's host waits for those, in short slices, so that a second Ctrl-C ends the wait at once.
      // (An uncounted Ray job's nodes count themselves in "joined" as they come.)
      if (plan_.host_store && end_->kind != "lost" && end_->kind != "join") {
        int64_t joined = 0;
        if (plan_.ray.open_membership) joined = store_.attempt->add("joined", 0);
        else
          for (int r = 0; r < plan_.nnodes; ++r) joined += store_.attempt->check({node_key(r)}) ? 1 : 0;
        const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                 std::chrono::duration<double>(plan_.kill_grace_s + 10));
        while (store_.attempt->add("exited", 0) < joined) {
          if (Clock::now() >= deadline)
            throw TimeoutError(fmt::format("{} of the {} nodes that joined reported", store_.attempt->add("exited", 0), joined));
          if (pending_interrupt()) throw Interrupted(SIGINT, "interrupted again");
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
      }
    } catch (const Interrupted&) {
      // A second interrupt: the others learn the end from the store while it lasts, or see it gone.
    } catch (const Error& e) {
      log::warn("not every node reported its workers stopped: {}", e.what());
    }
  }
  // Another node may have replaced a reported consequence with its root cause after this node
  // adopted the end (upgrade_end): the summary and exit code follow the store's last word.
  if (distributed_ && !control_.head_lost() && is_consequence(*end_)) {
    try {
      std::vector<std::string> key{"end"};
      if (store_.attempt->check(key)) {
        EndInfo last = end_from_string(store_.attempt->get("end"));
        if (is_root_cause_of(last, *end_)) end_ = last;
      }
    } catch (const Error& err) {
      log::warn("could not read the job's root cause from the store: {}", err.what());
    }
  }
}

}  // namespace cohort::launch::job_detail
