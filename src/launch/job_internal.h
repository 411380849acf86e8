#pragma once
// The launcher's job, inside: the Job class that job.h's run_job drives, and what its parts share.
// The class is one object; its member functions live in one file per responsibility:
//   job.cc           supervision: the event loop, signals, timers, attempts and restarts
//   job_workers.cc   this node's workers: starting them (environment, CPUs, GPU), stopping, their exits
//   job_end.cc       the store protocol of a job's end: hosting or joining the store, the watcher thread,
//                    publishing and adopting the end record, the root cause, nodes done and exited
//   job_output.cc    output routing (draining workers' and agents' pipes) and the failure summary
//   job_trace.cc     observability: the workers' flight recorder rings, the inspector thread (stall
//                    warnings, live stats), dumps and diagnosis of a failed attempt, the merged timeline
// Parts with a narrow interface to the supervisor are objects of their own, which Job holds:
//   job_exits.cc     RankExits: the exit records the ranks read when one of this node's workers ends
//   job_trace.cc     TraceFolder: the default trace folder's claim, pruning and removal
//   job_ray.cc       RayCluster: Ray mode: the head, the other nodes joining it, the driver
//   job_fanout.cc    Agents: a fan-out head's `cohort agent` children over ssh or srun;
//                    ControlChannel: an agent's stdin from its head (forwarded signals, the head's loss)
//   job_elastic.cc   ElasticMember: an elastic job's generations, this agent's lease, the store's failover
// The modes' objects reach no more of Job than their constructors name: RayCluster, Agents and
// ControlChannel a Supervisor (below: the attempt's end, the loop's attention for a descriptor);
// ElasticMember the plan and the job's StoreLinks, the two things a generation and a failover redefine.
// docs/launcher.md describes the protocol and the failure policy; nothing here is used outside launch/.

#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "comm/peer_exits.h"
#include "common/fd.h"
#include "launch/inspector.h"
#include "launch/job.h"
#include "launch/oom.h"
#include "launch/output.h"
#include "launch/ray.h"
#include "launch/rendezvous.h"
#include "launch/trace_dirs.h"
#include "store/tcp_store.h"
#include "trace/flight_ring.h"

