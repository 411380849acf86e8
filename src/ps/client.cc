// The worker side: splits each call by server, sends one request per server, and assembles the
// replies. All state is guarded by one mutex; whoever holds it drives the connections (a blocking
// call, or a handle's wait/done), so asynchronous calls progress whenever the client is used.
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <list>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>

#include "cohort/error.h"
#include "common/log.h"
#include "ps/client.h"
#include "ps/config_json.h"
#include "ps/sharding.h"
#include "ps/wire.h"

namespace cohort::ps {

namespace {

// One request to one server and its reply.
struct Call {
  int server = 0;
  uint64_t seq = 0;
  RequestHeader hdr;
  Buffer payload;
  ReplyHeader reply;
  Buffer reply_payload;
  Posted hdr_send, payload_send, reply_recv, reply_payload_recv;
  bool have_reply = false;
  bool done = false;
};

class ClientImpl;

// A call on several servers; `finish` runs once every reply is in (under the client's lock).
struct Operation {
  std::vector<std::unique_ptr<Call>> calls;
  std::function<void(Operation&)> finish;
  std::string what;  // "pull of 'emb'" (for timeouts)
  bool background = false;  // step(): nobody waits for it; its error surfaces on a later call
  bool recycle = false;     // pull/push: its buffers go back to the pool once complete
  bool done = false;
  std::exception_ptr error;
};

class HandleImpl final : public Handle {
 public:
  HandleImpl(ClientImpl* client, std::shared_ptr<Operation> op) : client_(client), op_(std::move(op)) {}
  void wait() override;
  bool done() override;

 private:
  ClientImpl* client_;
  std::shared_ptr<Operation> op_;
};

// A worker connects to the servers only.
std::vector<bool> servers_only(const Roles& roles) {
  std::vector<bool> peers(size_t(roles.size()), false);
  for (int s = 0; s < roles.num_servers; ++s) peers[size_t(roles.server_rank(s))] = true;
  return peers;
}

class ClientImpl final : public Client {
 public:
  ClientImpl(std::shared_ptr<Store> store, const std::string& prefix, int worker, const Roles& roles,
             std::chrono::milliseconds timeout)
      : roles_(roles),
        worker_(worker),
        timeout_(timeout),
        ep_(std::move(store), prefix, roles.worker_rank(worker), servers_only(roles), timeout) {
    next_seq_.assign(size_t(roles_.num_servers), 0);
    std::lock_guard<std::mutex> g(mu_);
    auto op = start_all(Op::kHello, "", {}, "hello");
    run_locked(*op);
    auto j = nlohmann::json::parse(op->calls.front()->reply_payload.begin(), op->calls.front()->reply_payload.end());
    mode_ = ConsistencyMode::parse(j.at("mode").get<std::string>());
    max_request_ = j.at("max_request").get<uint64_t>();
  }

  ~ClientImpl() override {
    // Tell every server this worker is done (a server stops once all workers have), then wait for
    // the acknowledgements so that none of our sends is cut off; bounded like everything else.
    try {
      std::lock_guard<std::mutex> g(mu_);
      if (broken_) return;  // a server is lost: the error was reported, nobody to say bye to
      auto op = start_all(Op::kBye, "", {}, "bye");
      run_locked(*op);
    } catch (const std::exception& e) {
      log::warn("parameter-server client of worker {}: closing: {}", worker_, e.what());
    }
  }

  int worker_index() const override { return worker_; }
  int num_workers() const override { return roles_.num_workers; }
  int num_servers() const override { return roles_.num_servers; }
  ConsistencyMode mode() const override { return mode_; }
  uint64_t clock() const override { return clock_; }

  void create_table(const std::string& name, const TableConfig& config) override {
    validate(name, config);
    std::lock_guard<std::mutex> g(mu_);
    std::string text = config_to_json(config).dump();
    auto op = start_all(Op::kCreate, name, text,
                        fmt::format("create_table '{}'", name));
    run_locked(*op);
    tables_[name] = config;
  }

  TableConfig table(const std::string& name) override {
    std::lock_guard<std::mutex> g(mu_);
    return table_locked(name);
  }

  void pull(const std::string& table, const uint64_t* ids, size_t n, float* rows) override {
    pull_async(table, ids, n, rows)->wait();
  }

  void push(const std::string& table, const uint64_t* ids, size_t n, const float* grads) override {
    push_async(table, ids, n, grads)->wait();
  }

