// The worker side: splits each call by server, sends one request per server, and assembles the
// replies. All state is guarded by one mutex; whoever holds it drives the connections (a blocking
// call, or a handle's wait/done), so asynchronous calls progress whenever the client is used.
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <list>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <random>

#include "cohort/error.h"
#include "common/env.h"
#include "common/fd.h"
#include "common/handoff.h"
#include "common/io.h"
#include "common/log.h"
#include "ps/client.h"
#include "ps/config_json.h"
#include "ps/decode.h"
#include "ps/sharding.h"
#include "ps/table.h"
#include "ps/wire.h"

namespace cohort::ps {

namespace {

const env::BoolSetting kDirect("COHORT_PS_DIRECT", true,
                               "async parameter-server jobs: workers on a server's host read and update its rows in "
                               "shared memory (0: every pull and push goes through messages)");

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

// A handle shares its client's state: it may outlive the Client object (whose destructor closes
// the client, completing what it can), and then answers from its operation.
class HandleImpl final : public Handle {
 public:
  HandleImpl(std::shared_ptr<ClientImpl> client, std::shared_ptr<Operation> op)
      : client_(std::move(client)), op_(std::move(op)) {}
  void wait() override;
  bool done() override;

 private:
  std::shared_ptr<ClientImpl> client_;
  std::shared_ptr<Operation> op_;
};

// A worker connects to the servers only.
std::vector<bool> servers_only(const Roles& roles) {
  std::vector<bool> peers(size_t(roles.size()), false);
  for (int s = 0; s < roles.num_servers; ++s) peers[size_t(roles.server_rank(s))] = true;
  return peers;
}

// The client's state and work; `Front` below is the Client that a program holds. Handles share it.
class ClientImpl final : public Client, public std::enable_shared_from_this<ClientImpl> {
  // A server's shard of one table, mapped here (table.h), or why not.
  struct Attached {
    std::unique_ptr<TableShard> shard;
    bool refused = false;  // the message path for good
  };

 public:
  ClientImpl(std::shared_ptr<Store> store, const std::string& prefix, int worker, const Roles& roles,
             std::chrono::milliseconds timeout)
      : roles_(roles),
        worker_(worker),
        timeout_(timeout),
        ep_(std::make_unique<Endpoint>(std::move(store), prefix, roles.worker_rank(worker), servers_only(roles),
                                       timeout)) {
    next_seq_.assign(size_t(roles_.num_servers), 0);
    std::lock_guard<std::mutex> g(mu_);
    auto op = start_all(Op::kHello, "", {}, "hello");
    run_locked(*op);
    std::string mode;
    if (std::string why = decode_hello(reply_text(*op->calls.front()), &mode, &max_request_); !why.empty())
      throw malformed(*op->calls.front(), why);
    mode_ = ConsistencyMode::parse(mode);
    // Read at each client's start, not once per process: a program (or a test) may build clients
    // under different settings.
    direct_ = mode_.mode == Mode::kAsync && kDirect.from(env::get_raw(kDirect.name()));
    server_pid_.assign(size_t(roles_.num_servers), 0);
    server_pidfd_.resize(size_t(roles_.num_servers));
  }

  // The program let go of its Client. Tell every server this worker is done (a server stops once all
  // workers have), then wait for the acknowledgements so that none of our sends is cut off; bounded
  // like everything else. Operations still in flight complete on the way (their replies come before
  // the bye's). Then the connections and mappings go; handles that remain answer from their
  // operations.
  void close() {
    std::lock_guard<std::mutex> g(mu_);
    try {
      if (!broken_) {  // else a server is lost: the error was reported, nobody to say bye to
        auto op = start_all(Op::kBye, "", {}, "bye");
        run_locked(*op);
      }
    } catch (const std::exception& e) {
      log::warn("parameter-server client of worker {}: closing: {}", worker_, e.what());
    }
    closed_ = true;
    ep_.reset();  // first: the transports may hold receives into the operations' buffers
    attached_.clear();
    inflight_.clear();
  }

  // A handle's operation once the client is closed: its result if it completed, else why not.
  void closed_answer(Operation& op) {
    if (!op.done)
      throw Error(fmt::format("parameter-server worker {}: the {} did not complete before its client was closed",
                              worker_, op.what));
    if (op.error) std::rethrow_exception(op.error);
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
    return std::make_shared<HandleImpl>(shared_from_this(),
                                        start_pull_push(Op::kPull, table, c, nullptr, 0, nullptr, ids, n, rows));
  }