namespace cohort::launch::job_detail {

using Clock = std::chrono::steady_clock;
inline constexpr int kForwarded[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

// The default deadline of the main thread's store calls once the job runs: each is one small request
// (publish the end or a failure, count finished nodes) to a store that answers thousands of clients in
// about a second. A node cut off from the head must not sit out a long default in one of them: while
// the call blocks, the main loop cannot see its control channel close and stop its workers.
inline constexpr Millis kStoreCallTimeout{2000};
// How long past a wait's own deadline the launcher's store clients wait for its answer: the store
// answers in milliseconds (and within about a second while thousands of clients join), so no answer
// this long after the deadline means a cut link or a dead host.
inline constexpr Millis kStoreReplyGrace{1000};
// The same for the clients of a store this launcher hosts in-process (job_end.cc): longer, since the
// only way its answer is late is this process not running; still a deadline.
inline constexpr Millis kOwnStoreReplyGrace{10000};
// One munge or unmunge run (a local daemon's answer: milliseconds when it is up).
inline constexpr Millis kMungeTimeout{10000};

// The exit code of a job stopped at its wall-clock limit (--timeout): 124, the code of coreutils'
// timeout(1), so a script tells a limit from a failure the usual way (Open MPI's mpirun exits 110).
inline constexpr int kTimeLimitExitCode = 124;

// A port the OS says is free on `host` now (bind to 0, read it, close).
int pick_free_port(const std::string& host);

inline bool is_terminating(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP || sig == SIGQUIT; }

// Thrown where the launcher blocks outside its event loop (waiting for the job's store, for the other
// nodes' last reports) when SIGINT/SIGTERM/SIGHUP/SIGQUIT arrives: the job ends there with 128 + sig.
class Interrupted : public Error {
 public:
  Interrupted(int sig, const std::string& what) : Error(what), sig_(sig) {}
  int sig() const { return sig_; }

 private:
  int sig_;
};

std::string signal_name(int sig);
// One line on stderr, "cohort run: <line>".
void say(const std::string& line);

// How an attempt ended, as every node agrees through the store key "end".
struct EndInfo {
  // "done" (all workers finished), "failure", "interrupted", "lost", "agent", "join", "timeout" (the
  // wall-clock limit of --timeout); elastic jobs add
  // "node" (a node of the generation is gone or left), "membership" (a newcomer is admitted at the
  // next generation), "store" (the store's host is lost: the store moves, job_elastic.cc) and
  // "refused" (this agent is not admitted).
  std::string kind;
  int code = 0;  // the launcher's exit code
  std::string summary;
  bool restartable() const { return (kind == "failure" || kind == "done" || kind == "node") && code != 0; }
};
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(EndInfo, kind, code, summary)

std::string end_to_string(const EndInfo& e);
// A failure that only reports another one: the worker's communicator lost a peer ("lost rank N
// (host)") or heard a peer's failure notice ("rank N (host) failed: ..."), and it exited with an error
// code. When a peer is killed, its neighbours' errors can reach the launcher before the kill itself;
// the kill, not their report of it, is the job's root cause (summary and exit code).
bool is_consequence(const EndInfo& e);
// Whether `e` should replace `current` as the root cause.
bool is_root_cause_of(const EndInfo& e, const EndInfo& current);

EndInfo end_from_string(const std::string& s);

struct Worker {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  bool sigkill_sent = false;  // the launcher sent it SIGKILL: a death by SIGKILL is no news then (launch/oom.h)
  Clock::time_point started, ended;
  UniqueFd out, err;  // read ends (invalid when not piped or at EOF)
  std::unique_ptr<OutputSink> sink;
  trace::Ring ring;  // its flight recorder (invalid when off); outlives the process for the diagnosis
};

// Events from the store watcher thread to the loop. `attempt` is the attempt the watcher serves (events
// of an earlier attempt's watcher are dropped); kAnyAttempt: news for whichever attempt runs.
inline constexpr int kAnyAttempt = -1;
struct WatchEvent {
  // kStoreMoved: this agent's standby store was promoted (text: its epoch), job_elastic.cc. kRayHead: a Ray
  // job's head answers (text: its GCS, HOST:PORT); kRayHeadTimeout: it did not in time (text: why), job_ray.cc.
  enum Kind { kJoined, kEnd, kLost, kJoinTimeout, kRefused, kLeaseLost, kStoreMoved, kRayHead, kRayHeadTimeout } kind;
  std::string text;
  int attempt = 0;
  int lease = 0;  // kLeaseLost: which of this agent's leases (a replaced one's loss is old news)
};

class EventQueue {
 public:
  EventQueue() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}
  int fd() const { return fd_.get(); }
  void push(WatchEvent e) {
    {
      std::lock_guard<std::mutex> g(m_);
      q_.push_back(std::move(e));
    }
    uint64_t one = 1;
    [[maybe_unused]] auto r = ::write(fd_.get(), &one, sizeof one);
  }
  std::deque<WatchEvent> take() {
    uint64_t v;
    [[maybe_unused]] auto r = ::read(fd_.get(), &v, sizeof v);
    std::lock_guard<std::mutex> g(m_);
    return std::exchange(q_, {});
  }

 private:
  UniqueFd fd_;
  std::mutex m_;
  std::deque<WatchEvent> q_;
};

inline std::string node_key(int r) { return "node/" + std::to_string(r); }
// The id of the job a per-node store serves (outside every job's prefix): Job::check_job_id.
inline constexpr const char* kJobIdKey = "cohort/job_id";

struct WatchParams {
  std::vector<int> nodes;  // the node ranks to wait for: every node's, or in an uncounted Ray job node 0's and
                           // this node's (plan.h, RayPlan::open_membership)
  int this_node = 0;
  double join_timeout_s = 300;
  std::string store_addr;
};

// Multi-node: waits for every node (p.nodes) to register (saying every few seconds who is missing), then for
// the attempt's "end" record, on its own store connection. It is detached: it owns everything it
// touches, and a stop flag ends it within one wait slice without the loop ever waiting for it.
void watcher_main(std::shared_ptr<Store> store, std::shared_ptr<EventQueue> events,
                  std::shared_ptr<std::atomic<bool>> stop, WatchParams p, int attempt);

// The rendezvous bounds and timings of an elastic plan, on a store at `epoch`.
RendezvousSettings rendezvous_settings(const Plan& plan, int64_t epoch = 0);

// Elastic jobs (job_elastic.cc): joins generation `generation` (or the first one that admits this
// agent) and reports its membership (kJoined, JSON), then waits for the generation's end record like
// watcher_main, and writes one itself when a member's lease ended. `store`: the job's launch prefix.
void elastic_watcher_main(std::shared_ptr<Store> store, std::shared_ptr<EventQueue> events,
                          std::shared_ptr<std::atomic<bool>> stop, AgentInfo self, RendezvousSettings settings,
                          int generation);

// Ray jobs (job_ray.cc), on every node but the head: waits for the head's GCS address in the store ("ray/gcs",
// set by the head once its GCS answers) and reports it (kRayHead), or its absence a few seconds after
// `timeout_s`, the head's own deadline (kRayHeadTimeout). `store`: the attempt's prefix. Detached, like
// watcher_main.
void ray_head_watcher_main(std::shared_ptr<Store> store, std::shared_ptr<EventQueue> events,
                           std::shared_ptr<std::atomic<bool>> stop, int node_rank, double timeout_s, int attempt);

// The job's store as this launcher reaches it. Job::start_store sets them up (job_end.cc); an elastic job's
// failover moves them to a survivor's standby store (job_elastic.cc), so they are one value both can reach.
struct StoreLinks {
  std::unique_ptr<StoreServer> server;  // the store this launcher hosts (the job's, or a single node's)
  std::string addr;                     // HOST:PORT of the job's store, for the workers and for messages
  StoreClientOptions client_options;    // how to open another connection to it
  std::shared_ptr<Store> base;          // coordination (main thread), under the job's launch prefix
  std::shared_ptr<Store> base_client;   // the TCP client under `base` (its default timeout)
  std::shared_ptr<Store> watch_base;    // the watcher thread's own connection
  std::shared_ptr<Store> attempt;       // the attempt's (or the generation's) prefix of `base`
  int torch_port = 0;                   // MASTER_PORT: torch's own store, on node 0
};

// What the parts of a job with state of their own (RayCluster, Agents, ControlChannel, ElasticMember) may
// ask of the supervisor, Job: the end of the attempt, and the event loop's attention for a descriptor.
// They reach nothing else of Job's; what else they need is handed to them by value or in their calls.
class Supervisor {
 public:
  // This node's end of the attempt, claimed in the job's store first (another node's root cause may win).
  virtual void publish_end(const EndInfo& e) = 0;
  // An end that needs no claim (the store's own, or one this node cannot publish).
  virtual void adopt_end(const EndInfo& e) = 0;
  virtual bool ended() const = 0;     // the attempt's end is known
  virtual bool stopping() const = 0;  // this node's workers are being stopped
  // The loop reads `fd` when readable and hands it back to the part that watches it.
  virtual void watch(int fd) = 0;
  virtual void unwatch(int fd) = 0;

