// The parameter server's tables (server_impl.h): create_table and the lookup every request makes,
// the check that a request names only rows this server owns, this server's share of a new table,
// and the attach of a worker on this host to a shard's shared memory (table.h; async mode only).
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "common/fd.h"
#include "common/handoff.h"
#include "common/log.h"
#include "ps/config_json.h"
#include "ps/server_impl.h"
#include "ps/sharding.h"

namespace cohort::ps::server_internal {

TableShard& Server::table(const Request& r, bool check_dim) {
  auto it = tables_.find(r.table);
  if (it == tables_.end()) {
    std::vector<std::string> names;
    for (auto& [n, t] : tables_) names.push_back("'" + n + "'");
    throw InvalidArgument(fmt::format("no table '{}' (tables: {})", r.table,
                                      names.empty() ? "none; call create_table first" : fmt::format("{}", fmt::join(names, ", "))));
  }
  if (check_dim && r.dim != it->second->dim())
    throw InvalidArgument(fmt::format("table '{}' has rows of dim {}; this {} was built for dim {}", r.table,
                                      it->second->dim(), op_name(r.op), r.dim));
  return *it->second;
}

void Server::check_ids(const TableShard& t, const uint64_t* ids, uint64_t n) {
  const TableConfig& c = t.config();
  for (uint64_t i = 0; i < n; ++i) {
    if (c.dense && ids[i] >= c.rows)
      throw InvalidArgument(fmt::format("table '{}': row {} is outside the dense table's {} rows", t.name(), ids[i],
                                        c.rows));
    int owner = c.dense ? shard_of_row(ids[i], c.rows, roles_.num_servers) : shard_of_id(ids[i], roles_.num_servers);
    if (owner != index_)
      throw InvalidArgument(fmt::format("table '{}': id {} belongs to server {}, not {} (does the worker see {} servers?)",
                                        t.name(), ids[i], owner, index_, roles_.num_servers));
  }
}

void Server::create(int w, uint64_t seq, const Request& r) {
  auto it = tables_.find(r.table);
  if (it != tables_.end()) {
    std::string diff = config_difference(it->second->config(), r.config);
    if (!diff.empty())
      throw InvalidArgument(fmt::format("create_table '{}': the table exists with {}", r.table, diff));
    return reply(w, seq);
  }
  tables_.emplace(r.table, make_shard(r.table, r.config));
  reply(w, seq);
}

std::unique_ptr<TableShard> Server::make_shard(const std::string& name, const TableConfig& c) {
  if (!c.dense) {
    // expected_rows: this server's share (the hash spreads ids evenly), and 1/64 more for the spread.
    const uint64_t share = (c.expected_rows + uint64_t(roles_.num_servers) - 1) / uint64_t(roles_.num_servers);
    return std::make_unique<TableShard>(name, c, 0, 0, timeout_, share + share / 64, index_);
  }
  // Dense: this server's contiguous range (shard_of_row).
  uint64_t per = (c.rows + uint64_t(roles_.num_servers) - 1) / uint64_t(roles_.num_servers);
  uint64_t first = std::min(c.rows, per * uint64_t(index_));
  uint64_t last = std::min(c.rows, first + per);
  return std::make_unique<TableShard>(name, c, first, last - first, timeout_, 0, index_);
}

// A worker on this host asks for a table's shared memory (table.h), to pull and push rows itself.
// Only in async mode: bsp holds pushes and stale:K holds pulls here, by the server's clock.
// The request (checked by decode_request): the worker's abstract Unix socket and its pid.
void Server::attach(int w, uint64_t seq, const Request& r) {
  TableShard& t = table(r, false);
  nlohmann::json j{{"attached", false}};
  uint32_t holder = 0;
  if (mode_.mode != Mode::kAsync) {
    j["why"] = fmt::format("{} mode: pushes and pulls follow the server's clock", mode_.to_string());
  } else if (std::string why = hand_over(t, w, r.text, r.pid, &holder); !why.empty()) {
    j["why"] = why;
  } else {
    j = {{"attached", true}, {"pid", ::getpid()}, {"holder", holder}, {"first_row", t.first_row()},
         {"rows", t.held_rows()}, {"config", config_to_json(t.config())}};
  }
  reply(w, seq, buffer_of(j.dump()));
}

// Sends the shard's memfds to the worker's abstract socket (the memfd handoff, common/handoff.h:
// scope, the socket's name; role, this server's index); "" on success, else why not. The socket must
// be the process that asked (`pid`, of this job's connection to worker w), which then becomes one of
// the shard's holders (table.h), so that a process waiting for its locks can see it die. The worker
// listens already (no waiting), and checks the tables' sizes as it maps them.
std::string Server::hand_over(TableShard& t, int w, const std::string& socket_name, int64_t pid, uint32_t* holder) {
  const std::string whom = fmt::format("worker {}", w);
  try {
    UniqueFd sock = handoff::connect(socket_name, int(pid), whom, Deadline::after(std::chrono::seconds(0)));
    *holder = t.register_holder(w, int(pid));
    if (*holder == 0)
      return fmt::format("{} processes hold table '{}' already", TableShard::kMaxHolders, t.name());
    handoff::send(sock.get(), handoff::make_hello(handoff::scope_of(socket_name), uint32_t(index_)), t.fds(),
                  Deadline::after(std::chrono::seconds(1)), whom);
  } catch (const TimeoutError& e) {
    return e.what();  // no such socket here (a worker in another network namespace): nobody to refuse
  } catch (const Error& e) {
    log::warn("parameter server {}: refused worker {}'s attach of table '{}': {}", index_, w, t.name(), e.what());
    return e.what();
  }
  return {};
}

}  // namespace cohort::ps::server_internal