  std::shared_ptr<Handle> push_async(const std::string& table, const uint64_t* ids, size_t n,
                                     const float* grads) override {
    std::lock_guard<std::mutex> g(mu_);
    TableConfig c = table_locked(table);
    return std::make_shared<HandleImpl>(shared_from_this(),
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
    HandleImpl(shared_from_this(), op).wait();
  }

  void step() override {
    std::lock_guard<std::mutex> g(mu_);
    ++clock_;
    // In async mode no server waits on clocks (pushes apply on arrival, pulls answer at once): a
    // message per step would only wake every server.
    if (mode_.mode == Mode::kAsync) return reap_background_locked();
    // Every server must know (each holds its share of the step's pushes); nothing to wait for:
    // the acknowledgements are collected by later calls.
    auto op = start_all(Op::kClock, "", {}, "step");
    op->background = true;
    reap_background_locked();
  }

  // Save and load are staged on every server, then committed, or discarded where any server refused
  // (docs/parameter-server.md, "Save and load"): all or nothing, and one error naming the server and file.
  //
  // A save is one step that cannot be half done: the servers write into a fresh folder of `dir` that
  // no manifest names, and the rename of manifest.json, naming that folder, publishes it. Any failure
  // before that rename leaves the previous manifest and the folder it names as they were (the
  // servers delete what they wrote); after it, the previous save's folder goes.
  void save(const std::string& dir) override {
    std::lock_guard<std::mutex> g(mu_);
    const std::string folder = fresh_folder_name();
    auto op = start_all(Op::kSave, "", dir + "/" + folder, fmt::format("save to {}", dir));
    run_staged(*op);
    nlohmann::json tables = nlohmann::json::object();
    for (auto& c : op->calls) {
      std::vector<std::pair<std::string, TableConfig>> saved;
      if (std::string why = decode_saved_tables(reply_text(*c), &saved); !why.empty()) {
        end_staged(Op::kDiscard, op->what);
        throw malformed(*c, why);
      }
      for (auto& [name, config] : saved) tables[name] = config_to_json(config);
    }
    nlohmann::json manifest{
        {"format", "cohort-ps-1"}, {"servers", roles_.num_servers}, {"shards", folder}, {"tables", tables}};
    const std::string path = dir + "/manifest.json", tmp = path + ".tmp";
    const std::string previous = shards_folder_of(path);
    // The servers wrote their shards into `dir` on their hosts; this worker writes the manifest into
    // its own view of it, so a save needs one filesystem that all of them see.
    if (std::string why = io::replace_file(path, tmp, manifest.dump(2) + "\n"); !why.empty()) {
      end_staged(Op::kDiscard, op->what);
      throw InvalidArgument(fmt::format("save: {} (the servers wrote their shards to {}/{} on their hosts: the "
                                        "saving worker and every server must see one filesystem there)",
                                        why, dir, folder));
    }
    end_staged(Op::kCommit, op->what);  // the servers keep their files
    if (!previous.empty() && previous != folder) {
      std::error_code ec;
      std::filesystem::remove_all(dir + "/" + previous, ec);
      if (ec)
        log::warn("parameter-server worker {}: save to {}: cannot remove the previous save's folder {}: {}", worker_,
                  dir, previous, ec.message());
    }
  }

  // "shards-<16 hex digits>": a folder no other save, of this job or another, picks.
  static std::string fresh_folder_name() {
    std::random_device rd;
    const uint64_t r = (uint64_t(rd()) << 32) ^ rd();
    return fmt::format("shards-{:016x}", r);
  }

  // The folder the manifest at `path` names, "" when there is none (no manifest, a manifest of
  // before folders, or one that is not a valid manifest: nothing to remove then).
  static std::string shards_folder_of(const std::string& path) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (ec || size > kMaxJsonBytes) return "";
    Manifest m;
    if (!parse_manifest(read_small_file(path), &m).empty()) return "";
    return m.shards;
  }

  static std::string read_small_file(const std::string& path) {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    std::string text;
    if (!fd) return text;
    char chunk[65536];
    for (;;) {
      const ssize_t k = ::read(fd.get(), chunk, sizeof chunk);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0 || text.size() + size_t(k) > kMaxJsonBytes) return text;
      text.append(chunk, size_t(k));
    }
  }