 protected:
  ~Supervisor() = default;
};

// job_ray.cc: Ray mode (plan.ray.enabled): this node's part in bringing the job's Ray cluster up, and the
// head's driver once the cluster is whole. This node's Ray node is process 0 of the workers, the head's
// driver process 1; the cluster starts them through `start_process` and the supervisor runs them like any
// worker. It has its own timer and its own child, the `ray status` probe, which the loop hands it.
class RayCluster {
 public:
  // Starts process `index` of this node (0: its Ray node, 1: the head's driver) for `attempt`.
  using StartProcess = std::function<void(size_t index, int attempt)>;
  RayCluster(const Plan& plan, bool distributed, Supervisor& supervisor, StartProcess start_process)
      : plan_(plan), distributed_(distributed), supervisor_(supervisor), start_process_(std::move(start_process)) {}
  // Its timer joins the loop (once, at set-up).
  void open();
  // From spawn_workers: the head starts its Ray at once, the others wait for the head's GCS address in
  // `attempt_store` (a watcher thread of their own connection, `client`, that reports to `events` and
  // ends with `stop`). `store_addr`: the store's address, for messages.
  void start(int attempt, std::shared_ptr<Store> attempt_store, const StoreClientOptions& client,
             const std::string& store_addr, std::shared_ptr<EventQueue> events,
             std::shared_ptr<std::atomic<bool>> stop);
  void on_head(const std::string& gcs);            // WatchEvent::kRayHead: this node joins the head at `gcs`
  void fail(const std::string& kind, const std::string& why);  // kRayHeadTimeout and the cluster's own failures
  bool on_readable(int fd);              // its timer or its probe's output; false: not its descriptor
  bool on_exit(pid_t pid, int status);   // reap(): the probe ended; false: not its child
  void stop();                           // the end of an attempt: the probe (if any) and the timer stop
  // HOST:PORT of the head's GCS (empty until known), for every process's environment.
  const std::string& gcs() const { return gcs_; }
  // `ray start` of this node's Ray node.
  std::vector<std::string> node_argv() const;