  std::shared_ptr<Handle> pull_async(const std::string& table, const uint64_t* ids, size_t n, float* rows) override {
    std::lock_guard<std::mutex> g(mu_);
    TableConfig c = table_locked(table);
    return std::make_shared<HandleImpl>(this, start_pull_push(Op::kPull, table, c, nullptr, 0, nullptr, ids, n, rows));
  }

  std::shared_ptr<Handle> push_async(const std::string& table, const uint64_t* ids, size_t n,
                                     const float* grads) override {
    std::lock_guard<std::mutex> g(mu_);
    TableConfig c = table_locked(table);
    return std::make_shared<HandleImpl>(this,
                                        start_pull_push(Op::kPush, table, c, ids, n, grads, nullptr, 0, nullptr));
  }

  void push_pull(const std::string& table, const uint64_t* push_ids, size_t n, const float* grads,
                 const uint64_t* pull_ids, size_t m, float* rows) override {
    std::shared_ptr<Operation> op;
    {
      std::lock_guard<std::mutex> g(mu_);
      TableConfig c = table_locked(table);
      op = start_pull_push(Op::kPushPull, table, c, push_ids, n, grads, pull_ids, m, rows);
    }
    HandleImpl(this, op).wait();
  }

  void step() override {
    std::lock_guard<std::mutex> g(mu_);
    ++clock_;
    // Every server must know (each holds its share of the step's pushes); nothing to wait for:
    // the acknowledgements are collected by later calls.
    auto op = start_all(Op::kClock, "", {}, "step");
    op->background = true;
    reap_background_locked();
  }

  void save(const std::string& dir) override {
    std::lock_guard<std::mutex> g(mu_);
    auto op = start_all(Op::kSave, "", dir, fmt::format("save to {}", dir));
    run_locked(*op);
    nlohmann::json tables = nlohmann::json::object();
    for (auto& c : op->calls) {
      auto j = nlohmann::json::parse(c->reply_payload.begin(), c->reply_payload.end());
      for (auto& [k, v] : j.items()) tables[k] = v;
    }
    nlohmann::json manifest{{"format", "cohort-ps-1"}, {"servers", roles_.num_servers}, {"tables", tables}};
    std::string path = dir + "/manifest.json", tmp = path + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << manifest.dump(2) << '\n';
      if (!out) throw InvalidArgument(fmt::format("save: cannot write {}", tmp));
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec) throw InvalidArgument(fmt::format("save: cannot rename {}: {}", tmp, ec.message()));
  }

  void load(const std::string& dir) override {
    std::lock_guard<std::mutex> g(mu_);
    auto op = start_all(Op::kLoad, "", dir, fmt::format("load from {}", dir));
    run_locked(*op);
    tables_.clear();  // re-learned on next use
  }

  TableStats stats(const std::string& table) override {
    std::lock_guard<std::mutex> g(mu_);
    auto op = start_all(Op::kStats, table, {}, fmt::format("stats of '{}'", table));
    run_locked(*op);
    TableStats s;
    for (auto& c : op->calls) {
      uint64_t v[3];
      std::memcpy(v, c->reply_payload.data(), sizeof v);
      s.rows += v[0];
      s.bytes += v[1];
      s.applied_rows += v[2];
    }
    return s;
  }

  // ---- driving (mu_ held) ----

