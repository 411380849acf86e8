#pragma once
// The launch plan: what `cohort run` will do, derived from flags, the scheduler environment and
// hostfiles before anything starts. build_plan() is a pure function of (Options, EnvMap, a few
// facts about this machine), so every combination is unit-tested; --dry-run prints it.

#include <optional>
#include <string>
#include <vector>

#include "common/affinity.h"
#include "launch/gpus.h"
#include "launch/parsers.h"
#include "launch/ray.h"

namespace cohort::launch {

// The command line, as parsed (nothing resolved yet). Unset optionals mean "not given".
struct Options {
  std::optional<std::string> nproc_per_node;  // "N" or "auto"
  std::string nproc_per_node_flag = "--nproc-per-node";  // the spelling given (-N, --npernode), for messages
  std::optional<int> np;                      // -n/-np: total number of workers
  std::optional<int> nnodes;
  // --nnodes MIN:MAX (torchrun's elastic form): the minimum; `nnodes` holds the maximum.
  std::optional<int> min_nodes;
  std::optional<int> node_rank;
  std::optional<std::string> master_addr;
  // Where master_addr came from, for --dry-run: the flag, or mpirun's -mca oob_tcp_if_include IFACES
  // (this host's address on those interfaces).
  std::string master_addr_flag = "--master-addr";
  std::optional<int> master_port;
  std::optional<std::string> hosts;     // -H
  std::optional<std::string> hostfile;  // path
  std::string hostfile_text;            // contents of `hostfile` (read by the caller)
  std::string ssh_command = "ssh -o BatchMode=yes";
  // --launcher: how a fan-out starts its agents: "ssh", "srun" (inside a Slurm allocation) or "auto"
  // (srun when the hosts are the Slurm allocation's, ssh otherwise).
  std::string launcher = "auto";
  std::vector<std::string> export_env;  // -x VAR or VAR=value
  double join_timeout_s = 300;  // also --rdzv-timeout
  double rdzv_last_call_s = 5;  // --rdzv-conf last_call_timeout=S
  std::optional<std::string> rdzv_backend;
  bool rdzv_endpoint = false;  // the store's address came as --rdzv-endpoint (torchrun's line), not --master-addr
  double kill_grace_s = 5;
  std::optional<bool> tag_output;
  std::string output_dir;  // --output-filename
  bool merge_stderr = false;
  std::optional<std::string> ranks_to_console;
  std::string bind_to = "auto";
  bool device_per_rank = false;
  std::optional<std::string> gpus_per_node;  // --gpus-per-node: "auto" or N (unset: not a GPU job)
  bool gpu_share = false;                    // --gpu-share: more local ranks than GPUs is allowed
  bool abort_on_failure = true;
  int max_restarts = 0;
  bool dry_run = false;
  std::optional<std::string> run_id;
  std::string timeline;   // --timeline PATH (default COHORT_TIMELINE)
  bool stats = false;     // --stats
  std::string trace_dir;  // --trace-dir DIR (default COHORT_TRACE_DIR, else $TMPDIR/cohort-traces-<uid>/<job id>)
  // Parameter-server mode (docs/parameter-server.md): --ps N servers besides the workers,
  // --ps-mode, and whether servers run the built-in `cohort ps serve` or the program itself.
  std::optional<int> ps;
  std::optional<std::string> ps_mode;
  std::string ps_server = "builtin";
  std::vector<std::string> program;  // PROGRAM ARGS...
  // How PROGRAM runs (torchrun's forms): a PROGRAM ending in .py, or -m MODULE, runs under a Python
  // interpreter (--python, else COHORT_PYTHON, else python3); --no-python runs PROGRAM directly.
  bool module = false;
  bool no_python = false;
  std::optional<std::string> python;
  bool append_local_rank = false;  // --append-local-rank: --local_rank=N after the script
  // --local-rank-arg: how that argument is spelt: local_rank (torch 1.x's launch), local-rank (2.x's) or
  // auto (as the installed torch's launch spells it: choose_local_rank_arg, launch/torch_version.h).
  std::optional<std::string> local_rank_arg;
  bool use_env = false;            // --use-env (torch.distributed.launch's; nothing to do for cohort)
  // `cohort horovodrun` (horovodrun's line): every worker also gets Horovod's variables (HOROVOD_RANK,
  // HOROVOD_SIZE, HOROVOD_LOCAL_*, HOROVOD_CROSS_*, HOROVOD_HOSTNAME), as `horovodrun --gloo` sets them.
  bool horovod_env = false;
  // horovodrun's line too: a fan-out's other hosts get this launcher's whole environment, as horovodrun
  // hands its own to every worker it starts over ssh (forward_environment, launch/plan_worker_env.cc).
  bool forward_environment = false;
  // mpirun's --map-by, --rank-by, --report-bindings, --oversubscribe (-n may exceed the hosts' slots),
  // --timestamp-output, --timeout (the job's wall-clock limit, seconds) and --wdir (the workers' folder,
  // absolute; the launcher has already entered it).
  std::optional<std::string> map_by;
  std::optional<std::string> rank_by;  // mpirun's --rank-by: slot or node
  bool report_bindings = false;
  bool oversubscribe = false;
  bool timestamp_output = false;
  std::optional<double> timeout_s;
  std::string timeout_flag = "--timeout";  // or MPIEXEC_TIMEOUT (mpirun's variable), for messages
  std::optional<std::string> wdir;
  // torchrun's per-rank log files and console filter.
  std::optional<std::string> log_dir;
  std::optional<std::string> redirects;
  std::optional<std::string> tee;
  std::optional<std::string> local_ranks_filter;
  // Ray mode (docs/ray.md): --ray, the head's GCS port (--ray-port, else HEAD_PORT), the range of the
  // nodes' other Ray ports (--ray-ports FIRST-LAST) and the ray executable (--ray-command).
  bool ray = false;
  std::optional<int> ray_port;
  std::optional<std::string> ray_ports;
  std::optional<std::string> ray_command;
};

// Facts about the machine build_plan needs (injected so tests control them).
struct MachineFacts {
  std::string hostname = "localhost";
  int cpu_count = 1;
  int gpu_count = 0;  // visible GPUs (--nproc-per-node auto)
  // This node's GPUs, detected only when the plan needs them (--gpus-per-node); see launch/gpus.h.
  GpuInventory gpus;
  // This host's name and IP addresses (an Ascend rank table's node is the server listing one).
  std::vector<std::string> addresses;
  // Resolves PROGRAM to an executable path, or throws ConfigError; tests pass a fake.
  std::string (*resolve_program)(const std::string&) = nullptr;
};
// `detect_gpus`: run the GPU detection of launch/gpus.h (nvidia-smi -L, /proc, sysfs), which only
// --gpus-per-node needs; otherwise gpu_count comes from CUDA_VISIBLE_DEVICES or /dev/nvidiaN.
MachineFacts this_machine(bool detect_gpus = false);
// Whether `host` names this machine: localhost, 127.0.0.1, ::1, this host's name (short or full) or one
// of its addresses. (Other loopback addresses, 127.0.0.2 and up, count as other hosts, as in a fan-out:
// tests use them to stand for other machines.) `cohort doctor` checks such hosts without ssh.
bool is_this_machine(const std::string& host, const MachineFacts& machine);
// horovodrun's line: whether the launcher's variable `name` goes to the workers on other hosts, as horovodrun
// hands its environment to every worker it starts over ssh: all but horovodrun's exceptions (shell functions,
// OLDPWD, CUDA_VISIBLE_DEVICES) and the ones that describe the launcher's own process (the places cohort sets
// for each worker, COHORT_*, TORCHELASTIC_*, Open MPI's, PMIx's and Slurm's).
bool forwarded_to_other_hosts(const std::string& name);
// PATH lookup + access(X_OK); ConfigError "program 'x' not found on PATH" / "... is not executable".
std::string resolve_program(const std::string& program);

enum class Mode { kLocal, kPerNode, kFanOut };

// How a worker runs PROGRAM (torchrun's forms; docs/launcher.md, "How PROGRAM runs").
struct ProgramForm {
  std::string kind = "direct";  // direct: exec PROGRAM; script: PYTHON -u PROGRAM; module: PYTHON -u -m PROGRAM
  std::string python;           // the interpreter as named; every host resolves it on its own PATH
  std::string python_source;    // --python, COHORT_PYTHON or default
  bool append_local_rank = false;  // --local_rank=N right after the script (torch.distributed.launch)
  // Its spelling: "--local_rank" (torch 1.x's launch) or "--local-rank" (torch 2.x's), and why that one
  // ("default", "--local-rank-arg", or "auto": resolved by choose_local_rank_arg before the job starts).
  std::string local_rank_arg = "--local_rank";
  std::string local_rank_arg_source = "default";
  // Fan-out: the head's folder. An agent runs its workers there when the folder exists on its host, as
  // mpirun does, so relative paths (PROGRAM, a script, the program's own files) mean the same everywhere.
  std::string working_dir;
  // --wdir: the folder was asked for, so a host without it is an error rather than a fallback.
  bool working_dir_required = false;
};

// torchrun's per-rank log files and console filter (--log-dir, --redirects, --tee, --local-ranks-filter).
struct RankLogs {
  std::string dir;        // DIR/<run id>: attempt_<n>/<rank>/{stdout,stderr}.log below it; "" = no files
  std::string redirects;  // torchrun's form, checked by build_plan: "3" (every local rank) or "0:1,1:2"
  std::string tee;
  std::vector<int> console_local_ranks;  // --local-ranks-filter
  bool all_local_ranks = true;
};
// Which streams a torchrun-style spec ("", "3", "0:1,1:2") names for `local_rank`: bit 1 stdout,
// bit 2 stderr. Throws ConfigError naming `flag` on a malformed spec.
int std_streams(const std::string& flag, const std::string& spec, int local_rank);
const char* mode_name(Mode m);

struct NodePlan {
  int node_rank = 0;
  std::string host;  // name used in tags and, for fan-out, the ssh target
  bool local = true;  // started by this launcher (in-process) rather than over ssh
  int first_rank = 0;  // processes of this node: first_rank .. first_rank + nproc - 1 (unless `ranks`)
  int nproc = 1;       // all of them: its workers, then its parameter servers (nservers)
  int nservers = 0;
  // The node's processes when they are not consecutive (mpirun's --map-by node / --rank-by node deal
  // ranks round robin over the hosts: 0 and 2 on one, 1 and 3 on the other), in local-index order;
  // empty in the usual case, where first_rank and nproc say them.
  std::vector<int> ranks{};

