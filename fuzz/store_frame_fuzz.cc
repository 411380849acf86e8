// libFuzzer target: the store's frame decoder and request/handshake parsers (src/store/protocol.cc),
// fed arbitrary bytes as a stream of frames, exactly as the server reads a connection.
// Invariants checked beyond "no crash, no sanitizer report":
//  - a decoded frame never claims more bytes than it was given, nor a length above the limit;
//  - every request that parses re-encodes to exactly the same bytes (the encoding is canonical),
//    so the decoder accepts nothing that the encoder would write differently.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "store/protocol.h"

using namespace cohort::proto;

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

std::vector<std::string> strings(const std::vector<std::string_view>& views) {
  return std::vector<std::string>(views.begin(), views.end());
}

std::string reencode(const Request& r) {
  std::string out;
  switch (r.op) {
    case Op::kSet: encode_set(out, r.id, r.key, r.value); break;
    case Op::kGet: encode_get(out, r.id, r.key, r.timeout_ms); break;
    case Op::kAdd: encode_add(out, r.id, r.key, r.delta); break;
    case Op::kCompareSet: encode_compare_set(out, r.id, r.key, r.expected, r.value); break;
    case Op::kDelete: encode_delete(out, r.id, r.key); break;
    case Op::kNumKeys: encode_num_keys(out, r.id); break;
    case Op::kCheck:
    case Op::kMultiGet:
    case Op::kWait: encode_keys(out, r.op, r.id, strings(r.keys), r.timeout_ms); break;
    case Op::kMultiSet: encode_multi_set(out, r.id, strings(r.keys), strings(r.values)); break;
    case Op::kLease: encode_lease(out, r.id, r.timeout_ms, strings(r.keys), strings(r.values)); break;
    case Op::kFence: encode_fence(out, r.id, r.key, r.delta); break;
    default: check(false);
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr uint32_t kMax = 1 << 16;
  const char* bytes = reinterpret_cast<const char*>(data);
  size_t off = 0;
  Request request;
  std::string error;
  while (off < size) {
    FrameView frame;
    DecodeResult d = decode_frame(bytes + off, size - off, kMax, &frame);
    if (d.status != DecodeStatus::kFrame) {
      if (d.status == DecodeStatus::kBad) check(d.length < kMinLength || d.length > kMax);
      break;
    }
    check(d.consumed >= kHeaderSize && d.consumed <= size - off && d.length <= kMax);
    check(frame.payload.size() == d.consumed - kHeaderSize);
    if (parse_request(frame, &request, &error)) {
      check(is_request(frame.op));
      std::string again = reencode(request);
      check(again.size() == d.consumed && std::memcmp(again.data(), bytes + off, again.size()) == 0);
    } else {
      check(!error.empty());
    }
    Challenge challenge;
    parse_challenge(frame.payload, &challenge);
    Hello hello;
    if (parse_hello(frame.payload, &hello)) {
      std::string again;
      // The id of a handshake frame is not part of what parse_hello checks; compare the payloads.
      encode_hello(again, hello.proof);
      if (hello.magic == kMagic && hello.version == kVersion) {
        check(again.size() == d.consumed && std::memcmp(again.data() + kHeaderSize, frame.payload.data(),
                                                        frame.payload.size()) == 0);
      }
    }
    // A notice request (read before authentication): one string, re-encoded to the same payload.
    std::string_view notice_name;
    if (parse_notice(frame.payload, &notice_name)) {
      std::string again;
      encode_notice(again, notice_name);
      check(again.size() == frame.payload.size() + kHeaderSize &&
            std::memcmp(again.data() + kHeaderSize, frame.payload.data(), frame.payload.size()) == 0);
    }
    // Replies as the client reads them.
    Reader reader(frame.payload);
    reader.u32();
    uint32_t n = reader.count(4);
    for (uint32_t i = 0; i < n && reader.ok(); ++i) reader.bytes();
    off += d.consumed;
  }
  return 0;
}
