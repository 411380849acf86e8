#pragma once
// The CUDA runtime and NCCL, loaded at run time (dlopen), never linked.
//
// Why not link: a `cohort` binary linked against libcudart and libnccl would not even start on the
// CPU machines that are most of its users, and a GPU machine's libraries are often not where the build
// machine had them (pip wheels put NCCL under site-packages/nvidia/nccl/lib). Loading them when a GPU
// buffer first shows up lets one build serve both, and lets a missing library be one clear line
// ("NCCL not found: tried ...") instead of a loader error before main().
//
// The few C functions used are declared here with plain types (pointers for handles, int for enums).
// These functions and values have not changed since CUDA 11 and NCCL 2.10; when the real headers are
// found at build time, abi_check.cc compares every value and struct layout with them (CI does).
//
// Where the libraries are looked for, in order: COHORT_CUDA_RUNTIME / COHORT_NCCL_LIBRARY (a path);
// a copy the process has loaded already (torch's); the loader's own search (LD_LIBRARY_PATH, ld.so
// cache); $CUDA_HOME/lib64, /usr/local/cuda/lib64, and the CUDA folder found when cohort was built.

#include <cstddef>
#include <string>

namespace cohort::gpu {

// cudaError_t values used by name.
inline constexpr int kCudaSuccess = 0;
inline constexpr int kCudaErrorNotReady = 600;
inline constexpr int kCudaErrorInsufficientDriver = 35;  // no driver at all, or one older than the runtime
inline constexpr int kCudaErrorNoDevice = 100;
// cudaMemcpyKind: cudaMemcpyDefault (direction inferred from unified virtual addressing).
inline constexpr int kCudaMemcpyDefault = 4;
// cudaMemoryType.
inline constexpr int kCudaMemoryUnregistered = 0, kCudaMemoryHost = 1, kCudaMemoryDevice = 2, kCudaMemoryManaged = 3;
inline constexpr unsigned kCudaEventDefault = 0x00, kCudaEventDisableTiming = 0x02;
// cudaStreamCreateWithFlags: a stream that does not synchronise with the legacy default stream.
inline constexpr unsigned kCudaStreamNonBlocking = 0x01;

// cudaPointerAttributes: the four fields every version has, then room for the ones CUDA 13 added
// (`long reserved[8]`), so that a newer runtime never writes past the end.
struct CudaPointerAttributes {
  int type = 0;
  int device = 0;
  void* device_pointer = nullptr;
  void* host_pointer = nullptr;
  long reserved[16] = {};
};

struct CudaApi {
  int (*GetDeviceCount)(int* count);
  int (*SetDevice)(int device);
  int (*GetDevice)(int* device);
  int (*Malloc)(void** ptr, size_t bytes);
  int (*Free)(void* ptr);
  int (*MallocHost)(void** ptr, size_t bytes);
  int (*FreeHost)(void* ptr);
  int (*Memcpy)(void* dst, const void* src, size_t bytes, int kind);
  int (*MemcpyAsync)(void* dst, const void* src, size_t bytes, int kind, void* stream);
  int (*MemsetAsync)(void* dst, int value, size_t bytes, void* stream);
  int (*StreamCreateWithFlags)(void** stream, unsigned flags);
  int (*StreamDestroy)(void* stream);
  int (*StreamSynchronize)(void* stream);
  int (*StreamQuery)(void* stream);
  int (*StreamWaitEvent)(void* stream, void* event, unsigned flags);
  int (*EventCreateWithFlags)(void** event, unsigned flags);
  int (*EventRecord)(void* event, void* stream);
  int (*EventQuery)(void* event);
  int (*EventElapsedTime)(float* ms, void* start, void* end);
  int (*EventDestroy)(void* event);
  int (*PointerGetAttributes)(CudaPointerAttributes* attributes, const void* ptr);
  int (*DeviceGetPCIBusId)(char* bus_id, int len, int device);
  int (*DriverGetVersion)(int* version);
  int (*RuntimeGetVersion)(int* version);
  int (*GetLastError)();
  const char* (*GetErrorName)(int error);
  const char* (*GetErrorString)(int error);
};

// ncclResult_t values, ncclDataType_t and ncclRedOp_t as NCCL numbers them.
inline constexpr int kNcclSuccess = 0;
inline constexpr int kNcclInProgress = 7;
inline constexpr int kNcclConfigUndefInt = -2147483647 - 1;  // NCCL_CONFIG_UNDEF_INT (INT_MIN): NCCL's default
enum NcclDataType : int {
  kNcclInt8 = 0, kNcclUint8 = 1, kNcclInt32 = 2, kNcclUint32 = 3, kNcclInt64 = 4, kNcclUint64 = 5,
  kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclFloat64 = 8, kNcclBfloat16 = 9,
};
enum NcclRedOp : int { kNcclSum = 0, kNcclProd = 1, kNcclMax = 2, kNcclMin = 3, kNcclAvg = 4 };
inline constexpr size_t kNcclUniqueIdBytes = 128;
struct NcclUniqueId {
  char internal[kNcclUniqueIdBytes];
};

// ncclConfig_t as NCCL 2.14 laid it out (the first version with it). NCCL reads `size` bytes of it and
// keeps its defaults for the fields a newer NCCL added, so this prefix is a valid config for every
// NCCL >= 2.14. Only `blocking` is set by cohort: 0 makes the communicator non-blocking (below).
struct NcclConfig {
  size_t size = sizeof(NcclConfig);
  unsigned int magic = 0xcafebeef;  // what NCCL_CONFIG_INITIALIZER sets; NCCL refuses a config without it
  unsigned int version = 21400;     // NCCL_VERSION(2, 14, 0): the fields below are that version's
  int blocking = kNcclConfigUndefInt;
  int cga_cluster_size = kNcclConfigUndefInt;
  int min_ctas = kNcclConfigUndefInt;
  int max_ctas = kNcclConfigUndefInt;
  const char* net_name = nullptr;
};

struct NcclApi {
  int (*GetVersion)(int* version);
  int (*GetUniqueId)(NcclUniqueId* id);
  int (*CommInitRank)(void** comm, int nranks, NcclUniqueId id, int rank);
  // NCCL >= 2.14; null before. With config.blocking = 0 every call on the communicator returns at
  // once (ncclInProgress while it works), which is what lets a watchdog abort it (see
  // nccl_calls.cc).
  int (*CommInitRankConfig)(void** comm, int nranks, NcclUniqueId id, int rank, NcclConfig* config);
  int (*CommInitAll)(void** comms, int ndev, const int* devices);
  int (*CommDestroy)(void* comm);
  int (*CommAbort)(void* comm);
  int (*CommGetAsyncError)(void* comm, int* error);
  const char* (*GetErrorString)(int result);
  const char* (*GetLastError)(void* comm);  // NCCL >= 2.13; null before
  int (*AllReduce)(const void* send, void* recv, size_t count, int dtype, int op, void* comm, void* stream);
  int (*Broadcast)(const void* send, void* recv, size_t count, int dtype, int root, void* comm, void* stream);
  int (*Reduce)(const void* send, void* recv, size_t count, int dtype, int op, int root, void* comm, void* stream);
  int (*AllGather)(const void* send, void* recv, size_t count, int dtype, void* comm, void* stream);
  int (*ReduceScatter)(const void* send, void* recv, size_t count, int dtype, int op, void* comm, void* stream);
  int (*Send)(const void* send, size_t count, int dtype, int peer, void* comm, void* stream);
  int (*Recv)(void* recv, size_t count, int dtype, int peer, void* comm, void* stream);
  int (*GroupStart)();
  int (*GroupEnd)();
};

// A loaded library: the table, where it came from, or why it could not be loaded.
template <typename Api>
struct Loaded {
  const Api* api = nullptr;  // null when not loaded
  std::string path;          // the file dlopen took (or the name it was asked for)
  std::string why_not;       // one line: what was tried and what failed
};

// Loaded once per process, on first call; never throws.
const Loaded<CudaApi>& cuda_runtime();
const Loaded<NcclApi>& nccl();

// The CUDA runtime's table, or ConfigError "no CUDA runtime: <why>".
const CudaApi& cuda();
// The NCCL table, or ConfigError "NCCL not found: <why>".
const NcclApi& nccl_api();

// "cudaErrorInsufficientDriver (CUDA driver version is insufficient for CUDA runtime version)".
std::string cuda_error_text(int error);
// Throws cohort::Error "<what>: <cuda_error_text>" when error != 0.
void check_cuda(int error, const std::string& what);
// "unhandled system error (NCCL: <last error>)".
std::string nccl_error_text(int result, void* comm = nullptr);

// 12040 -> "12.4"; NCCL's 22809 -> "2.28.9" (nccl_version_text).
std::string cuda_version_text(int version);
std::string nccl_version_text(int version);

}  // namespace cohort::gpu
