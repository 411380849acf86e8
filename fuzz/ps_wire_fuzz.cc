// libFuzzer target: the parameter server's checks of what it reads (src/ps/decode.cc): requests as
// the server decodes them, replies as a worker checks them, save manifests and shard headers as a
// load reads them. The first byte picks which (bits 0-1; bit 2: a request header keeps its own payload
// size instead of the size that came); the rest is the input.
// Invariants checked beyond "no crash, no sanitizer report":
//  - an accepted request's counts fit its payload exactly (computed again in 128 bits), its pointers
//    lie within the payload, its table name is a valid one, its configuration passes validate(), and
//    a pull's reply fits the limit; a request whose header the frame check refuses is refused;
//  - an accepted reply's payload is the size its request gets;
//  - an accepted attach request names a valid table, a socket name of 1 to 107 bytes without NUL
//    (read from its JSON payload) and a process id;
//  - an accepted manifest or shard header holds counts in range and configurations validate() takes;
//  - every refusal is one line of printable ASCII, and a refusal's text as a worker shows it one line.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "cohort/error.h"
#include "ps/config_json.h"
#include "ps/decode.h"

using namespace cohort::ps;
using u128 = unsigned __int128;

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

void check_refusal(const std::string& why) {
  check(!why.empty() && why.size() < 2000);
  for (char c : why) check(c >= 0x20 && c < 0x7f);
}

void check_config(const std::string& table, const TableConfig& c) {
  try {
    validate(table, c);
  } catch (const cohort::InvalidArgument&) {
    check(false);
  }
}

constexpr uint64_t kMaxRequest = 1 << 16;

void request(const uint8_t* data, size_t size, bool keep_claim) {
  RequestHeader h;
  const size_t head = size < sizeof h ? size : sizeof h;
  std::memcpy(&h, data, head);
  // The transport delivers exactly the payload the header announced: mostly let the header say what
  // came, sometimes keep its own claim (which only the frame check and the size check see).
  const size_t n = size - head;
  if (!keep_claim) h.payload = n;
  std::vector<uint64_t> aligned((n + 7) / 8 + 1);  // the server's buffers are 8-byte aligned
  auto* payload = reinterpret_cast<uint8_t*>(aligned.data());
  if (n) std::memcpy(payload, data + head, n);
  const std::string frame = check_request_frame(h, kMaxRequest);
  if (!frame.empty()) check_refusal(frame);
  Request r;
  const std::string why = decode_request(h, payload, n, kMaxRequest, &r);
  if (!why.empty()) {
    check_refusal(why);
    return;
  }
  check(frame.empty() && h.payload == n && r.op == h.op && r.clock == h.clock && r.clock != UINT64_MAX);
  auto within = [&](const void* p, u128 bytes) {
    const auto* b = static_cast<const uint8_t*>(p);
    check(b >= payload && u128(b - payload) + bytes <= n);
  };
  switch (r.op) {
    case Op::kPull:
    case Op::kPush:
    case Op::kPushPull: {
      check(r.dim >= 1 && r.dim <= kMaxDim && r.dim == h.dim && r.n == h.n && r.m == h.m);
      check(check_table_name(r.table).empty());
      const u128 row = u128(r.dim) * 4;
      const u128 expected = r.op == Op::kPull ? u128(r.n) * 8 : u128(r.n) * (8 + row) + u128(r.m) * 8;
      check(expected == n);
      if (r.op != Op::kPush) check((r.op == Op::kPull ? u128(r.n) : u128(r.m)) * row <= kMaxRequest);
      if (r.op == Op::kPush) check(r.m == 0);
      if (n > 0) {
        within(r.ids, u128(r.n) * 8);
        if (r.op != Op::kPull) {
          within(r.grads, u128(r.n) * row);
          within(r.pull_ids, u128(r.m) * 8);
        }
      }
      break;
    }
    case Op::kCreate:
      check(check_table_name(r.table).empty());
      check_config(r.table, r.config);
      break;
    case Op::kSave:
    case Op::kLoad:
      check(!r.text.empty() && r.text.size() == n && r.text.find('\0') == std::string::npos);
      check(r.text.size() <= kMaxPathBytes);
      break;
    case Op::kAttach:
      // The payload is a JSON object {"socket", "pid"}: the socket's name is one of its fields, not
      // the payload itself.
      check(check_table_name(r.table).empty());
      check(n >= 1 && n <= kMaxJsonBytes);
      check(!r.text.empty() && r.text.size() <= kMaxSocketName && r.text.find('\0') == std::string::npos);
      check(r.pid > 0 && r.pid <= (int64_t{1} << 22));
      // Once per run, so that a test can see the seeds reach the attach decoder's success path
      // (fuzz/CMakeLists.txt: fuzz.ps_wire_attach_seed).
      if (static bool said = false; !said) {
        said = true;
        std::fprintf(stderr, "ps_wire_fuzz: decoded an attach request\n");
      }
      break;
    case Op::kDescribe:
    case Op::kStats:
      check(check_table_name(r.table).empty() && n == 0);
      break;
    default: check(n == 0);
  }
}

