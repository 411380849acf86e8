// The parameter server: one thread, one loop over the PS world's connections.
//
// The loop keeps one posted header receive per worker (the worker's next request number), reads
// the payload the header announces, handles the request and posts its reply; replies in flight
// are kept until their sends complete. Nothing here blocks except Endpoint::poll, bounded to 100 ms
// so that slow-warnings come on time. A lost worker fails the transport: serve() throws, the
// process exits non-zero and the launcher ends the job naming it.
//
// Consistency (include/cohort/ps.h): the server knows each worker's clock (its step() count, sent
// with every request). bsp holds a step's pushes until every worker has ended the step; pulls that
// may not be answered yet (bsp, stale:K) wait in `deferred_` and are retried whenever a clock moves.
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <unordered_map>

#include <fcntl.h>
#include <unistd.h>

#include "cohort/error.h"
#include "common/fd.h"
#include "common/handoff.h"
#include "common/io.h"
#include "common/log.h"
#include "ps/config_json.h"
#include "ps/decode.h"
#include "ps/server.h"
#include "ps/table.h"
#include "ps/wire.h"

namespace cohort::ps {

namespace {

constexpr uint64_t kDone = UINT64_MAX;  // the clock of a worker that said bye

struct Inbox {
  RequestHeader hdr;
  Buffer payload;
  Posted hdr_recv, payload_recv;
  uint64_t seq = 0;
  bool reading_payload = false;
  bool bye = false;
};

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

struct HeldPush {
  std::string table;
  std::vector<uint64_t> ids;
  std::vector<float> grads;
};

// A server connects to the workers only.
std::vector<bool> workers_only(const Roles& roles) {
  std::vector<bool> peers(size_t(roles.size()), false);
  for (int w = 0; w < roles.num_workers; ++w) peers[size_t(roles.worker_rank(w))] = true;
  return peers;
}

class Server {
 public:
  Server(std::shared_ptr<Store> store, const std::string& prefix, int index, const Roles& roles, ConsistencyMode mode,
         std::chrono::milliseconds timeout, uint64_t max_request)
      : roles_(roles),
        index_(index),
        mode_(mode),
        max_request_(max_request),
        timeout_(timeout),
        ep_(std::move(store), prefix, roles.server_rank(index), workers_only(roles), timeout, max_request) {
    inbox_.resize(size_t(roles_.num_workers));
    clock_.assign(size_t(roles_.num_workers), 0);
    log::debug("parameter server {} of {}: {} workers, mode {}", index_, roles_.num_servers, roles_.num_workers,
               mode_.to_string());
  }

  // A save a worker staged and never ended (it was lost in between) leaves no files.
  ~Server() {
    for (auto& [w, st] : staged_) remove_files(st);
  }

  void run() {
    for (int w = 0; w < roles_.num_workers; ++w) post_header(w);
    int open = roles_.num_workers;
    while (open > 0 || !sending_.empty()) {
      ep_.poll(100);
      for (int w = 0; w < roles_.num_workers; ++w) {
        Inbox& in = inbox_[size_t(w)];
        if (in.bye) continue;
        // Several requests of one worker may be waiting: take them all.
        for (;;) {
          if (!in.reading_payload) {
            if (!ep_.test(in.hdr_recv)) break;
            in.payload.resize(0);
            if (std::string why = check_request_frame(in.hdr, max_request_); !why.empty()) {
              // A header that is not ours, or a payload over the limit (the client refuses those
              // against the limit this server announced): refused. Its payload, whose size is not
              // to be trusted or allocated, is never received: whatever the worker sends under this
              // number is thrown away as it comes (one over the limit was never buffered: the
              // transports keep nothing over max_request that no receive asked for). Requests are
              // matched by number, so the worker's next one is read as usual.
              ep_.discard(roles_.worker_rank(w), Msg::kRequestPayload, in.seq);
              reply_error(w, in.seq, fmt::format("parameter server {}: {}", index_, why));
              ++in.seq;
              post_header(w);
              continue;
            }
            if (in.hdr.payload > 0) {
              in.payload.resize(in.hdr.payload);
              in.payload_recv = ep_.irecv(roles_.worker_rank(w), Msg::kRequestPayload, in.seq, in.payload.data(),
                                          in.payload.size());
              in.reading_payload = true;
            }
          }
          if (in.reading_payload && !ep_.test(in.payload_recv)) break;
          in.reading_payload = false;
          handle(w);
          if (in.bye) {
            --open;
            break;
          }
          ++in.seq;
          post_header(w);
        }
      }
      // Sent replies give their buffers back. Sends complete in order per peer; a long reply to one
      // worker must not keep the others' buffers: past a few, any completed one goes.
      while (!sending_.empty() && sent(*sending_.front())) {
        pool_.give(std::move(sending_.front()->payload));
        sending_.pop_front();
      }
      if (sending_.size() > 64)
        std::erase_if(sending_, [this](const std::unique_ptr<Outgoing>& o) { return sent(*o); });
      warn_deferred();
    }
  }