  void load(const std::string& dir) override {
    std::lock_guard<std::mutex> g(mu_);
    auto op = start_all(Op::kLoad, "", dir, fmt::format("load from {}", dir));
    run_staged(*op);
    end_staged(Op::kCommit, op->what);
    tables_.clear();  // re-learned on next use
    attached_.clear();  // the servers replaced their tables (other workers see them retired)
  }

  // A staged save or load: where any server refused, every server drops what it staged, and the
  // first refusal (server order) is thrown.
  void run_staged(Operation& op) {
    try {
      run_locked(op);
    } catch (const InvalidArgument&) {
      end_staged(Op::kDiscard, op.what);
      throw;
    }
  }

  void end_staged(Op kind, const std::string& what) {
    auto op = start_all(kind, "", {}, fmt::format("{} of {}", op_name(kind), what));
    run_locked(*op);
  }

  std::string reply_text(const Call& c) const {
    return std::string(reinterpret_cast<const char*>(c.reply_payload.data()), c.reply_payload.size());
  }

  Error malformed(const Call& c, const std::string& why) const {
    return Error(fmt::format("parameter-server worker {}: server {} ({}) sent a malformed reply to {}: {}", worker_,
                             c.server, ep_->host_of(roles_.server_rank(c.server)), op_name(c.hdr.op), why));
  }

  TableStats stats(const std::string& table) override {
    std::lock_guard<std::mutex> g(mu_);
    auto op = start_all(Op::kStats, table, {}, fmt::format("stats of '{}'", table));
    run_locked(*op);
    TableStats s;
    for (auto& c : op->calls) {
      uint64_t v[4];
      std::memcpy(v, c->reply_payload.data(), sizeof v);
      s.rows += v[0];
      s.bytes += v[1];
      s.applied_rows += v[2];
      s.direct_applied_rows += v[3];
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
          if (!c->done) who.push_back(fmt::format("server {} ({})", c->server, ep_->host_of(roles_.server_rank(c->server))));
        throw TimeoutError(fmt::format("parameter-server worker {}: {} got no answer from {} within {:.0f} s "
                                       "(COHORT_TIMEOUT){}",
                                       worker_, op.what, fmt::join(who, ", "),
                                       std::chrono::duration<double>(timeout_).count(),
                                       mode_.mode == Mode::kAsync ? "" : "; in bsp/stale mode a pull waits for the slowest worker's step()"));
      }
      ep_->poll(10);
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
        if (c->reply.status != Status::kOk) throw InvalidArgument(reply_message(c->reply));
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
    ep_->test(c.hdr_send);
    if (c.payload_send) ep_->test(c.payload_send);
    if (!c.have_reply) {
      if (!ep_->test(c.reply_recv)) return false;
      // Checked before its payload is allocated (decode.h): a payload of the size this request gets.
      if (std::string why = check_reply_header(c.hdr, c.reply); !why.empty())
        throw Error(fmt::format("server {} sent a malformed {}", c.server, why));
      c.have_reply = true;
      if (c.reply.payload > 0) {
        c.reply_payload = pool_.take(c.reply.payload);
        c.reply_payload_recv = ep_->irecv(roles_.server_rank(c.server), Msg::kReplyPayload, c.seq,
                                         c.reply_payload.data(), c.reply_payload.size());
      }
    }
    if (c.reply_payload_recv && !ep_->test(c.reply_payload_recv)) return false;
    // A reply implies the server read our request; our sends completed (tcp/shm report send
    // completion when the bytes left our buffer).
    if (!ep_->test(c.hdr_send) || (c.payload_send && !ep_->test(c.payload_send))) return false;
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
      c->hdr_send = ep_->isend(peer, Msg::kRequest, c->seq, &c->hdr, sizeof c->hdr);
      if (!c->payload.empty())
        c->payload_send = ep_->isend(peer, Msg::kRequestPayload, c->seq, c->payload.data(), c->payload.size());
      c->reply_recv = ep_->irecv(peer, Msg::kReply, c->seq, &c->reply, sizeof c->reply);
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
    TableConfig c;
    nlohmann::json j;
    std::string why = parse_json(reply_text(*op->calls.front()), &j);
    if (why.empty()) why = parse_config(j, name, &c);
    if (!why.empty()) throw malformed(*op->calls.front(), why);
    tables_[name] = c;
    return c;
  }