 private:
  void on_timer();                 // the head: probe its GCS, then run `ray status` again
  std::string head_ip();           // the head's address that the other nodes reach; throws ConfigError
  void start_status();
  void drain_status();             // the probe's output, as the loop sees it readable
  void on_status_exit(int status); // the probe ended; the driver starts when every node is there
  void start_driver();
  std::string node_names(const std::vector<int>& ranks);  // "3 (h3, 10.0.0.4), 4 (h4: Ray not started)"
  void arm_timer(double seconds);
  void lost_store(const Error& e);  // a store call failed: this node is cut off from the job

  const Plan& plan_;
  const bool distributed_;
  Supervisor& supervisor_;
  StartProcess start_process_;
  std::shared_ptr<Store> attempt_store_;
  std::string store_addr_;
  // The head goes kHeadStarting (its GCS does not answer yet) -> kWaitingForNodes (`ray status` probes) ->
  // kDriverRunning; the others kWaitingForHead -> kNodeRunning.
  enum class Phase { kOff, kHeadStarting, kWaitingForNodes, kDriverRunning, kWaitingForHead, kNodeRunning };
  Phase phase_ = Phase::kOff;
  int attempt_ = 0;
  std::string gcs_;      // HOST:PORT of the head's GCS
  std::string node_ip_;  // this node's address in the Ray cluster
  RayPorts ports_;
  Clock::time_point since_, deadline_, next_note_;
  double retry_s_ = 0.1;  // the wait before the next `ray status` (doubles up to 1 s)
  UniqueFd timer_fd_;
  // The `ray status` probe running (pid -1: none) and its output (stdout and stderr merged).
  pid_t status_pid_ = -1;
  UniqueFd status_out_;
  std::string status_text_;
  std::string last_status_;  // what the last probe that failed said (its last line), for the timeout's message
};

// Reads what `fd` holds now into `sink` (non-blocking); at EOF the stream is finished: `loop` stops
// watching it and `holder` closes it (job_output.cc).
void drain_output(int fd, OutputSink& sink, bool is_stderr, UniqueFd& holder, Supervisor& loop);

// job_fanout.cc, the head's side of a fan-out (-H/--hostfile over ssh, or srun): one `cohort agent` per
// other host, each a child of the head with the plan on its stdin, which stays the control channel.
// Agents starts them, forwards signals to them, routes their output, and turns an agent that ends before
// the job into the job's end (publish_end), naming its host and quoting its last stderr lines.
class Agents {
 public:
  Agents(const Plan& plan, Supervisor& supervisor) : plan_(plan), supervisor_(supervisor) {}
  // Starts an agent for every node that is not this host's, handing each its part of the plan, `token`
  // and `torch_port`; `self_exe`: the cohort path they run. One that cannot start stops the others and throws.
  void start(const std::string& token, int torch_port, const std::string& self_exe);
  bool empty() const { return agents_.empty(); }
  int running() const;
  bool is_child(pid_t pid) const;  // one of the running agents' processes (the ssh or srun client)
  void forward(int sig);           // "sig N" on each running agent's control channel
  void kill_all(int sig);          // to each running agent's process group
  bool on_exit(pid_t pid, int status);  // reap(): false when `pid` is not an agent
  bool on_readable(int fd);             // an agent's output; false: not its descriptor
  void close_channels();                // the job is over: EOF on each control channel