 private:
  void post_header(int w) {
    Inbox& in = inbox_[size_t(w)];
    in.hdr_recv = ep_.irecv(roles_.worker_rank(w), Msg::kRequest, in.seq, &in.hdr, sizeof in.hdr);
  }

  bool sent(Outgoing& o) { return ep_.test(o.hdr_send) && (!o.payload_send || ep_.test(o.payload_send)); }

  void reply(int w, uint64_t seq, Buffer payload = {}) {
    auto o = std::make_unique<Outgoing>();
    o->worker = w;
    o->payload = std::move(payload);
    o->hdr.payload = o->payload.size();
    o->hdr_send = ep_.isend(roles_.worker_rank(w), Msg::kReply, seq, &o->hdr, sizeof o->hdr);
    if (!o->payload.empty())
      o->payload_send = ep_.isend(roles_.worker_rank(w), Msg::kReplyPayload, seq, o->payload.data(), o->payload.size());
    sending_.push_back(std::move(o));
  }

  void reply_error(int w, uint64_t seq, const std::string& message) {
    auto o = std::make_unique<Outgoing>();
    o->worker = w;
    o->hdr.status = Status::kInvalid;
    std::snprintf(o->hdr.message, sizeof o->hdr.message, "%s", message.c_str());
    o->hdr_send = ep_.isend(roles_.worker_rank(w), Msg::kReply, seq, &o->hdr, sizeof o->hdr);
    sending_.push_back(std::move(o));
  }

