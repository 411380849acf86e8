#pragma once
// The launcher's live view of its workers' flight recorders (docs/observability.md):
//  * the stall inspector: an operation that some ranks entered and others have not, for
//    COHORT_STALL_WARN_S, gets one warning naming the missing ranks and the operation (once per
//    operation; the job goes on, and ends at the communicators' own deadline if it stays stuck);
//    ranks at the same operation number with different operations get one error line naming both;
//  * live stats (--stats): per rank and second, operations, bytes, bus bandwidth, the share of time
//    spent in communication and, for data-parallel training, the share of step time waiting for it;
//    at the end of the attempt (finish), one summary of each rank's totals.
//
// It runs on a thread of its own that reads the rings (shared memory) once a second: the
// supervision loop never waits for it, and the workers never notice it.

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cohort/store.h"
#include "common/console.h"
#include "trace/flight_ring.h"

namespace cohort::launch {

// "running", "stopped (SIGSTOP)", "exited", ... from /proc/<pid>/stat (live processes only).
std::string process_state(pid_t pid);

struct InspectedRank {
  int rank = 0;
  pid_t pid = -1;
  const trace::Ring* ring = nullptr;  // owned by the launcher's worker record, alive while inspected
};

// Several nodes: every node's inspector publishes its ranks' recent operations to the job's store
// once a tick (key "trace/node/<n>" of the attempt); the head's reads the others' and inspects the
// whole job. Only the head warns about stalls and mismatches then, so each is reported once. A node
// whose snapshot stopped changing (its launcher is frozen, cut off or gone) is not taken for current:
// its ranks are named as silent since the last snapshot came (trace::find_stall).
// The ranks with a flight recorder on node `node` (their rings are published by that node).
struct NodeRanks {
  int node = 0;
  std::string host;
  std::vector<int> ranks;  // not always consecutive (mpirun's --rank-by node deals them over the hosts)
};
struct InspectorSharing {
  std::shared_ptr<Store> store;  // the attempt's prefix, on a connection of the inspector's own
  int node = 0;
  int nnodes = 1;
  bool head = false;
  std::vector<NodeRanks> nodes;  // the head: every node's ranks (for a node that never published)
};
// The key a node's ranks are published under, live and (trace/final/<n>) after a failed attempt.
std::string node_trace_key(int node);
std::string node_final_trace_key(int node);
// Snapshots as published (the last `entries` operations of each) and read back. The monotonic clocks
// of two hosts are unrelated: the remote one is moved onto this host's by taking the snapshot to have
// been taken at `read_at` (this host's clock), when it was first read here (the error is the
// publishing delay, under a tick). taken_at becomes read_at, so the snapshot keeps its real age.
std::string publish_snapshots(const std::vector<trace::RankSnapshot>& snaps, size_t entries);
std::vector<trace::RankSnapshot> adopt_snapshots(const std::string& text, int64_t read_at);

// The other nodes' published snapshots as the head reads them once a tick. Each node's value keeps the
// time it was first read here: one that stops changing ages, where reading it as new at every tick
// would show its ranks as current forever. A node that has published nothing yet stands for its ranks
// (`nodes`) with empty snapshots as old as the attempt (`since`, when its workers were started).
class RemoteSnapshots {
 public:
  RemoteSnapshots(std::vector<NodeRanks> nodes = {}, int world = 0, int64_t since = 0)
      : nodes_(std::move(nodes)), world_(world), since_(since) {}
  // Node `node`'s value `text` (nullopt: none yet), read at `now`.
  std::vector<trace::RankSnapshot> adopt(int node, const std::optional<std::string>& text, int64_t now);

 private:
  struct Seen {
    std::string text;
    int64_t first_read = 0;
  };
  std::vector<NodeRanks> nodes_;
  int world_;
  int64_t since_;
  std::map<int, Seen> seen_;
};

class Inspector {
 public:
  using Say = std::function<void(const std::string&)>;
  // `stats_fd`: where live stats go (a terminal gets a table, anything else JSON lines). The rings'
  // counters are taken to start at zero now (they are new: the workers were just started), so the
  // first tick already has an interval to show.
  Inspector(std::vector<InspectedRank> ranks, int world, double stall_warn_s, bool stats, int stats_fd, Say say,
            InspectorSharing sharing = {});
  ~Inspector();  // stops and joins the thread (at once: it waits on a condition variable)
  // The attempt is over: stops the thread and, with --stats, prints the figures of the whole attempt
  // when no tick printed any (a job shorter than a tick), then each rank's totals. `final_snaps`: the
  // rings as the workers left them, with how each process ended (process_state).
  void finish(const std::vector<trace::RankSnapshot>& final_snaps, int64_t now);
  Inspector(const Inspector&) = delete;
  Inspector& operator=(const Inspector&) = delete;

  // One inspection at `now` (the thread calls this every second; tests call it directly).
  void inspect(int64_t now);
  // Snapshots of every inspected rank, with their process states.
  std::vector<trace::RankSnapshot> snapshots() const;

 private:
  void run();
  void stop_thread();
  void print_stats(const std::vector<trace::RankSnapshot>& snaps, int64_t now);
  void print_summary(const std::vector<trace::RankSnapshot>& snaps, int64_t now);
  // The bus bytes of `s`'s operations since the reading `prev`.
  double interval_bus_bytes(const trace::RankSnapshot& s, const trace::CounterSnapshot& prev) const;
  // Whether a table of `lines` lines can be redrawn in place (it fits on the terminal's screen).
  bool fits_screen(int lines) const;

  std::vector<InspectedRank> ranks_;
  int world_;
  double stall_warn_s_;
  bool stats_;
  int stats_fd_;
  bool stats_tty_;
  Say say_;
  InspectorSharing sharing_;
  std::chrono::milliseconds tick_{1000};
  // Another node's snapshot older than this is stale (a few ticks: it is published and read once a
  // tick each, over the store).
  double stale_s_ = 0;
  RemoteSnapshots remote_;
  std::set<std::pair<uint32_t, uint64_t>> warned_stalls_;      // (communicator, operation) already reported
  std::set<std::pair<uint32_t, uint64_t>> warned_mismatches_;  // likewise
  // Live stats: the previous reading per rank, and the bus bytes so far (the ring's mix of operation
  // kinds weighs each interval's bytes).
  std::map<int, trace::CounterSnapshot> last_counters_;
  std::map<int, double> bus_bytes_;
  int64_t last_time_ = 0;
  int64_t first_time_ = 0;
  bool stats_printed_ = false;  // a table or JSON lines went out
  console::Block table_;        // the table on the terminal, redrawn in place while nothing else is printed
  bool finished_ = false;

  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace cohort::launch
