// resolve_launch_env under a PMIx launcher (mpirun, srun --mpi=pmix): without MASTER_ADDR the store's
// address is left to the PMIx exchange; with it, nothing changes; with neither, the error says what to set.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>

#include "cohort/error.h"
#include "comm/launch_env.h"

namespace cohort {
namespace {

comm::LaunchEnv resolve(const std::map<std::string, std::string>& vars) {
  return comm::resolve_launch_env([&](const std::string& n) -> std::optional<std::string> {
    auto it = vars.find(n);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    resolve(vars);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

// What Open MPI 4.1's mpirun gives each process (besides its own OMPI_* and PMIX_* settings).
std::map<std::string, std::string> mpirun_env(int rank, int size) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank)},
          {"PMIX_NAMESPACE", "1185939457"},
          {"PMIX_RANK", std::to_string(rank)},
          {"PMIX_SERVER_URI4", "1185939456.0;tcp4://127.0.0.1:55431"}};
}

TEST(LaunchEnvPmix, MpirunWithoutMasterAddrMeetsThroughPmix) {
  auto r0 = resolve(mpirun_env(0, 8));
  EXPECT_TRUE(r0.pmix);
  EXPECT_EQ(r0.source, "Open MPI");
  EXPECT_EQ(r0.rank, 0);
  EXPECT_EQ(r0.world_size, 8);
  EXPECT_TRUE(r0.host_store) << "rank 0 hosts the store";
  EXPECT_TRUE(r0.store_host.empty()) << "the address comes from the PMIx exchange";
  EXPECT_EQ(r0.prefix, "cohort/world/comm");

  auto r3 = resolve(mpirun_env(3, 8));
  EXPECT_TRUE(r3.pmix);
  EXPECT_EQ(r3.rank, 3);
  EXPECT_FALSE(r3.host_store);

  // Only without MASTER_ADDR: a job that names its store keeps it.
  auto vars = mpirun_env(1, 2);
  vars["MASTER_ADDR"] = "10.0.0.1";
  vars["MASTER_PORT"] = "29500";
  auto m = resolve(vars);
  EXPECT_FALSE(m.pmix);
  EXPECT_EQ(m.store_host, "10.0.0.1");
  EXPECT_EQ(m.store_port, 29500);

  // cohort run's workers inside an mpirun allocation inherit PMIX_*; the launcher's store is theirs.
  vars = mpirun_env(0, 2);
  vars.insert({{"COHORT_RANK", "5"}, {"COHORT_WORLD_SIZE", "8"}, {"COHORT_STORE_ADDR", "10.0.0.2:29400"}});
  auto c = resolve(vars);
  EXPECT_FALSE(c.pmix);
  EXPECT_EQ(c.rank, 5);
  EXPECT_EQ(c.store_host, "10.0.0.2");

  // cohort run's variables without its store stay an error, PMIx or not.
  vars.erase("COHORT_STORE_ADDR");
  EXPECT_NE(error_of(vars).find("COHORT_STORE_ADDR is not"), std::string::npos) << error_of(vars);
}

TEST(LaunchEnvPmix, SrunAndPmixOnlyLaunchers) {
  // srun --mpi=pmix: Slurm's rank variables, PMIx's server.
  auto s = resolve({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"PMIX_NAMESPACE", "slurm.pmix.7.0"},
                    {"PMIX_RANK", "1"}});
  EXPECT_TRUE(s.pmix);
  EXPECT_EQ(s.source, "Slurm");
  EXPECT_EQ(s.world_size, 4);
  // A launcher that sets only PMIx's variables (prterun): the world size is PMIx's to give.
  auto p = resolve({{"PMIX_NAMESPACE", "prterun-h-1@1"}, {"PMIX_RANK", "2"}});
  EXPECT_TRUE(p.pmix);
  EXPECT_EQ(p.source, "PMIx");
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.world_size, 0);
  EXPECT_FALSE(p.host_store);
}

TEST(LaunchEnvPmix, NeitherMasterAddrNorPmixSaysWhatToSet) {
  const std::string e = error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "8"}});
  EXPECT_NE(e.find("Open MPI gives the rank (OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=8)"), std::string::npos) << e;
  EXPECT_NE(e.find("no PMIx server is named (PMIX_NAMESPACE, PMIX_RANK)"), std::string::npos) << e;
  EXPECT_NE(e.find("set MASTER_ADDR and MASTER_PORT"), std::string::npos) << e;
  EXPECT_NE(e.find("mpirun or srun --mpi=pmix"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << "one line";

  // PMIX_RANK without its namespace names no server.
  const std::string half = error_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"PMIX_RANK", "0"}});
  EXPECT_NE(half.find("no PMIx server is named"), std::string::npos) << half;

  // MASTER_ADDR alone still asks for the port.
  const std::string port = error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}});
  EXPECT_NE(port.find("MASTER_PORT is not set"), std::string::npos) << port;

  // Nothing at all: the list of what would do names PMIx's launchers too.
  const std::string none = error_of({});
  EXPECT_NE(none.find("PMIX_NAMESPACE/PMIX_RANK (mpirun, srun --mpi=pmix)"), std::string::npos) << none;
}

TEST(LaunchEnvPmix, PmixRankWithANamedStoreButNoWorldSizeIsAnError) {
  const std::string e = error_of({{"PMIX_NAMESPACE", "n"}, {"PMIX_RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
  EXPECT_NE(e.find("PMIX_RANK=0 gives the rank but no variable gives the world size"), std::string::npos) << e;
  EXPECT_THROW(resolve({{"PMIX_NAMESPACE", "n"}, {"PMIX_RANK", "x"}}), ConfigError);
}

}  // namespace
}  // namespace cohort