  void handle(int w) {
    Inbox& in = inbox_[size_t(w)];
    Request r;
    // Every count, length and name is checked before it is used (decode.h); a malformed request is
    // refused like any other mistake of the worker's.
    if (std::string why = decode_request(in.hdr, in.payload.data(), in.payload.size(), max_request_, &r); !why.empty())
      return reply_error(w, in.seq, fmt::format("parameter server {}: {}", index_, why));
    try {
      switch (r.op) {
        case Op::kHello: {
          nlohmann::json j{{"mode", mode_.to_string()}, {"max_request", max_request_}};
          return reply(w, in.seq, buffer_of(j.dump()));
        }
        case Op::kCreate: return create(w, in.seq, r);
        case Op::kDescribe: {
          TableShard& t = table(r, false);
          return reply(w, in.seq, buffer_of(config_to_json(t.config()).dump()));
        }
        case Op::kPull: {
          TableShard& t = table(r, true);
          check_ids(t, r.ids, r.n);
          return pull_or_defer(w, in.seq, t, r.clock, r.ids, r.n);
        }
        case Op::kPush:
        case Op::kPushPull: {
          TableShard& t = table(r, true);
          check_ids(t, r.ids, r.n);
          // The pull ids follow dim * n floats: not 8-byte aligned for an odd dim, so copied out.
          std::vector<uint64_t> pull_ids(r.m);
          if (r.m > 0) std::memcpy(pull_ids.data(), r.pull_ids, r.m * 8);
          check_ids(t, pull_ids.data(), r.m);
          push(w, t, r.clock, r.ids, r.n, r.grads);
          if (r.op == Op::kPush) return reply(w, in.seq);
          advance_clock(w, r.clock + 1);
          return pull_or_defer(w, in.seq, t, r.clock + 1, pull_ids.data(), r.m);
        }
        case Op::kClock:
          reply(w, in.seq);
          return advance_clock(w, r.clock);
        case Op::kSave: {
          // bsp/stale: the files hold every push of the steps the saving worker has ended (held bsp
          // sums included), whatever order the workers' messages arrive in.
          const uint64_t seq = in.seq;
          auto answer = [this, w, seq, dir = r.text] {
            try {
              reply(w, seq, buffer_of(stage_save(w, dir)));
            } catch (const InvalidArgument& e) {  // stage_save makes every error of a save one
              reply_error(w, seq, fmt::format("parameter server {}: {}", index_, e.what()));
            }
          };
          if (mode_.mode == Mode::kAsync || may_answer(r.clock, 0)) return answer();
          deferred_.push_back(Deferred{w, seq, r.clock, 0, fmt::format("save to {}", r.text), answer});
          return;
        }
        case Op::kLoad:
          stage_load(w, r.text);
          return reply(w, in.seq);
        case Op::kCommit:
          commit(w);
          return reply(w, in.seq);
        case Op::kDiscard:
          discard(w);
          return reply(w, in.seq);
        case Op::kStats: {
          TableShard& t = table(r, false);
          uint64_t s[4] = {t.rows(), t.bytes(), t.applied(), t.direct_applied()};
          static_assert(sizeof s == kStatsReplyBytes);
          Buffer out;
          out.resize(sizeof s);
          std::memcpy(out.data(), s, sizeof s);
          return reply(w, in.seq, std::move(out));
        }
        case Op::kAttach: return attach(w, in.seq, r);
        case Op::kBye:
          in.bye = true;
          reply(w, in.seq);
          return advance_clock(w, kDone);
      }
    } catch (const InvalidArgument& e) {
      // The worker's mistake: it gets the reason; everyone else is served on.
      reply_error(w, in.seq, fmt::format("parameter server {}: {}", index_, e.what()));
    }
  }

  TableShard& table(const Request& r, bool check_dim) {
    auto it = tables_.find(r.table);
    if (it == tables_.end()) {
      std::vector<std::string> names;
      for (auto& [n, t] : tables_) names.push_back("'" + n + "'");
      throw InvalidArgument(fmt::format("no table '{}' (tables: {})", r.table,
                                        names.empty() ? "none; call create_table first" : fmt::format("{}", fmt::join(names, ", "))));
    }
    if (check_dim && r.dim != it->second->dim())
      throw InvalidArgument(fmt::format("table '{}' has rows of dim {}; this {} was built for dim {}", r.table,
                                        it->second->dim(), op_name(r.op), r.dim));
    return *it->second;
  }

  void check_ids(const TableShard& t, const uint64_t* ids, uint64_t n) {
    const TableConfig& c = t.config();
    for (uint64_t i = 0; i < n; ++i) {
      if (c.dense && ids[i] >= c.rows)
        throw InvalidArgument(fmt::format("table '{}': row {} is outside the dense table's {} rows", t.name(), ids[i],
                                          c.rows));
      int owner = c.dense ? shard_of_row(ids[i], c.rows, roles_.num_servers) : shard_of_id(ids[i], roles_.num_servers);
      if (owner != index_)
        throw InvalidArgument(fmt::format("table '{}': id {} belongs to server {}, not {} (does the worker see {} servers?)",
                                          t.name(), ids[i], owner, index_, roles_.num_servers));
    }
  }

  void create(int w, uint64_t seq, const Request& r) {
    auto it = tables_.find(r.table);
    if (it != tables_.end()) {
      std::string diff = config_difference(it->second->config(), r.config);
      if (!diff.empty())
        throw InvalidArgument(fmt::format("create_table '{}': the table exists with {}", r.table, diff));
      return reply(w, seq);
    }
    tables_.emplace(r.table, make_shard(r.table, r.config));
    reply(w, seq);
  }

