// hello: the smallest multi-process cohort program. Each worker prints its place in the job; with
// --store it also meets its peers through the job's store: it publishes its host name, waits for
// everyone at a barrier, and rank 0 prints who came.
//
//   cohort run -n 4 build/examples/hello/hello --store
//   mpirun -n 4 build/examples/hello/hello --store      (or torchrun, srun: any launcher cohort reads)
//
// The rank, the world size and the store come from comm/launch_env.h, where Communicator::from_env
// finds them: cohort run's variables, torchrun's, Open MPI's (OMPI_COMM_WORLD_RANK/SIZE) or Slurm's,
// else PMIx. Without a launcher's store, rank 0 hosts one (at MASTER_ADDR:MASTER_PORT, or on a port the
// OS picks whose address travels through PMIx under mpirun).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "cohort/error.h"
#include "comm/launch_env.h"
#include "comm/pmix.h"
#include "common/env.h"
#include "common/socket.h"
#include "store/tcp_store.h"

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  bool use_store = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--store") == 0) {
      use_store = true;
    } else {
      std::fprintf(stderr, "usage: hello [--store]\n");
      return 2;
    }
  }
  cohort::comm::LaunchEnv e;
  try {
    e = cohort::comm::resolve_launch_env([](const std::string& n) { return cohort::env::get_raw(n); });
  } catch (const cohort::Error& err) {
    std::fprintf(stderr, "hello: %s\n", err.what());
    return 2;
  }
  const int rank = e.rank;
  // The node-local rank, from whichever launcher gave the rank (cohort run and torchrun: LOCAL_RANK;
  // Open MPI: OMPI_COMM_WORLD_LOCAL_RANK; Slurm: SLURM_LOCALID).
  int local_rank = env_int("COHORT_LOCAL_RANK", env_int("LOCAL_RANK", env_int("OMPI_COMM_WORLD_LOCAL_RANK",
                                                                             env_int("SLURM_LOCALID", 0))));
  int node = env_int("COHORT_NODE_RANK", env_int("GROUP_RANK", env_int("SLURM_NODEID", 0)));
  std::string host = cohort::net::hostname();
  std::shared_ptr<cohort::StoreServer> server;
  std::shared_ptr<cohort::Store> store;
  try {
    if (use_store) {
      const std::chrono::seconds timeout(60);
      auto start_store = [&](uint16_t port) {
        cohort::StoreServerOptions so;
        so.port = port;
        so.token = e.token;
        server = cohort::StoreServer::start(so);
        return server->port();
      };
      // Under mpirun without MASTER_ADDR, rank 0's store address travels through PMIx (as from_env does);
      // that is also where the world size comes from when no variable gives it.
      if (e.pmix) cohort::comm::pmix::exchange_store_address(e, timeout, [&] { return start_store(0); });
      else if (e.host_store) start_store(e.store_port);
      cohort::StoreClientOptions options;
      options.host = e.store_host;
      options.port = e.store_port;
      options.token = e.token;
      options.timeout = timeout;
      store = cohort::connect_tcp_store(options);
    }
  } catch (const cohort::Error& err) {
    std::fprintf(stderr, "hello rank %d: %s\n", rank, err.what());
    return 1;
  }
  std::string world = e.world_size > 0 ? std::to_string(e.world_size) : "? (only PMIx knows: run with --store)";
  std::printf("hello from rank %d of %s (local rank %d, node %d, host %s, pid %d; %s)\n", rank, world.c_str(),
              local_rank, node, host.c_str(), static_cast<int>(getpid()), e.source.c_str());
  std::fflush(stdout);  // a pipe is fully buffered: show the greeting before the barrier
  if (!use_store) return 0;
  try {
    const std::string prefix = e.prefix + "/hello";
    const std::chrono::seconds timeout(60);
    store->set(prefix + "/host/" + std::to_string(rank), host);
    store->barrier(prefix + "/barrier", rank, e.world_size, timeout);
    if (rank == 0) {
      std::string hosts;
      for (int r = 0; r < e.world_size; ++r) hosts += (r ? ", " : "") + store->get(prefix + "/host/" + std::to_string(r));
      std::printf("rank 0: all %d ranks met at the store %s:%d (hosts: %s)\n", e.world_size, e.store_host.c_str(),
                  e.store_port, hosts.c_str());
    }
    if (server) {
      // This rank hosts the store: it stays up until every other rank is done with it.
      std::vector<std::string> left;
      for (int r = 1; r < e.world_size; ++r) left.push_back(prefix + "/left/" + std::to_string(r));
      store->wait(left, timeout);
    } else {
      store->set(prefix + "/left/" + std::to_string(rank), "1");
    }
  } catch (const cohort::Error& err) {
    std::fprintf(stderr, "hello rank %d: %s\n", rank, err.what());
    return 1;
  }
  return 0;
}
