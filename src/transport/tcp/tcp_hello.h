#pragma once
// The TCP transport's hello: the first 24 bytes a rank sends on each connection it dials to a higher
// rank (tcp_transport.cc), read by the accepting rank before it takes the connection. Kept apart from
// the transport so that its check is a pure function, fuzzed by fuzz/tcp_hello_fuzz.cc.
//
// What a hello proves today: that the dialer knows the job's scope hash, its own rank below the
// acceptor's and a connection index. Nothing in it is secret (docs/security.md, "The network: data
// plane and stores").

#include <cstddef>
#include <cstdint>
#include <string>

namespace cohort::transport::tcp_hello {

inline constexpr uint32_t kMagic = 0x31484843;  // "CHH1"

struct Hello {
  uint32_t magic;
  uint32_t rank;    // the dialing rank
  uint32_t index;   // which of its connections to the acceptor this is
  uint32_t reserved;
  uint64_t scope;   // the job's (communicator's) scope hash
};
static_assert(sizeof(Hello) == 24, "TCP hello layout");

Hello make(int rank, int index, uint64_t scope);

// Checks the `n` bytes a connecting peer sent first, as rank `self` of a transport with `connections`
// connections per peer and scope hash `scope` reads them: empty when they are a hello of this scope from
// a lower rank (0 <= rank < self) with an index below `connections`, else why not (one line, for the log).
// `*out` gets the hello whenever `n` is a hello's size.
std::string check(const void* data, size_t n, uint64_t scope, int self, int connections, Hello* out);

}  // namespace cohort::transport::tcp_hello
