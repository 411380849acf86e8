// The worker side's direct path (client_impl.h; table.h: shared memory): a worker on a server's host,
// in async mode, maps the server's shard of a table (the memfd handoff, common/handoff.h) and reads
// and updates its rows itself. A pidfd per server process tells such a worker that a server died,
// since no message would.
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "common/fd.h"
#include "common/handoff.h"
#include "common/log.h"
#include "ps/client_impl.h"
#include "ps/config_json.h"
#include "ps/decode.h"

namespace cohort::ps::client_internal {

// The mapped shard of `table` on server s, or null for the message path: another host, bsp or
// stale mode, COHORT_PS_DIRECT=0, or a server that said no. Attaches on first use, and again
// after the server replaced the table (a load).
TableShard* ClientImpl::direct_shard(const std::string& table, const TableConfig& c, int s) {
  if (!direct_) return nullptr;
  auto& per_server = attached_[table];
  per_server.resize(size_t(roles_.num_servers));
  Attached& a = per_server[size_t(s)];
  if (a.refused) return nullptr;
  if (a.shard && a.shard->retired()) a.shard.reset();
  if (!a.shard) attach(table, c, s, a);
  return a.shard.get();
}

void ClientImpl::attach(const std::string& table, const TableConfig& c, int s, Attached& a) {
  const int peer = roles_.server_rank(s);
  if (!ep_->same_host(peer)) {
    a.refused = true;
    return;
  }
  // The server connects to this socket and sends the memfds before it replies (the memfd handoff,
  // common/handoff.h: its scope is the socket's name, the server's role its index).
  static std::atomic<uint64_t> sockets{0};
  const std::string name = fmt::format("cohort-ps-attach-{}-{}-{}", ::getpid(), worker_, sockets++);
  std::optional<handoff::Listener> listener;
  try {
    listener.emplace(name, 4, fmt::format("parameter-server worker {}", worker_));
  } catch (const Error& e) {
    log::debug("parameter-server worker {}: no socket to attach '{}' on: {}", worker_, table, e.what());
    a.refused = true;
    return;
  }
  auto op = std::make_shared<Operation>();
  op->what = fmt::format("attach of '{}'", table);
  post(*op, s, Op::kAttach, table, buffer_of(nlohmann::json{{"socket", name}, {"pid", ::getpid()}}.dump()));
  inflight_.push_back(op);
  run_locked(*op);
  nlohmann::json j;
  if (std::string why = parse_json(reply_text(*op->calls.front()), &j); !why.empty() || !j.is_object())
    throw malformed(*op->calls.front(), why.empty() ? "expected a JSON object" : why);
  if (!j.at("attached").get<bool>()) {
    log::debug("parameter-server worker {}: '{}' on server {} through messages: {}", worker_, table, s,
               j.value("why", std::string()));
    a.refused = true;
    return;
  }
  // Sent before the reply, so it is queued on the socket now. The socket's name is no secret
  // (/proc/net/unix lists it): only the server's own connection is taken (SO_PEERCRED).
  const int pid = j.at("pid").get<int>();
  std::optional<handoff::Received> got =
      listener->accept(handoff::Expect{handoff::scope_of(name), {{uint32_t(s), pid}}, "parameter server", 3},
                       Deadline::after(std::chrono::seconds(1)));
  if (!got)
    throw Error(fmt::format("parameter-server worker {}: server {} said it sent table '{}''s memory, but it did not "
                            "arrive", worker_, s, table));
  if (pid != ::getpid() && server_pid_[size_t(s)] != pid) {
    // A server that dies leaves its memory mapped here: its pidfd says so (check_servers_alive).
    // Without one (a kernel before 5.3), messages, which notice a dead server by themselves.
    UniqueFd pidfd(int(::syscall(SYS_pidfd_open, pid, 0)));
    if (!pidfd) {
      log::debug("parameter-server worker {}: no pidfd for server {} ({}): '{}' through messages", worker_, s,
                 std::strerror(errno), table);
      a.refused = true;
      return;
    }
    server_pid_[size_t(s)] = pid;
    server_pidfd_[size_t(s)] = std::move(pidfd);
  }
  // The server's configuration, not this worker's copy: a load may have replaced the table with
  // another (the rows' layout and the optimizer's settings come from it).
  TableConfig now = config_from_json(j.at("config"));
  if (now.dim != c.dim)
    throw InvalidArgument(fmt::format("table '{}' has rows of dim {} (replaced by a load?); this call was built for "
                                      "dim {}", table, now.dim, c.dim));
  tables_[table] = now;
  a.shard = std::make_unique<TableShard>(table, now, j.at("first_row").get<uint64_t>(), j.at("rows").get<uint64_t>(),
                                         std::move(got->fds), timeout_, j.at("holder").get<uint32_t>());
}

// Direct calls send nothing, so nothing would notice a server that died: a pidfd per server
// process becomes readable when it exits. One poll(2) per call.
void ClientImpl::check_servers_alive(const std::string& what) {
  std::vector<pollfd> fds;
  std::vector<int> who;
  for (int s = 0; s < roles_.num_servers; ++s)
    if (server_pidfd_[size_t(s)]) {
      fds.push_back(pollfd{server_pidfd_[size_t(s)].get(), POLLIN, 0});
      who.push_back(s);
    }
  if (fds.empty() || ::poll(fds.data(), fds.size(), 0) <= 0) return;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (!(fds[i].revents & POLLIN)) continue;
    const int s = who[i];
    broken_ = true;
    throw PeerLostError(fmt::format("parameter-server worker {}: {} failed: lost parameter server {} ({}): its "
                                    "process (pid {}) exited",
                                    worker_, what, s, ep_->host_of(roles_.server_rank(s)), server_pid_[size_t(s)]));
  }
}

}  // namespace cohort::ps::client_internal
