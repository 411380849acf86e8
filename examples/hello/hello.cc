// hello: the smallest multi-process cohort program. Each worker prints its place in the job (from
// the environment `cohort run` sets); with --store it also meets its peers through the job's store:
// it publishes its host name, waits for everyone at a barrier, and rank 0 prints who came.
//
//   cohort run -n 4 build/examples/hello --store
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <unistd.h>

#include "cohort/error.h"
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
  int rank = env_int("COHORT_RANK", env_int("RANK", 0));
  int world = env_int("COHORT_WORLD_SIZE", env_int("WORLD_SIZE", 1));
  int local_rank = env_int("COHORT_LOCAL_RANK", env_int("LOCAL_RANK", 0));
  int node = env_int("COHORT_NODE_RANK", 0);
  std::string host = cohort::net::hostname();
  std::printf("hello from rank %d of %d (local rank %d, node %d, host %s, pid %d)\n", rank, world, local_rank, node,
              host.c_str(), static_cast<int>(getpid()));
  std::fflush(stdout);  // a pipe is fully buffered: show the greeting before the barrier
  if (!use_store) return 0;
  const char* addr = std::getenv("COHORT_STORE_ADDR");
  if (!addr || !*addr) {
    std::fprintf(stderr, "hello: --store needs COHORT_STORE_ADDR (run me under `cohort run`)\n");
    return 2;
  }
  try {
    auto [store_host, store_port] = cohort::net::split_host_port(addr);
    cohort::StoreClientOptions options;
    options.host = store_host;
    options.port = store_port;
    const char* token = std::getenv("COHORT_JOB_TOKEN");
    options.token = token ? token : "";
    options.timeout = std::chrono::seconds(60);
    auto store = cohort::connect_tcp_store(options);
    const char* job = std::getenv("COHORT_JOB_ID");
    std::string prefix = std::string("hello/") + (job ? job : "job") + "/" + (std::getenv("COHORT_RESTART_COUNT") ? std::getenv("COHORT_RESTART_COUNT") : "0");
    store->set(prefix + "/host/" + std::to_string(rank), host);
    store->barrier(prefix + "/barrier", rank, world, std::chrono::seconds(60));
    if (rank == 0) {
      std::string hosts;
      for (int r = 0; r < world; ++r) hosts += (r ? ", " : "") + store->get(prefix + "/host/" + std::to_string(r));
      std::printf("rank 0: all %d ranks met at the store %s (hosts: %s)\n", world, addr, hosts.c_str());
    }
  } catch (const cohort::Error& e) {
    std::fprintf(stderr, "hello rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
