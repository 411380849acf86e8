#pragma once
// The store's wire protocol: frame encoder and decoder (docs/store.md describes the format).
//
// This module is pure: no sockets, no OpenSSL, no logging, only the standard library, so that the
// libFuzzer target (fuzz/store_frame_fuzz.cc) can drive it directly and so that the server, the
// client and the bench's state-machine clients all speak through exactly the same code.
//
// Frame: u32 length | u8 op | u32 request id | payload        (integers little-endian)
// `length` counts op + id + payload (so it is at least 5) and is bounded by the receiver's maximum
// frame size; a longer frame is a protocol error and the connection is closed.
// Strings inside a payload are u32 length + bytes; lists are u32 count + items.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cohort::proto {

constexpr uint32_t kMagic = 0x53484f43;  // "COHS" read as a little-endian u32
constexpr uint16_t kVersion = 1;
constexpr size_t kLengthSize = 4;
constexpr size_t kHeaderSize = 9;                      // length + op + request id
constexpr uint32_t kMinLength = 5;                     // op + request id
constexpr uint32_t kDefaultMaxFrame = 64u << 20;       // 64 MiB
constexpr size_t kNonceSize = 32;
constexpr size_t kProofSize = 32;                      // HMAC-SHA256

enum class Op : uint8_t {
  // Handshake. The server speaks first (Challenge) so that a client needs one round trip.
  kChallenge = 1,  // server: magic u32, version u16, auth_required u8, nonce bytes
  kHello = 2,      // client: magic u32, version u16, proof bytes (empty: no token)
  kWelcome = 3,    // server: (empty)
  kRefused = 4,    // server: reason string; the connection is then closed
  // Before the Hello, a client may ask for one of the server's notices: values it serves to anyone,
  // unauthenticated, because they are no secret (StoreServerOptions::notices; a Slurm per-node job's
  // munge credentials, docs/security.md). The server answers Ok(value), or Error when it has none by
  // that name; the connection stays in the handshake (a Hello may follow, or the client closes).
  kNotice = 5,     // client: name string                -> Ok(value) | Error
  // Requests (client -> server).
  kSet = 16,         // key, value                      -> Ok()
  kGet = 17,         // timeout_ms u32, key             -> Ok(value) | TimedOut
  kAdd = 18,         // key, delta i64                  -> Ok(i64)
  kCompareSet = 19,  // key, expected, desired          -> Ok(value after)
  kDelete = 20,      // key                             -> Ok(u8 existed)
  kNumKeys = 21,     //                                 -> Ok(i64)
  kCheck = 22,       // keys                            -> Ok(u8 all exist)
  kMultiGet = 23,    // timeout_ms u32, keys            -> Ok(values) | TimedOut
  kMultiSet = 24,    // count u32, (key, value)*        -> Ok()
  kWait = 25,        // timeout_ms u32, keys            -> Ok() | TimedOut
  // The connection's lease (docs/store.md, "Leases"): replaces its wills and its silence limit.
  // When the connection ends (closed, reset, or silent for longer than lease_ms when that is not
  // 0), the server sets each will's key that does not exist by then. An empty list is an orderly
  // release.
  kLease = 26,       // lease_ms u32, count u32, (key, value)*  -> Ok()
  // Fences the connection's writes (docs/store.md, "Epochs"): from then on each write on it (set,
  // add, compare_set, delete, multi_set, and its lease's wills) is refused with Stale, and not done,
  // while the integer at `key` (missing: 0) is greater than `epoch`. A connection that never sends
  // it is never checked. Replaces an earlier fence of the connection.
  kFence = 27,       // key, epoch i64                  -> Ok(i64 the key's epoch now) | Stale
  // Replies (server -> client), carrying the request's id.
  kOk = 64,        // op-specific payload above
  kTimedOut = 65,  // waited_ms u32, missing keys
  kError = 66,     // message string (the request was invalid, e.g. add on a non-integer)
  kClosing = 67,   // reason string: the server closes this connection (protocol error, stopping)
  kStale = 68,     // message string: a fenced connection's write refused (the store's epoch is newer)
};

bool is_request(Op op);
const char* op_name(Op op);  // "set", "get", ... or "unknown"

// One frame as it lies in the receive buffer (views into it).
struct FrameView {
  Op op = Op::kOk;
  uint32_t id = 0;
  std::string_view payload;
};

enum class DecodeStatus { kNeedMore, kFrame, kBad };

