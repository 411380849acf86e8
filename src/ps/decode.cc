#include "ps/decode.h"

#include <fmt/core.h>

#include <cstring>

#include "cohort/error.h"
#include "ps/config_json.h"

namespace cohort::ps {

namespace {

// a * b + c, or false where it does not fit 64 bits.
bool mul_add(uint64_t a, uint64_t b, uint64_t c, uint64_t* out) {
  uint64_t p = 0;
  return !__builtin_mul_overflow(a, b, &p) && !__builtin_add_overflow(p, c, out);
}

std::string bytes_or_overflow(bool fits, uint64_t bytes) {
  return fits ? fmt::format("{}", bytes) : std::string("more than 2^64");
}

bool has_table(Op op) {
  switch (op) {
    case Op::kCreate:
    case Op::kDescribe:
    case Op::kPull:
    case Op::kPush:
    case Op::kPushPull:
    case Op::kStats:
    case Op::kAttach: return true;
    default: return false;
  }
}

bool known(Op op) { return uint8_t(op) <= uint8_t(Op::kDiscard); }

// What a request is called in messages: "pull of 'emb'", "save".
std::string what(const RequestHeader& h) {
  const std::string name = table_name(h);
  if (!has_table(h.op)) return op_name(h.op);
  return fmt::format("{} of '{}'", op_name(h.op), printable(name));
}

std::string check_text(const char* what, const uint8_t* p, size_t size, size_t max) {
  if (size == 0) return fmt::format("{}: empty", what);
  if (size > max) return fmt::format("{} of {} bytes: at most {}", what, size, max);
  if (std::memchr(p, 0, size)) return fmt::format("{} holds a NUL byte", what);
  return "";
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kHello: return "hello";
    case Op::kCreate: return "create_table";
    case Op::kDescribe: return "describe";
    case Op::kPull: return "pull";
    case Op::kPush: return "push";
    case Op::kPushPull: return "push_pull";
    case Op::kClock: return "step";
    case Op::kSave: return "save";
    case Op::kLoad: return "load";
    case Op::kStats: return "stats";
    case Op::kBye: return "bye";
    case Op::kAttach: return "attach";
    case Op::kCommit: return "commit";
    case Op::kDiscard: return "discard";
  }
  return "?";
}

std::string printable(std::string_view text, size_t max) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (out.size() >= max) {
      out += "...";
      break;
    }
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) out += char(c);
    else out += fmt::format("\\x{:02x}", c);
  }
  return out;
}

std::string check_table_name(std::string_view name) {
  bool ok = !name.empty() && name.size() <= kMaxTableName && name[0] != '.';
  for (char c : name)
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
                c == '.');
  if (ok) return "";
  return fmt::format("table name '{}': expected 1 to {} characters of A-Z a-z 0-9 _ - . (not starting with '.'); "
                     "it names the table's files in a save",
                     printable(name), kMaxTableName);
}

void set_table_name(RequestHeader& h, const std::string& name) {
  if (std::string why = check_table_name(name); !why.empty()) throw InvalidArgument(why);
  std::memset(h.table, 0, sizeof h.table);
  std::memcpy(h.table, name.data(), name.size());
}

std::string table_name(const RequestHeader& h) { return std::string(h.table, strnlen(h.table, sizeof h.table)); }

std::string check_request_frame(const RequestHeader& h, uint64_t max_request) {
  if (h.magic != kRequestMagic)
    return fmt::format("malformed request: magic {:#x}, expected {:#x} (not a cohort parameter-server worker of "
                       "this version)",
                       h.magic, kRequestMagic);
  if (h.payload > max_request)
    return fmt::format("{} request of {} bytes exceeds this server's limit of {} bytes (COHORT_PS_MAX_REQUEST)",
                       known(h.op) ? op_name(h.op) : "unknown", h.payload, max_request);
  return "";
}

