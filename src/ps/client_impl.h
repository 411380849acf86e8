#pragma once
// The worker side's state, shared by the files that implement it (internal to src/ps):
//   client.cc            the Client a program holds: start (hello), close (bye), the calls' entry points
//   client_driving.cc    requests in flight: posting them, progressing them, their errors and timeouts
//   client_pull_push.cc  pull, push and push_pull: ids split by server and deduplicated, payloads built
//   client_direct.cc     workers on a server's host: its shards mapped here, read and updated in place
//   client_save_load.cc  save and load, staged on every server and committed all or nothing
//
// The client splits each call by server, sends one request per server, and assembles the replies.
// All state is guarded by one mutex; whoever holds it drives the connections (a blocking call, or a
// handle's wait/done), so asynchronous calls progress whenever the client is used.

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "cohort/ps.h"
#include "common/fd.h"
#include "ps/table.h"
#include "ps/wire.h"

namespace cohort::ps::client_internal {

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

// The client's state and work; `Front` (client.cc) is the Client that a program holds. Handles share it.
class ClientImpl final : public Client, public std::enable_shared_from_this<ClientImpl> {
  // A server's shard of one table, mapped here (table.h), or why not.
  struct Attached {
    std::unique_ptr<TableShard> shard;
    bool refused = false;  // the message path for good
  };

 public:
  // client.cc
  ClientImpl(std::shared_ptr<Store> store, const std::string& prefix, int worker, const Roles& roles,
             std::chrono::milliseconds timeout);
  void close();
  void closed_answer(Operation& op);

  int worker_index() const override { return worker_; }
  int num_workers() const override { return roles_.num_workers; }
  int num_servers() const override { return roles_.num_servers; }
  ConsistencyMode mode() const override { return mode_; }
  uint64_t clock() const override { return clock_; }

  void create_table(const std::string& name, const TableConfig& config) override;
  TableConfig table(const std::string& name) override;
  void pull(const std::string& table, const uint64_t* ids, size_t n, float* rows) override;
  void push(const std::string& table, const uint64_t* ids, size_t n, const float* grads) override;
  std::shared_ptr<Handle> pull_async(const std::string& table, const uint64_t* ids, size_t n, float* rows) override;
  std::shared_ptr<Handle> push_async(const std::string& table, const uint64_t* ids, size_t n,
                                     const float* grads) override;
  void push_pull(const std::string& table, const uint64_t* push_ids, size_t n, const float* grads,
                 const uint64_t* pull_ids, size_t m, float* rows) override;
  void step() override;
  TableStats stats(const std::string& table) override;

  // client_save_load.cc
  void save(const std::string& dir) override;
  void load(const std::string& dir) override;

 private:
  // client_save_load.cc
  static std::string fresh_folder_name();
  static std::string shards_folder_of(const std::string& path);
  static std::string read_small_file(const std::string& path);
  void run_staged(Operation& op);
  void end_staged(Op kind, const std::string& what);

  // client_driving.cc (mu_ held)
  std::string reply_text(const Call& c) const;
  Error malformed(const Call& c, const std::string& why) const;
  void run_locked(Operation& op);
  bool progress_locked(Operation& op);
  [[noreturn]] void throw_lost(const std::string& what, const Error& e);
  bool progress_call(Call& c);
  void reap_background_locked();
  Call& post(Operation& op, int server, Op kind, const std::string& table, Buffer payload,
             const std::function<void(RequestHeader&)>& fill = {});
  std::shared_ptr<Operation> start_all(Op kind, const std::string& table, const std::string& payload,
                                       std::string what);
  TableConfig table_locked(const std::string& name);

  // client_pull_push.cc
  // Where one position of a call's ids went: the server, the index among that server's unique ids,
  // and whether this position is the id's first (its gradient is copied; later ones are added).
  struct Place {
    uint32_t server;
    uint32_t index;
    bool first;
  };
  int owner(const TableConfig& c, uint64_t id) const;
  std::shared_ptr<Operation> start_pull_push(Op kind, const std::string& table, const TableConfig& c,
                                             const uint64_t* push_ids, size_t n, const float* grads,
                                             const uint64_t* pull_ids, size_t m, float* rows);
  void index_ids(const TableConfig& c, const uint64_t* ids, size_t n, std::vector<std::vector<uint64_t>>& by,
                 std::vector<Place>& at);
  void index_ids_uncached(const TableConfig& c, const uint64_t* ids, size_t n,
                          std::vector<std::vector<uint64_t>>& by, std::vector<Place>& at);

  // client_direct.cc
  TableShard* direct_shard(const std::string& table, const TableConfig& c, int s);
  void attach(const std::string& table, const TableConfig& c, int s, Attached& a);
  void check_servers_alive(const std::string& what);

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

}  // namespace cohort::ps::client_internal