 private:
  struct Child {
    NodePlan node;
    pid_t pid = -1;
    bool running = false;
    int status = 0;
    UniqueFd in, out, err;
    std::unique_ptr<OutputSink> sink;
  };
  void stop_now();  // a fan-out that cannot start all its agents: the ones started are killed and reaped

  const Plan& plan_;
  Supervisor& supervisor_;
  std::vector<Child> agents_;
};

// job_fanout.cc, an agent's side (`cohort agent`): its stdin, after the plan, is the control channel from
// the head: "sig N" lines are signals to forward to this node's workers, EOF means the head (or the
// connection to it) is gone, and this node's workers stop.
class ControlChannel {
 public:
  using OnSignal = std::function<void(int sig)>;
  using StopWorkers = std::function<void()>;
  ControlChannel(Supervisor& supervisor, OnSignal on_signal, StopWorkers stop_workers)
      : supervisor_(supervisor), on_signal_(std::move(on_signal)), stop_workers_(std::move(stop_workers)) {}
  void open(int this_node);  // stdin joins the loop (an agent only)
  bool on_readable(int fd);  // false: not stdin, or not open
  // The head is gone (EOF): nothing is published to the store any more, nothing is restarted.
  bool head_lost() const { return head_lost_; }

 private:
  Supervisor& supervisor_;
  OnSignal on_signal_;
  StopWorkers stop_workers_;
  int this_node_ = 0;
  bool open_ = false;
  bool head_lost_ = false;
  std::string buf_;  // a line not yet complete
};

// job_elastic.cc: this agent's membership of an elastic job (--nnodes MIN:MAX): its identity and its lease on
// the job's store, the generation it runs, its standby store, and the store's failover. The supervisor runs
// each generation as an attempt and hands it the watcher's news; it lays the generation out in `plan` (nodes,
// ranks, world size) and, when the job's store moves, moves `store` with it: those two are the job's own
// state that membership redefines, and all it reaches of the job.
class ElasticMember {
 public:
  ElasticMember(Plan& plan, StoreLinks& store, std::shared_ptr<EventQueue> events)
      : plan_(plan), store_(store), events_(std::move(events)) {}
  // Set-up, once the job's store answers. An agent that does not host it keeps a standby store (idle until
  // the store's host is lost and the survivors pick it), served with `token`.
  void open_standby(const std::string& token);
  void open_lease();      // this agent's identity, its lease
  int first_generation();  // the round a fresh agent joins
  // Attempt `round`: its round runs on a watcher thread (its own connection), which reports kJoined with
  // the membership and then the generation's end; `stop` ends it.
  void join_round(int round, std::shared_ptr<std::atomic<bool>> stop);
  // kJoined: this generation's nodes, ranks and wills. Throws when the store is lost meanwhile.
  void apply_membership(const Membership& m);
  // The generation this agent runs (set when its round closes).
  const std::optional<Membership>& membership() const { return membership_; }
  // kLeaseLost of lease `lease`: the end it means; nullopt for a lease that was replaced (the store moved).
  std::optional<EndInfo> on_lease_lost(int lease, const std::string& why) const;
  // kStoreMoved: the others promoted this agent's standby store at `epoch`; nullopt when this agent moved
  // the store there itself.
  std::optional<EndInfo> on_store_moved(const std::string& epoch);
  // An interrupted agent. With MIN < MAX it leaves: the others end the generation and go on without it.
  // With MIN = MAX the job cannot go on without it, so the interrupt ends it on every node (the round
  // fails, or the generation ends as interrupted) instead of leaving it. `joined`: its round had closed.
  void leave(int sig, bool joined);
  void end_everywhere(const EndInfo& interrupted, bool joined);
  // After a generation's end `e` (`joined`: its round had closed; `head_lost`: see ControlChannel): the
  // generation to meet for next, moving the job's store first when its host is lost; nullopt when the job
  // is over, `e` then saying why when the store could not move.
  std::optional<int> after(EndInfo& e, bool joined, bool head_lost);
  // The attempt ended with `e`: this agent counts itself out, and the store's host stays until the others
  // are out too (`pending_interrupt`: a second interrupt ends that wait).
  void settle_end(const EndInfo& e, bool head_lost, const std::function<int()>& pending_interrupt);
  // Whether node `node_rank` of the generation is gone (its lease ended, or it left).
  bool node_gone(int node_rank) const;

