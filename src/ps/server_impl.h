#pragma once
// The parameter server's state, shared by the files that implement it (internal to src/ps):
//   server.cc              the loop: a worker's requests received, decoded, dispatched; replies sent
//   server_tables.cc       the tables: creation, lookup, the ids a request may name, the attach of a
//                          same-host worker to a shard's shared memory
//   server_consistency.cc  the workers' clocks: bsp's held pushes, deferred pulls (bsp, stale:K)
//   server_save_load.cc    save and load, staged per worker until it commits or discards
//
// One thread, one loop over the PS world's connections; nothing here blocks except Endpoint::poll.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/ps.h"
#include "ps/decode.h"
#include "ps/table.h"
#include "ps/wire.h"

namespace cohort::ps::server_internal {

inline constexpr uint64_t kDone = UINT64_MAX;  // the clock of a worker that said bye

// A worker's next request, as it is received: its header, then the payload the header announces.
struct Inbox {
  RequestHeader hdr;
  Buffer payload;
  Posted hdr_recv, payload_recv;
  uint64_t seq = 0;
  bool reading_payload = false;
  bool bye = false;
};

// A reply in flight, kept until its sends complete.
struct Outgoing {
  int worker = 0;
  ReplyHeader hdr;
  Buffer payload;
  Posted hdr_send, payload_send;
};

// A request that may not be answered yet (bsp/stale pulls, bsp/stale saves): answered once every
// worker has ended step clock - lag.
struct Deferred {
  int worker = 0;
  uint64_t seq = 0;  // the worker's request number: the answer, or its error, goes there
  uint64_t clock = 0;
  uint64_t lag = 0;
  std::string what;  // "pull of 'emb'", for the slow warning
  std::function<void()> answer;
  std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
  bool warned = false;
};

// A bsp push, held until every worker has ended its step.
struct HeldPush {
  std::string table;
  std::vector<uint64_t> ids;
  std::vector<float> grads;
};

class Server {
 public:
  // server.cc
  Server(std::shared_ptr<Store> store, const std::string& prefix, int index, const Roles& roles, ConsistencyMode mode,
         std::chrono::milliseconds timeout, uint64_t max_request);
  ~Server();
  void run();

 private:
  // server.cc
  void post_header(int w);
  bool sent(Outgoing& o) { return ep_.test(o.hdr_send) && (!o.payload_send || ep_.test(o.payload_send)); }
  void reply(int w, uint64_t seq, Buffer payload = {});
  void reply_error(int w, uint64_t seq, const std::string& message);
  void handle(int w);

  // server_tables.cc
  TableShard& table(const Request& r, bool check_dim);
  void check_ids(const TableShard& t, const uint64_t* ids, uint64_t n);
  void create(int w, uint64_t seq, const Request& r);
  std::unique_ptr<TableShard> make_shard(const std::string& name, const TableConfig& c);
  void attach(int w, uint64_t seq, const Request& r);
  std::string hand_over(TableShard& t, int w, const std::string& socket_name, int64_t pid, uint32_t* holder);

  // server_consistency.cc
  // A pull in step `clock` may be answered (include/cohort/ps.h: consistency).
  uint64_t pull_lag() const { return mode_.mode == Mode::kStale ? uint64_t(mode_.staleness) : 0; }
  bool may_pull(uint64_t clock) const { return mode_.mode == Mode::kAsync || may_answer(clock, pull_lag()); }
  bool may_answer(uint64_t clock, uint64_t lag) const { return clock <= lag || min_clock() >= clock - lag; }

  uint64_t min_clock() const { return *std::min_element(clock_.begin(), clock_.end()); }

  void pull_or_defer(int w, uint64_t seq, TableShard& t, uint64_t clock, const uint64_t* ids, uint64_t n);
  void answer_pull(int w, uint64_t seq, TableShard& t, const uint64_t* ids, uint64_t n);
  void push(int w, TableShard& t, uint64_t clock, const uint64_t* ids, uint64_t n, const float* grads);
  void advance_clock(int w, uint64_t clock);
  void answer_deferred(Deferred& d);
  void apply_step(std::vector<std::vector<HeldPush>>& per_worker);
  void warn_deferred();

  // server_save_load.cc
  // A worker's save or load, staged until it commits or discards.
  struct Staged {
    std::vector<std::string> files;  // save: the shards written, deleted on discard
    std::string folder;              // save: where they are (removed on discard once empty)
    std::map<std::string, std::unique_ptr<TableShard>> tables;  // load
  };
  static std::string shard_path(const std::string& dir, const std::string& table, int k, int n);
  static void remove_files(const Staged& st);
  void discard(int w);
  void commit(int w);
  std::string stage_save(int w, const std::string& folder);
  void abandon(int w, Staged& st);
  void write_shard(const std::string& tmp, TableShard& t);
  void stage_load(int w, const std::string& dir);
  static std::string read_manifest(const std::string& path, std::string* text);
  std::unique_ptr<TableShard> load_table(const std::string& dir, const std::string& name, const TableConfig& c,
                                         int saved_servers);

  Roles roles_;
  int index_;
  ConsistencyMode mode_;
  uint64_t max_request_;
  std::chrono::milliseconds timeout_;
  Endpoint ep_;
  std::map<std::string, std::unique_ptr<TableShard>> tables_;
  std::map<int, Staged> staged_;  // per worker: its save or load, until it commits or discards
  std::vector<Inbox> inbox_;
  std::vector<uint64_t> clock_;
  std::deque<std::unique_ptr<Outgoing>> sending_;
  BufferPool pool_;
  std::deque<Deferred> deferred_;
  std::map<uint64_t, std::vector<std::vector<HeldPush>>> held_;
};

}  // namespace cohort::ps::server_internal
