#include "store/protocol.h"

#include <cstring>
#include <limits>

namespace cohort::proto {

namespace {

uint32_t load_u32(const char* p) {
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 | static_cast<uint32_t>(b[2]) << 16 |
         static_cast<uint32_t>(b[3]) << 24;
}

void store_u32(char* p, uint32_t v) {
  p[0] = static_cast<char>(v & 0xff);
  p[1] = static_cast<char>((v >> 8) & 0xff);
  p[2] = static_cast<char>((v >> 16) & 0xff);
  p[3] = static_cast<char>((v >> 24) & 0xff);
}

}  // namespace

bool is_request(Op op) {
  auto v = static_cast<uint8_t>(op);
  return v >= static_cast<uint8_t>(Op::kSet) && v <= static_cast<uint8_t>(Op::kFence);
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kChallenge: return "challenge";
    case Op::kHello: return "hello";
    case Op::kWelcome: return "welcome";
    case Op::kRefused: return "refused";
    case Op::kNotice: return "notice";
    case Op::kSet: return "set";
    case Op::kGet: return "get";
    case Op::kAdd: return "add";
    case Op::kCompareSet: return "compare_set";
    case Op::kDelete: return "delete";
    case Op::kNumKeys: return "num_keys";
    case Op::kCheck: return "check";
    case Op::kMultiGet: return "multi_get";
    case Op::kMultiSet: return "multi_set";
    case Op::kWait: return "wait";
    case Op::kLease: return "lease";
    case Op::kFence: return "fence";
    case Op::kOk: return "ok";
    case Op::kTimedOut: return "timed_out";
    case Op::kError: return "error";
    case Op::kClosing: return "closing";
    case Op::kStale: return "stale";
  }
  return "unknown";
}

DecodeResult decode_frame(const char* data, size_t size, uint32_t max_frame, FrameView* out) {
  DecodeResult r;
  if (size < kLengthSize) return r;
  r.length = load_u32(data);
  if (r.length < kMinLength || r.length > max_frame) {
    r.status = DecodeStatus::kBad;
    return r;
  }
  if (size - kLengthSize < r.length) return r;
  out->op = static_cast<Op>(static_cast<uint8_t>(data[4]));
  out->id = load_u32(data + 5);
  out->payload = std::string_view(data + kHeaderSize, r.length - kMinLength);
  r.status = DecodeStatus::kFrame;
  r.consumed = kLengthSize + r.length;
  return r;
}

bool Reader::take(size_t n, const char** p) {
  if (!ok_ || rest_.size() < n) {
    ok_ = false;
    return false;
  }
  *p = rest_.data();
  rest_.remove_prefix(n);
  return true;
}

uint8_t Reader::u8() {
  const char* p;
  return take(1, &p) ? static_cast<uint8_t>(*p) : 0;
}

uint16_t Reader::u16() {
  const char* p;
  if (!take(2, &p)) return 0;
  const auto* b = reinterpret_cast<const unsigned char*>(p);
  return static_cast<uint16_t>(b[0] | (b[1] << 8));
}

uint32_t Reader::u32() {
  const char* p;
  return take(4, &p) ? load_u32(p) : 0;
}

int64_t Reader::i64() {
  const char* p;
  if (!take(8, &p)) return 0;
  uint64_t v = static_cast<uint64_t>(load_u32(p)) | static_cast<uint64_t>(load_u32(p + 4)) << 32;
  return static_cast<int64_t>(v);
}

std::string_view Reader::bytes() {
  uint32_t n = u32();
  const char* p;
  if (!take(n, &p)) return {};
  return std::string_view(p, n);
}

uint32_t Reader::count(size_t min_item) {
  uint32_t n = u32();
  if (!ok_) return 0;
  if (min_item > 0 && n > rest_.size() / min_item) {
    ok_ = false;
    return 0;
  }
  return n;
}

Writer& Writer::begin(Op op, uint32_t id) {
  start_ = out_.size();
  char h[kHeaderSize];
  store_u32(h, 0);
  h[4] = static_cast<char>(op);
  store_u32(h + 5, id);
  out_.append(h, kHeaderSize);
  return *this;
}

Writer& Writer::u8(uint8_t v) {
  out_.push_back(static_cast<char>(v));
  return *this;
}

Writer& Writer::u16(uint16_t v) {
  char b[2] = {static_cast<char>(v & 0xff), static_cast<char>(v >> 8)};
  out_.append(b, 2);
  return *this;
}

Writer& Writer::u32(uint32_t v) {
  char b[4];
  store_u32(b, v);
  out_.append(b, 4);
  return *this;
}

Writer& Writer::i64(int64_t v) {
  auto u = static_cast<uint64_t>(v);
  char b[8];
  store_u32(b, static_cast<uint32_t>(u & 0xffffffffu));
  store_u32(b + 4, static_cast<uint32_t>(u >> 32));
  out_.append(b, 8);
  return *this;
}

Writer& Writer::bytes(std::string_view v) {
  u32(static_cast<uint32_t>(v.size()));
  out_.append(v.data(), v.size());
  return *this;
}

void Writer::end() { store_u32(out_.data() + start_, static_cast<uint32_t>(out_.size() - start_ - kLengthSize)); }