  int owner(const TableConfig& c, uint64_t id) const {
    if (roles_.num_servers == 1) return 0;
    return c.dense ? (id < c.rows ? shard_of_row(id, c.rows, roles_.num_servers) : 0)
                   : shard_of_id(id, roles_.num_servers);
  }

  // pull (push_ids null), push (pull_ids null) or push_pull. Duplicate ids are merged here: a
  // pulled row is asked once and copied to every position; pushed gradients of one id are summed.
  // A server whose shard this worker has mapped (same host, async mode: direct_shard) is served
  // here, without a message: its pushes are applied to the shared rows and its rows read from them.
  std::shared_ptr<Operation> start_pull_push(Op kind, const std::string& table, const TableConfig& c,
                                             const uint64_t* push_ids, size_t n, const float* grads,
                                             const uint64_t* pull_ids, size_t m, float* rows) {
    const size_t d = c.dim;
    const int S = roles_.num_servers;
    auto op = std::make_shared<Operation>();
    op->what = fmt::format("{} of '{}'", op_name(kind), table);
    if (c.dense) {  // caught here, as no shard holds such a row (the servers check it too)
      for (const auto& [ids, count] : {std::pair{push_ids, n}, std::pair{pull_ids, m}})
        for (size_t i = 0; ids && i < count; ++i)
          if (ids[i] >= c.rows)
            throw InvalidArgument(fmt::format("{}: row {} is outside the dense table's {} rows", op->what, ids[i], c.rows));
    }

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
    std::vector<TableShard*> direct(static_cast<size_t>(S), nullptr);
    bool any_direct = false;
    for (int s = 0; s < S; ++s) {
      if (push_by[size_t(s)].empty() && pull_by[size_t(s)].empty()) continue;
      direct[size_t(s)] = direct_shard(table, c, s);
      any_direct |= direct[size_t(s)] != nullptr;
    }
    if (any_direct) check_servers_alive(op->what);

    // Direct servers first: pushes (a push_pull's pull sees them), then rows. Nothing is copied
    // on the way: a gradient is read from the caller's row where its id occurs once (a sum in
    // scratch where it recurs), and a row is read into the caller's buffer at the id's first position.
    if (any_direct) {
      // first[s][k]: the first position of server s's k-th unique id.
      std::vector<std::vector<uint32_t>> first(static_cast<size_t>(S));
      if (push_ids) {
        std::vector<std::vector<const float*>> src(static_cast<size_t>(S));
        for (int s = 0; s < S; ++s)
          if (direct[size_t(s)]) {
            src[size_t(s)].resize(push_by[size_t(s)].size());
            first[size_t(s)].resize(push_by[size_t(s)].size());
          }
        for (size_t i = 0; i < push_at.size(); ++i) {
          const Place at = push_at[i];
          if (!direct[at.server]) continue;
          const float*& from_row = src[at.server][at.index];
          if (at.first) {
            from_row = grads + i * d;
            first[at.server][at.index] = uint32_t(i);
            continue;
          }
          const size_t f = first[at.server][at.index];
          if (push_scratch_.size() < n * d) push_scratch_.resize(n * d);
          float* sum = push_scratch_.data() + f * d;  // the first position's row: one per id
          if (from_row != sum) {
            std::memcpy(sum, grads + f * d, d * 4);
            from_row = sum;
          }
          for (size_t j = 0; j < d; ++j) sum[j] += grads[i * d + j];
        }
        for (int s = 0; s < S; ++s)
          if (direct[size_t(s)] && !push_by[size_t(s)].empty())
            direct[size_t(s)]->apply(push_by[size_t(s)].data(), push_by[size_t(s)].size(), src[size_t(s)].data());
      }
      if (pull_ids) {
        std::vector<std::vector<float*>> dst(static_cast<size_t>(S));
        for (int s = 0; s < S; ++s) {
          first[size_t(s)].clear();
          if (direct[size_t(s)]) {
            dst[size_t(s)].resize(pull_by[size_t(s)].size());
            first[size_t(s)].resize(pull_by[size_t(s)].size());
          }
        }
        for (size_t i = 0; i < from->size(); ++i) {
          const Place at = (*from)[i];
          if (!direct[at.server] || !at.first) continue;
          dst[at.server][at.index] = rows + i * d;
          first[at.server][at.index] = uint32_t(i);
        }
        for (int s = 0; s < S; ++s)
          if (direct[size_t(s)] && !pull_by[size_t(s)].empty())
            direct[size_t(s)]->read(pull_by[size_t(s)].data(), pull_by[size_t(s)].size(), dst[size_t(s)].data());
        for (size_t i = 0; i < from->size(); ++i) {
          const Place at = (*from)[i];
          if (direct[at.server] && !at.first)
            std::memcpy(rows + i * d, rows + size_t(first[at.server][at.index]) * d, d * 4);
        }
      }
    }

    std::vector<Buffer> payloads(static_cast<size_t>(S));
    std::vector<float*> grads_at(static_cast<size_t>(S), nullptr);
    for (int s = 0; s < S; ++s) {
      if (direct[size_t(s)]) continue;
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
      if (direct[push_at[i].server]) continue;
      float* g = grads_at[push_at[i].server] + size_t(push_at[i].index) * d;
      if (push_at[i].first) std::memcpy(g, grads + i * d, d * 4);
      else
        for (size_t j = 0; j < d; ++j) g[j] += grads[i * d + j];
    }
    std::vector<int> call_of(static_cast<size_t>(S), -1);
    for (int s = 0; s < S; ++s) {
      if (direct[size_t(s)]) continue;
      const auto& pi = push_by[size_t(s)];
      const auto& qi = pull_by[size_t(s)];
      // push_pull goes to every server outside async mode: each must hear that the step ended.
      if ((kind != Op::kPushPull || mode_.mode == Mode::kAsync) && pi.empty() && qi.empty()) continue;
      call_of[size_t(s)] = int(op->calls.size());
      post(*op, s, kind, table, std::move(payloads[size_t(s)]), [&](RequestHeader& h) {
        h.dim = c.dim;
        h.n = kind == Op::kPull ? qi.size() : pi.size();
        h.m = kind == Op::kPushPull ? qi.size() : 0;
      });
    }
    if (kind == Op::kPushPull) ++clock_;
    op->recycle = true;
    inflight_.push_back(op);
    if (pull_ids) {
      op->finish = [from, call_of, rows, d](Operation& o) {
        for (size_t i = 0; i < from->size(); ++i) {
          const Place at = (*from)[i];
          if (call_of[at.server] < 0) continue;  // a direct server's rows are in place already
          const uint8_t* src = o.calls[size_t(call_of[at.server])]->reply_payload.data();
          std::memcpy(rows + i * d, src + size_t(at.index) * d * 4, d * 4);
        }
      };
    }
    return op;
  }