 private:
  void take_lease();  // a store lease with the agent's "gone" will
  std::optional<int> next_generation(const EndInfo& e, bool head_lost) const;  // nullopt: the job is over
  bool member_gone(const AgentInfo& a) const;
  // The store's host is lost (or this agent's standby store was promoted by the others): vote at the
  // first member's standby store that answers, and once more than half of the last generation did,
  // move the job's store there, seed it with the last generation and go on. False, with *why, when
  // the job cannot go on here (no majority, no standby answers, the old store still answers).
  bool fail_over_store(bool joined, std::string* why);
  // This agent's round stopped (a split, a refusal) while members voted to move the job's store to
  // its standby store: waits for that vote's outcome. True when the standby was promoted (follow it).
  bool standby_promotion_pending();

  Plan& plan_;
  StoreLinks& store_;
  std::shared_ptr<EventQueue> events_;
  AgentInfo self_;
  std::unique_ptr<StoreLease> lease_;
  int lease_number_ = 0;                  // counts take_lease() calls
  std::unique_ptr<StoreServer> standby_;  // this agent's standby store (not on the store's host)
  std::string standby_address_;           // where the others reach it
  std::optional<Membership> membership_;
  int round_ = 0;                       // the generation this agent's round is for (the attempt)
  int64_t store_epoch_ = 0;             // the job's store's epoch (rdzv/epoch): how often it moved
  bool standby_promoted_ = false;       // the others moved the job's store to this agent's standby
  bool torch_port_from_store_ = false;  // the store moved to another node: read its torch port when joined
};

// job_trace.cc: the job's default trace folder (launch/trace_dirs.h): the finished ones older than
// COHORT_TRACE_KEEP_DAYS go, this job's is claimed; at the end it is removed unless a failure left
// files in it, and the summary names it when it is kept. A user's --trace-dir is left alone.
class TraceFolder {
 public:
  explicit TraceFolder(const Plan& plan) : plan_(plan) {}
  // Throws ConfigError when --timeline's rank files would have nowhere to go.
  void open();
  // The job ended with `code`; `print`: say so when the folder is kept.
  void close(int code, bool print);
  // Why the default trace folder cannot be used (not this user's own, not creatable): nothing is
  // written there then. Empty when it can, and for a user's --trace-dir.
  const std::string& refused() const { return refused_; }

 private:
  const Plan& plan_;
  std::unique_ptr<TraceDirClaim> claim_;  // this job's default trace folder, while it runs
  std::string refused_;
};

// job_exits.cc: what the ranks learn when one of this node's workers' processes ends. Each attempt opens
// it on the store the ranks read; the supervisor hands it each exit as it reaps the worker, and asks it
// whether a failure was caused by a peer that exited with code 0.
class RankExits {
 public:
  explicit RankExits(const Plan& plan) : plan_(plan) {}
  // Attempt `attempt` begins. A job of several nodes (`distributed`) publishes in `job_store`, the job's
  // store (null: none); a job of one node in `server`, this launcher's store (null: none), through a
  // client opened once with `token`. `store_addr`: the store's address, for messages.
  void open(int attempt, bool distributed, std::shared_ptr<Store> job_store, const StoreServer* server,
            const std::string& token, const std::string& store_addr);
  // Publishes `w`'s exit record (nothing in a Ray job, or after a store call failed in this attempt).
  void publish(const Worker& w);
  // "" or, when `failed` reports a peer that exited with code 0 (not a failure by itself), the part of
  // the summary that names that peer as the root cause. `workers`: this node's, for their rings.
  std::string early_exit_cause(const Worker& failed, const std::vector<Worker>& workers);