std::string decode_request(const RequestHeader& h, const uint8_t* payload, size_t size, uint64_t max_request,
                           Request* out) {
  if (std::string why = check_request_frame(h, max_request); !why.empty()) return why;
  if (!known(h.op)) return fmt::format("unknown request type {}", int(h.op));
  if (h.payload != size)  // the transport delivers what the header announced; a caller that does not is wrong
    return fmt::format("{}: the header announces {} payload bytes, {} came", op_name(h.op), h.payload, size);
  // The worker's clock counts its steps; the highest value is the server's mark of a worker that left.
  if (h.clock == UINT64_MAX) return fmt::format("{}: clock {} is out of range", what(h), h.clock);
  Request r;
  r.op = h.op;
  r.clock = h.clock;
  if (has_table(h.op)) {
    r.table = table_name(h);
    if (std::string why = check_table_name(r.table); !why.empty()) return fmt::format("{}: {}", op_name(h.op), why);
  }
  switch (h.op) {
    case Op::kPull:
    case Op::kPush:
    case Op::kPushPull: {
      if (h.dim == 0 || h.dim > kMaxDim) return fmt::format("{}: dim {}: expected 1 to {}", what(h), h.dim, kMaxDim);
      r.dim = h.dim;
      const bool pull = h.op == Op::kPull;
      // pull: n ids; push: n ids and their n rows of gradients; push_pull: those, then m ids.
      uint64_t expected = 0;
      const bool fits = pull ? mul_add(h.n, 8, 0, &expected)
                             : mul_add(h.n, 8 + uint64_t(h.dim) * 4, 0, &expected) &&
                                   (h.op == Op::kPush || mul_add(h.m, 8, expected, &expected));
      if (!fits || expected != size) {
        std::string counts = pull ? fmt::format("{} ids", h.n)
                                  : h.op == Op::kPush ? fmt::format("{} ids of dim {}", h.n, h.dim)
                                                      : fmt::format("{} pushed ids of dim {} and {} pulled", h.n,
                                                                    h.dim, h.m);
        return fmt::format("{}: payload of {} bytes, expected {} for {}", what(h), size,
                           bytes_or_overflow(fits, expected), counts);
      }
      if (h.op == Op::kPush && h.m != 0) return fmt::format("{}: {} pulled ids in a push", what(h), h.m);
      if (pull && h.m != 0) return fmt::format("{}: m = {} in a pull", what(h), h.m);
      // The rows of the reply: at most what the server allows a message to be, like the request.
      const uint64_t pulled = pull ? h.n : h.m;
      uint64_t reply = 0;
      const bool reply_fits = mul_add(pulled, uint64_t(h.dim) * 4, 0, &reply);
      if (h.op != Op::kPush && (!reply_fits || reply > max_request))
        return fmt::format("{}: a reply of {} rows of dim {} is {} bytes, more than this server's limit of {} "
                           "bytes (COHORT_PS_MAX_REQUEST)",
                           what(h), pulled, h.dim, bytes_or_overflow(reply_fits, reply), max_request);
      r.n = h.n;
      r.m = h.m;
      if (size > 0) {  // (no pointer arithmetic on an empty payload's null pointer)
        r.ids = reinterpret_cast<const uint64_t*>(payload);
        if (!pull) {
          r.grads = reinterpret_cast<const float*>(payload + h.n * 8);
          r.pull_ids = payload + h.n * 8 + h.n * uint64_t(h.dim) * 4;
        }
      }
      break;
    }
    case Op::kCreate: {
      if (size == 0) return fmt::format("{}: no configuration", what(h));
      if (size > kMaxJsonBytes)
        return fmt::format("{}: configuration of {} bytes, at most {}", what(h), size, kMaxJsonBytes);
      nlohmann::json j;
      if (std::string why = parse_json({reinterpret_cast<const char*>(payload), size}, &j); !why.empty())
        return fmt::format("{}: configuration {}", what(h), why);
      if (std::string why = parse_config(j, r.table, &r.config); !why.empty())
        return fmt::format("{}: {}", op_name(h.op), why);
      break;
    }
    case Op::kSave:
    case Op::kLoad:
      if (std::string why = check_text("the directory path", payload, size, kMaxPathBytes); !why.empty())
        return fmt::format("{}: {}", op_name(h.op), why);
      r.text.assign(reinterpret_cast<const char*>(payload), size);
      break;
    case Op::kAttach: {
      // {"socket": the worker's abstract Unix socket, "pid": the worker's pid}
      nlohmann::json j;
      if (size > kMaxJsonBytes) return fmt::format("{}: payload of {} bytes, at most {}", what(h), size, kMaxJsonBytes);
      if (std::string why = parse_json(std::string_view(reinterpret_cast<const char*>(payload), size), &j);
          !why.empty())
        return fmt::format("{}: {}", what(h), why);
      if (!j.is_object() || !j.contains("socket") || !j["socket"].is_string() || !j.contains("pid") ||
          !j["pid"].is_number_integer())
        return fmt::format("{}: expected {{\"socket\": name, \"pid\": pid}}", what(h));
      const std::string socket = j["socket"].get<std::string>();
      if (std::string why = check_text("the socket name", reinterpret_cast<const uint8_t*>(socket.data()),
                                       socket.size(), kMaxSocketName);
          !why.empty())
        return fmt::format("{}: {}", what(h), why);
      const int64_t pid = j["pid"].get<int64_t>();
      if (pid <= 0 || pid > (int64_t{1} << 22)) return fmt::format("{}: pid {}: not a process id", what(h), pid);
      r.text = socket;
      r.pid = pid;
      break;
    }
    case Op::kHello:
    case Op::kDescribe:
    case Op::kClock:
    case Op::kStats:
    case Op::kBye:
    case Op::kCommit:
    case Op::kDiscard:
      if (size != 0) return fmt::format("{}: payload of {} bytes, expected none", what(h), size);
      break;
  }
  *out = std::move(r);
  return "";
}

