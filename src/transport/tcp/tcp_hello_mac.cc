// The hello's nonces and macs (OpenSSL): tcp_hello.h has the protocol.
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "cohort/error.h"
#include "transport/tcp/tcp_hello.h"

namespace cohort::transport::tcp_hello {

namespace {
constexpr std::string_view kContext = "cohort-tcp-hello-v1";

void append_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(char((v >> (8 * i)) & 0xff));
}
}  // namespace

std::string make_nonce() {
  std::string nonce(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), int(nonce.size())) != 1)
    throw Error("tcp transport: OpenSSL RAND_bytes failed to produce a nonce");
  return nonce;
}

std::string mac(std::string_view token, Role role, const Fields& f) {
  // Every variable-length field is preceded by its length, so that no two field lists make one message.
  std::string m;
  m.reserve(kContext.size() + f.scope.size() + 64);
  m.append(kContext);
  m.push_back(char(role));
  append_u32(m, uint32_t(f.scope.size()));
  m.append(f.scope);
  append_u32(m, f.dialer);
  append_u32(m, f.index);
  append_u32(m, f.acceptor);
  append_u32(m, uint32_t(f.dialer_nonce.size()));
  m.append(f.dialer_nonce);
  append_u32(m, uint32_t(f.acceptor_nonce.size()));
  m.append(f.acceptor_nonce);
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), token.data(), int(token.size()), reinterpret_cast<const unsigned char*>(m.data()), m.size(),
           out, &len) == nullptr ||
      len != kMacBytes)
    throw Error("tcp transport: OpenSSL HMAC-SHA256 failed");
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool verify(std::string_view token, Role role, const Fields& f, const void* received) {
  const std::string expected = mac(token, role, f);
  return CRYPTO_memcmp(expected.data(), received, kMacBytes) == 0;
}

}  // namespace cohort::transport::tcp_hello