  std::unique_ptr<TableShard> make_shard(const std::string& name, const TableConfig& c) {
    if (!c.dense) {
      // expected_rows: this server's share (the hash spreads ids evenly), and 1/64 more for the spread.
      const uint64_t share = (c.expected_rows + uint64_t(roles_.num_servers) - 1) / uint64_t(roles_.num_servers);
      return std::make_unique<TableShard>(name, c, 0, 0, timeout_, share + share / 64, index_);
    }
    // Dense: this server's contiguous range (shard_of_row).
    uint64_t per = (c.rows + uint64_t(roles_.num_servers) - 1) / uint64_t(roles_.num_servers);
    uint64_t first = std::min(c.rows, per * uint64_t(index_));
    uint64_t last = std::min(c.rows, first + per);
    return std::make_unique<TableShard>(name, c, first, last - first, timeout_, 0, index_);
  }

  // A worker on this host asks for a table's shared memory (table.h), to pull and push rows itself.
  // Only in async mode: bsp holds pushes and stale:K holds pulls here, by the server's clock.
  // The request (checked by decode_request): the worker's abstract Unix socket and its pid.
  void attach(int w, uint64_t seq, const Request& r) {
    TableShard& t = table(r, false);
    nlohmann::json j{{"attached", false}};
    uint32_t holder = 0;
    if (mode_.mode != Mode::kAsync) {
      j["why"] = fmt::format("{} mode: pushes and pulls follow the server's clock", mode_.to_string());
    } else if (std::string why = hand_over(t, w, r.text, r.pid, &holder); !why.empty()) {
      j["why"] = why;
    } else {
      j = {{"attached", true}, {"pid", ::getpid()}, {"holder", holder}, {"first_row", t.first_row()},
           {"rows", t.held_rows()}, {"config", config_to_json(t.config())}};
    }
    reply(w, seq, buffer_of(j.dump()));
  }

  // Sends the shard's memfds to the worker's abstract socket (the memfd handoff, common/handoff.h:
  // scope, the socket's name; role, this server's index); "" on success, else why not. The socket must
  // be the process that asked (`pid`, of this job's connection to worker w), which then becomes one of
  // the shard's holders (table.h), so that a process waiting for its locks can see it die. The worker
  // listens already (no waiting), and checks the tables' sizes as it maps them.
  std::string hand_over(TableShard& t, int w, const std::string& socket_name, int64_t pid, uint32_t* holder) {
    const std::string whom = fmt::format("worker {}", w);
    try {
      UniqueFd sock = handoff::connect(socket_name, int(pid), whom, Deadline::after(std::chrono::seconds(0)));
      *holder = t.register_holder(w, int(pid));
      if (*holder == 0)
        return fmt::format("{} processes hold table '{}' already", TableShard::kMaxHolders, t.name());
      handoff::send(sock.get(), handoff::make_hello(handoff::scope_of(socket_name), uint32_t(index_)), t.fds(),
                    Deadline::after(std::chrono::seconds(1)), whom);
    } catch (const TimeoutError& e) {
      return e.what();  // no such socket here (a worker in another network namespace): nobody to refuse
    } catch (const Error& e) {
      log::warn("parameter server {}: refused worker {}'s attach of table '{}': {}", index_, w, t.name(), e.what());
      return e.what();
    }
    return {};
  }

  // A pull in step `clock` may be answered (include/cohort/ps.h: consistency).
  uint64_t pull_lag() const { return mode_.mode == Mode::kStale ? uint64_t(mode_.staleness) : 0; }
  bool may_pull(uint64_t clock) const { return mode_.mode == Mode::kAsync || may_answer(clock, pull_lag()); }
  bool may_answer(uint64_t clock, uint64_t lag) const { return clock <= lag || min_clock() >= clock - lag; }

  uint64_t min_clock() const { return *std::min_element(clock_.begin(), clock_.end()); }

  void pull_or_defer(int w, uint64_t seq, TableShard& t, uint64_t clock, const uint64_t* ids, uint64_t n) {
    if (may_pull(clock)) return answer_pull(w, seq, t, ids, n);
    auto answer = [this, w, seq, table = t.name(), kept = std::vector<uint64_t>(ids, ids + n)] {
      auto it = tables_.find(table);
      if (it == tables_.end())  // replaced by a load meanwhile
        reply_error(w, seq, fmt::format("parameter server {}: table '{}' is gone", index_, table));
      else
        answer_pull(w, seq, *it->second, kept.data(), kept.size());
    };
    deferred_.push_back(Deferred{w, seq, clock, pull_lag(), fmt::format("pull of '{}'", t.name()), answer});
  }

