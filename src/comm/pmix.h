#pragma once
// PMIx: how a worker started by mpirun (Open MPI) or srun --mpi=pmix finds rank 0's store when no
// MASTER_ADDR is set. Those launchers run a PMIx server for every job and name it to each process
// (PMIX_NAMESPACE, PMIX_RANK, PMIX_SERVER_URI*); MPI libraries meet through it, and so does cohort:
// rank 0 starts the store on a port the OS picks and puts "host:port" under a key, every rank
// fences (a barrier that also spreads what was put), the others get the key.
//
// libpmix is loaded at run time (dlopen of libpmix.so.2, the OpenPMIx soname since 2.x), never linked,
// as src/gpu loads CUDA: the same build then runs where no PMIx is installed (a container without
// Open MPI, the Python extension), and a process that also uses MPI shares the libpmix its libmpi
// loaded (already-loaded copies are taken first) instead of bringing a second one. The few PMIx
// structures used are declared here by layout; pmix_abi_check.cc compares them with pmix.h whenever
// the build machine has the headers (libpmix-dev).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "comm/launch_env.h"

namespace cohort::comm::pmix {

// The layout of the PMIx structures and constants this file uses (PMIx Standard v4; OpenPMIx 3 and
// later; checked against pmix.h by pmix_abi_check.cc).
namespace abi {
using Status = int;
using DataType = uint16_t;
using Rank = uint32_t;
using Scope = uint8_t;
constexpr size_t kMaxNsLen = 255;
constexpr size_t kMaxKeyLen = 511;
constexpr Rank kRankWildcard = UINT32_MAX - 1;
constexpr Status kSuccess = 0;
constexpr Status kErrTimeout = -24;
constexpr DataType kBool = 1;
constexpr DataType kString = 3;
constexpr DataType kInt = 6;
constexpr DataType kUint32 = 14;
constexpr Scope kGlobal = 3;
constexpr const char* kTimeoutKey = "pmix.timeout";      // PMIX_TIMEOUT (int seconds)
constexpr const char* kCollectData = "pmix.collect";     // PMIX_COLLECT_DATA (bool)
constexpr const char* kJobSize = "pmix.job.size";        // PMIX_JOB_SIZE (uint32)
constexpr const char* kLocalSize = "pmix.local.size";    // PMIX_LOCAL_SIZE (uint32)
constexpr const char* kLocalPeers = "pmix.lpeers";       // PMIX_LOCAL_PEERS (string "0,1,2")
constexpr const char* kHostname = "pmix.hname";          // PMIX_HOSTNAME (string)

struct Proc {
  char nspace[kMaxNsLen + 1];
  Rank rank;
};
struct Value {
  DataType type;
  union {
    bool flag;
    char* string;
    int integer;
    uint32_t uint32;
    unsigned char bytes[24];  // the largest member of PMIx's union (pmix_envar_t)
  } data;
};
struct Info {
  char key[kMaxKeyLen + 1];
  uint32_t flags;
  Value value;
};

struct Api {
  Status (*Init)(Proc* proc, Info info[], size_t ninfo);
  Status (*Finalize)(const Info info[], size_t ninfo);
  Status (*Put)(Scope scope, const char key[], Value* val);
  Status (*Commit)();
  Status (*Fence)(const Proc procs[], size_t nprocs, const Info info[], size_t ninfo);
  Status (*Get)(const Proc* proc, const char key[], const Info info[], size_t ninfo, Value** val);
  const char* (*Error_string)(Status status);
  const char* (*Get_version)();
};
}  // namespace abi

// libpmix, loaded once per process. nullptr, with `why_not` set, where it cannot be loaded.
const abi::Api* load(std::string* why_not);

// Under a PMIx launcher without MASTER_ADDR (`e.pmix`): connects to the job's PMIx server, checks that
// PMIx's rank and world size agree with `e`'s (and fills the world size when only PMIx knows it);
// rank 0 calls start_store(), which starts the store server and returns its port, and publishes its
// address and a fresh job token (unless COHORT_JOB_TOKEN gave one); every rank then has
// e.store_host / e.store_port / e.token. Each wait is bounded by `timeout`.
//
// The PMIx connection is opened once per process and ended at exit (PMIx_Finalize from an atexit
// handler), not after the exchange: Open MPI's MPI_Init fails in a process that already finalized PMIx,
// so a program that builds its communicator first and calls MPI_Init after needs it open.
// Throws ConfigError when libpmix is missing, no PMIx server answers, or PMIx contradicts the
// environment; TimeoutError when the server or a rank does not answer in time. One line each.
void exchange_store_address(LaunchEnv& e, std::chrono::milliseconds timeout,
                            const std::function<uint16_t()>& start_store);

}  // namespace cohort::comm::pmix