 private:
  const Plan& plan_;
  // The store the ranks' exits are published to (the job's, without a prefix; null: none), the
  // attempt the workers run (COHORT_RESTART_COUNT), and what this node published in it.
  std::shared_ptr<Store> exit_store_;
  std::shared_ptr<Store> local_exit_client_;  // single-node jobs: a client of this launcher's store
  bool distributed_ = false;
  std::string store_addr_;
  int exit_attempt_ = 0;
  bool exit_store_failed_ = false;
  std::map<std::string, comm::ExitRecord> published_exits_;  // by key
};

class Job : private Supervisor {
 public:
  explicit Job(JobContext ctx) : ctx_(std::move(ctx)), plan_(ctx_.plan) {}
  int run();

 private:
  // Supervisor: what the job's parts (Ray, fan-out, elastic membership) may ask of it.
  void publish_end(const EndInfo& e) override;
  void adopt_end(const EndInfo& e) override;
  bool ended() const override { return end_.has_value(); }
  bool stopping() const override { return stopping_; }
  void watch(int fd) override { epoll_add(fd); }
  void unwatch(int fd) override { epoll_del(fd); }
  Supervisor& supervisor() { return *this; }  // the private base, for the parts' constructors
  // Set-up
  void setup_signals();
  void start_store();
  // Slurm per-node jobs without a token (JobContext::munge): node 0 makes the token and a munge
  // credential of it for each other node; the others fetch theirs from node 0's store and decode it.
  std::map<std::string, std::string> make_munge_credentials();
  bool munge_usable_here();  // false: open_reason_ says why
  void take_munge_token(StoreClientOptions& co);
  void require_settled_token();
  void check_job_id();  // per-node jobs: the store serves this job (its --rdzv-id), or ConfigError
  // One attempt
  EndInfo run_attempt(int attempt);
  void spawn_workers(int attempt);
  void spawn_worker(Worker& w, const NodePlan& node, int attempt, const std::vector<int>& cpus,
                    const GpuAssignment& gpu);
  // Loop handlers
  void on_signal(int sig);
  // Outside the event loop: handles what the signal fd holds (children's exits, forwarded signals)
  // and returns the first terminating signal among them, 0 if none. Every wait outside the loop
  // calls it at least every few hundred milliseconds, so that Ctrl-C ends any phase within a second.
  int pending_interrupt();
  void reap();
  void on_worker_exit(Worker& w, int status);
  // job_end.cc: the end record and the nodes' counts in the store (publish_end, adopt_end above).
  void upgrade_end(const EndInfo& e);
  // Sets store key `key` to `e` unless another node set it first, and replaces theirs when it only
  // reports `e` (is_consequence). Returns what the key holds afterwards. Throws on a store error.
  std::string claim_root_cause(const std::string& key, const EndInfo& e);
  // This node's workers have all exited: a local job ends; in a distributed one the node counts itself
  // done in the store and the last node publishes "done" (with the first failure, if any).
  void report_node_done();
  // After an attempt: per-node jobs keep node 0's store up until every node saw the end, and the
  // summary follows the store's last word on the root cause.
  void settle_end_with_store();
  void begin_stop();
  void send_stop_signal();
  void kill_all(int sig);
  // job_workers.cc: descendants of the workers that left their process groups. The launcher is the
  // child subreaper, so they become its children when their parent dies; at the end of each attempt
  // they get the workers' stop (SIGTERM, SIGKILL after --kill-grace).
  struct Adopted {
    pid_t pid;
    std::string name;  // its comm, for the message
    bool stopped;
  };
  void become_subreaper();
  std::vector<Adopted> adopted_children() const;
  void end_adopted_children();
  void drain(int fd, OutputSink& sink, bool is_stderr, UniqueFd& holder);
  void arm_timer(double seconds);
  void disarm_timer();
  // --timeout: the job's wall-clock limit. Its own timer (the kill-grace timer comes and goes with each
  // stop), armed once for the whole job, restarts included; when it fires the job ends on every node.
  void arm_time_limit();
  void on_time_limit();
  void epoll_add(int fd);
  void epoll_del(int fd);
  std::string failure_summary(const Worker& w);
  // "" or, for a worker that exited with code 2, the line saying the code is the program's, not cohort run's.
  std::string usage_exit_hint(const Worker& w) const;
  // A .py script's or module's failure to import: which interpreter ran and how to choose another.
  std::string missing_module_hint(const std::vector<std::string>& stderr_tail) const;
  // describe_status, and for a SIGKILL who sent it, as far as the launcher and the kernel know (launch/oom.h).
  std::string describe_worker_exit(const Worker& w);
  // The path and argv of process `w` of this node: PROGRAM (or its interpreter), the built-in parameter
  // server, or in a Ray job its node's `ray start`.
  std::pair<std::string, std::vector<std::string>> process_command(const Worker& w);
  // job_trace.cc
  void prepare_trace(Worker& w, const NodePlan& node, std::vector<std::pair<std::string, std::string>>& vars);
  void start_inspector(int attempt);
  void stop_inspector();
  std::vector<trace::RankSnapshot> final_snapshots() const;  // this node's rings, with process states
  void publish_final_trace();        // several nodes: this node's rings for the head's diagnosis
  void record_failure(int attempt);  // dumps and diagnosis_ of a failed attempt
  void merge_timeline();
  std::string timeline_rank_dir() const;
  int running_workers() const;