std::string check_reply_header(const RequestHeader& request, const ReplyHeader& r) {
  const std::string to = fmt::format("reply to {}", what(request));
  if (r.magic != kReplyMagic) return fmt::format("{}: magic {:#x}, expected {:#x}", to, r.magic, kReplyMagic);
  if (r.status != Status::kOk && r.status != Status::kInvalid)
    return fmt::format("{}: status {}", to, int(r.status));
  if (r.status == Status::kInvalid) {
    if (r.payload != 0) return fmt::format("{}: a refusal with a payload of {} bytes", to, r.payload);
    return "";
  }
  uint64_t rows = 0, expected = 0;
  switch (request.op) {
    case Op::kPull:
    case Op::kPushPull: {
      rows = request.op == Op::kPull ? request.n : request.m;
      const bool fits = mul_add(rows, uint64_t(request.dim) * 4, 0, &expected);
      if (!fits || r.payload != expected)
        return fmt::format("{}: payload of {} bytes, expected {} for {} rows of dim {}", to, r.payload,
                           bytes_or_overflow(fits, expected), rows, request.dim);
      return "";
    }
    case Op::kStats: expected = kStatsReplyBytes; break;
    case Op::kHello:
    case Op::kDescribe:
    case Op::kSave:
    case Op::kAttach:
      if (r.payload == 0 || r.payload > kMaxJsonBytes)
        return fmt::format("{}: payload of {} bytes, expected 1 to {}", to, r.payload, kMaxJsonBytes);
      return "";
    default: expected = 0;
  }
  if (r.payload != expected) return fmt::format("{}: payload of {} bytes, expected {}", to, r.payload, expected);
  return "";
}

std::string reply_message(const ReplyHeader& r) {
  // Control characters escaped (one line), other bytes kept: a path in the message may be UTF-8.
  std::string out;
  for (char c : std::string_view(r.message, strnlen(r.message, sizeof r.message))) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) out += fmt::format("\\x{:02x}", u);
    else out += c;
  }
  return out;
}

std::string parse_json(std::string_view text, nlohmann::json* out) {
  try {
    *out = nlohmann::json::parse(text.begin(), text.end());
    return "";
  } catch (const nlohmann::json::exception& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 2: ...": the bracket says nothing.
    std::string_view why = e.what();
    if (auto end = why.find("] "); why.rfind("[json.", 0) == 0 && end != std::string_view::npos)
      why.remove_prefix(end + 2);
    return fmt::format("is not valid JSON ({})", printable(why, 200));
  }
}

std::string parse_config(const nlohmann::json& j, const std::string& table, TableConfig* out) {
  TableConfig c;
  try {
    c = config_from_json(j);
  } catch (const InvalidArgument& e) {
    return fmt::format("table '{}': {}", printable(table), printable(e.what(), 200));
  }
  try {
    validate(table, c);
  } catch (const InvalidArgument& e) {
    return printable(e.what(), 300);
  }
  *out = c;
  return "";
}

std::string decode_hello(std::string_view text, std::string* mode, uint64_t* max_request) {
  nlohmann::json j;
  if (std::string why = parse_json(text, &j); !why.empty()) return why;
  if (!j.is_object() || !j.contains("mode") || !j["mode"].is_string() || !j.contains("max_request") ||
      !j["max_request"].is_number_unsigned())
    return "expected {\"mode\": text, \"max_request\": bytes}";
  *mode = j["mode"].get<std::string>();
  *max_request = j["max_request"].get<uint64_t>();
  return "";
}

