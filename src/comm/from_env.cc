// Communicator::from_env: the world communicator of a launched job.
#include <fmt/core.h>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "comm/communicator_impl.h"
#include "comm/launch_env.h"
#include "comm/pmix.h"
#include "comm/settings.h"
#include "common/env.h"
#include "common/log.h"
#include "store/tcp_store.h"

namespace cohort {

std::shared_ptr<Communicator> Communicator::from_env(CommOptions options) {
  comm::LaunchEnv e = comm::resolve_launch_env([](const std::string& n) { return env::get_raw(n); });
  comm::apply_env_overrides(options);
  log::set_identity(fmt::format("rank {}", e.rank));
  std::shared_ptr<StoreServer> server;
  auto start_store = [&](uint16_t port) {
    StoreServerOptions so;
    so.port = port;
    so.token = e.token;
    so.backlog = std::max(16384, e.world_size);
    server = StoreServer::start(so);
    return server->port();
  };
  // Under mpirun / srun --mpi=pmix without MASTER_ADDR, rank 0's store address (on a port the OS picks)
  // travels through PMIx.
  if (e.pmix) {
    comm::pmix::exchange_store_address(e, options.timeout, [&] { return start_store(0); });
  } else if (e.host_store) {
    try {
      start_store(e.store_port);
    } catch (const ConfigError& err) {
      // The other ranks look for the store at that port: only another port for every rank helps.
      throw ConfigError(fmt::format("rank 0 cannot host the job's store at MASTER_PORT={}: {}; give every rank "
                                    "another free MASTER_PORT",
                                    e.store_port, err.what()));
    }
  }
  StoreClientOptions co;
  co.host = e.store_host;
  co.port = e.store_port;
  co.token = e.token;
  co.timeout = options.timeout;
  auto store = connect_tcp_store(co);
  options.store_prefix = e.prefix;
  comm::CommSetup s{store, options.store_prefix, e.rank, e.world_size, options, {}, false, false, {}, nullptr};
  if (e.launcher_publishes_exits) {
    // The launcher's records of ranks whose process ended sit beside this communicator's keys.
    auto exits = std::make_shared<comm::ExitWatch>();
    exits->store = make_prefix_store(store, e.prefix);
    s.exits = std::move(exits);
  }
  auto comm = std::make_shared<comm::CommunicatorImpl>(std::move(s));
  comm->bootstrap();
  if (server) comm->keep_alive(server);
  return comm;
}

}  // namespace cohort