  void answer_pull(int w, uint64_t seq, TableShard& t, const uint64_t* ids, uint64_t n) {
    Buffer rows = pool_.take(n * t.dim() * 4);
    t.read(ids, n, reinterpret_cast<float*>(rows.data()));
    reply(w, seq, std::move(rows));
  }

  void push(int w, TableShard& t, uint64_t clock, const uint64_t* ids, uint64_t n, const float* grads) {
    if (mode_.mode != Mode::kBsp) return t.apply(ids, n, grads);
    held_[clock].resize(size_t(roles_.num_workers));
    held_[clock][size_t(w)].push_back(
        HeldPush{t.name(), std::vector<uint64_t>(ids, ids + n), std::vector<float>(grads, grads + n * t.dim())});
  }

  void advance_clock(int w, uint64_t clock) {
    uint64_t before = min_clock();
    clock_[size_t(w)] = std::max(clock_[size_t(w)], clock);
    uint64_t now = min_clock();
    if (now == before) return;
    // bsp: every worker has ended the steps below `now`: apply what they pushed in them.
    while (!held_.empty() && held_.begin()->first < now) {
      apply_step(held_.begin()->second);
      held_.erase(held_.begin());
    }
    // In arrival order: a worker's deferred requests are answered in the order it sent them.
    for (auto it = deferred_.begin(); it != deferred_.end();) {
      if (!may_answer(it->clock, it->lag)) {
        ++it;
        continue;
      }
      Deferred d = std::move(*it);
      it = deferred_.erase(it);
      answer_deferred(d);
    }
  }

  // A deferred answer runs inside another worker's request (the one whose clock moved): an error of
  // it is its own worker's, under its own request number, never a second reply to the worker
  // being handled.
  void answer_deferred(Deferred& d) {
    try {
      d.answer();
    } catch (const InvalidArgument& e) {
      reply_error(d.worker, d.seq, fmt::format("parameter server {}: {}", index_, e.what()));
    }
  }

  // Sums one step's pushes per row, in worker order (reproducible), and applies each row once.
  void apply_step(std::vector<std::vector<HeldPush>>& per_worker) {
    struct Sum {
      std::unordered_map<uint64_t, size_t> at;
      std::vector<uint64_t> ids;
      std::vector<float> grads;
    };
    std::map<std::string, Sum> sums;
    for (auto& pushes : per_worker) {
      for (auto& p : pushes) {
        auto t = tables_.find(p.table);
        if (t == tables_.end()) continue;
        const size_t d = t->second->dim();
        Sum& s = sums[p.table];
        for (size_t i = 0; i < p.ids.size(); ++i) {
          auto [pos, fresh] = s.at.try_emplace(p.ids[i], s.ids.size());
          if (fresh) {
            s.ids.push_back(p.ids[i]);
            s.grads.insert(s.grads.end(), p.grads.begin() + long(i * d), p.grads.begin() + long((i + 1) * d));
          } else {
            for (size_t j = 0; j < d; ++j) s.grads[pos->second * d + j] += p.grads[i * d + j];
          }
        }
      }
    }
    for (auto& [name, s] : sums) tables_[name]->apply(s.ids.data(), s.ids.size(), s.grads.data());
  }

  void warn_deferred() {
    auto now = std::chrono::steady_clock::now();
    for (auto& d : deferred_) {
      if (d.warned || now - d.since < std::chrono::seconds(10)) continue;
      d.warned = true;
      std::vector<int> behind;
      for (int w = 0; w < roles_.num_workers; ++w)
        if (clock_[size_t(w)] + d.lag < d.clock) behind.push_back(w);
      log::warn("parameter server {}: worker {}'s {} in step {} has waited 10 s for worker(s) {} to end step {} ({} "
                "mode)",
                index_, d.worker, d.what, d.clock, fmt::join(behind, ","), d.clock - d.lag - 1, mode_.to_string());
    }
  }

