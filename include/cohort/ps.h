#pragma once
// cohort::ps: the parameter-server mode (docs/parameter-server.md).
//
// A job has servers and workers. `cohort run --ps N --nproc-per-node M ./prog` starts N servers (the
// built-in `cohort ps serve`, or the program itself with --ps-server program) and M workers per node;
// each process learns its role from COHORT_ROLE. Servers hold tables of rows; workers pull rows and
// push gradients that the servers apply with the table's optimizer.
//
//   auto ps = cohort::ps::Client::from_env();
//   ps->create_table("emb", {.dim = 64, .optimizer = cohort::ps::Optimizer::kAdagrad, .lr = 0.05f});
//   ps->pull("emb", ids.data(), ids.size(), rows.data());        // rows: ids.size() * 64 floats
//   ps->push("emb", ids.data(), ids.size(), grads.data());
//   ps->step();                                                   // end of this worker's step
//
// Tables: sparse ones are keyed by any 64-bit id and sharded over the servers by hash
// (shard_of_id); dense ones have `rows` rows 0..rows-1 split into contiguous ranges
// (shard_of_row). A row is created on first touch (pull or push) from the table's initializer, so
// a pull of an id nobody pushed returns the initializer's row. Rows are float32 on the wire;
// storage may be float16 or bfloat16 (optimizer state stays float32).
//
// Consistency (a job setting, COHORT_PS_MODE, `cohort run --ps-mode`):
//   async (default, as TensorFlow's parameter servers): pushes are applied on arrival, pulls answer
//     at once.
//   bsp: a worker's pushes of step c are held until every worker has ended step c (step()), then
//     summed over the workers (in worker order, so results are reproducible) and applied once per
//     row; a pull in step c+1 returns only after that.
//   stale:K (bounded staleness): pushes are applied on arrival; a pull in step c waits until every
//     worker has ended step c-K (no worker runs more than K steps ahead of the slowest). stale:0
//     is bsp (a pull would wait for the same steps; bsp also makes their order reproducible).
// save() in bsp and stale modes waits, like a pull with K = 0, until every worker has ended the
// saving worker's steps, so the files hold every push of those steps.
// A worker must close (destroy) its client before it exits: servers take a worker that vanishes
// without saying so for a lost one, and fail the job.
// Workers on a server's host (async mode): the worker maps the server's shard of a table and pulls
// and pushes its rows itself, without a message (docs/parameter-server.md); COHORT_PS_DIRECT=0 sends
// everything through the server instead. Same results either way. A process that dies holding a
// row's lock is seen by the next process that waits for it, which restores the row and warns; none
// waits COHORT_TIMEOUT for a dead one.
// Errors: a request the server refuses (unknown table, wrong dimension, id outside a dense table,
// oversized request) throws cohort::InvalidArgument on that worker; the server keeps serving. A lost
// server throws PeerLostError naming it; every wait is bounded by COHORT_TIMEOUT.
//
// Threading: one Client may be used from several threads (calls are serialised); asynchronous
// calls progress whenever the client is driven (any call, or a handle's wait()).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/store.h"
#include "cohort/types.h"

