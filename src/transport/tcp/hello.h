#pragma once
// The TCP transport's hello: each connection proves, in both directions, that its two ends hold the
// same job token, without the token on the wire (HMAC-SHA256 challenge-response, like the store's:
// store/auth.h).
//
//   dialer   -> acceptor  Hello     : magic, dialer rank, connection index, acceptor rank, scope hash, nonce_d
//   acceptor -> dialer    Challenge : magic, acceptor rank, nonce_a, mac(acceptor)
//   dialer   -> acceptor  Proof     : magic, mac(dialer)
//
// mac(role) = HMAC-SHA256(key = job token, message = "cohort-tcp-hello-v1" | role | scope | dialer rank |
// index | acceptor rank | nonce_d | nonce_a). Both nonces are fresh per connection, so a recorded proof
// is worth nothing on another connection; the scope (cohort/job/<id>/attempt/<n>/comm...) and both ranks
// are in the message, so a proof is worth nothing in another job, attempt, communicator or slot. The
// acceptor takes a slot (rank, index) only after a valid proof: whoever lacks the token can neither pose
// as a rank nor take a rank's place. The dialer checks the acceptor's mac before it sends anything
// else, and a wrong one (another job on that port, another token) fails it with one line.

#include <cstdint>
#include <string>
#include <string_view>

namespace cohort::transport::hello {

constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;

enum class Role : uint8_t { kAcceptor = 'A', kDialer = 'D' };

struct Fields {
  std::string_view scope;  // the communicator's job scope (TransportOptions::job_scope)
  uint32_t dialer = 0;
  uint32_t index = 0;  // which of the dialer's connections to the acceptor
  uint32_t acceptor = 0;
  std::string_view dialer_nonce;
  std::string_view acceptor_nonce;
};

// kNonceBytes from OpenSSL's CSPRNG.
std::string make_nonce();
// The kMacBytes proof of `role` for the connection described by `f`.
std::string mac(std::string_view token, Role role, const Fields& f);
// Constant-time comparison of a received proof with the expected one.
bool verify(std::string_view token, Role role, const Fields& f, const void* received);

}  // namespace cohort::transport::hello