  // ---- save and load (docs/parameter-server.md: "Save and load") ----
  //
  // Both are staged, so that they are all or nothing across the servers: a save writes each shard
  // into a folder of its own that no manifest names yet (the worker picks a fresh one per save), a
  // load reads and checks every file into new tables beside the old ones. The worker then tells
  // every server to commit (keep the files, or swap the tables in) or, where any server refused, to
  // discard what it staged (delete the files). A worker has at most one save or load staged.
  //
  // Any error of a save or load (a full disk, a row lock held past the timeout, memory that cannot
  // be had) is the requesting worker's: stage_save and stage_load throw them all as
  // InvalidArgument, and this server serves on.

  struct Staged {
    std::vector<std::string> files;  // save: the shards written, deleted on discard
    std::string folder;              // save: where they are (removed on discard once empty)
    std::map<std::string, std::unique_ptr<TableShard>> tables;  // load
  };

  static std::string shard_path(const std::string& dir, const std::string& table, int k, int n) {
    return fmt::format("{}/{}.shard-{}-of-{}", dir, table, k, n);
  }

  // Every server writes into the same folder: the last one to leave it empty removes it.
  static void remove_files(const Staged& st) {
    for (const auto& f : st.files) ::unlink(f.c_str());
    if (!st.folder.empty()) ::rmdir(st.folder.c_str());
  }

  void discard(int w) {
    auto it = staged_.find(w);
    if (it == staged_.end()) return;
    remove_files(it->second);
    staged_.erase(it);
  }

  // Nothing here can fail: a save's files are in place already (the worker's manifest names them),
  // a load's tables are swapped in.
  void commit(int w) {
    auto it = staged_.find(w);
    if (it == staged_.end()) throw InvalidArgument("commit: this worker has no save or load staged on this server");
    Staged st = std::move(it->second);
    staged_.erase(it);
    for (auto& [name, shard] : st.tables) tables_[name] = std::move(shard);  // the old shards retire
  }

  // Writes every table's shard into `folder` (a fresh one, named by no manifest yet); returns
  // {table: config} of them.
  std::string stage_save(int w, const std::string& folder) {
    discard(w);
    Staged st;
    std::string path = folder;
    try {
      std::error_code ec;
      if (!std::filesystem::create_directories(folder, ec) && ec)
        throw InvalidArgument(fmt::format("save: {}: cannot create the directory: {}", folder, ec.message()));
      st.folder = folder;
      nlohmann::json saved = nlohmann::json::object();
      for (auto& [name, t] : tables_) {
        path = shard_path(folder, name, index_, roles_.num_servers);
        st.files.push_back(path);
        write_shard(path, *t);
        saved[name] = config_to_json(t->config());
      }
      staged_[w] = std::move(st);
      return saved.dump();
    } catch (const InvalidArgument&) {
      abandon(w, st);
      throw;
    } catch (const std::bad_alloc&) {
      abandon(w, st);
      throw InvalidArgument(fmt::format("save: {}: out of memory", path));
    } catch (const std::exception& e) {  // a row lock held past the timeout, the table's memory
      abandon(w, st);
      throw InvalidArgument(fmt::format("save: {}: {}", path, e.what()));
    }
  }

  // A save this server could not write: its own files go now, but not the folder, which the other
  // servers may still be writing into (removing it would fail them too, and their error could reach
  // the worker before this one's); the worker's discard, which every server gets once all answered,
  // removes it.
  void abandon(int w, Staged& st) {
    for (const auto& f : st.files) ::unlink(f.c_str());
    Staged folder_only;
    folder_only.folder = st.folder;
    staged_[w] = std::move(folder_only);
  }