std::string decode_saved_tables(std::string_view text, std::vector<std::pair<std::string, TableConfig>>* out) {
  nlohmann::json j;
  if (std::string why = parse_json(text, &j); !why.empty()) return why;
  if (!j.is_object()) return "expected {table: configuration}";
  std::vector<std::pair<std::string, TableConfig>> tables;
  for (auto& [name, cj] : j.items()) {
    if (std::string why = check_table_name(name); !why.empty()) return why;
    TableConfig c;
    if (std::string why = parse_config(cj, name, &c); !why.empty()) return why;
    tables.emplace_back(name, c);
  }
  *out = std::move(tables);
  return "";
}

std::string parse_manifest(std::string_view text, Manifest* out) {
  nlohmann::json j;
  if (std::string why = parse_json(text, &j); !why.empty()) return why;
  if (!j.is_object()) return "expected a JSON object {\"format\", \"servers\", \"tables\"}";
  if (!j.contains("format") || j["format"] != "cohort-ps-1")
    return fmt::format("format {}: expected \"cohort-ps-1\"",
                       j.contains("format") ? printable(j["format"].dump(-1, ' ', false,
                                                                          nlohmann::json::error_handler_t::replace))
                                            : std::string("missing"));
  if (!j.contains("servers") || !j["servers"].is_number_unsigned() || j["servers"].get<uint64_t>() < 1 ||
      j["servers"].get<uint64_t>() > uint64_t(kMaxServers))
    return fmt::format("'servers': expected an integer from 1 to {}", kMaxServers);
  if (!j.contains("tables") || !j["tables"].is_object()) return "'tables': expected {table: configuration}";
  Manifest m;
  if (j.contains("shards")) {
    // One name inside the manifest's directory: no '/', no "..", nothing hidden.
    if (!j["shards"].is_string()) return "'shards': expected the name of the folder that holds the shard files";
    m.shards = j["shards"].get<std::string>();
    if (std::string why = check_table_name(m.shards); !why.empty())
      return fmt::format("'shards': folder '{}': expected 1 to {} characters of A-Z a-z 0-9 _ - . (not starting with "
                         "'.')",
                         printable(m.shards), kMaxTableName);
  }
  m.servers = int(j["servers"].get<uint64_t>());
  for (auto& [name, cj] : j["tables"].items()) {
    if (std::string why = check_table_name(name); !why.empty()) return why;
    TableConfig c;
    if (std::string why = parse_config(cj, name, &c); !why.empty()) return why;
    m.tables.emplace_back(name, c);
  }
  *out = std::move(m);
  return "";
}

std::string parse_shard_header(std::string_view line, ShardFileHeader* out) {
  nlohmann::json j;
  if (std::string why = parse_json(line, &j); !why.empty()) return "header line " + why;
  if (!j.is_object()) return "header line: expected a JSON object";
  auto count = [&](const char* key, uint64_t max, uint64_t* v) -> std::string {
    if (!j.contains(key) || !j[key].is_number_unsigned() || j[key].get<uint64_t>() > max)
      return fmt::format("header line: '{}': expected an integer from 0 to {}", key, max);
    *v = j[key].get<uint64_t>();
    return "";
  };
  ShardFileHeader h;
  if (!j.contains("table") || !j["table"].is_string()) return "header line: 'table': expected a string";
  h.table = j["table"].get<std::string>();
  if (std::string why = check_table_name(h.table); !why.empty()) return "header line: " + why;
  if (!j.contains("config")) return "header line: 'config' is missing";
  if (std::string why = parse_config(j["config"], h.table, &h.config); !why.empty()) return "header line: " + why;
  uint64_t server = 0, servers = 0;
  for (auto [key, max, v] : {std::tuple{"server", uint64_t(kMaxServers - 1), &server},
                             std::tuple{"servers", uint64_t(kMaxServers), &servers},
                             std::tuple{"state_floats", uint64_t(2) * kMaxDim + 1, &h.state_floats},
                             std::tuple{"rows", UINT64_MAX, &h.rows}})
    if (std::string why = count(key, max, v); !why.empty()) return why;
  h.server = int(server);
  h.servers = int(servers);
  *out = std::move(h);
  return "";
}

}  // namespace cohort::ps
