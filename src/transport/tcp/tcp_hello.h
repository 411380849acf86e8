#pragma once
// The TCP transport's hello: how each connection between two ranks proves, in both directions, that its
// ends hold the same job token, without the token on the wire (HMAC-SHA256 challenge-response, like the
// store's: store/auth.h). Kept apart from the transport (tcp_transport.cc) so that the check of what a
// connecting process sends first is a pure function, fuzzed by fuzz/tcp_hello_fuzz.cc.
//
//   dialer   -> acceptor  Hello     : magic, dialer rank, connection index, acceptor rank, scope hash, nonce_d
//   acceptor -> dialer    Challenge : magic, acceptor rank, nonce_a, mac(acceptor)
//   dialer   -> acceptor  Proof     : magic, mac(dialer)
//
// mac(role) = HMAC-SHA256(key = job token, message = "cohort-tcp-hello-v1" | role | scope | dialer rank |
// index | acceptor rank | nonce_d | nonce_a). Both nonces are fresh per connection, so a recorded proof
// is worth nothing on another connection; the scope (cohort/job/<id>/attempt/<n>/comm...) and both ranks
// are in the message, so a proof is worth nothing in another job, attempt, communicator or slot. The
// acceptor gives a connection a rank's slot only after a valid Proof: whoever lacks the token can neither
// pose as a rank nor take a rank's place. The dialer checks the acceptor's mac before it sends anything
// else, and a wrong one (another job on that port, another token) fails it with one line.
// docs/security.md, "The network: data plane and stores".

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace cohort::transport::tcp_hello {

inline constexpr uint32_t kHelloMagic = 0x32484843;      // "CHH2"
inline constexpr uint32_t kChallengeMagic = 0x32434843;  // "CHC2"
inline constexpr uint32_t kProofMagic = 0x32504843;      // "CHP2"
inline constexpr size_t kNonceBytes = 16;
inline constexpr size_t kMacBytes = 32;

struct Hello {
  uint32_t magic;
  uint32_t rank;      // the dialing rank
  uint32_t index;     // which of its connections to the acceptor this is
  uint32_t acceptor;  // the rank the dialer means to reach
  uint64_t scope;     // the communicator's scope hash: a quick refusal of another communicator's dialer
  char nonce[kNonceBytes];
};
struct Challenge {
  uint32_t magic;
  uint32_t rank;  // the acceptor's
  char nonce[kNonceBytes];
  char mac[kMacBytes];
};
struct Proof {
  uint32_t magic;
  uint32_t reserved;
  char mac[kMacBytes];
};
static_assert(sizeof(Hello) == 40 && sizeof(Challenge) == 56 && sizeof(Proof) == 40, "TCP hello layout");

// kNonceBytes from OpenSSL's CSPRNG.
std::string make_nonce();

Hello make(int rank, int index, int acceptor, uint64_t scope, std::string_view nonce);

// Checks the `n` bytes a connecting peer sent first, as rank `self` of a transport with `connections`
// connections per peer and scope hash `scope` reads them: empty when they are a Hello of this scope from
// a lower rank (0 <= rank < self) to `self` with an index below `connections`, else why not (one line,
// for the log). `*out` gets the hello whenever `n` is a hello's size.
std::string check(const void* data, size_t n, uint64_t scope, int self, int connections, Hello* out);

enum class Role : uint8_t { kAcceptor = 'A', kDialer = 'D' };

// What a mac covers besides the role.
struct Fields {
  std::string_view scope;  // the communicator's job scope (TransportOptions::job_scope)
  uint32_t dialer = 0;
  uint32_t index = 0;
  uint32_t acceptor = 0;
  std::string_view dialer_nonce;
  std::string_view acceptor_nonce;
};

// The kMacBytes proof of `role` for the connection described by `f`.
std::string mac(std::string_view token, Role role, const Fields& f);
// Constant-time comparison of a received proof (kMacBytes at `received`) with the expected one.
bool verify(std::string_view token, Role role, const Fields& f, const void* received);

}  // namespace cohort::transport::tcp_hello