  // ---- workers on a server's host (table.h: shared memory) ----

  // The mapped shard of `table` on server s, or null for the message path: another host, bsp or
  // stale mode, COHORT_PS_DIRECT=0, or a server that said no. Attaches on first use, and again
  // after the server replaced the table (a load).
  TableShard* direct_shard(const std::string& table, const TableConfig& c, int s) {
    if (!direct_) return nullptr;
    auto& per_server = attached_[table];
    per_server.resize(size_t(roles_.num_servers));
    Attached& a = per_server[size_t(s)];
    if (a.refused) return nullptr;
    if (a.shard && a.shard->retired()) a.shard.reset();
    if (!a.shard) attach(table, c, s, a);
    return a.shard.get();
  }

  void attach(const std::string& table, const TableConfig& c, int s, Attached& a) {
    const int peer = roles_.server_rank(s);
    if (!ep_->same_host(peer)) {
      a.refused = true;
      return;
    }
    // The server connects to this socket and sends the memfds before it replies (the memfd handoff,
    // common/handoff.h: its scope is the socket's name, the server's role its index).
    static std::atomic<uint64_t> sockets{0};
    const std::string name = fmt::format("cohort-ps-attach-{}-{}-{}", ::getpid(), worker_, sockets++);
    std::optional<handoff::Listener> listener;
    try {
      listener.emplace(name, 4, fmt::format("parameter-server worker {}", worker_));
    } catch (const Error& e) {
      log::debug("parameter-server worker {}: no socket to attach '{}' on: {}", worker_, table, e.what());
      a.refused = true;
      return;
    }
    auto op = std::make_shared<Operation>();
    op->what = fmt::format("attach of '{}'", table);
    post(*op, s, Op::kAttach, table, buffer_of(nlohmann::json{{"socket", name}, {"pid", ::getpid()}}.dump()));
    inflight_.push_back(op);
    run_locked(*op);
    nlohmann::json j;
    if (std::string why = parse_json(reply_text(*op->calls.front()), &j); !why.empty() || !j.is_object())
      throw malformed(*op->calls.front(), why.empty() ? "expected a JSON object" : why);
    if (!j.at("attached").get<bool>()) {
      log::debug("parameter-server worker {}: '{}' on server {} through messages: {}", worker_, table, s,
                 j.value("why", std::string()));
      a.refused = true;
      return;
    }
    // Sent before the reply, so it is queued on the socket now. The socket's name is no secret
    // (/proc/net/unix lists it): only the server's own connection is taken (SO_PEERCRED).
    const int pid = j.at("pid").get<int>();
    std::optional<handoff::Received> got =
        listener->accept(handoff::Expect{handoff::scope_of(name), {{uint32_t(s), pid}}, "parameter server", 3},
                         Deadline::after(std::chrono::seconds(1)));
    if (!got)
      throw Error(fmt::format("parameter-server worker {}: server {} said it sent table '{}''s memory, but it did not "
                              "arrive", worker_, s, table));
    if (pid != ::getpid() && server_pid_[size_t(s)] != pid) {
      // A server that dies leaves its memory mapped here: its pidfd says so (check_servers_alive).
      // Without one (a kernel before 5.3), messages, which notice a dead server by themselves.
      UniqueFd pidfd(int(::syscall(SYS_pidfd_open, pid, 0)));
      if (!pidfd) {
        log::debug("parameter-server worker {}: no pidfd for server {} ({}): '{}' through messages", worker_, s,
                   std::strerror(errno), table);
        a.refused = true;
        return;
      }
      server_pid_[size_t(s)] = pid;
      server_pidfd_[size_t(s)] = std::move(pidfd);
    }
    // The server's configuration, not this worker's copy: a load may have replaced the table with
    // another (the rows' layout and the optimizer's settings come from it).
    TableConfig now = config_from_json(j.at("config"));
    if (now.dim != c.dim)
      throw InvalidArgument(fmt::format("table '{}' has rows of dim {} (replaced by a load?); this call was built for "
                                        "dim {}", table, now.dim, c.dim));
    tables_[table] = now;
    a.shard = std::make_unique<TableShard>(table, now, j.at("first_row").get<uint64_t>(), j.at("rows").get<uint64_t>(),
                                           std::move(got->fds), timeout_, j.at("holder").get<uint32_t>());
  }

