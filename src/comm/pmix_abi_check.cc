// Compiled only when CMake finds PMIx's headers (libpmix-dev): checks that the declarations pmix.h loads
// libpmix with match the real ones. A mismatch is a build error here, not a corrupted exchange under mpirun.
#include <pmix.h>

#include <cstddef>
#include <cstring>
#include <type_traits>

#include "comm/pmix.h"
#include "common/abi_same_arity.h"

namespace cohort::comm::pmix::abi {

static_assert(std::is_same_v<pmix_status_t, Status> && std::is_same_v<pmix_data_type_t, DataType> &&
              std::is_same_v<pmix_rank_t, Rank> && std::is_same_v<pmix_scope_t, Scope>);
static_assert(PMIX_MAX_NSLEN == kMaxNsLen && PMIX_MAX_KEYLEN == kMaxKeyLen);
static_assert(PMIX_RANK_WILDCARD == kRankWildcard);
static_assert(PMIX_SUCCESS == kSuccess && PMIX_ERR_TIMEOUT == kErrTimeout);
static_assert(PMIX_BOOL == kBool && PMIX_STRING == kString && PMIX_INT == kInt && PMIX_UINT32 == kUint32);
static_assert(PMIX_GLOBAL == kGlobal);

constexpr bool same(const char* a, const char* b) { return std::char_traits<char>::compare(a, b, std::char_traits<char>::length(b) + 1) == 0; }
static_assert(same(PMIX_TIMEOUT, kTimeoutKey) && same(PMIX_COLLECT_DATA, kCollectData));
static_assert(same(PMIX_JOB_SIZE, kJobSize) && same(PMIX_LOCAL_SIZE, kLocalSize));
static_assert(same(PMIX_LOCAL_PEERS, kLocalPeers) && same(PMIX_HOSTNAME, kHostname));

static_assert(sizeof(pmix_proc_t) == sizeof(Proc) && offsetof(pmix_proc_t, nspace) == offsetof(Proc, nspace) &&
              offsetof(pmix_proc_t, rank) == offsetof(Proc, rank));
static_assert(sizeof(pmix_value_t) == sizeof(Value) && offsetof(pmix_value_t, type) == offsetof(Value, type) &&
              offsetof(pmix_value_t, data) == offsetof(Value, data) &&
              sizeof(pmix_value_t::data) == sizeof(Value::data));
// Arrays of pmix_info_t are passed (the fence's), so the size must match exactly.
static_assert(sizeof(pmix_info_t) == sizeof(Info) && offsetof(pmix_info_t, key) == offsetof(Info, key) &&
              offsetof(pmix_info_t, flags) == offsetof(Info, flags) &&
              offsetof(pmix_info_t, value) == offsetof(Info, value));

// The same parameter lists as the real prototypes (sizes of each parameter and of the result).
COHORT_SAME_ARITY(PMIx_Init, Api{}.Init);
COHORT_SAME_ARITY(PMIx_Finalize, Api{}.Finalize);
COHORT_SAME_ARITY(PMIx_Put, Api{}.Put);
COHORT_SAME_ARITY(PMIx_Commit, Api{}.Commit);
COHORT_SAME_ARITY(PMIx_Fence, Api{}.Fence);
COHORT_SAME_ARITY(PMIx_Get, Api{}.Get);
COHORT_SAME_ARITY(PMIx_Error_string, Api{}.Error_string);
COHORT_SAME_ARITY(PMIx_Get_version, Api{}.Get_version);

}  // namespace cohort::comm::pmix::abi