bool parse_request(const FrameView& frame, Request* out, std::string* error) {
  out->op = frame.op;
  out->id = frame.id;
  out->keys.clear();
  out->values.clear();
  Reader r(frame.payload);
  switch (frame.op) {
    case Op::kSet:
      out->key = r.bytes();
      out->value = r.bytes();
      break;
    case Op::kGet:
      out->timeout_ms = r.u32();
      out->key = r.bytes();
      break;
    case Op::kAdd:
      out->key = r.bytes();
      out->delta = r.i64();
      break;
    case Op::kCompareSet:
      out->key = r.bytes();
      out->expected = r.bytes();
      out->value = r.bytes();
      break;
    case Op::kDelete:
      out->key = r.bytes();
      break;
    case Op::kFence:
      out->key = r.bytes();
      out->delta = r.i64();
      break;
    case Op::kNumKeys:
      break;
    case Op::kCheck:
    case Op::kMultiGet:
    case Op::kWait: {
      out->timeout_ms = frame.op == Op::kCheck ? 0 : r.u32();
      uint32_t n = r.count(4);
      out->keys.reserve(n);
      for (uint32_t i = 0; i < n && r.ok(); ++i) out->keys.push_back(r.bytes());
      break;
    }
    case Op::kLease:
      out->timeout_ms = r.u32();
      [[fallthrough]];
    case Op::kMultiSet: {
      uint32_t n = r.count(8);
      out->keys.reserve(n);
      out->values.reserve(n);
      for (uint32_t i = 0; i < n && r.ok(); ++i) {
        out->keys.push_back(r.bytes());
        out->values.push_back(r.bytes());
      }
      break;
    }
    default:
      *error = "unknown operation " + std::to_string(static_cast<unsigned>(frame.op));
      return false;
  }
  if (!r.ok()) {
    *error = std::string("malformed ") + op_name(frame.op) + " request: payload too short";
    return false;
  }
  if (!r.at_end()) {
    *error = std::string("malformed ") + op_name(frame.op) + " request: trailing bytes";
    return false;
  }
  return true;
}

bool parse_challenge(std::string_view payload, Challenge* out) {
  Reader r(payload);
  out->magic = r.u32();
  out->version = r.u16();
  out->auth_required = r.u8() != 0;
  out->nonce = r.bytes();
  return r.at_end();
}

bool parse_hello(std::string_view payload, Hello* out) {
  Reader r(payload);
  out->magic = r.u32();
  out->version = r.u16();
  out->proof = r.bytes();
  return r.at_end();
}

void encode_challenge(std::string& out, bool auth_required, std::string_view nonce) {
  Writer w(out);
  w.begin(Op::kChallenge, 0).u32(kMagic).u16(kVersion).u8(auth_required ? 1 : 0).bytes(nonce).end();
}

void encode_hello(std::string& out, std::string_view proof) {
  Writer w(out);
  w.begin(Op::kHello, 0).u32(kMagic).u16(kVersion).bytes(proof).end();
}

void encode_notice(std::string& out, std::string_view name) {
  Writer w(out);
  w.begin(Op::kNotice, 0).bytes(name).end();
}

bool parse_notice(std::string_view payload, std::string_view* name) {
  Reader r(payload);
  *name = r.bytes();
  return r.at_end();
}

void encode_set(std::string& out, uint32_t id, std::string_view key, std::string_view value) {
  Writer w(out);
  w.begin(Op::kSet, id).bytes(key).bytes(value).end();
}

void encode_get(std::string& out, uint32_t id, std::string_view key, uint32_t timeout_ms) {
  Writer w(out);
  w.begin(Op::kGet, id).u32(timeout_ms).bytes(key).end();
}

void encode_add(std::string& out, uint32_t id, std::string_view key, int64_t delta) {
  Writer w(out);
  w.begin(Op::kAdd, id).bytes(key).i64(delta).end();
}

void encode_compare_set(std::string& out, uint32_t id, std::string_view key, std::string_view expected,
                        std::string_view desired) {
  Writer w(out);
  w.begin(Op::kCompareSet, id).bytes(key).bytes(expected).bytes(desired).end();
}

void encode_delete(std::string& out, uint32_t id, std::string_view key) {
  Writer w(out);
  w.begin(Op::kDelete, id).bytes(key).end();
}

void encode_num_keys(std::string& out, uint32_t id) {
  Writer w(out);
  w.begin(Op::kNumKeys, id).end();
}

void encode_keys(std::string& out, Op op, uint32_t id, const std::vector<std::string>& keys, uint32_t timeout_ms) {
  Writer w(out);
  w.begin(op, id);
  if (op != Op::kCheck) w.u32(timeout_ms);
  w.u32(static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) w.bytes(k);
  w.end();
}

void encode_multi_set(std::string& out, uint32_t id, const std::vector<std::string>& keys,
                      const std::vector<std::string>& values) {
  Writer w(out);
  w.begin(Op::kMultiSet, id).u32(static_cast<uint32_t>(keys.size()));
  for (size_t i = 0; i < keys.size(); ++i) w.bytes(keys[i]).bytes(values[i]);
  w.end();
}

void encode_lease(std::string& out, uint32_t id, uint32_t lease_ms, const std::vector<std::string>& keys,
                  const std::vector<std::string>& values) {
  Writer w(out);
  w.begin(Op::kLease, id).u32(lease_ms).u32(static_cast<uint32_t>(keys.size()));
  for (size_t i = 0; i < keys.size(); ++i) w.bytes(keys[i]).bytes(values[i]);
  w.end();
}

void encode_fence(std::string& out, uint32_t id, std::string_view key, int64_t epoch) {
  Writer w(out);
  w.begin(Op::kFence, id).bytes(key).i64(epoch).end();
}

void encode_string_reply(std::string& out, Op op, uint32_t id, std::string_view text) {
  Writer w(out);
  w.begin(op, id).bytes(text).end();
}

uint32_t clamp_timeout_ms(int64_t ms) {
  if (ms < 0) return 0;
  if (ms > std::numeric_limits<uint32_t>::max()) return std::numeric_limits<uint32_t>::max();
  return static_cast<uint32_t>(ms);
}

}  // namespace cohort::proto