struct DecodeResult {
  DecodeStatus status = DecodeStatus::kNeedMore;
  size_t consumed = 0;   // bytes of the frame (kFrame only)
  uint32_t length = 0;   // the length field, when it was readable (for error messages)
};

// Looks for one complete frame at the start of data[0, size). kBad: the length field is below the
// minimum or above max_frame (the bytes are not a frame of this protocol).
DecodeResult decode_frame(const char* data, size_t size, uint32_t max_frame, FrameView* out);

// Reads fields from a payload; any read past the end sets !ok() and returns zero/empty.
class Reader {
 public:
  explicit Reader(std::string_view data) : rest_(data) {}
  uint8_t u8();
  uint16_t u16();
  uint32_t u32();
  int64_t i64();
  std::string_view bytes();
  // A count of items that each take at least `min_item` bytes: rejects counts the payload cannot
  // hold, so a hostile count never makes the reader reserve memory.
  uint32_t count(size_t min_item);
  bool ok() const { return ok_; }
  bool at_end() const { return ok_ && rest_.empty(); }

 private:
  bool take(size_t n, const char** p);
  std::string_view rest_;
  bool ok_ = true;
};

// Appends frames to a caller-owned buffer (reused across frames: no allocation once it has grown).
class Writer {
 public:
  explicit Writer(std::string& out) : out_(out) {}
  Writer& begin(Op op, uint32_t id);
  Writer& u8(uint8_t v);
  Writer& u16(uint16_t v);
  Writer& u32(uint32_t v);
  Writer& i64(int64_t v);
  Writer& bytes(std::string_view v);
  // Patches the length field of the frame begun last.
  void end();

 private:
  std::string& out_;
  size_t start_ = 0;
};

// A parsed request (views into the frame; `keys`/`values` keep their capacity between requests).
struct Request {
  Op op = Op::kOk;
  uint32_t id = 0;
  uint32_t timeout_ms = 0;  // get, multi_get, wait; lease: the lease's silence limit
  int64_t delta = 0;         // add; fence: the epoch
  std::string_view key, value, expected;
  std::vector<std::string_view> keys, values;
};

// Parses a request frame. Returns false with a one-line reason for an unknown op or a payload that
// does not match the op (too short, trailing bytes, impossible counts).
bool parse_request(const FrameView& frame, Request* out, std::string* error);

// Handshake payloads.
struct Challenge {
  uint32_t magic = 0;
  uint16_t version = 0;
  bool auth_required = false;
  std::string_view nonce;
};
bool parse_challenge(std::string_view payload, Challenge* out);
struct Hello {
  uint32_t magic = 0;
  uint16_t version = 0;
  std::string_view proof;
};
bool parse_hello(std::string_view payload, Hello* out);

// Encoders used by the client, the bench clients and the server.
void encode_challenge(std::string& out, bool auth_required, std::string_view nonce);
void encode_hello(std::string& out, std::string_view proof);
void encode_notice(std::string& out, std::string_view name);
// The name a kNotice frame asks for; false when its payload is not exactly one string.
bool parse_notice(std::string_view payload, std::string_view* name);
void encode_set(std::string& out, uint32_t id, std::string_view key, std::string_view value);
void encode_get(std::string& out, uint32_t id, std::string_view key, uint32_t timeout_ms);
void encode_add(std::string& out, uint32_t id, std::string_view key, int64_t delta);
void encode_compare_set(std::string& out, uint32_t id, std::string_view key, std::string_view expected,
                        std::string_view desired);
void encode_delete(std::string& out, uint32_t id, std::string_view key);
void encode_num_keys(std::string& out, uint32_t id);
void encode_keys(std::string& out, Op op, uint32_t id, const std::vector<std::string>& keys,
                 uint32_t timeout_ms);  // check (timeout ignored), multi_get, wait
void encode_multi_set(std::string& out, uint32_t id, const std::vector<std::string>& keys,
                      const std::vector<std::string>& values);
void encode_lease(std::string& out, uint32_t id, uint32_t lease_ms, const std::vector<std::string>& keys,
                  const std::vector<std::string>& values);
void encode_fence(std::string& out, uint32_t id, std::string_view key, int64_t epoch);
// A reply whose payload is one string (kRefused, kError, kClosing, kStale, or Ok(value)).
void encode_string_reply(std::string& out, Op op, uint32_t id, std::string_view text);

// Clamps a millisecond timeout to the u32 the protocol carries.
uint32_t clamp_timeout_ms(int64_t ms);

}  // namespace cohort::proto