  // A shard file: a JSON header line, then one record per row (id u64, values f32 x dim, optimizer
  // state f32 x state_floats). Workers on this host may create rows while the shard is read
  // (for_each visits the rows that existed when it began), so the header's row count is the number
  // of records written: 20 spaces at first, filled in at the end (JSON allows the blanks).
  void write_shard(const std::string& tmp, TableShard& t) {
    auto fail = [&](const char* what) {
      throw InvalidArgument(fmt::format("save: {}: cannot {}: {}", tmp, what, std::strerror(errno)));
    };
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd) fail("create it");
    const nlohmann::json head{{"table", t.name()}, {"config", config_to_json(t.config())}, {"server", index_},
                              {"servers", roles_.num_servers}, {"state_floats", state_floats(t.config())}};
    std::string line = head.dump();
    line.pop_back();  // its closing brace: "rows" comes last
    line += ",\"rows\":";
    const size_t rows_at = line.size();
    line += std::string(20, ' ') + "}\n";
    constexpr size_t kChunk = 1 << 20;
    std::vector<char> buf(line.begin(), line.end());
    buf.reserve(kChunk + line.size());
    auto flush = [&] {
      if (!io::write_all(fd.get(), buf.data(), buf.size())) fail("write it");
      buf.clear();
    };
    const size_t d = t.dim(), sf = state_floats(t.config());
    uint64_t rows = 0;
    t.for_each([&](uint64_t id, const float* values, const float* state) {
      const char* p = reinterpret_cast<const char*>(&id);
      buf.insert(buf.end(), p, p + 8);
      buf.insert(buf.end(), reinterpret_cast<const char*>(values), reinterpret_cast<const char*>(values + d));
      buf.insert(buf.end(), reinterpret_cast<const char*>(state), reinterpret_cast<const char*>(state + sf));
      ++rows;
      if (buf.size() >= kChunk) flush();
    });
    flush();
    const std::string count = fmt::format("{:<20}", rows);
    if (::pwrite(fd.get(), count.data(), count.size(), off_t(rows_at)) != ssize_t(count.size())) fail("write it");
    if (::fsync(fd.get()) != 0) fail("sync it");
  }

  // Reads and checks dir/manifest.json and every shard it names into new tables, kept until commit.
  // Every error is the loading worker's (InvalidArgument); what was staged is dropped.
  void stage_load(int w, const std::string& dir) {
    discard(w);
    const std::string path = dir + "/manifest.json";
    std::string text;
    if (std::string why = read_manifest(path, &text); !why.empty())
      throw InvalidArgument(fmt::format("load: {}: {}", path, why));
    Manifest m;
    if (std::string why = parse_manifest(text, &m); !why.empty())
      throw InvalidArgument(fmt::format("load: {}: {}", path, why));
    // A save names its shards' folder; a manifest of before that keeps them beside it.
    const std::string shards = m.shards.empty() ? dir : dir + "/" + m.shards;
    Staged st;
    std::string table;
    try {
      for (auto& [name, c] : m.tables) {
        table = name;
        st.tables[name] = load_table(shards, name, c, m.servers);
      }
    } catch (const InvalidArgument&) {
      throw;
    } catch (const std::bad_alloc&) {
      throw InvalidArgument(fmt::format("load: {}: table '{}': out of memory", dir, table));
    } catch (const std::exception& e) {  // the new table's memory (memfd, mmap, growing it)
      throw InvalidArgument(fmt::format("load: {}: table '{}': {}", dir, table, e.what()));
    }
    staged_[w] = std::move(st);
  }

