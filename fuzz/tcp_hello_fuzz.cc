// libFuzzer target: the TCP transport's hello check (transport::tcp_hello::check, src/transport/tcp/
// tcp_hello.cc), which an accepting rank runs on the first bytes any host's process sends to its port.
// The input is the acceptor's situation (its rank, connections per peer, scope hash: 16 bytes), then
// the bytes the connecting peer sent.
// Invariants checked beyond "no crash, no sanitizer report":
//  - a hello that is accepted names a rank below the acceptor's, the acceptor, and an index below its
//    connections, with the acceptor's scope (so the acceptor's tables indexed by them are in bounds);
//  - a refusal says why (one line);
//  - the hello that a dialer of this situation makes is accepted.
#include <cstdint>
#include <cstring>
#include <string>

#include "transport/tcp/tcp_hello.h"

using namespace cohort::transport;

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 16) return 0;
  int32_t self;
  uint32_t connections;
  uint64_t scope;
  std::memcpy(&self, data, 4);
  std::memcpy(&connections, data + 4, 4);
  std::memcpy(&scope, data + 8, 8);
  connections %= 65;  // 0 to 64, as COHORT_TCP_CONNECTIONS allows (and 0, which no transport has)
  tcp_hello::Hello h{};
  const std::string why = tcp_hello::check(data + 16, size - 16, scope, self, int(connections), &h);
  if (why.empty()) {
    check(size - 16 == sizeof h);
    check(self > 0 && h.rank < uint32_t(self) && h.index < connections && h.acceptor == uint32_t(self));
    check(h.magic == tcp_hello::kHelloMagic && h.scope == scope);
  } else {
    check(why.find('\n') == std::string::npos);
  }
  // What a lower rank of this job sends is accepted.
  if (self > 0 && connections > 0) {
    const std::string nonce(tcp_hello::kNonceBytes, 'n');
    tcp_hello::Hello mine = tcp_hello::make(self - 1, int(connections) - 1, self, scope, nonce), read{};
    check(tcp_hello::check(&mine, sizeof mine, scope, self, int(connections), &read).empty());
    check(std::memcmp(&mine, &read, sizeof mine) == 0);
  }
  return 0;
}