  void run_locked(Operation& op) {
    auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (!progress_locked(op)) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::vector<std::string> who;
        for (auto& c : op.calls)
          if (!c->done) who.push_back(fmt::format("server {} ({})", c->server, ep_.host_of(roles_.server_rank(c->server))));
        throw TimeoutError(fmt::format("parameter-server worker {}: {} got no answer from {} within {:.0f} s "
                                       "(COHORT_TIMEOUT){}",
                                       worker_, op.what, fmt::join(who, ", "),
                                       std::chrono::duration<double>(timeout_).count(),
                                       mode_.mode == Mode::kAsync ? "" : "; in bsp/stale mode a pull waits for the slowest worker's step()"));
      }
      ep_.poll(10);
    }
    reap_background_locked();
    if (op.error) std::rethrow_exception(op.error);
  }

  // True when `op` is complete.
  bool progress_locked(Operation& op) {
    if (op.done) return true;
    try {
      bool all = true;
      for (auto& c : op.calls) {
        try {
          all &= progress_call(*c);
        } catch (const InvalidArgument&) {
          throw;
        } catch (const Error& e) {
          throw_lost(op.what, e);
        }
      }
      if (!all) return false;
      for (auto& c : op.calls)
        if (c->reply.status != Status::kOk) throw InvalidArgument(std::string(c->reply.message));
      if (op.finish) op.finish(op);
    } catch (const InvalidArgument&) {
      op.error = std::current_exception();
    }
    op.done = true;
    // Every byte has been sent and read: the buffers serve the next calls. (Replies that callers
    // read after completion — hello, describe, save, stats — are read before the next call.)
    if (op.recycle) {
      for (auto& c : op.calls) {
        pool_.give(std::move(c->payload));
        pool_.give(std::move(c->reply_payload));
      }
    }
    return true;
  }

  // The connections failed (a server lost, or a failure notice): the transport's message names the
  // peer that caused it, whichever server this call was waiting for.
  [[noreturn]] void throw_lost(const std::string& what, const Error& e) {
    broken_ = true;
    throw PeerLostError(fmt::format("parameter-server worker {}: {} failed: {}", worker_, what,
                                    name_roles(e.what(), roles_.num_servers)));
  }

  bool progress_call(Call& c) {
    if (c.done) return true;
    ep_.test(c.hdr_send);
    if (c.payload_send) ep_.test(c.payload_send);
    if (!c.have_reply) {
      if (!ep_.test(c.reply_recv)) return false;
      if (c.reply.magic != kReplyMagic)
        throw Error(fmt::format("server {} sent a malformed reply", c.server));
      c.have_reply = true;
      if (c.reply.payload > 0) {
        c.reply_payload = pool_.take(c.reply.payload);
        c.reply_payload_recv = ep_.irecv(roles_.server_rank(c.server), Msg::kReplyPayload, c.seq,
                                         c.reply_payload.data(), c.reply_payload.size());
      }
    }
    if (c.reply_payload_recv && !ep_.test(c.reply_payload_recv)) return false;
    // A reply implies the server read our request; our sends completed (tcp/shm report send
    // completion when the bytes left our buffer).
    if (!ep_.test(c.hdr_send) || (c.payload_send && !ep_.test(c.payload_send))) return false;
    c.done = true;
    return true;
  }

  // Every started operation stays here until complete, so that its buffers outlive the transport's
  // use of them even when the caller drops its handle.
  void reap_background_locked() {
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (!progress_locked(**it)) {
        ++it;
        continue;
      }
      auto op = *it;
      it = inflight_.erase(it);
      if (op->background && op->error) std::rethrow_exception(op->error);
    }
  }

  Call& post(Operation& op, int server, Op kind, const std::string& table, Buffer payload,
             const std::function<void(RequestHeader&)>& fill = {}) {
    auto c = std::make_unique<Call>();
    if (!table.empty()) set_table_name(c->hdr, table);  // may throw: before the request is numbered
    c->server = server;
    c->seq = next_seq_[size_t(server)]++;
    c->hdr.op = kind;
    c->hdr.clock = clock_;
    c->payload = std::move(payload);
    c->hdr.payload = c->payload.size();
    if (fill) fill(c->hdr);
    const int peer = roles_.server_rank(server);
    try {
      c->hdr_send = ep_.isend(peer, Msg::kRequest, c->seq, &c->hdr, sizeof c->hdr);
      if (!c->payload.empty())
        c->payload_send = ep_.isend(peer, Msg::kRequestPayload, c->seq, c->payload.data(), c->payload.size());
      c->reply_recv = ep_.irecv(peer, Msg::kReply, c->seq, &c->reply, sizeof c->reply);
    } catch (const InvalidArgument&) {
      throw;
    } catch (const Error& e) {
      throw_lost(fmt::format("{} of '{}'", op_name(kind), table), e);
    }
    op.calls.push_back(std::move(c));
    return *op.calls.back();
  }

  std::shared_ptr<Operation> start_all(Op kind, const std::string& table, const std::string& payload,
                                       std::string what) {
    auto op = std::make_shared<Operation>();
    op->what = std::move(what);
    for (int s = 0; s < roles_.num_servers; ++s) post(*op, s, kind, table, buffer_of(payload));
    inflight_.push_back(op);
    return op;
  }

  TableConfig table_locked(const std::string& name) {
    auto it = tables_.find(name);
    if (it != tables_.end()) return it->second;
    auto op = std::make_shared<Operation>();
    op->what = fmt::format("describe '{}'", name);
    post(*op, 0, Op::kDescribe, name, {});
    inflight_.push_back(op);
    run_locked(*op);
    TableConfig c = config_from_json(nlohmann::json::parse(op->calls.front()->reply_payload.begin(), op->calls.front()->reply_payload.end()));
    tables_[name] = c;
    return c;
  }

  int owner(const TableConfig& c, uint64_t id) const {
    return c.dense ? (id < c.rows ? shard_of_row(id, c.rows, roles_.num_servers) : 0)
                   : shard_of_id(id, roles_.num_servers);
  }

  // pull (push_ids null), push (pull_ids null) or push_pull. Duplicate ids are merged here: a
  // pulled row is asked once and copied to every position; pushed gradients of one id are summed.
  std::shared_ptr<Operation> start_pull_push(Op kind, const std::string& table, const TableConfig& c,
                                             const uint64_t* push_ids, size_t n, const float* grads,
                                             const uint64_t* pull_ids, size_t m, float* rows) {
    const size_t d = c.dim;
    const int S = roles_.num_servers;
    auto op = std::make_shared<Operation>();
    op->what = fmt::format("{} of '{}'", op_name(kind), table);

    // Unique ids per server, and for every position which (server, index there) it became. The
    // request to server s is [its push ids][their gradients, summed over duplicates][its pull ids]:
    // the gradients are added straight into that payload, so they are copied once.
    std::vector<std::vector<uint64_t>> push_by(static_cast<size_t>(S));
    std::vector<Place> push_at;
    if (push_ids) index_ids(c, push_ids, n, push_by, push_at);
    std::vector<std::vector<uint64_t>> pull_by(static_cast<size_t>(S));
    auto from = std::make_shared<std::vector<Place>>();
    if (pull_ids) index_ids(c, pull_ids, m, pull_by, *from);

    // Every server's request is built and checked before any is sent: a refused call leaves
    // nothing in flight.
    if (!table.empty()) {
      RequestHeader probe;
      set_table_name(probe, table);
    }
    for (int s = 0; s < S; ++s) {
      const size_t k = push_by[size_t(s)].size(), q = pull_by[size_t(s)].size();
      const size_t bytes = k * 8 + k * d * 4 + q * 8;
      if (bytes > max_request_ || q * d * 4 > max_request_)
        throw InvalidArgument(fmt::format("{} of '{}': {} ids make a request of {} bytes to server {}, more than "
                                          "the servers' limit of {} bytes (COHORT_PS_MAX_REQUEST); split the call",
                                          op_name(kind), table, k + q, std::max(bytes, q * d * 4), s, max_request_));
    }
    std::vector<Buffer> payloads(static_cast<size_t>(S));
    std::vector<float*> grads_at(static_cast<size_t>(S), nullptr);
    for (int s = 0; s < S; ++s) {
      const auto& pi = push_by[size_t(s)];
      const auto& qi = pull_by[size_t(s)];
      Buffer& payload = payloads[size_t(s)];
      payload = pool_.take(pi.size() * 8 + pi.size() * d * 4 + qi.size() * 8);
      // (memcpy is skipped for empty parts: their pointers may be null, which memcpy may not get.)
      uint8_t* p = payload.data();
      if (!pi.empty()) std::memcpy(p, pi.data(), pi.size() * 8);
      grads_at[size_t(s)] = reinterpret_cast<float*>(p + pi.size() * 8);  // 8-aligned: ids before it
      if (!qi.empty()) std::memcpy(p + pi.size() * 8 + pi.size() * d * 4, qi.data(), qi.size() * 8);
    }
    for (size_t i = 0; i < push_at.size(); ++i) {
      float* g = grads_at[push_at[i].server] + size_t(push_at[i].index) * d;
      if (push_at[i].first) std::memcpy(g, grads + i * d, d * 4);
      else
        for (size_t j = 0; j < d; ++j) g[j] += grads[i * d + j];
    }
    std::vector<int> call_of(static_cast<size_t>(S), -1);
    for (int s = 0; s < S; ++s) {
      const auto& pi = push_by[size_t(s)];
      const auto& qi = pull_by[size_t(s)];
      // push_pull goes to every server: each must hear that the step ended.
      if (kind != Op::kPushPull && pi.empty() && qi.empty()) continue;
      call_of[size_t(s)] = int(op->calls.size());
      Call& call = post(*op, s, kind, table, std::move(payloads[size_t(s)]), [&](RequestHeader& h) {
        h.dim = c.dim;
        h.n = kind == Op::kPull ? qi.size() : pi.size();
        h.m = kind == Op::kPushPull ? qi.size() : 0;
      });
      (void)call;
    }
    if (kind == Op::kPushPull) ++clock_;
    op->recycle = true;
    inflight_.push_back(op);
    if (pull_ids) {
      op->finish = [from, call_of, rows, d](Operation& o) {
        for (size_t i = 0; i < from->size(); ++i) {
          const Place at = (*from)[i];
          const Call& c = *o.calls[size_t(call_of[at.server])];
          std::memcpy(rows + i * d, c.reply_payload.data() + size_t(at.index) * d * 4, d * 4);
        }
      };
    }
    return op;
  }

  // Where one position of a call's ids went: the server, the index among that server's unique ids,
  // and whether this position is the id's first (its gradient is copied; later ones are added).
  struct Place {
    uint32_t server;
    uint32_t index;
    bool first;
  };
  // Dedups ids[0..n) per server into by[server] and sets at[i] for each position. The index is an
  // open-addressing table kept between calls and stamped per call, so nothing is allocated or cleared
  // per call once it has grown (a std::unordered_map cost a node allocation per id).
  void index_ids(const TableConfig& c, const uint64_t* ids, size_t n, std::vector<std::vector<uint64_t>>& by,
                 std::vector<Place>& at) {
    size_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    if (dedup_keys_.size() < cap) {
      dedup_keys_.assign(cap, 0);
      dedup_places_.assign(cap, Place{});
      dedup_stamps_.assign(cap, 0);
      dedup_stamp_ = 0;
    }
    cap = dedup_keys_.size();
    if (++dedup_stamp_ == 0) {  // wrapped: no slot may look current
      std::fill(dedup_stamps_.begin(), dedup_stamps_.end(), 0);
      dedup_stamp_ = 1;
    }
    at.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t id = ids[i];
      size_t h = mix64(id) & (cap - 1);
      while (dedup_stamps_[h] == dedup_stamp_ && dedup_keys_[h] != id) h = (h + 1) & (cap - 1);
      if (dedup_stamps_[h] == dedup_stamp_) {
        at[i] = dedup_places_[h];
        at[i].first = false;
        continue;
      }
      const auto s = static_cast<uint32_t>(owner(c, id));
      const Place place{s, static_cast<uint32_t>(by[s].size()), true};
      by[s].push_back(id);
      dedup_stamps_[h] = dedup_stamp_;
      dedup_keys_[h] = id;
      dedup_places_[h] = place;
      at[i] = place;
    }
    // A table for a huge call is not kept: 24 bytes a slot would stay allocated for good.
    constexpr size_t kKeepSlots = size_t{1} << 20;
    if (dedup_keys_.size() > kKeepSlots) {
      dedup_keys_ = {};
      dedup_places_ = {};
      dedup_stamps_ = {};
    }
  }

  Roles roles_;
  int worker_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  Endpoint ep_;
  ConsistencyMode mode_;
  uint64_t max_request_ = 0;
  uint64_t clock_ = 0;
  bool broken_ = false;  // a server was lost
  std::vector<uint64_t> next_seq_;
  std::map<std::string, TableConfig> tables_;
  std::list<std::shared_ptr<Operation>> inflight_;
  BufferPool pool_;
  std::vector<uint64_t> dedup_keys_;  // index_ids' table
  std::vector<Place> dedup_places_;
  std::vector<uint32_t> dedup_stamps_;
  uint32_t dedup_stamp_ = 0;

  friend class HandleImpl;
};

void HandleImpl::wait() {
  std::lock_guard<std::mutex> g(client_->mu_);
  client_->run_locked(*op_);
}

bool HandleImpl::done() {
  std::lock_guard<std::mutex> g(client_->mu_);
  client_->ep_.poll(0);
  if (!client_->progress_locked(*op_)) return false;
  if (op_->error) std::rethrow_exception(op_->error);
  return true;
}

}  // namespace

std::unique_ptr<Client> make_client(std::shared_ptr<Store> store, const std::string& prefix, int worker,
                                    const Roles& roles, std::chrono::milliseconds timeout) {
  return std::make_unique<ClientImpl>(std::move(store), prefix, worker, roles, timeout);
}

}  // namespace cohort::ps
