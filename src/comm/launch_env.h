#pragma once
// Where a worker learns its rank, world size and rendezvous store: the launcher's COHORT_*
// variables, else torchrun's, else Open MPI's or Slurm's rank variables with MASTER_ADDR/PORT, else
// (no MASTER_ADDR) the PMIx server that mpirun and srun --mpi=pmix run for every job: then the store's
// address is exchanged through PMIx when the communicator is built (comm/pmix.h), not read here.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace cohort::comm {

struct LaunchEnv {
  std::string source;        // "cohort run", "torchrun", "Open MPI", "Slurm", "PMIx" (for messages)
  std::string rank_vars;     // the variables that gave the rank, "OMPI_COMM_WORLD_RANK=0 ..." (for messages)
  int rank = 0;
  int world_size = 1;        // 0: only PMIx knows it (a PMIx launcher that sets no other rank variables)
  std::string store_host;
  uint16_t store_port = 0;
  bool host_store = false;   // this rank starts the store server (rank 0 without a launcher)
  // No MASTER_ADDR, but a PMIx server is named (PMIX_NAMESPACE, PMIX_RANK): store_host/store_port are
  // empty until comm::pmix::exchange_store_address fills them (rank 0 hosts on a port the OS picks).
  bool pmix = false;
  std::string token;         // COHORT_JOB_TOKEN, may be empty
  std::string prefix;        // job-scoped key prefix of the world communicator
  // The job's prefix whatever the process's role. In a parameter-server job (COHORT_ROLE) the
  // world communicator is the role's: servers meet under prefix = job_prefix + "/servers", so a
  // server that builds one never meets the workers' (docs/parameter-server.md).
  std::string job_prefix;
  // Started by `cohort run`: its launcher publishes under `prefix` the exits of the ranks' processes
  // (comm/peer_exits.h), which the world communicator and its children read.
  bool launcher_publishes_exits = false;
};

// The key prefix of a `cohort run` job's communicators in attempt (restart count, elastic
// generation) `attempt`; the launcher publishes the ranks' exits under it.
std::string job_comm_prefix(const std::string& job_id, const std::string& attempt);

using GetEnv = std::function<std::optional<std::string>(const std::string&)>;

// Whether any launcher's rank variables (or a PMIx server's) are set: a process without them was
// started by hand, and resolve_launch_env refuses it. (Set but incomplete counts as set: the refusal
// then says what is missing.)
bool has_launch_env(const GetEnv& get);

// Reads the environment through `get` (tests pass a map). A missing or contradictory environment
// throws one ConfigError saying what was found and what is needed.
LaunchEnv resolve_launch_env(const GetEnv& get);

}  // namespace cohort::comm
