#include "common/copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <emmintrin.h>
#endif

namespace cohort::copy {

void copy_streaming(void* dst_v, const void* src_v, size_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  auto* dst = static_cast<char*>(dst_v);
  const auto* src = static_cast<const char*>(src_v);
  // Head: up to the first 16-byte boundary of the destination (movntdq needs aligned stores).
  const size_t head = std::min(bytes, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  if (head) std::memcpy(dst, src, head);
  dst += head, src += head, bytes -= head;
  const size_t body = bytes & ~size_t{63};
  for (size_t i = 0; i < body; i += 64) {  // a line per iteration: 4 loads, 4 streaming stores
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  if (bytes > body) std::memcpy(dst + body, src + body, bytes - body);
  // Streaming stores are weakly ordered: make them visible before the caller posts its flag.
  _mm_sfence();
#else
  if (bytes) std::memcpy(dst_v, src_v, bytes);
#endif
}

}  // namespace cohort::copy