  // Direct calls send nothing, so nothing would notice a server that died: a pidfd per server
  // process becomes readable when it exits. One poll(2) per call.
  void check_servers_alive(const std::string& what) {
    std::vector<pollfd> fds;
    std::vector<int> who;
    for (int s = 0; s < roles_.num_servers; ++s)
      if (server_pidfd_[size_t(s)]) {
        fds.push_back(pollfd{server_pidfd_[size_t(s)].get(), POLLIN, 0});
        who.push_back(s);
      }
    if (fds.empty() || ::poll(fds.data(), fds.size(), 0) <= 0) return;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & POLLIN)) continue;
      const int s = who[i];
      broken_ = true;
      throw PeerLostError(fmt::format("parameter-server worker {}: {} failed: lost parameter server {} ({}): its "
                                      "process (pid {}) exited",
                                      worker_, what, s, ep_->host_of(roles_.server_rank(s)), server_pid_[size_t(s)]));
    }
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
    // A push usually names the ids of the pull before it (a step pulls a batch's rows and pushes
    // their gradients): then that pull's split serves again. Comparing the ids is one sequential read.
    if (n > 0 && n == last_ids_.size() && c.dense == last_dense_ && c.rows == last_rows_ &&
        std::memcmp(ids, last_ids_.data(), n * 8) == 0) {
      by = last_by_;
      at = last_at_;
      return;
    }
    index_ids_uncached(c, ids, n, by, at);
    if (n > kCacheIds) {  // not kept: a huge call's copies would stay allocated
      last_ids_ = {};
      return;
    }
    last_ids_.assign(ids, ids + n);
    last_dense_ = c.dense;
    last_rows_ = c.rows;
    last_by_ = by;
    last_at_ = at;
  }

  void index_ids_uncached(const TableConfig& c, const uint64_t* ids, size_t n,
                          std::vector<std::vector<uint64_t>>& by, std::vector<Place>& at) {
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
  std::unique_ptr<Endpoint> ep_;  // null once closed
  ConsistencyMode mode_;
  uint64_t max_request_ = 0;
  uint64_t clock_ = 0;
  bool broken_ = false;  // a server was lost
  bool closed_ = false;  // close() ran: no connections any more
  std::vector<uint64_t> next_seq_;
  std::map<std::string, TableConfig> tables_;
  std::list<std::shared_ptr<Operation>> inflight_;
  BufferPool pool_;
  std::vector<uint64_t> dedup_keys_;  // index_ids' table
  std::vector<Place> dedup_places_;
  std::vector<uint32_t> dedup_stamps_;
  uint32_t dedup_stamp_ = 0;
  static constexpr size_t kCacheIds = size_t{1} << 16;
  std::vector<uint64_t> last_ids_;  // index_ids' last call and its result
  bool last_dense_ = false;
  uint64_t last_rows_ = 0;
  std::vector<std::vector<uint64_t>> last_by_;
  std::vector<Place> last_at_;
  bool direct_ = false;  // async mode and not COHORT_PS_DIRECT=0: map same-host shards
  std::map<std::string, std::vector<Attached>> attached_;  // per table, per server
  std::vector<int> server_pid_;
  std::vector<UniqueFd> server_pidfd_;
  std::vector<float> push_scratch_;  // summed gradients of recurring ids (direct servers)

  friend class HandleImpl;
};

