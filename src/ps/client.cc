// The worker side's Client (include/cohort/ps.h): the one a program holds (Front), the hello that
// starts it and the bye that closes it, and the calls' entry points. The work behind them lives in
// the files client_impl.h lists; this file is where a reader starts.
#include <fmt/core.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "common/env.h"
#include "common/log.h"
#include "ps/client.h"
#include "ps/client_impl.h"
#include "ps/config_json.h"
#include "ps/decode.h"

namespace cohort::ps {

namespace client_internal {

namespace {

const env::BoolSetting kDirect("COHORT_PS_DIRECT", true,
                               "async parameter-server jobs: workers on a server's host read and update its rows in "
                               "shared memory (0: every pull and push goes through messages)");

// A worker connects to the servers only.
std::vector<bool> servers_only(const Roles& roles) {
  std::vector<bool> peers(size_t(roles.size()), false);
  for (int s = 0; s < roles.num_servers; ++s) peers[size_t(roles.server_rank(s))] = true;
  return peers;
}

}  // namespace

ClientImpl::ClientImpl(std::shared_ptr<Store> store, const std::string& prefix, int worker, const Roles& roles,
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
void ClientImpl::close() {
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
void ClientImpl::closed_answer(Operation& op) {
  if (!op.done)
    throw Error(fmt::format("parameter-server worker {}: the {} did not complete before its client was closed",
                            worker_, op.what));
  if (op.error) std::rethrow_exception(op.error);
}

void ClientImpl::create_table(const std::string& name, const TableConfig& config) {
  validate(name, config);
  std::lock_guard<std::mutex> g(mu_);
  std::string text = config_to_json(config).dump();
  auto op = start_all(Op::kCreate, name, text,
                      fmt::format("create_table '{}'", name));
  run_locked(*op);
  tables_[name] = config;
}

TableConfig ClientImpl::table(const std::string& name) {
  std::lock_guard<std::mutex> g(mu_);
  return table_locked(name);
}

void ClientImpl::pull(const std::string& table, const uint64_t* ids, size_t n, float* rows) {
  pull_async(table, ids, n, rows)->wait();
}

void ClientImpl::push(const std::string& table, const uint64_t* ids, size_t n, const float* grads) {
  push_async(table, ids, n, grads)->wait();
}

std::shared_ptr<Handle> ClientImpl::pull_async(const std::string& table, const uint64_t* ids, size_t n, float* rows) {
  std::lock_guard<std::mutex> g(mu_);
  TableConfig c = table_locked(table);
  return std::make_shared<HandleImpl>(shared_from_this(),
                                      start_pull_push(Op::kPull, table, c, nullptr, 0, nullptr, ids, n, rows));
}

std::shared_ptr<Handle> ClientImpl::push_async(const std::string& table, const uint64_t* ids, size_t n,
                                               const float* grads) {
  std::lock_guard<std::mutex> g(mu_);
  TableConfig c = table_locked(table);
  return std::make_shared<HandleImpl>(shared_from_this(),
                                      start_pull_push(Op::kPush, table, c, ids, n, grads, nullptr, 0, nullptr));
}

void ClientImpl::push_pull(const std::string& table, const uint64_t* push_ids, size_t n, const float* grads,
                           const uint64_t* pull_ids, size_t m, float* rows) {
  std::shared_ptr<Operation> op;
  {
    std::lock_guard<std::mutex> g(mu_);
    TableConfig c = table_locked(table);
    op = start_pull_push(Op::kPushPull, table, c, push_ids, n, grads, pull_ids, m, rows);
  }
  HandleImpl(shared_from_this(), op).wait();
}

void ClientImpl::step() {
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

TableStats ClientImpl::stats(const std::string& table) {
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

namespace {

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

}  // namespace client_internal

std::unique_ptr<Client> make_client(std::shared_ptr<Store> store, const std::string& prefix, int worker,
                                    const Roles& roles, std::chrono::milliseconds timeout) {
  using client_internal::ClientImpl;
  using client_internal::Front;
  return std::make_unique<Front>(std::make_shared<ClientImpl>(std::move(store), prefix, worker, roles, timeout));
}

}  // namespace cohort::ps
