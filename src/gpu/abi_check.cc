// Compiled only when CMake finds CUDA's and NCCL's headers (e.g. /usr/local/cuda*/include): checks
// that the declarations runtime.h loads with dlopen match the real ones, value by value and field by
// field. A mismatch is a build error here, not memory corruption on a GPU machine.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <type_traits>

#include "common/abi_same_arity.h"
#include "gpu/runtime.h"

// The real enums are compared with ours as integers.
#pragma GCC diagnostic ignored "-Wenum-compare"

namespace cohort::gpu {

static_assert(sizeof(cudaError_t) == sizeof(int));
static_assert(cudaSuccess == kCudaSuccess && cudaErrorNotReady == kCudaErrorNotReady);
static_assert(cudaMemcpyDefault == kCudaMemcpyDefault);
static_assert(cudaMemoryTypeUnregistered == kCudaMemoryUnregistered && cudaMemoryTypeHost == kCudaMemoryHost &&
              cudaMemoryTypeDevice == kCudaMemoryDevice && cudaMemoryTypeManaged == kCudaMemoryManaged);
static_assert(cudaEventDisableTiming == kCudaEventDisableTiming && cudaEventDefault == kCudaEventDefault);
static_assert(cudaStreamNonBlocking == kCudaStreamNonBlocking);
static_assert(sizeof(cudaStream_t) == sizeof(void*) && sizeof(cudaEvent_t) == sizeof(void*));
// Our attribute struct starts like CUDA's and is at least as large.
static_assert(offsetof(cudaPointerAttributes, type) == offsetof(CudaPointerAttributes, type));
static_assert(offsetof(cudaPointerAttributes, device) == offsetof(CudaPointerAttributes, device));
static_assert(offsetof(cudaPointerAttributes, devicePointer) == offsetof(CudaPointerAttributes, device_pointer));
static_assert(offsetof(cudaPointerAttributes, hostPointer) == offsetof(CudaPointerAttributes, host_pointer));
static_assert(sizeof(cudaPointerAttributes) <= sizeof(CudaPointerAttributes));

static_assert(sizeof(ncclResult_t) == sizeof(int) && sizeof(ncclDataType_t) == sizeof(int) &&
              sizeof(ncclRedOp_t) == sizeof(int));
static_assert(ncclSuccess == kNcclSuccess && ncclInProgress == kNcclInProgress);
static_assert(ncclInt8 == kNcclInt8 && ncclUint8 == kNcclUint8 && ncclInt32 == kNcclInt32 &&
              ncclUint32 == kNcclUint32 && ncclInt64 == kNcclInt64 && ncclUint64 == kNcclUint64 &&
              ncclFloat16 == kNcclFloat16 && ncclFloat32 == kNcclFloat32 && ncclFloat64 == kNcclFloat64 &&
              ncclBfloat16 == kNcclBfloat16);
static_assert(ncclSum == kNcclSum && ncclProd == kNcclProd && ncclMax == kNcclMax && ncclMin == kNcclMin &&
              ncclAvg == kNcclAvg);
static_assert(sizeof(ncclUniqueId) == sizeof(NcclUniqueId) && NCCL_UNIQUE_ID_BYTES == kNcclUniqueIdBytes);
static_assert(sizeof(ncclComm_t) == sizeof(void*));
// Our config is the 2.14 prefix of NCCL's: the same offsets, and no longer than the real one.
static_assert(NCCL_CONFIG_UNDEF_INT == kNcclConfigUndefInt);
static_assert(offsetof(ncclConfig_t, size) == offsetof(NcclConfig, size));
static_assert(offsetof(ncclConfig_t, magic) == offsetof(NcclConfig, magic));
static_assert(offsetof(ncclConfig_t, version) == offsetof(NcclConfig, version));
static_assert(offsetof(ncclConfig_t, blocking) == offsetof(NcclConfig, blocking));
static_assert(offsetof(ncclConfig_t, cgaClusterSize) == offsetof(NcclConfig, cga_cluster_size));
static_assert(offsetof(ncclConfig_t, minCTAs) == offsetof(NcclConfig, min_ctas));
static_assert(offsetof(ncclConfig_t, maxCTAs) == offsetof(NcclConfig, max_ctas));
static_assert(offsetof(ncclConfig_t, netName) == offsetof(NcclConfig, net_name));
static_assert(sizeof(NcclConfig) <= sizeof(ncclConfig_t));
constexpr ncclConfig_t kNcclDefaultConfig = NCCL_CONFIG_INITIALIZER;
static_assert(kNcclDefaultConfig.magic == NcclConfig{}.magic && kNcclDefaultConfig.blocking == NcclConfig{}.blocking);

// The same parameter lists (handles as void*, enums as int) as the real prototypes.
COHORT_SAME_ARITY(cudaGetDeviceCount, CudaApi{}.GetDeviceCount);
COHORT_SAME_ARITY(cudaSetDevice, CudaApi{}.SetDevice);
COHORT_SAME_ARITY(cudaGetDevice, CudaApi{}.GetDevice);
COHORT_SAME_ARITY(cudaFree, CudaApi{}.Free);
COHORT_SAME_ARITY(cudaFreeHost, CudaApi{}.FreeHost);
COHORT_SAME_ARITY(cudaMemcpy, CudaApi{}.Memcpy);
COHORT_SAME_ARITY(cudaMemcpyAsync, CudaApi{}.MemcpyAsync);
COHORT_SAME_ARITY(cudaMemsetAsync, CudaApi{}.MemsetAsync);
COHORT_SAME_ARITY(cudaStreamCreateWithFlags, CudaApi{}.StreamCreateWithFlags);
COHORT_SAME_ARITY(cudaStreamDestroy, CudaApi{}.StreamDestroy);
COHORT_SAME_ARITY(cudaStreamSynchronize, CudaApi{}.StreamSynchronize);
COHORT_SAME_ARITY(cudaStreamQuery, CudaApi{}.StreamQuery);
COHORT_SAME_ARITY(cudaStreamWaitEvent, CudaApi{}.StreamWaitEvent);
COHORT_SAME_ARITY(cudaEventCreateWithFlags, CudaApi{}.EventCreateWithFlags);
COHORT_SAME_ARITY(cudaEventRecord, CudaApi{}.EventRecord);
COHORT_SAME_ARITY(cudaEventQuery, CudaApi{}.EventQuery);
COHORT_SAME_ARITY(cudaEventElapsedTime, CudaApi{}.EventElapsedTime);
COHORT_SAME_ARITY(cudaEventDestroy, CudaApi{}.EventDestroy);
COHORT_SAME_ARITY(cudaPointerGetAttributes, CudaApi{}.PointerGetAttributes);
COHORT_SAME_ARITY(cudaDeviceGetPCIBusId, CudaApi{}.DeviceGetPCIBusId);
COHORT_SAME_ARITY(cudaDriverGetVersion, CudaApi{}.DriverGetVersion);
COHORT_SAME_ARITY(cudaRuntimeGetVersion, CudaApi{}.RuntimeGetVersion);
COHORT_SAME_ARITY(cudaGetLastError, CudaApi{}.GetLastError);
COHORT_SAME_ARITY(cudaGetErrorName, CudaApi{}.GetErrorName);
COHORT_SAME_ARITY(cudaGetErrorString, CudaApi{}.GetErrorString);
COHORT_SAME_ARITY(ncclGetVersion, NcclApi{}.GetVersion);
COHORT_SAME_ARITY(ncclGetUniqueId, NcclApi{}.GetUniqueId);
COHORT_SAME_ARITY(ncclCommInitRank, NcclApi{}.CommInitRank);
COHORT_SAME_ARITY(ncclCommInitRankConfig, NcclApi{}.CommInitRankConfig);
COHORT_SAME_ARITY(ncclCommInitAll, NcclApi{}.CommInitAll);
COHORT_SAME_ARITY(ncclCommDestroy, NcclApi{}.CommDestroy);
COHORT_SAME_ARITY(ncclCommAbort, NcclApi{}.CommAbort);
COHORT_SAME_ARITY(ncclCommGetAsyncError, NcclApi{}.CommGetAsyncError);
COHORT_SAME_ARITY(ncclGetErrorString, NcclApi{}.GetErrorString);
COHORT_SAME_ARITY(ncclGetLastError, NcclApi{}.GetLastError);
COHORT_SAME_ARITY(ncclAllReduce, NcclApi{}.AllReduce);
COHORT_SAME_ARITY(ncclBroadcast, NcclApi{}.Broadcast);
COHORT_SAME_ARITY(ncclReduce, NcclApi{}.Reduce);
COHORT_SAME_ARITY(ncclAllGather, NcclApi{}.AllGather);
COHORT_SAME_ARITY(ncclReduceScatter, NcclApi{}.ReduceScatter);
COHORT_SAME_ARITY(ncclSend, NcclApi{}.Send);
COHORT_SAME_ARITY(ncclRecv, NcclApi{}.Recv);
COHORT_SAME_ARITY(ncclGroupStart, NcclApi{}.GroupStart);
COHORT_SAME_ARITY(ncclGroupEnd, NcclApi{}.GroupEnd);

}  // namespace cohort::gpu