namespace cohort::ps {

enum class Optimizer : uint8_t { kSgd = 0, kAdagrad = 1, kAdam = 2 };
enum class Initializer : uint8_t { kZeros = 0, kConstant = 1, kUniform = 2 };
enum class Mode : uint8_t { kAsync = 0, kBsp = 1, kStale = 2 };

struct TableConfig {
  uint32_t dim = 1;             // floats per row
  bool dense = false;           // dense: rows 0..rows-1 only, range-sharded
  uint64_t rows = 0;            // dense tables: the row count
  uint64_t expected_rows = 0;   // sparse tables: rows expected in all (0: not known). Each server's index
                                // is sized for its share from the start, so it never doubles (a pause
                                // of the creating processes) before that count. A share that cannot fit
                                // in the server host's memory is refused (InvalidArgument)
  DataType storage = DataType::kFloat32;  // kFloat32, kFloat16 or kBFloat16
  Optimizer optimizer = Optimizer::kSgd;
  float lr = 0.01f;
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;  // Adam (eps also Adagrad's)
  float initial_accumulator = 0.0f;                  // Adagrad
  Initializer init = Initializer::kZeros;
  float init_a = 0.0f, init_b = 0.0f;  // constant: a; uniform: [a, b)
  uint64_t seed = 0;                   // uniform: row values are a function of (seed, id, column)
};

// The server that holds a sparse id / a dense row (documented in docs/parameter-server.md).
int shard_of_id(uint64_t id, int num_servers);
int shard_of_row(uint64_t row, uint64_t rows, int num_servers);

// Bytes a server spends per row of a table (storage, optimizer state, and for sparse tables the
// index at its highest load); used by the memory test and stated in the docs.
size_t bytes_per_row(const TableConfig& config);

struct ConsistencyMode {
  Mode mode = Mode::kAsync;
  int staleness = 0;  // kStale only
  static ConsistencyMode parse(const std::string& text);  // "async", "bsp", "stale:K"
  std::string to_string() const;
};

// Who is who in a parameter-server job. Servers and workers meet in one "PS world" (its own store
// prefix) of num_servers + num_workers ranks: server i is rank i, worker j is rank num_servers + j.
// from_env reads the launcher's COHORT_NUM_SERVERS and COHORT_NUM_WORKERS.
struct Roles {
  int num_servers = 1;
  int num_workers = 1;
  int server_rank(int i) const { return i; }
  int worker_rank(int j) const { return num_servers + j; }
  int size() const { return num_servers + num_workers; }
  static Roles from_env();
};

struct TableStats {
  uint64_t rows = 0;    // rows held (summed over servers)
  uint64_t bytes = 0;   // bytes held for them: storage, optimizer state, index (summed over servers)
  uint64_t applied_rows = 0;  // row updates applied: one per id of each applied push (a bsp step's
                              // summed rows count once)
  uint64_t direct_applied_rows = 0;  // of those, applied by workers on the server's host in its shared
                                     // memory (async mode; docs/parameter-server.md)
};

// A handle may outlive its Client: closing the client completes what is in flight, and the handle
// then answers from its operation (or throws cohort::Error if it could not complete).
class Handle {
 public:
  virtual ~Handle() = default;
  virtual void wait() = 0;  // rethrows the request's error
  virtual bool done() = 0;  // drives the client a little; never blocks
};

class Client {
 public:
  // The worker side in a launched job (COHORT_ROLE=worker); connects to every server.
  static std::unique_ptr<Client> from_env();
  // For tests and embedding: the PS world over `store` (keys under the caller's prefix), this
  // process being worker `worker`.
  static std::unique_ptr<Client> create(std::shared_ptr<Store> store, int worker, const Roles& roles,
                                        std::chrono::milliseconds timeout = std::chrono::seconds(300));
  virtual ~Client() = default;

  virtual int worker_index() const = 0;
  virtual int num_workers() const = 0;
  virtual int num_servers() const = 0;
  virtual ConsistencyMode mode() const = 0;

  // Declares a table. Every worker may declare it; a declaration that differs from the table's
  // is an InvalidArgument naming the field.
  virtual void create_table(const std::string& name, const TableConfig& config) = 0;
  virtual TableConfig table(const std::string& name) = 0;

  // rows: n * dim floats, row i for ids[i] (duplicate ids get the same row).
  virtual void pull(const std::string& table, const uint64_t* ids, size_t n, float* rows) = 0;
  // grads: n * dim floats; duplicates are summed before sending.
  virtual void push(const std::string& table, const uint64_t* ids, size_t n, const float* grads) = 0;
  // Push, end the step (as step()), pull: one round trip per server.
  virtual void push_pull(const std::string& table, const uint64_t* push_ids, size_t n, const float* grads,
                         const uint64_t* pull_ids, size_t m, float* rows) = 0;
  // The buffers must stay valid until the handle completes.
  virtual std::shared_ptr<Handle> pull_async(const std::string& table, const uint64_t* ids, size_t n,
                                             float* rows) = 0;
  virtual std::shared_ptr<Handle> push_async(const std::string& table, const uint64_t* ids, size_t n,
                                             const float* grads) = 0;
  // Ends this worker's step (the clock of bsp and stale modes; harmless in async).
  virtual void step() = 0;
  virtual uint64_t clock() const = 0;

  // Every server writes its shards of every table to `dir` (atomically), then this worker writes
  // dir/manifest.json. Load reads them back, whatever the server count that saved them.
  virtual void save(const std::string& dir) = 0;
  virtual void load(const std::string& dir) = 0;
  virtual TableStats stats(const std::string& table) = 0;
};

// Runs this process as a server until every worker has closed its client (or a worker is lost:
// then it throws). `from_env`: COHORT_ROLE=server in a launched job.
void serve_from_env();
void serve(std::shared_ptr<Store> store, int server, const Roles& roles, ConsistencyMode mode = {},
           std::chrono::milliseconds timeout = std::chrono::seconds(300));

}  // namespace cohort::ps
