#pragma once
// Job-token authentication of store connections: HMAC-SHA256 challenge-response (OpenSSL).
//
// The server sends a fresh random nonce; the client answers HMAC-SHA256(key = token,
// message = "cohort-store-auth-v1" || nonce). The server recomputes it and compares in constant
// time. The token itself never travels; a recorded proof is useless for another nonce.

#include <string>
#include <string_view>

namespace cohort::store_auth {

// kNonceSize random bytes from OpenSSL's CSPRNG.
std::string make_nonce();
// The client's proof for `nonce` (32 bytes).
std::string proof(std::string_view token, std::string_view nonce);
// Constant-time check of a client's proof.
bool verify(std::string_view token, std::string_view nonce, std::string_view client_proof);

}  // namespace cohort::store_auth
