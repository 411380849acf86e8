// The hello's messages and the check of what a connecting process sends first: pure functions (no I/O,
// no OpenSSL), so that fuzz/tcp_hello_fuzz.cc builds them alone. The macs are in tcp_hello_mac.cc.
#include "transport/tcp/tcp_hello.h"

#include <algorithm>
#include <cstring>

#include <fmt/core.h>

namespace cohort::transport::tcp_hello {

Hello make(int rank, int index, int acceptor, uint64_t scope, std::string_view nonce) {
  Hello h{kHelloMagic, static_cast<uint32_t>(rank), static_cast<uint32_t>(index), static_cast<uint32_t>(acceptor),
          scope, {}};
  std::memcpy(h.nonce, nonce.data(), std::min(nonce.size(), sizeof h.nonce));
  return h;
}

std::string check(const void* data, size_t n, uint64_t scope, int self, int connections, Hello* out) {
  if (n != sizeof(Hello)) return fmt::format("a hello of {} bytes (expected {})", n, sizeof(Hello));
  Hello h;
  std::memcpy(&h, data, sizeof h);
  *out = h;
  if (h.magic != kHelloMagic)
    return fmt::format("not a cohort TCP hello of this version (magic {:#x}; another job, an older cohort, or not "
                       "cohort)",
                       h.magic);
  if (h.scope != scope) return fmt::format("a hello of another job or communicator (scope {:#x})", h.scope);
  // Unsigned comparisons: a rank or index read as a negative int would pass a signed one and then
  // index the acceptor's tables out of bounds.
  if (self <= 0 || h.rank >= static_cast<uint32_t>(self))
    return fmt::format("a hello from rank {} (only ranks below {} dial this one)", h.rank, self);
  if (h.acceptor != static_cast<uint32_t>(self))
    return fmt::format("a hello for rank {} (this is rank {})", h.acceptor, self);
  if (connections <= 0 || h.index >= static_cast<uint32_t>(connections))
    return fmt::format("a hello for connection {} (this transport has {} per peer)", h.index, connections);
  return {};
}

}  // namespace cohort::transport::tcp_hello
