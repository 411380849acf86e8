// Compiled only when CMake finds CUDA's and NCCL's headers (e.g. /usr/local/cuda*/include): checks
// that the declarations runtime.h loads with dlopen match the real ones, value by value and field by
// field. A mismatch is a build error here, not memory corruption on a GPU machine.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <type_traits>

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
template <typename Real, typename Ours>
constexpr bool same_arity = false;
template <typename R1, typename... A1, typename R2, typename... A2>
constexpr bool same_arity<R1 (*)(A1...), R2 (*)(A2...)> =
    sizeof...(A1) == sizeof...(A2) && ((sizeof(A1) == sizeof(A2)) && ...) && sizeof(R1) == sizeof(R2);
#define COHORT_SAME(real, ours) static_assert(same_arity<decltype(&real), decltype(ours)>, #real)
COHORT_SAME(cudaGetDeviceCount, CudaApi{}.GetDeviceCount);
COHORT_SAME(cudaSetDevice, CudaApi{}.SetDevice);
COHORT_SAME(cudaGetDevice, CudaApi{}.GetDevice);
COHORT_SAME(cudaFree, CudaApi{}.Free);
COHORT_SAME(cudaFreeHost, CudaApi{}.FreeHost);
COHORT_SAME(cudaMemcpy, CudaApi{}.Memcpy);
COHORT_SAME(cudaMemcpyAsync, CudaApi{}.MemcpyAsync);
COHORT_SAME(cudaMemsetAsync, CudaApi{}.MemsetAsync);
COHORT_SAME(cudaStreamCreateWithFlags, CudaApi{}.StreamCreateWithFlags);
COHORT_SAME(cudaStreamDestroy, CudaApi{}.StreamDestroy);
COHORT_SAME(cudaStreamSynchronize, CudaApi{}.StreamSynchronize);
COHORT_SAME(cudaStreamQuery, CudaApi{}.StreamQuery);
COHORT_SAME(cudaStreamWaitEvent, CudaApi{}.StreamWaitEvent);
COHORT_SAME(cudaEventCreateWithFlags, CudaApi{}.EventCreateWithFlags);
COHORT_SAME(cudaEventRecord, CudaApi{}.EventRecord);
COHORT_SAME(cudaEventQuery, CudaApi{}.EventQuery);
COHORT_SAME(cudaEventElapsedTime, CudaApi{}.EventElapsedTime);
COHORT_SAME(cudaEventDestroy, CudaApi{}.EventDestroy);
COHORT_SAME(cudaPointerGetAttributes, CudaApi{}.PointerGetAttributes);
COHORT_SAME(cudaDeviceGetPCIBusId, CudaApi{}.DeviceGetPCIBusId);
COHORT_SAME(cudaDriverGetVersion, CudaApi{}.DriverGetVersion);
COHORT_SAME(cudaRuntimeGetVersion, CudaApi{}.RuntimeGetVersion);
COHORT_SAME(cudaGetLastError, CudaApi{}.GetLastError);
COHORT_SAME(cudaGetErrorName, CudaApi{}.GetErrorName);
COHORT_SAME(cudaGetErrorString, CudaApi{}.GetErrorString);
COHORT_SAME(ncclGetVersion, NcclApi{}.GetVersion);
COHORT_SAME(ncclGetUniqueId, NcclApi{}.GetUniqueId);
COHORT_SAME(ncclCommInitRank, NcclApi{}.CommInitRank);
COHORT_SAME(ncclCommInitRankConfig, NcclApi{}.CommInitRankConfig);
COHORT_SAME(ncclCommInitAll, NcclApi{}.CommInitAll);
COHORT_SAME(ncclCommDestroy, NcclApi{}.CommDestroy);
COHORT_SAME(ncclCommAbort, NcclApi{}.CommAbort);
COHORT_SAME(ncclCommGetAsyncError, NcclApi{}.CommGetAsyncError);
COHORT_SAME(ncclGetErrorString, NcclApi{}.GetErrorString);
COHORT_SAME(ncclGetLastError, NcclApi{}.GetLastError);
COHORT_SAME(ncclAllReduce, NcclApi{}.AllReduce);
COHORT_SAME(ncclBroadcast, NcclApi{}.Broadcast);
COHORT_SAME(ncclReduce, NcclApi{}.Reduce);
COHORT_SAME(ncclAllGather, NcclApi{}.AllGather);
COHORT_SAME(ncclReduceScatter, NcclApi{}.ReduceScatter);
COHORT_SAME(ncclSend, NcclApi{}.Send);
COHORT_SAME(ncclRecv, NcclApi{}.Recv);
COHORT_SAME(ncclGroupStart, NcclApi{}.GroupStart);
COHORT_SAME(ncclGroupEnd, NcclApi{}.GroupEnd);
#undef COHORT_SAME

}  // namespace cohort::gpu
