#pragma once
// What the parameter server and its workers take from each other and from a save's files, checked
// before anything is used: request headers and payloads, reply headers, JSON payloads, save
// manifests and shard headers. Pure functions of the bytes (no I/O, nothing kept), so that
// fuzz/ps_wire_fuzz.cc runs them on anything; the server and the client call the same ones.
//
// Every count and length is checked with overflow-safe arithmetic before it sizes a read, a buffer
// or a loop (a request's `n * 8` wrapping around to a small number would pass a plain comparison).
// A check returns "" when the input is good, else one line saying what was wrong; text from the
// input in it is made printable and cut short. The caller adds who sent it or which file held it.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cohort/ps.h"
#include "ps/wire.h"

namespace cohort::ps {

inline constexpr uint64_t kMaxJsonBytes = 16u << 20;  // a create's configuration, JSON replies, a manifest
inline constexpr size_t kMaxPathBytes = 4095;         // save/load directories (PATH_MAX less its NUL)
inline constexpr size_t kMaxSocketName = 107;         // attach: an abstract socket's name (sun_path less its NUL)
inline constexpr uint64_t kStatsReplyBytes = 32;      // stats: four u64
inline constexpr int kMaxServers = 1 << 16;           // a manifest's server count

// Input as text for a message: bytes outside printable ASCII as \xNN, cut at `max` characters.
std::string printable(std::string_view text, size_t max = 80);

// Table names become file names (save writes <dir>/<table>.shard-K-of-N): 1 to kMaxTableName
// characters of A-Z a-z 0-9 _ - . , not starting with '.'. "" or why not.
std::string check_table_name(std::string_view name);

// Before a request's payload is read: the magic, and a payload the server may allocate (at most
// max_request bytes). When this fails the payload is not read.
std::string check_request_frame(const RequestHeader& h, uint64_t max_request);

// A request whose header and payload passed decode_request. Pointers point into the payload.
struct Request {
  Op op = Op::kHello;
  std::string table;  // ops on a table: a valid name; else ""
  uint32_t dim = 0;   // pull, push, push_pull: 1 to kMaxDim
  uint64_t clock = 0;
  const uint64_t* ids = nullptr;  // pull: the ids pulled; push, push_pull: the ids pushed
  uint64_t n = 0;
  const float* grads = nullptr;  // push, push_pull: n * dim
  const uint8_t* pull_ids = nullptr;  // push_pull: m ids after the gradients (not 8-byte aligned for odd dims)
  uint64_t m = 0;
  std::string text;    // save, load: the directory; attach: the worker's socket name
  int64_t pid = 0;     // attach: the worker's pid (the server checks the socket's owner against it)
  TableConfig config;  // create: checked by validate()
};

// The whole request: op, table name, clock, and a payload of exactly the size its op and counts
// call for (pull: n ids; push: n ids and n * dim floats; push_pull: those and m ids; create: a JSON
// configuration that validate() accepts; save, load: text without NUL bytes; attach: JSON
// {"socket": a name without NUL bytes, "pid": a positive pid}; the others:
// none), and a pull's reply within max_request. `payload` is the `size` bytes the header announced,
// 8-byte aligned.
std::string decode_request(const RequestHeader& h, const uint8_t* payload, size_t size, uint64_t max_request,
                           Request* out);

// A reply header as the worker reads it, for the request `request` it answers: magic, status, and a
// payload of the size that request gets (pull: n rows of dim floats; push_pull: m rows; stats: 32
// bytes; hello, describe, save, attach: JSON of at most kMaxJsonBytes; the others and every
// refusal: none).
std::string check_reply_header(const RequestHeader& request, const ReplyHeader& r);
// A refusal's text: the message field up to its NUL (or its end, where a server sent none), control
// characters escaped.
std::string reply_message(const ReplyHeader& r);

// JSON text, parsed: "" or "not valid JSON (...)".
std::string parse_json(std::string_view text, nlohmann::json* out);
// A table's configuration as JSON (a create's payload, a describe reply, a manifest's entry):
// every field present and of its type, and validate() content with it.
std::string parse_config(const nlohmann::json& j, const std::string& table, TableConfig* out);

// The hello reply: the servers' consistency mode (unparsed) and request limit.
std::string decode_hello(std::string_view text, std::string* mode, uint64_t* max_request);
// A save's reply: {table: configuration} of the tables the server wrote.
std::string decode_saved_tables(std::string_view text, std::vector<std::pair<std::string, TableConfig>>* out);

// dir/manifest.json, written by the saving worker: {"format": "cohort-ps-1", "servers": N,
// "tables": {name: configuration}}.
struct Manifest {
  int servers = 0;
  std::vector<std::pair<std::string, TableConfig>> tables;
  // The folder (in the manifest's directory) that holds the shard files: one name, checked like a
  // table name; "" for a save of before folders, whose shards lie beside the manifest.
  std::string shards;
};
std::string parse_manifest(std::string_view text, Manifest* out);

// The first line of a shard file: {"table", "config", "server", "servers", "state_floats", "rows"}.
struct ShardFileHeader {
  std::string table;
  TableConfig config;
  int server = 0;
  int servers = 0;
  uint64_t state_floats = 0;
  uint64_t rows = 0;
};
std::string parse_shard_header(std::string_view line, ShardFileHeader* out);

}  // namespace cohort::ps