  // The process with local index `local` (0 .. nproc - 1), and the local index of `process` (-1: not
  // on this node). Every caller goes through these rather than first_rank + local.
  int rank_of(int local) const { return ranks.empty() ? first_rank + local : ranks[static_cast<size_t>(local)]; }
  int local_index_of(int process) const;
  // All of them in local-index order, and as text for messages ("0-3", "0,2").
  std::vector<int> processes() const;
  std::string ranks_text() const;
};

// What a process of the job is: a worker (index among the workers, local index among its node's
// workers) or, in a parameter-server job, a server (index among the servers).
struct ProcessRole {
  bool server = false;
  int index = 0;
  int local_index = 0;
  int local_count = 1;
};

// Ray mode (--ray, docs/ray.md): node 0 runs the Ray head and, once every node has joined the cluster, the
// driver (PROGRAM); every other node runs a Ray worker node; the driver's end is the job's. The processes:
// node 0's are 0 (its Ray node) and 1 (the driver), node k's is k + 1 (its Ray node).
struct RayPlan {
  bool enabled = false;
  // The job does not say how many nodes it has (TI-ONE's HEAD_ADDR, HEAD_PORT and RANK alone): node 0
  // starts the driver once its own Ray is up, and each other node joins the head whenever it starts and
  // stays until the job ends. Node 0's plan then has 1 node, node k's the nodes 0..k (it waits for node 0).
  bool open_membership = false;
  std::string command = "ray";  // --ray-command: each node resolves it on its own PATH
  std::string command_path;     // ... resolved on this host ("" where this host runs no Ray node)
  int head_port = 0;            // the GCS port: --ray-port or HEAD_PORT; 0: a free one the head picks
  std::string head_port_source;
  // HEAD_ADDR as the platform gave it: where the other nodes reach the head ("": node 0's name in the job,
  // resolved on node 0).
  std::string head_address;
  int first_port = 0;  // --ray-ports FIRST-LAST (0: each node takes the job's default block, launch/ray.h)
  int last_port = 0;
};

struct Plan {
  Mode mode = Mode::kLocal;
  int nnodes = 1;
  int this_node = 0;  // node rank this process runs workers for; -1: the head has no workers
  int world_size = 1;
  std::vector<NodePlan> nodes;
  bool host_store = true;      // this process hosts the job's store
  std::string master_addr;     // where the store is reached
  int master_port = 0;         // 0: chosen by the OS when the store starts
  std::string job_id;
  bool token_from_env = false;  // per-node mode: COHORT_JOB_TOKEN given on every node
  std::string token_file;       // cohort run --token-file (it wins over COHORT_JOB_TOKEN)
  std::vector<std::pair<std::string, std::string>> sources;  // setting -> where it came from
  std::vector<std::string> schedulers;                       // scheduler environments consulted
  // What the launcher says before it starts, one line each ("cohort run: note: ..."; --dry-run shows
  // them too): e.g. a shell's leftover MASTER_ADDR/RANK/WORLD_SIZE that a local job ignored.
  // Not sent to agents.
  std::vector<std::string> notes;
  std::vector<std::pair<std::string, std::string>> extra_env;  // -x
  bool set_omp_threads = false;  // OMP_NUM_THREADS=1 for the workers (unset, >1 worker per node)
  bool tag_output = false;
  std::string output_dir;
  bool merge_stderr = false;
  std::vector<int> ranks_to_console;  // empty: all
  bool all_ranks_to_console = true;
  std::string bind_to = "auto";
  bool device_per_rank = false;
  // GPU job (--gpus-per-node): the flag as given (each node resolves "auto" against its own GPUs),
  // the count on this node (0 when not a GPU job or not known here), and --gpu-share.
  std::string gpus_per_node_spec;
  int gpus_per_node = 0;
  bool gpu_share = false;
  bool abort_on_failure = true;
  int max_restarts = 0;
  double join_timeout_s = 300;
  double kill_grace_s = 5;
  std::string ssh_command;
  // Fan-out: how the agents start. "ssh": `ssh_command HOST cohort agent`; "srun": one srun step per
  // host inside the Slurm allocation (`srun --nodes=1 --ntasks=1 --nodelist=HOST --overlap ...`).
  std::string agent_launcher = "ssh";
  // Elastic membership (--nnodes MIN:MAX, docs/launcher.md "Elastic jobs"): the agents meet in
  // generations (launch/rendezvous.h); nodes, node ranks and the world size above are this node's
  // guess until the first generation closes, and change with every generation. The store is hosted
  // by the agent on the master address's host that binds its port first; each agent holds a store
  // lease of agent_lease_s (COHORT_AGENT_LEASE_S) whose end tells the others it is gone.
  bool elastic = false;
  int min_nodes = 1;
  int max_nodes = 1;
  double rdzv_last_call_s = 5;
  double agent_lease_s = 3;
  // Observability (docs/observability.md): the merged timeline's path ("" = off), live stats, where
  // flight recorder dumps and timeline rank files go, the stall inspector's threshold (0 = off) and
  // each rank's ring size (0 = flight recorder off).
  std::string timeline_path;
  bool stats = false;
  std::string trace_dir;
  bool trace_dir_default = false;  // cohort chose trace_dir: removed after a success (launch/trace_dirs.h)
  double stall_warn_s = 60;
  int flight_recorder = 2000;
  std::string program_path;          // what the workers exec: PROGRAM, or the Python interpreter, resolved
  std::vector<std::string> program;  // PROGRAM ARGS... as given (argv)
  ProgramForm form;
  RankLogs logs;
  bool report_bindings = false;  // --report-bindings: one stderr line per rank with its CPUs
  bool timestamp_output = false;  // --timestamp-output: each console line starts with the time it was read
  bool horovod_env = false;       // `cohort horovodrun`: HOROVOD_* for every worker (Options::horovod_env)
  // --timeout: the job's wall-clock limit in seconds (0: none), counted by every launcher that is not a
  // fan-out's agent from its own start; the first to reach it ends the job on every node.
  double timeout_s = 0;
  std::string timeout_flag = "--timeout";
  // Parameter-server mode: servers in the job (0: not a PS job), workers, the consistency mode,
  // and whether servers run the program (else `cohort ps serve`).
  // Ascend rank table (RANK_TABLE_FILE): per global rank, the table's device id and rank id, and
  // the table's rank count; workers get DEVICE_ID, RANK_ID and RANK_SIZE. Empty without a table.
  std::vector<std::pair<int, int>> rank_table_slots;
  int rank_table_size = 0;
  int ps_servers = 0;
  int num_workers = 1;
  std::string ps_mode;
  bool ps_server_program = false;
  RayPlan ray;