  static std::string read_manifest(const std::string& path, std::string* text) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd)
      return fmt::format("cannot open it: {} (was the directory written by save? every server reads it, so it must "
                         "be on a filesystem they all see)",
                         std::strerror(errno));
    char chunk[65536];
    for (;;) {
      const ssize_t k = ::read(fd.get(), chunk, sizeof chunk);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0) return fmt::format("cannot read it: {}", std::strerror(errno));
      if (k == 0) return "";
      text->append(chunk, size_t(k));
      if (text->size() > kMaxJsonBytes) return fmt::format("larger than {} bytes", kMaxJsonBytes);
    }
  }

  // Every saved shard of one table, keeping the rows this server owns under the current server count.
  // Every record is checked: a file holds exactly the rows its header counts, each in the shard the
  // file is for, each id once.
  std::unique_ptr<TableShard> load_table(const std::string& dir, const std::string& name, const TableConfig& c,
                                         int saved_servers) {
    auto shard = make_shard(name, c);
    const size_t d = c.dim, sf = state_floats(c);
    const size_t record = 8 + (d + sf) * 4;
    std::vector<char> rec(record);
    std::vector<float> values(d), state(sf);
    std::vector<bool> seen(c.dense ? shard->held_rows() : 0);  // dense rows exist from the start
    for (int k = 0; k < saved_servers; ++k) {
      const std::string path = shard_path(dir, name, k, saved_servers);
      auto bad = [&](const std::string& what) { return InvalidArgument(fmt::format("load: {}: {}", path, what)); };
      std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rbe"), &std::fclose);
      if (!f) throw bad(fmt::format("cannot open it: {}", std::strerror(errno)));
      constexpr size_t kMaxHeader = 65536;
      std::string line;
      int ch = 0;
      while (line.size() <= kMaxHeader && (ch = std::getc(f.get())) != EOF && ch != '\n') line += char(ch);
      if (ch != '\n')
        throw bad(ch == EOF ? std::string("ends within its header line")
                            : fmt::format("no header line within its first {} bytes", kMaxHeader));
      ShardFileHeader h;
      if (std::string why = parse_shard_header(line, &h); !why.empty()) throw bad(why);
      if (h.table != name) throw bad(fmt::format("its header names table '{}'", h.table));
      if (h.server != k || h.servers != saved_servers)
        throw bad(fmt::format("its header says shard {} of {}", h.server, h.servers));
      const nlohmann::json in_file = config_to_json(h.config), in_manifest = config_to_json(c);
      for (auto& [key, v] : in_file.items())
        if (v != in_manifest.at(key))
          throw bad(fmt::format("its header's configuration differs from the manifest's: {} {} (manifest: {})", key,
                                v.dump(), in_manifest.at(key).dump()));
      if (h.state_floats != sf)
        throw bad(fmt::format("its header says {} optimizer-state floats per row, the configuration {}",
                              h.state_floats, sf));
      for (uint64_t r = 0; r < h.rows; ++r) {
        if (std::fread(rec.data(), 1, record, f.get()) != record)
          throw bad(fmt::format("ends after {} of the {} rows its header counts{}", r, h.rows,
                                std::ferror(f.get()) ? fmt::format(" ({})", std::strerror(errno)) : ""));
        uint64_t id = 0;
        std::memcpy(&id, rec.data(), 8);
        if (c.dense && id >= c.rows)
          throw bad(fmt::format("row {}: id {} is outside the dense table's {} rows", r, id, c.rows));
        const int saved_owner = c.dense ? shard_of_row(id, c.rows, saved_servers) : shard_of_id(id, saved_servers);
        if (saved_owner != k) throw bad(fmt::format("row {}: id {} belongs in shard {}, not in this one", r, id, saved_owner));
        const int owner = c.dense ? shard_of_row(id, c.rows, roles_.num_servers) : shard_of_id(id, roles_.num_servers);
        if (owner != index_) continue;
        std::memcpy(values.data(), rec.data() + 8, d * 4);
        if (sf) std::memcpy(state.data(), rec.data() + 8 + d * 4, sf * 4);
        // A second record of one id (a damaged file) is found by its owner only: in a sparse shard
        // the row then exists already, in a dense one it was put before.
        bool again = false;
        if (c.dense) {
          auto slot = seen[id - shard->first_row()];
          again = slot;
          slot = true;
          shard->put(id, values.data(), state.data());
        } else {
          const uint64_t before = shard->rows();
          shard->put(id, values.data(), state.data());
          again = shard->rows() == before;
        }
        if (again) throw bad(fmt::format("row {}: id {} comes a second time", r, id));
      }
      if (std::getc(f.get()) != EOF) throw bad(fmt::format("holds more than the {} rows its header counts", h.rows));
    }
    return shard;
  }

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

}  // namespace

void run_server(std::shared_ptr<Store> store, const std::string& prefix, int index, const Roles& roles,
                ConsistencyMode mode, std::chrono::milliseconds timeout, uint64_t max_request) {
  try {
    Server(std::move(store), prefix, index, roles, mode, timeout, max_request).run();
  } catch (const PeerLostError& e) {
    throw PeerLostError(fmt::format("parameter server {}: {}", index, name_roles(e.what(), roles.num_servers)));
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("parameter server {}: {}", index, name_roles(e.what(), roles.num_servers)));
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Error& e) {
    throw Error(fmt::format("parameter server {}: {}", index, name_roles(e.what(), roles.num_servers)));
  }
}

}  // namespace cohort::ps