void reply(const uint8_t* data, size_t size) {
  RequestHeader req;
  ReplyHeader rep;
  const size_t a = size < sizeof req ? size : sizeof req;
  std::memcpy(&req, data, a);
  const size_t b = size - a < sizeof rep ? size - a : sizeof rep;
  std::memcpy(&rep, data + a, b);
  for (char c : reply_message(rep)) check(static_cast<unsigned char>(c) >= 0x20 && c != 0x7f);  // one line
  const std::string why = check_reply_header(req, rep);
  if (!why.empty()) return check_refusal(why);
  check(rep.magic == kReplyMagic && (rep.status == Status::kOk || rep.status == Status::kInvalid));
  if (rep.status == Status::kInvalid) return check(rep.payload == 0);
  if (req.op == Op::kPull) check(u128(rep.payload) == u128(req.n) * req.dim * 4);
  else if (req.op == Op::kPushPull) check(u128(rep.payload) == u128(req.m) * req.dim * 4);
  else if (req.op == Op::kStats) check(rep.payload == kStatsReplyBytes);
  else if (req.op == Op::kHello || req.op == Op::kDescribe || req.op == Op::kSave || req.op == Op::kAttach)
    check(rep.payload >= 1 && rep.payload <= kMaxJsonBytes);
  else check(rep.payload == 0);
}

void manifest(std::string_view text) {
  Manifest m;
  if (std::string why = parse_manifest(text, &m); !why.empty()) {
    check_refusal(why);
  } else {
    check(m.servers >= 1 && m.servers <= kMaxServers);
    check(m.shards.empty() || check_table_name(m.shards).empty());  // one name within the save's directory
    for (auto& [name, c] : m.tables) {
      check(check_table_name(name).empty());
      check_config(name, c);
    }
  }
  // The JSON replies a worker reads, on the same text.
  std::vector<std::pair<std::string, TableConfig>> saved;
  if (std::string why = decode_saved_tables(text, &saved); !why.empty()) check_refusal(why);
  else
    for (auto& [name, c] : saved) check_config(name, c);
  std::string mode;
  uint64_t max_request = 0;
  if (std::string why = decode_hello(text, &mode, &max_request); !why.empty()) check_refusal(why);
}

void shard_header(std::string_view line) {
  ShardFileHeader h;
  if (std::string why = parse_shard_header(line, &h); !why.empty()) return check_refusal(why);
  check(check_table_name(h.table).empty());
  check_config(h.table, h.config);
  check(h.server >= 0 && h.server < kMaxServers && h.servers >= 0 && h.servers <= kMaxServers);
  check(h.state_floats <= 2 * uint64_t(kMaxDim) + 1);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t* rest = data + 1;
  const size_t n = size - 1;
  const std::string_view text(reinterpret_cast<const char*>(rest), n);
  switch (data[0] & 3) {
    case 0: request(rest, n, data[0] & 4); break;
    case 1: reply(rest, n); break;
    case 2: manifest(text); break;
    case 3: shard_header(text); break;
  }
  return 0;
}
