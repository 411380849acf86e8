#include "store/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "cohort/error.h"
#include "store/protocol.h"

namespace cohort::store_auth {

namespace {
constexpr std::string_view kContext = "cohort-store-auth-v1";
}

std::string make_nonce() {
  std::string nonce(proto::kNonceSize, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) != 1) {
    throw Error("store: OpenSSL RAND_bytes failed to produce a nonce");
  }
  return nonce;
}

std::string proof(std::string_view token, std::string_view nonce) {
  std::string message;
  message.reserve(kContext.size() + nonce.size());
  message.append(kContext).append(nonce);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &len) == nullptr) {
    throw Error("store: OpenSSL HMAC-SHA256 failed");
  }
  return std::string(reinterpret_cast<const char*>(mac), len);
}

bool verify(std::string_view token, std::string_view nonce, std::string_view client_proof) {
  std::string expected = proof(token, nonce);
  return client_proof.size() == expected.size() &&
         CRYPTO_memcmp(expected.data(), client_proof.data(), expected.size()) == 0;
}

}  // namespace cohort::store_auth
