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
#include <fstream>
#include <map>
#include <unordered_map>

#include <sys/socket.h>
#include <unistd.h>

#include "cohort/error.h"
#include "common/fd.h"
#include "common/log.h"
#include "common/socket.h"
#include "ps/config_json.h"
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

template <typename T>
const T* at(const Buffer& buf, size_t offset) {
  return reinterpret_cast<const T*>(buf.data() + offset);
}

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
        ep_(std::move(store), prefix, roles.server_rank(index), workers_only(roles), timeout) {
    inbox_.resize(size_t(roles_.num_workers));
    clock_.assign(size_t(roles_.num_workers), 0);
    log::debug("parameter server {} of {}: {} workers, mode {}", index_, roles_.num_servers, roles_.num_workers,
               mode_.to_string());
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
            if (in.hdr.magic != kRequestMagic)
              throw Error(fmt::format("parameter server {}: worker {} sent a malformed request (magic {:#x})", index_,
                                      w, in.hdr.magic));
            if (in.hdr.payload > 0) {
              // Oversized requests are refused by the client against the limit this server
              // announced; one that comes anyway is read (the transport needs it consumed) and refused.
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
    const RequestHeader& h = in.hdr;
    try {
      if (h.payload > max_request_)
        throw InvalidArgument(fmt::format("{} request of {} bytes exceeds this server's limit of {} bytes "
                                          "(COHORT_PS_MAX_REQUEST)", op_name(h.op), h.payload, max_request_));
      switch (h.op) {
        case Op::kHello: {
          nlohmann::json j{{"mode", mode_.to_string()}, {"max_request", max_request_}};
          return reply(w, in.seq, buffer_of(j.dump()));
        }
        case Op::kCreate: return create(w, in);
        case Op::kDescribe: {
          TableShard& t = table(h, false);
          return reply(w, in.seq, buffer_of(config_to_json(t.config()).dump()));
        }
        case Op::kPull: {
          TableShard& t = table(h, true);
          check_size(h, h.n * 8);
          const uint64_t* ids = at<uint64_t>(in.payload, 0);
          check_ids(t, ids, h.n);
          return pull_or_defer(w, in.seq, t, h.clock, ids, h.n);
        }
        case Op::kPush:
        case Op::kPushPull: {
          TableShard& t = table(h, true);
          const size_t push_bytes = h.n * 8 + h.n * t.dim() * 4;
          check_size(h, push_bytes + (h.op == Op::kPushPull ? h.m * 8 : 0));
          const uint64_t* ids = at<uint64_t>(in.payload, 0);
          const float* grads = at<float>(in.payload, h.n * 8);
          check_ids(t, ids, h.n);
          // The pull ids follow dim * n floats: not 8-byte aligned for an odd dim, so copied out.
          std::vector<uint64_t> pull_ids(h.op == Op::kPushPull ? h.m : 0);
          if (!pull_ids.empty()) std::memcpy(pull_ids.data(), in.payload.data() + push_bytes, h.m * 8);
          if (h.op == Op::kPushPull) check_ids(t, pull_ids.data(), h.m);
          push(w, t, h.clock, ids, h.n, grads);
          if (h.op == Op::kPush) return reply(w, in.seq);
          advance_clock(w, h.clock + 1);
          return pull_or_defer(w, in.seq, t, h.clock + 1, pull_ids.data(), h.m);
        }
        case Op::kClock:
          reply(w, in.seq);
          return advance_clock(w, h.clock);
        case Op::kSave: {
          // bsp/stale: the files hold every push of the steps the saving worker has ended (held bsp
          // sums included), whatever order the workers' messages arrive in.
          std::string dir(in.payload.begin(), in.payload.end());
          const uint64_t seq = in.seq;
          auto answer = [this, w, seq, dir] {
            try {
              reply(w, seq, buffer_of(save(dir)));
            } catch (const InvalidArgument& e) {
              reply_error(w, seq, fmt::format("parameter server {}: {}", index_, e.what()));
            }
          };
          if (mode_.mode == Mode::kAsync || may_answer(h.clock, 0)) return answer();
          deferred_.push_back(Deferred{w, h.clock, 0, fmt::format("save to {}", dir), answer});
          return;
        }
        case Op::kLoad:
          load(std::string(in.payload.begin(), in.payload.end()));
          return reply(w, in.seq);
        case Op::kStats: {
          TableShard& t = table(h, false);
          uint64_t s[4] = {t.rows(), t.bytes(), t.applied(), t.direct_applied()};
          Buffer out;
          out.resize(sizeof s);
          std::memcpy(out.data(), s, sizeof s);
          return reply(w, in.seq, std::move(out));
        }
        case Op::kAttach: return attach(w, in);
        case Op::kBye:
          in.bye = true;
          reply(w, in.seq);
          return advance_clock(w, kDone);
      }
      throw InvalidArgument(fmt::format("unknown request type {}", int(h.op)));
    } catch (const InvalidArgument& e) {
      // The worker's mistake: it gets the reason; everyone else is served on.
      reply_error(w, in.seq, fmt::format("parameter server {}: {}", index_, e.what()));
    }
  }

  void check_size(const RequestHeader& h, size_t expected) {
    if (h.payload != expected)
      throw InvalidArgument(fmt::format("{} of '{}': payload of {} bytes, expected {} for {} ids of dim {}",
                                        op_name(h.op), table_name(h), h.payload, expected, h.n, h.dim));
  }

  TableShard& table(const RequestHeader& h, bool check_dim) {
    auto name = table_name(h);
    auto it = tables_.find(name);
    if (it == tables_.end()) {
      std::vector<std::string> names;
      for (auto& [n, t] : tables_) names.push_back("'" + n + "'");
      throw InvalidArgument(fmt::format("no table '{}' (tables: {})", name,
                                        names.empty() ? "none; call create_table first" : fmt::format("{}", fmt::join(names, ", "))));
    }
    if (check_dim && h.dim != it->second->dim())
      throw InvalidArgument(fmt::format("table '{}' has rows of dim {}; this {} was built for dim {}", name,
                                        it->second->dim(), op_name(h.op), h.dim));
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

  void create(int w, Inbox& in) {
    auto name = table_name(in.hdr);
    TableConfig c;
    try {
      c = config_from_json(nlohmann::json::parse(in.payload.begin(), in.payload.end()));
    } catch (const nlohmann::json::exception& e) {
      throw InvalidArgument(fmt::format("create_table '{}': unreadable configuration ({})", name, e.what()));
    }
    validate(name, c);
    auto it = tables_.find(name);
    if (it != tables_.end()) {
      std::string diff = config_difference(it->second->config(), c);
      if (!diff.empty())
        throw InvalidArgument(fmt::format("create_table '{}': the table exists with {}", name, diff));
      return reply(w, in.seq);
    }
    tables_.emplace(name, make_shard(name, c));
    reply(w, in.seq);
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
  // The request: JSON {"socket": the worker's abstract Unix socket, "pid": the worker's pid}.
  void attach(int w, Inbox& in) {
    TableShard& t = table(in.hdr, false);
    const auto req = nlohmann::json::parse(in.payload.begin(), in.payload.end(), nullptr, false);
    if (!req.is_object() || !req.contains("socket") || !req["socket"].is_string() || !req.contains("pid") ||
        !req["pid"].is_number_integer())
      throw InvalidArgument(fmt::format("attach of '{}': expected {{\"socket\": name, \"pid\": pid}}", t.name()));
    nlohmann::json j{{"attached", false}};
    uint32_t holder = 0;
    if (mode_.mode != Mode::kAsync) {
      j["why"] = fmt::format("{} mode: pushes and pulls follow the server's clock", mode_.to_string());
    } else if (std::string why = hand_over(t, w, req["socket"].get<std::string>(), req["pid"].get<int64_t>(), &holder);
               !why.empty()) {
      j["why"] = why;
    } else {
      j = {{"attached", true}, {"pid", ::getpid()}, {"holder", holder}, {"first_row", t.first_row()},
           {"rows", t.held_rows()}, {"config", config_to_json(t.config())}};
    }
    reply(w, in.seq, buffer_of(j.dump()));
  }

  // Sends the shard's memfds to the worker's abstract socket; "" on success, else why not (a
  // worker in another network namespace has no such socket here). Abstract sockets have no
  // permissions, so the socket's owner is checked (SO_PEERCRED) before: it must be the process that
  // asked (`pid`, of this job's connection to worker w), of this server's user. It becomes one of
  // the shard's holders (table.h), so that a process waiting for its locks can see it die.
  std::string hand_over(TableShard& t, int w, const std::string& socket_name, int64_t pid, uint32_t* holder) {
    UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!sock) return fmt::format("socket: {}", std::strerror(errno));
    socklen_t len = 0;
    sockaddr_un addr = net::abstract_address(socket_name, &len);
    if (::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0)
      return fmt::format("cannot reach the worker's socket: {}", std::strerror(errno));
    ucred peer{};
    socklen_t peer_len = sizeof peer;
    if (::getsockopt(sock.get(), SOL_SOCKET, SO_PEERCRED, &peer, &peer_len) != 0)
      return fmt::format("cannot read the credentials of the worker's socket: {}", std::strerror(errno));
    std::string refused;
    if (peer.uid != ::geteuid())
      refused = fmt::format("its socket '{}' belongs to uid {} (pid {}), not to this job's uid {}", socket_name,
                            peer.uid, peer.pid, ::geteuid());
    else if (peer.pid != pid)
      refused = fmt::format("its socket '{}' belongs to pid {}, not to the worker (pid {})", socket_name, peer.pid,
                            pid);
    if (!refused.empty()) {
      log::warn("parameter server {}: refused worker {}'s attach of table '{}': {}", index_, w, t.name(), refused);
      return refused;
    }
    *holder = t.register_holder(w, peer.pid);
    if (*holder == 0)
      return fmt::format("{} processes hold table '{}' already", TableShard::kMaxHolders, t.name());
    const char tag = 'T';
    if (net::send_with_fds(sock.get(), &tag, 1, t.fds(), MSG_DONTWAIT) != 1)
      return fmt::format("cannot send the table's memory: {}", std::strerror(errno));
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
    deferred_.push_back(Deferred{w, clock, pull_lag(), fmt::format("pull of '{}'", t.name()), answer});
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
      auto answer = std::move(it->answer);
      it = deferred_.erase(it);
      answer();
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

  // ---- save and load (docs/parameter-server.md: file format) ----

  std::string shard_path(const std::string& dir, const std::string& table, int k, int n) const {
    return fmt::format("{}/{}.shard-{}-of-{}", dir, table, k, n);
  }

  std::string save(const std::string& dir) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw InvalidArgument(fmt::format("save: cannot create directory {}: {}", dir, ec.message()));
    nlohmann::json saved = nlohmann::json::object();
    for (auto& [name, t] : tables_) {
      std::string path = shard_path(dir, name, index_, roles_.num_servers);
      std::string tmp = path + ".tmp";
      {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        if (!out) throw InvalidArgument(fmt::format("save: cannot write {}", tmp));
        nlohmann::json head{{"table", name}, {"config", config_to_json(t->config())}, {"rows", t->rows()},
                            {"server", index_}, {"servers", roles_.num_servers}, {"state_floats", state_floats(t->config())}};
        out << head.dump() << '\n';
        const size_t d = t->dim(), sf = state_floats(t->config());
        t->for_each([&](uint64_t id, const float* values, const float* state) {
          out.write(reinterpret_cast<const char*>(&id), 8);
          out.write(reinterpret_cast<const char*>(values), std::streamsize(d * 4));
          out.write(reinterpret_cast<const char*>(state), std::streamsize(sf * 4));
        });
        out.flush();
        if (!out) throw InvalidArgument(fmt::format("save: writing {} failed", tmp));
      }
      fs::rename(tmp, path, ec);  // atomic: a reader sees the old shard or the whole new one
      if (ec) throw InvalidArgument(fmt::format("save: cannot rename {}: {}", tmp, ec.message()));
      saved[name] = config_to_json(t->config());
    }
    return saved.dump();
  }

  void load(const std::string& dir) {
    std::ifstream mf(dir + "/manifest.json");
    if (!mf) throw InvalidArgument(fmt::format("load: {}/manifest.json not found (was the directory written by save?)", dir));
    nlohmann::json manifest;
    try {
      manifest = nlohmann::json::parse(mf);
    } catch (const std::exception& e) {
      throw InvalidArgument(fmt::format("load: {}/manifest.json is not valid JSON ({})", dir, e.what()));
    }
    const int saved_servers = manifest.value("servers", 0);
    std::map<std::string, std::unique_ptr<TableShard>> loaded;
    for (auto& [name, cj] : manifest.at("tables").items()) {
      TableConfig c = config_from_json(cj);
      auto shard = make_shard(name, c);
      const size_t d = c.dim, sf = state_floats(c);
      std::vector<float> values(d), state(sf);
      for (int k = 0; k < saved_servers; ++k) {
        std::string path = shard_path(dir, name, k, saved_servers);
        std::ifstream in(path, std::ios::binary);
        if (!in) throw InvalidArgument(fmt::format("load: {} is missing", path));
        std::string head_line;
        std::getline(in, head_line);
        auto head = nlohmann::json::parse(head_line);
        uint64_t rows = head.at("rows").get<uint64_t>();
        for (uint64_t r = 0; r < rows; ++r) {
          uint64_t id;
          in.read(reinterpret_cast<char*>(&id), 8);
          in.read(reinterpret_cast<char*>(values.data()), std::streamsize(d * 4));
          in.read(reinterpret_cast<char*>(state.data()), std::streamsize(sf * 4));
          if (!in) throw InvalidArgument(fmt::format("load: {} ends after {} of {} rows", path, r, rows));
          int owner = c.dense ? shard_of_row(id, c.rows, roles_.num_servers) : shard_of_id(id, roles_.num_servers);
          if (owner == index_) shard->put(id, values.data(), state.data());
        }
      }
      loaded[name] = std::move(shard);
    }
    for (auto& [name, shard] : loaded) tables_[name] = std::move(shard);
  }

  Roles roles_;
  int index_;
  ConsistencyMode mode_;
  uint64_t max_request_;
  std::chrono::milliseconds timeout_;
  Endpoint ep_;
  std::map<std::string, std::unique_ptr<TableShard>> tables_;
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
