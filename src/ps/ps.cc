// include/cohort/ps.h's free functions: sharding, modes, roles, and the from_env entry points of a
// launched job (cohort run --ps N).
#include <fmt/core.h>

#include "cohort/error.h"
#include "cohort/ps.h"
#include "comm/launch_env.h"
#include "comm/settings.h"
#include "common/env.h"
#include "common/log.h"
#include "ps/client.h"
#include "ps/server.h"
#include "ps/sharding.h"
#include "store/tcp_store.h"

namespace cohort::ps {

namespace {
const env::StringSetting kMode("COHORT_PS_MODE", "async",
                               "parameter-server consistency: async, bsp or stale:K (cohort run --ps-mode)");
const env::BytesSetting kMaxRequest("COHORT_PS_MAX_REQUEST", 256ull << 20,  // default repeated below
                                    "largest parameter-server request or reply payload (bytes)");

int role_count(const char* name) {
  auto v = env::get_raw(name);
  if (!v) throw ConfigError(fmt::format("{} is not set: not a parameter-server job (start it with cohort run --ps N)", name));
  try {
    size_t used = 0;
    int n = std::stoi(*v, &used);
    if (used == v->size() && n >= 1) return n;
  } catch (const std::exception&) {
  }
  throw ConfigError(fmt::format("{}={}: expected a positive integer", name, *v));
}

struct LaunchedJob {
  std::shared_ptr<Store> store;
  std::string prefix;
  std::chrono::milliseconds timeout;
  int index = 0;
};

LaunchedJob launched(const char* want_role) {
  auto role = env::get_raw("COHORT_ROLE");
  if (!role) throw ConfigError("COHORT_ROLE is not set: not a parameter-server job (start it with cohort run --ps N)");
  if (*role != want_role)
    throw ConfigError(fmt::format("COHORT_ROLE={}: this process is a {}; {}", *role, *role,
                                  *role == std::string("server") ? "call cohort::ps::serve_from_env()"
                                                                 : "use cohort::ps::Client::from_env()"));
  comm::LaunchEnv e = comm::resolve_launch_env([](const std::string& n) { return env::get_raw(n); });
  // Roles meet in the launcher's store; only a world communicator can meet through PMIx instead.
  if (e.pmix)
    throw ConfigError(fmt::format("COHORT_ROLE={} is set but COHORT_STORE_ADDR is not: parameter-server jobs start "
                                  "with cohort run --ps N",
                                  *role));
  CommOptions options;
  comm::apply_env_overrides(options);
  StoreClientOptions co;
  co.host = e.store_host;
  co.port = e.store_port;
  co.token = e.token;
  co.timeout = options.timeout;
  LaunchedJob j{connect_tcp_store(co), e.job_prefix + "/ps", options.timeout, 0};
  auto idx = env::get_raw("COHORT_ROLE_INDEX");
  j.index = idx ? std::stoi(*idx) : 0;
  return j;
}
}  // namespace

uint64_t max_request_setting() {
  // Read at every server start rather than once per process (kMaxRequest.get() caches): one process
  // may start servers with different settings one after the other, as the tests do.
  const auto raw = env::get_raw(kMaxRequest.name());
  return raw ? env::parse_bytes(kMaxRequest.name(), *raw) : 256ull << 20;
}

int shard_of_id(uint64_t id, int num_servers) { return int(mix64(id) % uint64_t(num_servers)); }

int shard_of_row(uint64_t row, uint64_t rows, int num_servers) {
  uint64_t per = (rows + uint64_t(num_servers) - 1) / uint64_t(num_servers);
  return int(row / per);
}

ConsistencyMode ConsistencyMode::parse(const std::string& text) {
  ConsistencyMode m;
  if (text == "async") return m;
  if (text == "bsp") {
    m.mode = Mode::kBsp;
    return m;
  }
  if (text.rfind("stale:", 0) == 0) {
    try {
      size_t used = 0;
      int k = std::stoi(text.substr(6), &used);
      if (used == text.size() - 6 && k >= 0) {
        m.mode = k == 0 ? Mode::kBsp : Mode::kStale;
        m.staleness = k;
        if (k == 0) m.staleness = 0;
        return m;
      }
    } catch (const std::exception&) {
    }
  }
  throw ConfigError(fmt::format("parameter-server mode '{}': expected async, bsp or stale:K (K >= 0)", text));
}

std::string ConsistencyMode::to_string() const {
  switch (mode) {
    case Mode::kAsync: return "async";
    case Mode::kBsp: return "bsp";
    case Mode::kStale: return fmt::format("stale:{}", staleness);
  }
  return "?";
}

Roles Roles::from_env() { return Roles{role_count("COHORT_NUM_SERVERS"), role_count("COHORT_NUM_WORKERS")}; }

std::unique_ptr<Client> Client::from_env() {
  Roles roles = Roles::from_env();
  LaunchedJob j = launched("worker");
  if (j.index < 0 || j.index >= roles.num_workers)
    throw ConfigError(fmt::format("COHORT_ROLE_INDEX={}: outside the {} workers", j.index, roles.num_workers));
  log::set_identity(fmt::format("worker {}", j.index));
  return make_client(j.store, j.prefix, j.index, roles, j.timeout);
}

std::unique_ptr<Client> Client::create(std::shared_ptr<Store> store, int worker, const Roles& roles,
                                       std::chrono::milliseconds timeout) {
  if (!store) throw InvalidArgument("ps::Client::create: store is null");
  if (worker < 0 || worker >= roles.num_workers)
    throw InvalidArgument(fmt::format("ps::Client::create: worker {} outside [0, {})", worker, roles.num_workers));
  return make_client(std::move(store), "ps", worker, roles, timeout);
}

void serve_from_env() {
  Roles roles = Roles::from_env();
  LaunchedJob j = launched("server");
  if (j.index < 0 || j.index >= roles.num_servers)
    throw ConfigError(fmt::format("COHORT_ROLE_INDEX={}: outside the {} servers", j.index, roles.num_servers));
  log::set_identity(fmt::format("ps server {}", j.index));
  run_server(j.store, j.prefix, j.index, roles, ConsistencyMode::parse(kMode.get()), j.timeout, max_request_setting());
}

void serve(std::shared_ptr<Store> store, int server, const Roles& roles, ConsistencyMode mode,
           std::chrono::milliseconds timeout) {
  if (!store) throw InvalidArgument("ps::serve: store is null");
  if (server < 0 || server >= roles.num_servers)
    throw InvalidArgument(fmt::format("ps::serve: server {} outside [0, {})", server, roles.num_servers));
  run_server(std::move(store), "ps", server, roles, mode, timeout, max_request_setting());
}

}  // namespace cohort::ps