  JobContext ctx_;
  Plan& plan_;
  std::vector<GpuAssignment> gpus_;  // per local rank (empty: not a GPU job)
  bool distributed_ = false;
  UniqueFd epoll_, signal_fd_, timer_fd_;
  UniqueFd limit_fd_;  // --timeout's timer (invalid without a limit)
  StoreLinks store_;         // job_end.cc's start_store makes them; an elastic job's failover moves them
  std::string open_reason_;  // why a job that could have had a token has none (munge failed): for the warning
  // Shared with the (detached) watcher threads, which may outlive an attempt by one wait slice.
  std::shared_ptr<EventQueue> events_ = std::make_shared<EventQueue>();
  std::shared_ptr<std::atomic<bool>> watcher_stop_ = std::make_shared<std::atomic<bool>>(false);
  std::vector<Worker> workers_;
  // job_fanout.cc: a fan-out head's agents; an agent's control channel from its head.
  Agents agents_{plan_, supervisor()};
  ControlChannel control_{supervisor(), [this](int sig) { on_signal(sig); }, [this] { begin_stop(); }};
  std::unique_ptr<Inspector> inspector_;  // reads workers_' rings: stopped before workers_ changes
  std::vector<std::string> diagnosis_;    // the flight recorders' account of the last failed attempt
  OomCounter oom_at_start_;               // this cgroup's OOM kills when the attempt's workers started
  TraceFolder trace_folder_{plan_};        // job_trace.cc: the default trace folder's claim
  // Attempt state
  bool stopping_ = false;
  bool reporting_ = false;  // in the report window: the stop signal is not sent yet (see begin_stop)
  bool killed_ = false;
  bool stop_signal_sent_ = false;  // the workers got their SIGTERM (forwarded, or the stop's own)
  bool done_reported_ = false;
  bool joined_ = false;
  std::optional<EndInfo> end_;
  std::optional<EndInfo> first_failure_;  // --no-abort-on-failure
  Clock::time_point end_seen_;
  bool subreaper_ = false;  // PR_SET_CHILD_SUBREAPER took
  // job_elastic.cc: this agent's membership of an elastic job (plan_.elastic; null otherwise), made at set-up.
  std::unique_ptr<ElasticMember> elastic_;
  // job_exits.cc: what the ranks learn of this node's workers' exits.
  RankExits exits_{plan_};
  // job_ray.cc: Ray mode's part of the job (plan_.ray.enabled; null otherwise), made at set-up.
  std::unique_ptr<RayCluster> ray_;
};


}  // namespace cohort::launch::job_detail