void HandleImpl::wait() {
  std::lock_guard<std::mutex> g(client_->mu_);
  if (client_->closed_) return client_->closed_answer(*op_);
  client_->run_locked(*op_);
}

bool HandleImpl::done() {
  std::lock_guard<std::mutex> g(client_->mu_);
  if (client_->closed_) {
    client_->closed_answer(*op_);
    return true;
  }
  client_->ep_->poll(0);
  if (!client_->progress_locked(*op_)) return false;
  if (op_->error) std::rethrow_exception(op_->error);
  return true;
}

// The Client a program holds: its calls go to the shared state, and letting go of it closes that
// state (handles keep what they need of it).
class Front final : public Client {
 public:
  explicit Front(std::shared_ptr<ClientImpl> impl) : impl_(std::move(impl)) {}
  ~Front() override { impl_->close(); }
  Front(const Front&) = delete;
  Front& operator=(const Front&) = delete;

  int worker_index() const override { return impl_->worker_index(); }
  int num_workers() const override { return impl_->num_workers(); }
  int num_servers() const override { return impl_->num_servers(); }
  ConsistencyMode mode() const override { return impl_->mode(); }
  uint64_t clock() const override { return impl_->clock(); }
  void create_table(const std::string& name, const TableConfig& config) override { impl_->create_table(name, config); }
  TableConfig table(const std::string& name) override { return impl_->table(name); }
  void pull(const std::string& t, const uint64_t* ids, size_t n, float* rows) override { impl_->pull(t, ids, n, rows); }
  void push(const std::string& t, const uint64_t* ids, size_t n, const float* grads) override {
    impl_->push(t, ids, n, grads);
  }
  void push_pull(const std::string& t, const uint64_t* push_ids, size_t n, const float* grads, const uint64_t* pull_ids,
                 size_t m, float* rows) override {
    impl_->push_pull(t, push_ids, n, grads, pull_ids, m, rows);
  }
  std::shared_ptr<Handle> pull_async(const std::string& t, const uint64_t* ids, size_t n, float* rows) override {
    return impl_->pull_async(t, ids, n, rows);
  }
  std::shared_ptr<Handle> push_async(const std::string& t, const uint64_t* ids, size_t n,
                                     const float* grads) override {
    return impl_->push_async(t, ids, n, grads);
  }
  void step() override { impl_->step(); }
  void save(const std::string& dir) override { impl_->save(dir); }
  void load(const std::string& dir) override { impl_->load(dir); }
  TableStats stats(const std::string& table) override { return impl_->stats(table); }

 private:
  std::shared_ptr<ClientImpl> impl_;
};

}  // namespace

std::unique_ptr<Client> make_client(std::shared_ptr<Store> store, const std::string& prefix, int worker,
                                    const Roles& roles, std::chrono::milliseconds timeout) {
  return std::make_unique<Front>(std::make_shared<ClientImpl>(std::move(store), prefix, worker, roles, timeout));
}

}  // namespace cohort::ps
