#pragma once
// Two ways to copy into memory that another core reads next (shm::Group's staging slots).
//
// copy_cached: memcpy. The lines stay, modified, in this core's cache; the reader pulls them across
// cache to cache. Fast where the two cores share a cache or a quick interconnect.
// copy_streaming: non-temporal stores (x86 SSE2 movntdq; plain memcpy elsewhere). The lines go to
// memory without being read first or kept in this cache; the reader then fetches them from memory.
// Faster where cache-to-cache transfers are slow (cores on different dies or sockets, or vCPUs the
// host moves), or where the data is far larger than the cache and would only evict useful lines.
// docs/algorithms-shm.md, "Which copy the slots get", says how shm::Group chooses.
#include <cstddef>
#include <cstring>

namespace cohort::copy {

inline void copy_cached(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);  // 0 bytes may come with null pointers
}

// Ends with a store fence, so the data is visible to other cores before any later store (a flag).
void copy_streaming(void* dst, const void* src, size_t bytes);

}  // namespace cohort::copy
