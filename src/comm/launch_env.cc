#include "comm/launch_env.h"

#include <fmt/core.h>

#include <vector>

#include "cohort/error.h"
#include "common/env.h"
#include "common/socket.h"
#include "common/strings.h"

namespace cohort::comm {
namespace {

int parse_nonneg(const std::string& name, const std::string& value) {
  int64_t v = env::parse_int(name, value);
  if (v < 0 || v > (int64_t(1) << 30)) throw ConfigError(fmt::format("{}={}: expected a rank or size >= 0", name, value));
  return int(v);
}

struct Pair {
  const char* rank;
  const char* size;
  const char* source;
};

// The launchers' (rank, world size) variables, in the order they are believed.
const Pair kPairs[] = {{"COHORT_RANK", "COHORT_WORLD_SIZE", "cohort run"},
                       {"RANK", "WORLD_SIZE", "torchrun"},
                       {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"},
                       {"SLURM_PROCID", "SLURM_NTASKS", "Slurm"}};

}  // namespace

bool has_launch_env(const GetEnv& get) {
  for (const Pair& p : kPairs)
    if (get(p.rank) || get(p.size)) return true;
  return get("PMIX_RANK") || get("PMIX_NAMESPACE");
}

std::string job_comm_prefix(const std::string& job_id, const std::string& attempt) {
  return fmt::format("cohort/job/{}/attempt/{}/comm", job_id, attempt);
}

LaunchEnv resolve_launch_env(const GetEnv& get) {
  LaunchEnv e;
  e.token = get("COHORT_JOB_TOKEN").value_or("");

  // Every (rank, size) pair that is set must agree: a worker started by one launcher inside another's
  // allocation would otherwise silently join the wrong job.
  const Pair* chosen = nullptr;
  std::vector<std::string> seen;
  for (const Pair& p : kPairs) {
    auto r = get(p.rank), s = get(p.size);
    if (!r && !s) continue;
    if (!r || !s) {
      throw ConfigError(fmt::format("{} is set but {} is not; set both (or neither)", r ? p.rank : p.size,
                                    r ? p.size : p.rank));
    }
    int rank = parse_nonneg(p.rank, *r), size = parse_nonneg(p.size, *s);
    seen.push_back(fmt::format("{}={} {}={}", p.rank, *r, p.size, *s));
    if (!chosen) {
      chosen = &p;
      e.rank = rank;
      e.world_size = size;
      e.source = p.source;
    } else if (p.source != std::string("Slurm") && p.source != std::string("Open MPI") &&
               (rank != e.rank || size != e.world_size)) {
      // Launcher variables must agree with torchrun's (cohort run sets both). Scheduler
      // variables (Slurm, Open MPI) describe the allocation and may legitimately differ when a
      // launcher runs inside it, so they are only used when nothing better is set.
      throw ConfigError(fmt::format("contradictory rank variables: {}", str::join(seen, " vs ")));
    }
  }
  // mpirun and srun --mpi=pmix name their PMIx server to every process they start; a PMIx launcher that
  // sets no other rank variables (prterun) still gives the rank, and PMIx itself gives the world size.
  const auto pmix_rank = get("PMIX_RANK");
  const bool pmix_server = pmix_rank && get("PMIX_NAMESPACE");
  if (!chosen && pmix_server) {
    e.source = "PMIx";
    e.rank = parse_nonneg("PMIX_RANK", *pmix_rank);
    e.world_size = 0;
    seen.push_back("PMIX_RANK=" + *pmix_rank);
  } else if (!chosen) {
    throw ConfigError(
        "no rank information in the environment: expected COHORT_RANK/COHORT_WORLD_SIZE/COHORT_STORE_ADDR "
        "(cohort run), RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun), OMPI_COMM_WORLD_RANK/SIZE or "
        "SLURM_PROCID/SLURM_NTASKS with MASTER_ADDR/MASTER_PORT, or a PMIx launcher's PMIX_NAMESPACE/PMIX_RANK "
        "(mpirun, srun --mpi=pmix)");
  } else {
    if (e.world_size < 1) throw ConfigError(fmt::format("{}: world size must be at least 1", chosen->size));
    if (e.rank >= e.world_size) {
      throw ConfigError(
          fmt::format("{}={} is out of range for {}={}", chosen->rank, e.rank, chosen->size, e.world_size));
    }
  }
  e.rank_vars = seen.front();

  if (e.world_size == 0 && (get("COHORT_STORE_ADDR") || get("MASTER_ADDR"))) {
    // Only the PMIx exchange asks PMIx for the world size; a named store would go without one.
    throw ConfigError(fmt::format("{} gives the rank but no variable gives the world size, and {} names the "
                                  "store: set WORLD_SIZE (and RANK), or unset it to meet through PMIx",
                                  e.rank_vars, get("COHORT_STORE_ADDR") ? "COHORT_STORE_ADDR" : "MASTER_ADDR"));
  }
  if (auto addr = get("COHORT_STORE_ADDR")) {
    auto [host, port] = net::split_host_port(*addr);
    e.store_host = host;
    e.store_port = port;
    std::string job = get("COHORT_JOB_ID").value_or("default");
    std::string attempt = get("COHORT_RESTART_COUNT").value_or("0");
    e.job_prefix = job_comm_prefix(job, attempt);
    e.prefix = get("COHORT_ROLE").value_or("") == "server" ? e.job_prefix + "/servers" : e.job_prefix;
    e.launcher_publishes_exits = std::string(chosen->source) == "cohort run";
    return e;
  }
  if (e.source == "cohort run") {
    throw ConfigError("COHORT_RANK is set but COHORT_STORE_ADDR is not (expected host:port of the job's store)");
  }
  auto maddr = get("MASTER_ADDR"), mport = get("MASTER_PORT");
  if (!maddr && pmix_server) {
    // MASTER_ADDR wins where both are set: a job that names its store keeps it.
    e.pmix = true;
    e.host_store = e.rank == 0;
    e.prefix = "cohort/world/comm";
    e.job_prefix = e.prefix;
    return e;
  }
  if (!maddr) {
    throw ConfigError(fmt::format(
        "{} gives the rank ({}) but MASTER_ADDR is not set and no PMIx server is named (PMIX_NAMESPACE, "
        "PMIX_RANK): set MASTER_ADDR and MASTER_PORT to rank 0's host and a free port there (rank 0 hosts the "
        "store), or start the job with cohort run, mpirun or srun --mpi=pmix",
        e.source, e.rank_vars));
  }
  if (!mport) {
    throw ConfigError(fmt::format("{} gives the rank ({}) and MASTER_ADDR={} but MASTER_PORT is not set: rank 0 "
                                  "hosts the store at MASTER_ADDR:MASTER_PORT",
                                  e.source, e.rank_vars, *maddr));
  }
  int64_t port = env::parse_int("MASTER_PORT", *mport);
  if (port <= 0 || port > 65535) throw ConfigError(fmt::format("MASTER_PORT={}: expected a port 1-65535", *mport));
  e.store_host = *maddr;
  e.store_port = uint16_t(port);
  e.host_store = e.rank == 0;
  e.prefix = "cohort/world/comm";
  e.job_prefix = e.prefix;
  return e;
}

}  // namespace cohort::comm