  const NodePlan* node(int rank) const;
  // The node that runs process `process`, and its role there.
  const NodePlan* node_of_process(int process) const;
  ProcessRole role_of(int process) const;
  // "rank 3" for workers, "parameter server 0" for servers (messages), and the short tag used in
  // output prefixes and folders: "3" / "ps0".
  std::string process_name(int process) const;
  std::string process_tag(int process) const;
  // The LOCAL_RANK process `process` gets (in a parameter-server job, its index among its node's
  // processes of its role).
  int local_rank_of(int process) const;
  // Ray mode: whether process `process` is the driver (else it is its node's Ray node).
  bool is_ray_driver(int process) const { return ray.enabled && process == 1; }
  std::string source_of(const std::string& setting) const;
};

// Throws ConfigError (one line naming the flag/variable/file) on bad or conflicting input.
Plan build_plan(const Options& options, const EnvMap& env, const MachineFacts& machine);

// Resolves, on this host, what the workers exec (plan.program_path): PROGRAM itself, or for a .py
// script and -m the Python interpreter (after checking that the script exists). `resolve`: PATH lookup
// (resolve_program, or a test's fake). Throws ConfigError, one line naming the program.
void resolve_worker_command(Plan& plan, std::string (*resolve)(const std::string&));
// The argv of process `process` (argv[0]: as given for a direct PROGRAM, the resolved interpreter for
// the Python forms; --local_rank=N after the script with --append-local-rank).
std::vector<std::string> worker_argv(const Plan& plan, int process);
// The same as one line a shell would accept (arguments quoted where needed), for --dry-run.
std::string shell_line(const std::vector<std::string>& argv);

// Worker environment (only the variables cohort sets; the worker also inherits the launcher's).
struct WorkerSlot {
  int rank = 0;
  int local_rank = 0;
  int local_world = 1;
  int node_rank = 0;
  GpuAssignment gpu;  // device -1: no GPU planned
  std::string ray_gcs{};  // Ray mode: HOST:PORT of the head's GCS ("" before it is known: --dry-run)
};
std::vector<std::pair<std::string, std::string>> worker_env(const Plan& plan, const WorkerSlot& slot,
                                                            const std::string& store_addr, int torch_port,
                                                            const std::string& token, int restart_count,
                                                            const EnvMap& launcher_env);

// CPU sets per local rank for --bind-to (empty vectors: not bound). `allowed` is this process's
// affinity; `numa_nodes` the CPUs of each NUMA node; `cores` the logical CPUs of each physical core
// (hyperthread siblings together; empty: every allowed CPU is a core of its own).
//   none: no binding.  core: local rank i gets the i-th allowed CPU (wrapping).
//   numa: the CPUs of NUMA node i mod (nodes).
//   auto (default): each local rank gets an equal, disjoint block of whole physical cores (of logical
//     CPUs when there are fewer cores than ranks), like mpirun's default binding; no binding for one
//     rank or when the ranks outnumber the CPUs (oversubscribed: the scheduler spreads them best).
//     With `near_cpus` (a GPU job: per local rank, the CPUs next to its GPU), the blocks are cut from
//     those CPUs instead: ranks whose GPUs share a NUMA node share its cores, each its own block.
//     Used only when every rank's set is known and leaves each rank at least one CPU.
std::vector<std::vector<int>> compute_bindings(const std::string& bind_to, int nproc, const std::vector<int>& allowed,
                                               const std::vector<std::vector<int>>& numa_nodes,
                                               const std::vector<std::vector<int>>& cores = {},
                                               const std::vector<std::vector<int>>& near_cpus = {});
// The allowed CPUs grouped by physical core (sysfs topology: package and core id).
std::vector<std::vector<int>> physical_cores(const std::vector<int>& allowed);
// The CPUs this process may run on (common/affinity.h; here for the launcher's callers).
using affinity::allowed_cpus;
std::vector<std::vector<int>> numa_node_cpus();

// Ray mode: what this node's Ray is given (--num-cpus, --num-gpus): the CPUs this launcher may use (its
// affinity, which a container's cpuset narrows), and the GPUs of --gpus-per-node, else those visible here.
int ray_num_cpus();
int ray_num_gpus(const Plan& plan);
// The `ray start` command of node `node_rank` (launch/ray.h): the head (node 0) listens on `gcs`'s port,
// the others join `gcs`; `node_ip` is this node's address that the others reach.
std::vector<std::string> ray_node_argv(const Plan& plan, int node_rank, const std::string& node_ip,
                                       const std::string& gcs, const RayPorts& ports);

// The --dry-run text: nodes, ranks, the source of each setting, each local worker's environment.
// `gpus`: this node's GPUs (for a GPU job, each local rank's GPU is shown).
std::string describe_plan(const Plan& plan, const EnvMap& env, const std::string& store_addr,
                          const GpuInventory& gpus = {});
// Per local rank, the CPUs next to its GPU; empty unless every rank has a GPU of known locality.
std::vector<std::vector<int>> near_cpus_of(const std::vector<GpuAssignment>& gpus);

// Serialisation of a plan for `cohort agent` (sent over the ssh connection's stdin).
std::string plan_to_json(const Plan& plan);
Plan plan_from_json(const std::string& text);

// 32 random bytes as hex (OpenSSL RAND_bytes).
std::string random_token(int bytes = 32);

}  // namespace cohort::launch
