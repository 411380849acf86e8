#include "launch/plan.h"

#include <dirent.h>
#include <fmt/core.h>
#include <openssl/rand.h>
#include <sched.h>
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <filesystem>
#include <thread>
#include <tuple>

#include "cohort/error.h"
#include "common/env.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/ray.h"
#include "launch/trace_dirs.h"

namespace cohort::launch {
namespace {
// Read from the launcher's environment as the plan sees it (an injected map in tests).
const env::SecondsSetting kAgentLease("COHORT_AGENT_LEASE_S", 3.0,
                                      "elastic jobs: each node's agent holds a lease in the store, renewed several "
                                      "times within this time; its end tells the others that the node is gone");
}  // namespace

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(NodePlan, node_rank, host, local, first_rank, nproc, nservers, ranks)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ProgramForm, kind, python, python_source, append_local_rank, local_rank_arg,
                                   local_rank_arg_source, working_dir, working_dir_required)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(RankLogs, dir, redirects, tee, console_local_ranks, all_local_ranks)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(RayPlan, enabled, open_membership, command, command_path, head_port, head_port_source, head_address,
                                   first_port, last_port)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Plan, mode, nnodes, this_node, world_size, nodes, host_store, master_addr,
                                   master_port, job_id, token_from_env, sources, schedulers, extra_env,
                                   set_omp_threads, tag_output, output_dir, merge_stderr, ranks_to_console,
                                   all_ranks_to_console, bind_to, device_per_rank, gpus_per_node_spec, gpus_per_node,
                                   gpu_share, abort_on_failure, max_restarts,
                                   join_timeout_s, kill_grace_s, ssh_command, agent_launcher, timeline_path, stats, trace_dir,
                                   trace_dir_default, stall_warn_s, flight_recorder, program_path, program, ps_servers,
                                   num_workers, ps_mode, ps_server_program, rank_table_slots,
                                   rank_table_size, elastic, min_nodes, max_nodes, rdzv_last_call_s, agent_lease_s, form, logs,
                                   report_bindings, timestamp_output, timeout_s, timeout_flag, ray, horovod_env)

// The Python interpreter of .py programs and -m modules (read from the launcher's environment map,
// like every setting build_plan uses, so that tests can give it).
const env::StringSetting kPython("COHORT_PYTHON", "python3",
                                 "interpreter that runs a .py PROGRAM and -m MODULE (cohort run --python overrides)");

const char* mode_name(Mode m) {
  switch (m) {
    case Mode::kLocal: return "local";
    case Mode::kPerNode: return "per-node";
    case Mode::kFanOut: return "fan-out";
  }
  return "?";
}

int NodePlan::local_index_of(int process) const {
  if (ranks.empty()) return process >= first_rank && process < first_rank + nproc ? process - first_rank : -1;
  auto it = std::find(ranks.begin(), ranks.end(), process);
  return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
}

std::vector<int> NodePlan::processes() const {
  std::vector<int> out;
  for (int l = 0; l < nproc; ++l) out.push_back(rank_of(l));
  return out;
}

std::string NodePlan::ranks_text() const {
  if (ranks.empty()) return fmt::format("{}-{}", first_rank, first_rank + nproc - 1);
  return str::format_ranges(ranks);
}

const NodePlan* Plan::node(int rank) const {
  for (const auto& n : nodes)
    if (n.node_rank == rank) return &n;
  return nullptr;
}

const NodePlan* Plan::node_of_process(int process) const {
  for (const auto& n : nodes)
    if (n.local_index_of(process) >= 0) return &n;
  return nullptr;
}

ProcessRole Plan::role_of(int process) const {
  ProcessRole r;
  const NodePlan* n = node_of_process(process);
  if (!n || ps_servers == 0) {
    r.index = process;
    r.local_index = n ? n->local_index_of(process) : 0;
    r.local_count = n ? n->nproc : 1;
    return r;
  }
  // (A parameter-server job's nodes always hold consecutive processes: build_plan refuses --rank-by node
  // with --ps.)
  const int local = n->local_index_of(process), workers_here = n->nproc - n->nservers;
  // Indices count the earlier nodes' workers / servers.
  int workers_before = 0, servers_before = 0;
  for (const auto& m : nodes) {
    if (m.first_rank >= n->first_rank) continue;
    workers_before += m.nproc - m.nservers;
    servers_before += m.nservers;
  }
  if (local < workers_here) return ProcessRole{false, workers_before + local, local, workers_here};
  return ProcessRole{true, servers_before + local - workers_here, local - workers_here, n->nservers};
}

std::string Plan::process_name(int process) const {
  if (ray.enabled) {
    if (is_ray_driver(process)) return "the driver";
    return process == 0 ? "the Ray head (node 0)" : fmt::format("Ray node {}", process - 1);
  }
  ProcessRole r = role_of(process);
  return r.server ? fmt::format("parameter server {}", r.index) : fmt::format("rank {}", r.index);
}

std::string Plan::process_tag(int process) const {
  if (ray.enabled) return is_ray_driver(process) ? "driver" : fmt::format("ray{}", process == 0 ? 0 : process - 1);
  ProcessRole r = role_of(process);
  return r.server ? fmt::format("ps{}", r.index) : std::to_string(r.index);
}

int Plan::local_rank_of(int process) const {
  if (ps_servers > 0) return role_of(process).local_index;
  const NodePlan* n = node_of_process(process);
  return n ? n->local_index_of(process) : 0;
}

std::string Plan::source_of(const std::string& setting) const {
  for (const auto& [k, v] : sources)
    if (k == setting) return v;
  return "default";
}

std::string resolve_program(const std::string& program) {
  auto check = [&](const std::string& path) -> bool {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) return false;
    if (S_ISDIR(st.st_mode)) throw ConfigError(fmt::format("program '{}' is a directory", path));
    if (access(path.c_str(), X_OK) != 0)
      throw ConfigError(fmt::format("program '{}' is not executable (chmod +x, or name its interpreter first)", path));
    // A script whose interpreter is missing would only fail in exec: check the "#!" line now.
    std::ifstream in(path, std::ios::binary);
    char magic[2] = {0, 0};
    if (in.read(magic, 2) && magic[0] == '#' && magic[1] == '!') {
      std::string line;
      std::getline(in, line);
      auto words = str::split(str::trim(line), ' ');
      if (!words.empty() && access(words[0].c_str(), X_OK) != 0)
        throw ConfigError(fmt::format("program '{}' cannot run: its interpreter '{}' (first line) is missing or not "
                                      "executable",
                                      path, words[0]));
    }
    return true;
  };
  if (program.empty()) throw ConfigError("no PROGRAM given (usage: cohort run [options] PROGRAM [ARGS...])");
  if (program.find('/') != std::string::npos) {
    if (!check(program)) throw ConfigError(fmt::format("program '{}' does not exist", program));
    return program;
  }
  const char* path = getenv("PATH");
  for (const auto& dir : str::split(path ? path : "/usr/local/bin:/usr/bin:/bin", ':')) {
    std::string candidate = dir + "/" + program;
    if (check(candidate)) return candidate;
  }
  // A file of that name right here is not run (a shell would not run it either), but the user most
  // likely meant it.
  struct stat here {};
  if (stat(program.c_str(), &here) == 0 && S_ISREG(here.st_mode))
    throw ConfigError(fmt::format("program '{}' not found on PATH (there is one in this folder: name it ./{})",
                                  program, program));
  throw ConfigError(fmt::format("program '{}' not found on PATH", program));
}

MachineFacts this_machine(bool with_gpus) {
  MachineFacts m;
  m.hostname = net::hostname();
  m.cpu_count = static_cast<int>(allowed_cpus().size());
  if (m.cpu_count <= 0) m.cpu_count = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  m.resolve_program = &resolve_program;
  m.addresses = {m.hostname};
  struct ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (auto* a = list; a; a = a->ifa_next) {
      if (!a->ifa_addr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6)) continue;
      char text[INET6_ADDRSTRLEN] = {};
      const void* raw = a->ifa_addr->sa_family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr);
      if (inet_ntop(a->ifa_addr->sa_family, raw, text, sizeof text)) m.addresses.push_back(text);
    }
    freeifaddrs(list);
  }
  if (with_gpus) {
    EnvMap env;
    if (const char* v = getenv("CUDA_VISIBLE_DEVICES")) env["CUDA_VISIBLE_DEVICES"] = v;
    m.gpus = detect_gpus(env);
    m.gpu_count = static_cast<int>(m.gpus.gpus.size());
    return m;
  }
  // Visible GPUs: CUDA_VISIBLE_DEVICES when set, else the /dev/nvidiaN device nodes.
  if (const char* v = getenv("CUDA_VISIBLE_DEVICES")) {
    m.gpu_count = static_cast<int>(str::split(v, ',').size());
  } else if (DIR* d = opendir("/dev")) {
    while (auto* e = readdir(d)) {
      std::string name = e->d_name;
      if (name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
          std::all_of(name.begin() + 6, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
        ++m.gpu_count;
    }
    closedir(d);
  }
  return m;
}

namespace {

bool is_local_host(const std::string& host, const std::string& hostname) {
  if (host == "localhost" || host == "127.0.0.1" || host == "::1" || host == hostname) return true;
  auto short_name = hostname.substr(0, hostname.find('.'));
  return host == short_name;
}

}  // namespace

bool is_this_machine(const std::string& host, const MachineFacts& machine) {
  if (is_local_host(host, machine.hostname)) return true;
  return std::find(machine.addresses.begin(), machine.addresses.end(), host) != machine.addresses.end();
}

namespace {

int parse_nproc(const std::string& flag, const std::string& text, const MachineFacts& machine, std::string& how) {
  if (text == "auto") {
    how = machine.gpu_count > 0 ? fmt::format("auto: {} visible GPUs", machine.gpu_count)
                                : fmt::format("auto: {} CPU cores", machine.cpu_count);
    return machine.gpu_count > 0 ? machine.gpu_count : machine.cpu_count;
  }
  long long v = 0;
  try {
    size_t used = 0;
    v = std::stoll(text, &used);
    if (used != text.size()) v = 0;
  } catch (...) {
    v = 0;
  }
  if (v < 1 || v > 100000)
    throw ConfigError(fmt::format("{} {}: expected a positive number or 'auto'", flag, text));
  return static_cast<int>(v);
}

}  // namespace

namespace {

// --timeline, --stats, --trace-dir and the flight recorder's settings (docs/observability.md). The
// launcher reads COHORT_FLIGHT_RECORDER itself: it sizes the rings it hands to the workers.
void set_observability(Plan& p, const Options& o, const EnvMap& env) {
  auto get = [&](const char* name) -> std::string {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  auto absolute = [](const std::string& path) {
    return path.empty() ? path : std::filesystem::absolute(path).lexically_normal().string();
  };
  p.timeline_path = absolute(!o.timeline.empty() ? o.timeline : get("COHORT_TIMELINE"));
  p.stats = o.stats;
  std::string dir = !o.trace_dir.empty() ? o.trace_dir : get("COHORT_TRACE_DIR");
  if (dir.empty()) {
    std::string tmp = get("TMPDIR");
    dir = default_trace_dir(tmp.empty() ? "/tmp" : tmp, p.job_id);
    p.trace_dir_default = true;
  }
  p.trace_dir = absolute(dir);
  if (std::string v = get("COHORT_STALL_WARN_S"); !v.empty()) {
    p.stall_warn_s = env::parse_seconds("COHORT_STALL_WARN_S", v);
    if (p.stall_warn_s < 0) throw ConfigError(fmt::format("COHORT_STALL_WARN_S={}: expected seconds >= 0 (0: off)", v));
  }
  if (std::string v = get("COHORT_FLIGHT_RECORDER"); !v.empty()) {
    int64_t n = env::parse_int("COHORT_FLIGHT_RECORDER", v);
    if (n < 0 || n > (int64_t(1) << 24))
      throw ConfigError(fmt::format("COHORT_FLIGHT_RECORDER={}: expected 0 (off) to 16777216 entries", v));
    p.flight_recorder = int(n);
  }
}

}  // namespace

namespace {

// Parameter-server mode: adds the servers to the nodes (after each node's workers) and renumbers
// the processes. --ps N puts server k on node k mod nnodes (every node of a per-node job computes
// the same layout); TF_CONFIG's cluster.ps entries are nodes that run one server and no worker.
void place_parameter_servers(Plan& p, const Options& o, const EnvMap& env,
                             const std::optional<Sourced<int>>& tf_ps_nodes) {
  p.num_workers = p.world_size;
  if (o.ps_server != "builtin" && o.ps_server != "program")
    throw ConfigError(fmt::format("--ps-server {}: expected builtin (cohort ps serve) or program", o.ps_server));
  if (!o.ps && !tf_ps_nodes) {
    if (o.ps_mode) throw ConfigError("--ps-mode needs --ps N (a parameter-server job)");
    if (o.ps_server != "builtin") throw ConfigError("--ps-server needs --ps N (a parameter-server job)");
    return;
  }
  if (o.ps && *o.ps < 1) throw ConfigError(fmt::format("--ps {}: expected a positive number of servers", *o.ps));
  if (tf_ps_nodes) {
    if (o.ps && *o.ps != tf_ps_nodes->value)
      throw ConfigError(fmt::format("--ps {} disagrees with {} ({} servers)", *o.ps, tf_ps_nodes->source,
                                    tf_ps_nodes->value));
    const int first_ps = p.nnodes - tf_ps_nodes->value;
    if (first_ps < 1) throw ConfigError(fmt::format("{}: a job needs at least one worker node", tf_ps_nodes->source));
    for (auto& n : p.nodes)
      if (n.node_rank >= first_ps) {
        n.nproc = 0;
        n.nservers = 1;
      }
    p.sources.emplace_back("parameter servers", tf_ps_nodes->source);
  } else {
    for (int k = 0; k < *o.ps; ++k) p.nodes[static_cast<size_t>(k % p.nnodes)].nservers++;
    p.sources.emplace_back("parameter servers", "--ps");
  }
  p.ps_servers = 0;
  int workers = 0, first = 0;
  for (auto& n : p.nodes) {
    workers += n.nproc;
    p.ps_servers += n.nservers;
    n.nproc += n.nservers;
    n.first_rank = first;
    first += n.nproc;
  }
  p.num_workers = workers;
  p.world_size = first;
  if (workers < 1) throw ConfigError("a parameter-server job needs at least one worker");
  std::string mode = o.ps_mode ? *o.ps_mode : env.count("COHORT_PS_MODE") ? env.at("COHORT_PS_MODE") : "async";
  p.sources.emplace_back("ps mode", o.ps_mode ? "--ps-mode" : env.count("COHORT_PS_MODE") ? "COHORT_PS_MODE" : "default");
  bool ok = mode == "async" || mode == "bsp";
  if (mode.rfind("stale:", 0) == 0 && mode.size() > 6)
    ok = mode.find_first_not_of("0123456789", 6) == std::string::npos && mode.size() < 16;
  if (!ok) throw ConfigError(fmt::format("--ps-mode {}: expected async, bsp or stale:K (K >= 0)", mode));
  p.ps_mode = mode;
  p.ps_server_program = o.ps_server == "program";
}

// torchrun's multi-node line (`--nnodes N --rdzv-backend c10d --rdzv-endpoint H:P`, the same on every
// node, no --node-rank): torchrun assigns node ranks at the rendezvous. So does cohort, through the
// elastic rendezvous with MIN = MAX = N. A node rank from a flag or a scheduler, `--rdzv-backend
// static` (torchrun's static rendezvous needs --node-rank), Ray and parameter-server jobs keep the
// fixed layout.
bool ranks_at_rendezvous(const Options& o, const SchedulerInfo& sched) {
  if (!o.nnodes || *o.nnodes < 2 || o.min_nodes || o.node_rank || sched.node_rank) return false;
  if (o.rdzv_backend == "static" || o.ray || o.ps) return false;
  return o.rdzv_endpoint || o.rdzv_backend == "c10d";
}

// --nnodes MIN:MAX (or Kubeflow's PET_NNODES=MIN:MAX): torchrun's elastic job (the agents meet in
// generations, launch/rendezvous.h).
void set_elastic(Plan& p, const Options& o, const EnvMap& env, int min_nodes, int max_nodes,
                 const std::string& source) {
  p.elastic = true;
  p.min_nodes = min_nodes;
  p.max_nodes = max_nodes;
  if (p.min_nodes < 1 || p.max_nodes < p.min_nodes)
    throw ConfigError(fmt::format("--nnodes {}:{}: expected 1 <= MIN <= MAX", p.min_nodes, p.max_nodes));
  if (o.rdzv_backend && *o.rdzv_backend != "c10d")
    throw ConfigError(fmt::format("--rdzv-backend {}: an elastic job (--nnodes MIN:MAX) meets in cohort's own store; "
                                  "use c10d (the default) or leave the flag out",
                                  *o.rdzv_backend));
  if (o.rdzv_last_call_s < 0)
    throw ConfigError(fmt::format("--rdzv-conf last_call_timeout={:g}: expected seconds >= 0", o.rdzv_last_call_s));
  p.rdzv_last_call_s = o.rdzv_last_call_s;
  if (auto it = env.find(kAgentLease.name()); it != env.end() && !it->second.empty()) {
    p.agent_lease_s = kAgentLease.from(it->second);
    if (p.agent_lease_s < 0.2 || p.agent_lease_s > 3600)
      throw ConfigError(fmt::format("COHORT_AGENT_LEASE_S={}: expected 0.2 to 3600 seconds", it->second));
  }
  p.sources.emplace_back("elastic", source);
}

}  // namespace

namespace {

// mpirun takes its --map-by and --rank-by words in any case (NODE, Slot).
std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

// What mpirun's --map-by asks of the placement.
struct MapBy {
  std::optional<int> per_node;  // ppr:N:node: N processes on every host
  bool by_node = false;         // node: the processes dealt round robin over the hosts
};

// mpirun's --map-by, in the forms that say something cohort's placement and binding can do: `slot`
// is cohort's placement (each node's slots in turn), `node` deals the processes round robin over the
// hosts (mpirun_counts_by_node), `ppr:N:node` is N processes per node, `core` binds each local rank to
// a CPU and `socket`/`numa` to a NUMA node (cohort knows NUMA nodes, not sockets: on the usual
// one-node-per-socket machine they are the same), unless --bind-to says otherwise.
MapBy apply_map_by(const std::string& given, std::string& bind_to) {
  std::string form = lower(given);
  const char* supported = "supported: slot, node, ppr:N:node, core, socket, numa";
  if (form == "slot") return {};
  if (form == "node") return MapBy{std::nullopt, true};
  if (form == "core" || form == "socket" || form == "numa") {
    if (bind_to == "auto") bind_to = form == "core" ? "core" : "numa";
    return {};
  }
  auto parts = str::split(form, ':', true);
  if (parts.size() == 3 && parts[0] == "ppr" && parts[2] == "node") {
    char* end = nullptr;
    long n = std::strtol(parts[1].c_str(), &end, 10);
    if (parts[1].empty() || *end != '\0' || n < 1 || n > 100000)
      throw ConfigError(fmt::format("--map-by {}: expected ppr:N:node with N a positive number", given));
    return MapBy{static_cast<int>(n), false};
  }
  throw ConfigError(fmt::format("--map-by {}: not a form cohort maps ({}; modifiers such as :PE=n and "
                                "ppr:N:socket are not)",
                                given, supported));
}

// How many of `n` processes each host gets, hosts in the order given with `slots[i]` slots each, as
// Open MPI 4.1's mapper by slot (its default) places them: each host's slots in turn. Beyond the slots
// (--oversubscribe) the processes left are dealt evenly over the hosts, the first hosts taking one more
// when they do not divide.
std::vector<int> mpirun_counts_by_slot(const std::vector<int>& slots, int n) {
  const int hosts = static_cast<int>(slots.size());
  int total = 0;
  for (int s : slots) total += s;
  std::vector<int> counts(slots.size(), 0);
  const int extra = std::max(0, n - total);
  for (int i = 0, left = n; i < hosts && left > 0; ++i) {
    const int here = slots[size_t(i)] + extra / hosts + (i < extra % hosts ? 1 : 0);
    counts[size_t(i)] = std::min(here, left);
    left -= counts[size_t(i)];
  }
  return counts;
}

// The same for --map-by node, as Open MPI 4.1's by-node mapper (orte_rmaps_rr_bynode) computes it: in
// passes, the processes left are shared evenly over the hosts that took some in the pass before (all
// hosts at first), the first of them taking one more when they do not divide (and each at least one);
// a host takes no more than its free slots, and a full host sits the pass out. Beyond the slots
// (--oversubscribe) every host just takes its share, slots or not. (So -n 6 over a:1,b:4,c:2 gives
// a 1, b 3, c 2: b takes the one a could not.)
std::vector<int> mpirun_counts_by_node(const std::vector<int>& slots, int n) {
  int total = 0;
  for (int s : slots) total += s;
  const bool beyond_slots = n > total;
  std::vector<int> counts(slots.size(), 0);
  int placed = 0;
  int takers = static_cast<int>(slots.size());
  // Every pass places at least one process while a host has a free slot (or beyond the slots, where the
  // first pass places them all), so the passes end.
  while (placed < n && takers > 0) {
    const int left = n - placed;
    const int share = std::max(1, left / takers);
    int one_more = std::max(0, left - share * takers);  // hosts taking share + 1
    takers = 0;
    for (size_t h = 0; h < slots.size() && placed < n; ++h) {
      const int free = slots[h] - counts[h];
      if (!beyond_slots && free <= 0) continue;
      int take = share;
      if (one_more > 0) {
        ++take;
        --one_more;
      }
      if (!beyond_slots) take = std::min(take, free);
      take = std::min(take, n - placed);
      counts[h] += take;
      placed += take;
      ++takers;
    }
  }
  return counts;
}

// mpirun's --rank-by node: the ranks are dealt round robin over the hosts (host order), one per host
// that still has an unnumbered process in each round, until every process has one. Per host, its
// ranks in local-index order.
std::vector<std::vector<int>> mpirun_ranks_by_node(const std::vector<int>& counts) {
  std::vector<std::vector<int>> ranks(counts.size());
  int next = 0;
  for (int round = 0, dealt = 1; dealt > 0; ++round) {
    dealt = 0;
    for (size_t h = 0; h < counts.size(); ++h)
      if (round < counts[h]) {
        ranks[h].push_back(next++);
        ++dealt;
      }
  }
  return ranks;
}

}  // namespace

// horovodrun's line: the workers on other hosts get this launcher's environment, as horovodrun hands its
// own to each worker it starts over ssh (PATH, PYTHONPATH, the program's settings), with horovodrun's
// exceptions (shell functions, OLDPWD, CUDA_VISIBLE_DEVICES) and cohort's: what the launcher sets for each
// worker (its place in the job), and other launchers' variables (Open MPI's, PMIx's, Slurm's), which
// describe this launcher's process, not the workers. -x still wins: its variables come first.
bool forwarded_to_other_hosts(const std::string& name) {
  static const std::vector<std::string> kOwnNames = {
      "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
      "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "OLDPWD", "HOROVOD_RANK",
      "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE",
      "HOROVOD_HOSTNAME"};
  static const std::vector<std::string> kOwnPrefixes = {"COHORT_", "TORCHELASTIC_", "OMPI_", "PMIX_", "SLURM_",
                                                        "BASH_FUNC_"};
  if (std::find(kOwnNames.begin(), kOwnNames.end(), name) != kOwnNames.end()) return false;
  if (std::any_of(kOwnPrefixes.begin(), kOwnPrefixes.end(), [&](const std::string& x) { return name.starts_with(x); }))
    return false;
  return !name.ends_with("CUDA_VISIBLE_DEVICES");
}

namespace {

void forward_environment(Plan& p, const EnvMap& env) {
  for (const auto& entry : env) {
    // Named references, not a structured binding: clang 14 (the sanitizer build) cannot capture those.
    const std::string& name = entry.first;
    const std::string& value = entry.second;
    if (!forwarded_to_other_hosts(name)) continue;
    if (std::any_of(p.extra_env.begin(), p.extra_env.end(), [&](const auto& kv) { return kv.first == name; })) continue;
    p.extra_env.emplace_back(name, value);
  }
}

// torchrun's program forms: a PROGRAM ending in .py runs as `PYTHON -u PROGRAM ARGS` and -m MODULE as
// `PYTHON -u -m MODULE ARGS`; --no-python runs PROGRAM directly whatever its name. Other programs run
// directly as before (torchrun would hand them to Python too; cohort runs executables of any kind).
void set_program_form(Plan& p, const Options& o, const EnvMap& env) {
  const std::string& program = o.program[0];
  if (o.module && o.no_python)
    throw ConfigError("-m/--module and --no-python both given: -m runs PROGRAM as a Python module, --no-python runs "
                      "it directly; use one");
  if (o.python && o.no_python) throw ConfigError("--python and --no-python both given; use one");
  if (o.use_env && o.append_local_rank)
    throw ConfigError("--use-env and --append-local-rank both given: --use-env says the program reads LOCAL_RANK "
                      "from its environment, --append-local-rank passes --local_rank=N; use one");
  const bool script = !o.no_python && !o.module && program.size() > 3 && program.ends_with(".py");
  p.form.kind = o.module ? "module" : script ? "script" : "direct";
  p.form.append_local_rank = o.append_local_rank;
  if (o.local_rank_arg) {
    const std::string& given = *o.local_rank_arg;
    if (given != "local_rank" && given != "local-rank" && given != "auto")
      throw ConfigError(fmt::format("--local-rank-arg {}: expected local_rank (torch 1.x's launch), local-rank "
                                    "(torch 2.x's) or auto (as the installed torch's launch spells it)",
                                    given));
    if (!o.append_local_rank)
      throw ConfigError(fmt::format("--local-rank-arg {} without a local rank argument to spell: it goes with "
                                    "--append-local-rank (cohort launch passes one unless --use-env)",
                                    given));
    p.form.local_rank_arg = given == "local-rank" ? "--local-rank" : "--local_rank";
    p.form.local_rank_arg_source = given == "auto" ? "auto" : "--local-rank-arg";
  }
  if (p.form.kind == "direct") {
    if (o.python)
      throw ConfigError(fmt::format("--python {}: '{}' runs directly (it does not end in .py and -m is not given); "
                                    "name the interpreter as PROGRAM instead: cohort run ... {} {}",
                                    *o.python, program, *o.python, program));
    return;
  }
  auto from_env = env.find(kPython.name());
  if (o.python) {
    p.form.python = *o.python;
    p.form.python_source = "--python";
  } else if (from_env != env.end() && !from_env->second.empty()) {
    p.form.python = from_env->second;
    p.form.python_source = kPython.name();
  } else {
    p.form.python = "python3";
    p.form.python_source = "default";
  }
  if (p.form.python.empty()) throw ConfigError("--python: expected an interpreter (a name on PATH or a path)");
}

// torchrun's log files and console filter: --log-dir DIR, --redirects/--tee SPEC, --local-ranks-filter.
void set_rank_logs(Plan& p, const Options& o, const EnvMap& env) {
  if (o.redirects) std_streams("--redirects", *o.redirects, 0);  // the syntax, for every node alike
  if (o.tee) std_streams("--tee", *o.tee, 0);
  p.logs.redirects = o.redirects.value_or("");
  p.logs.tee = o.tee.value_or("");
  const bool any_files = (!p.logs.redirects.empty() && p.logs.redirects != "0") || (!p.logs.tee.empty() && p.logs.tee != "0");
  if ((o.log_dir || any_files) && !o.output_dir.empty())
    throw ConfigError("--output-filename and --log-dir/--redirects/--tee both given: use one way of writing per-rank files");
  if (o.log_dir && o.log_dir->empty()) throw ConfigError("--log-dir: expected a folder");
  std::string base = o.log_dir.value_or("");
  if (base.empty() && any_files) {
    // As torchrun, which writes to a fresh temporary folder when --log-dir is not given.
    auto tmp = env.find("TMPDIR");
    base = (tmp != env.end() && !tmp->second.empty() ? tmp->second : std::string("/tmp")) + "/cohort-logs";
  }
  if (!base.empty())
    p.logs.dir = (std::filesystem::absolute(base) / p.job_id).lexically_normal().string();
  if (o.local_ranks_filter) {
    p.logs.all_local_ranks = false;
    if (*o.local_ranks_filter != "none" && !o.local_ranks_filter->empty())
      p.logs.console_local_ranks = str::parse_int_list(*o.local_ranks_filter, "--local-ranks-filter");
  }
}

}  // namespace

namespace {

// Ray mode's flags, checked before anything else: what a Ray job cannot mean is refused with one line.
// Ray places the work on its nodes itself, so cohort's worker counts, per-process CPU binding and GPU
// assignment, and its rank-based console filters have nothing to act on; a Ray job ends with its driver.
void check_ray_flags(const Options& o) {
  if (!o.ray) {
    for (const auto& [given, flag] : {std::pair{o.ray_port.has_value(), "--ray-port"},
                                      std::pair{o.ray_ports.has_value(), "--ray-ports"},
                                      std::pair{o.ray_command.has_value(), "--ray-command"}})
      if (given) throw ConfigError(fmt::format("{} needs --ray (a Ray job, docs/ray.md)", flag));
    return;
  }
  auto refuse = [](const std::string& flag, const char* why) {
    throw ConfigError(fmt::format("--ray and {} both given: {}", flag, why));
  };
  const char* placement = "a Ray job runs one Ray node on each node and the driver once, on node 0; Ray places the "
                          "work on its nodes itself (leave it out)";
  if (o.np) refuse(fmt::format("-n {}", *o.np), placement);
  if (o.nproc_per_node) refuse(fmt::format("{} {}", o.nproc_per_node_flag, *o.nproc_per_node), placement);
  if (o.map_by) refuse("--map-by " + *o.map_by, placement);
  if (o.ps) refuse("--ps", "a job is a Ray job or a parameter-server job");
  if (o.min_nodes) refuse(fmt::format("--nnodes {}:{}", *o.min_nodes, *o.nnodes),
                          "a Ray cluster's membership is Ray's own; an elastic cohort job cannot hold one");
  if (!o.abort_on_failure)
    refuse("--no-abort-on-failure", "a Ray job ends when its driver ends or a node's Ray is lost");
  if (o.gpu_share) refuse("--gpu-share", "each node's Ray gets all its GPUs (--num-gpus) and shares them out itself");
  if (o.device_per_rank) refuse("--device-per-rank", "each node's Ray gets all its GPUs and shares them out itself");
  if (o.bind_to == "core" || o.bind_to == "numa")
    refuse("--bind-to " + o.bind_to, "Ray's processes are not bound (Ray starts and places its workers itself)");
  if (o.ranks_to_console) refuse("--ranks-to-console", "a Ray job has no ranks of cohort's");
  if (o.local_ranks_filter) refuse("--local-ranks-filter", "a Ray job has no ranks of cohort's");
  if (!o.timeline.empty()) refuse("--timeline", "cohort records the operations of its own collectives, which a Ray job does not run");
  if (o.stats) refuse("--stats", "cohort's live stats count its own collectives, which a Ray job does not run");
  if (o.append_local_rank) refuse("--append-local-rank", "the driver is one process, on node 0");
  if (o.ray_port && (*o.ray_port < 1 || *o.ray_port > 65535))
    throw ConfigError(fmt::format("--ray-port {}: expected a port between 1 and 65535", *o.ray_port));
  if (o.ray_command && o.ray_command->empty()) throw ConfigError("--ray-command: expected the ray executable");
}

// "FIRST-LAST" of --ray-ports.
std::pair<int, int> parse_ray_ports(const std::string& text) {
  auto bad = [&] {
    return ConfigError(fmt::format("--ray-ports {}: expected FIRST-LAST, at least {} ports between 1024 and 65535",
                                   text, kRayMinPortRange));
  };
  auto dash = text.find('-');
  if (dash == std::string::npos) throw bad();
  int first = 0, last = 0;
  try {
    size_t used = 0;
    first = std::stoi(text.substr(0, dash), &used);
    if (used != dash) throw bad();
    last = std::stoi(text.substr(dash + 1), &used);
    if (used != text.size() - dash - 1) throw bad();
  } catch (const std::logic_error&) {
    throw bad();
  }
  if (first < 1024 || last > 65535 || last - first + 1 < kRayMinPortRange) throw bad();
  return {first, last};
}

// Ray mode's layout (docs/ray.md): one Ray node on each node of the job and the driver beside node 0's;
// `head_address`, `head_port`: TI-ONE's HEAD_ADDR and HEAD_PORT, when a per-node job's environment has them.
void set_ray_mode(Plan& p, const Options& o, const std::optional<Sourced<std::string>>& head_address,
                  const std::optional<Sourced<int>>& head_port) {
  if (p.elastic)
    throw ConfigError(fmt::format("--ray and an elastic job ({}) both given: a Ray cluster's membership is Ray's "
                                  "own; an elastic cohort job cannot hold one",
                                  p.source_of("elastic")));
  p.ray.enabled = true;
  p.ray.command = o.ray_command.value_or("ray");
  if (o.ray_port) {
    p.ray.head_port = *o.ray_port;
    p.ray.head_port_source = "--ray-port";
  } else if (head_port) {
    p.ray.head_port = head_port->value;
    p.ray.head_port_source = head_port->source;
  } else {
    p.ray.head_port_source = "a free port node 0 picks at start, published in the job's store";
  }
  if (head_address) p.ray.head_address = head_address->value;
  if (o.ray_ports) std::tie(p.ray.first_port, p.ray.last_port) = parse_ray_ports(*o.ray_ports);
  int first = 0;
  for (auto& n : p.nodes) {
    n.first_rank = first;
    n.ranks.clear();  // (as dealt by --rank-by node: Ray numbers its processes its own way)
    n.nproc = n.node_rank == 0 ? 2 : 1;  // its Ray node; node 0's driver besides
    n.nservers = 0;
    first += n.nproc;
  }
  p.world_size = p.num_workers = first;
  // Ray starts and places its own worker processes: none of cohort's binding, recording or rank tables.
  p.bind_to = "none";
  p.flight_recorder = 0;
  p.timeline_path.clear();
  p.stats = false;
  p.rank_table_slots.clear();
  p.rank_table_size = 0;
  p.sources.emplace_back("ray", "--ray");
}

}  // namespace

namespace {

// The variables a shell keeps after a DDP script was run by hand (`export MASTER_ADDR=... RANK=0
// WORLD_SIZE=2`), which torchrun and Kubeflow's first operators also use to place a job of nodes.
constexpr const char* kShellLeftovers[] = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"};

// The scheduler environment that places a per-node or local job. `local_shape`: the command line gives
// this node's processes (-n, --nproc-per-node, -N, --map-by ppr:N:node) and no node count or node rank.
// Such a command is a job on this machine, as torchrun makes it: MASTER_ADDR, MASTER_PORT, WORLD_SIZE and
// RANK alone are then a shell's leftovers, ignored with one note naming them (a job of several nodes
// waiting 300 s for a node that never comes is what they would make). With any platform's own variables
// beside them (Slurm's, Kubeflow's PET_*, TI-ONE's NODE_LIST, Open MPI's, a rank table, TF_CONFIG,
// HEAD_ADDR) the environment is a platform's and places the job as it always did.
SchedulerInfo placement_env(const EnvMap& env, bool local_shape, const std::string& shape,
                            const MachineFacts& machine, std::vector<std::string>& notes) {
  if (!local_shape) return read_scheduler_env(env, machine.addresses);
  EnvMap rest = env;
  std::vector<std::string> ignored;
  for (const char* name : kShellLeftovers) {
    auto it = rest.find(name);
    if (it == rest.end()) continue;
    if (!it->second.empty()) ignored.push_back(fmt::format("{}={}", name, it->second));
    rest.erase(it);
  }
  SchedulerInfo platform = read_scheduler_env(rest, machine.addresses);
  if (ignored.empty() || !platform.scheduler_names.empty()) return read_scheduler_env(env, machine.addresses);
  notes.push_back(fmt::format(
      "ignoring {} from the environment: {} without --nnodes is a job on this machine (as with torchrun), and no "
      "platform's variables (Slurm's, Kubeflow's PET_*, TI-ONE's NODE_LIST, ...) came with them; for a job of "
      "several nodes give --nnodes and --node-rank",
      str::join(ignored, " "), shape));
  return platform;
}

}  // namespace

int std_streams(const std::string& flag, const std::string& spec, int local_rank) {
  if (spec.empty()) return 0;
  auto bad = [&] {
    return ConfigError(fmt::format("{} {}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both) for every local "
                                   "rank, or LOCAL_RANK:N pairs such as 0:1,1:2",
                                   flag, spec));
  };
  auto streams = [&](std::string_view text) {
    if (text.size() != 1 || text[0] < '0' || text[0] > '3') throw bad();
    return text[0] - '0';
  };
  if (spec.find(':') == std::string::npos) return streams(spec);
  int mine = 0;
  for (const auto& item : str::split(spec, ',', true)) {
    auto colon = item.find(':');
    if (colon == std::string::npos || colon == 0) throw bad();
    std::string key = item.substr(0, colon);
    if (key.find_first_not_of("0123456789") != std::string::npos || key.size() > 6) throw bad();
    int value = streams(std::string_view(item).substr(colon + 1));
    if (std::stoi(key) == local_rank) mine = value;
  }
  return mine;
}

Plan build_plan(const Options& o, const EnvMap& env, const MachineFacts& machine) {
  Plan p;
  auto source = [&](const std::string& setting, const std::string& from) { p.sources.emplace_back(setting, from); };

  if (o.program.empty()) throw ConfigError("no PROGRAM given (usage: cohort run [options] PROGRAM [ARGS...])");
  check_ray_flags(o);
  p.program = o.program;
  set_program_form(p, o, env);
  if (o.kill_grace_s < 0) throw ConfigError(fmt::format("--kill-grace {}: expected seconds >= 0", o.kill_grace_s));
  if (o.join_timeout_s <= 0)
    throw ConfigError(fmt::format("--join-timeout {}: expected seconds > 0", o.join_timeout_s));
  if (o.max_restarts < 0) throw ConfigError(fmt::format("--max-restarts {}: expected a number >= 0", o.max_restarts));
  if (o.bind_to != "auto" && o.bind_to != "none" && o.bind_to != "core" && o.bind_to != "numa")
    throw ConfigError(fmt::format("--bind-to {}: expected auto, none, core or numa", o.bind_to));
  if (o.np && *o.np < 1) throw ConfigError(fmt::format("-n {}: expected a positive number of processes", *o.np));
  if (o.master_port && (*o.master_port < 1 || *o.master_port > 65535))
    throw ConfigError(fmt::format("--master-port {}: expected a port between 1 and 65535", *o.master_port));
  std::string nproc_how;
  std::optional<int> nproc_flag;
  std::string nproc_flag_name = o.nproc_per_node_flag;
  if (o.nproc_per_node) nproc_flag = parse_nproc(o.nproc_per_node_flag, *o.nproc_per_node, machine, nproc_how);
  std::string bind_to = o.bind_to;
  MapBy map_by;
  if (o.map_by) {
    map_by = apply_map_by(*o.map_by, bind_to);
    if (auto ppr = map_by.per_node) {
      if (nproc_flag && *nproc_flag != *ppr)
        throw ConfigError(fmt::format("--map-by {} and {} {} disagree about the processes per node", *o.map_by,
                                      o.nproc_per_node_flag, *o.nproc_per_node));
      nproc_flag = *ppr;
      nproc_how.clear();
      nproc_flag_name = "--map-by " + *o.map_by;
    }
    source("map-by", "--map-by " + *o.map_by);
  }
  // mpirun's --rank-by: `slot` numbers each host's processes in turn (torchrun's order too), `node` deals
  // the ranks round robin over the hosts. Without it the ranks follow the mapping, as Open MPI's do:
  // by node after --map-by node, by slot otherwise.
  bool rank_by_node = map_by.by_node;
  std::string rank_by_flag = map_by.by_node ? "--map-by " + *o.map_by : "";
  if (o.rank_by) {
    const std::string form = lower(*o.rank_by);
    if (form != "slot" && form != "node")
      throw ConfigError(fmt::format("--rank-by {}: cohort numbers ranks by slot (each host's processes in turn) or "
                                    "by node (round robin over the hosts); supported: slot, node",
                                    *o.rank_by));
    rank_by_node = form == "node";
    rank_by_flag = "--rank-by " + *o.rank_by;
    source("rank-by", rank_by_flag);
  }
  if (rank_by_node && o.ps)
    throw ConfigError(fmt::format("{} and --ps both given: a parameter-server job keeps each node's processes "
                                  "consecutive (its workers, then its servers); use --rank-by slot",
                                  rank_by_flag));
  // GPUs: resolved against this machine's inventory when it has any; a fan-out head without GPUs
  // leaves "auto" to each node's agent (which checks its own GPUs before starting workers).
  if (o.gpu_share && !o.gpus_per_node) throw ConfigError("--gpu-share needs --gpus-per-node");
  std::optional<int> gpus_here;
  if (o.gpus_per_node) {
    p.gpus_per_node_spec = *o.gpus_per_node;
    p.gpu_share = o.gpu_share;
    const bool remote_only = (o.hosts || o.hostfile) && machine.gpus.gpus.empty();
    if (!remote_only) gpus_here = resolve_gpus_per_node(*o.gpus_per_node, machine.gpus, machine.hostname);
    else parse_gpus_per_node(*o.gpus_per_node);  // the syntax, at least
    p.gpus_per_node = gpus_here.value_or(0);
    source("gpus per node", "--gpus-per-node " + *o.gpus_per_node +
                                (gpus_here ? " (" + machine.gpus.source + ")" : " (each host's own count)"));
  }

  p.kill_grace_s = o.kill_grace_s;
  p.join_timeout_s = o.join_timeout_s;
  p.max_restarts = o.max_restarts;
  p.abort_on_failure = o.abort_on_failure;
  p.bind_to = bind_to;
  p.report_bindings = o.report_bindings;
  p.device_per_rank = o.device_per_rank;
  p.output_dir = o.output_dir;
  p.merge_stderr = o.merge_stderr;
  p.ssh_command = o.ssh_command;

  std::optional<Sourced<std::string>> sched_job_id;
  std::optional<Sourced<int>> sched_ps_nodes;
  std::optional<Sourced<std::string>> ray_head_address;
  std::optional<Sourced<int>> ray_head_port;
  if (o.launcher != "auto" && o.launcher != "ssh" && o.launcher != "srun")
    throw ConfigError(fmt::format("--launcher {}: expected auto, ssh or srun", o.launcher));
  // Inside a Slurm allocation (a batch script, an salloc shell), with no hosts and no per-node flags:
  // the allocation's nodes are the hosts, as mpirun takes them (docs/slurm.md). An allocation of this
  // one node alone stays a local job.
  std::optional<SlurmAllocation> slurm;
  if (!o.hosts && !o.hostfile && !o.nnodes && !o.node_rank) {
    slurm = read_slurm_allocation(env);
    if (slurm && slurm->nodes.size() == 1 && is_local_host(slurm->nodes.front().host, machine.hostname))
      slurm.reset();
  }
  if (o.launcher == "srun" && !slurm && !env.count("SLURM_JOB_ID"))
    throw ConfigError("--launcher srun: not inside a Slurm allocation (SLURM_JOB_ID is not set); run cohort run "
                      "in an sbatch script or an salloc shell");
  if (o.hosts || o.hostfile || slurm) {
    // One launcher fans out to every host (mpirun / DeepSpeed style).
    if (o.hosts && o.hostfile) throw ConfigError("both -H and --hostfile given; use one of them");
    const char* hosts_flag = o.hosts ? "-H" : "--hostfile";
    if (o.nnodes || o.node_rank)  // (never with the allocation's hosts: they are read only without these)
      throw ConfigError(fmt::format("{} and --nnodes/--node-rank both given: {} starts every node itself, "
                                    "--nnodes is for running cohort once per node",
                                    hosts_flag, hosts_flag));
    auto hosts = slurm ? slurm->nodes : o.hosts ? parse_host_list(*o.hosts) : parse_hostfile(o.hostfile_text, *o.hostfile);
    std::string hosts_source = slurm    ? fmt::format("SLURM_JOB_NODELIST (Slurm job {}; slots: {})", slurm->job_id,
                                                      slurm->slots_source)
                               : o.hosts ? "-H " + *o.hosts
                                         : "--hostfile " + *o.hostfile;
    p.agent_launcher = o.launcher == "auto" ? (slurm ? "srun" : "ssh") : o.launcher;
    source("agent launcher", o.launcher == "auto" ? (slurm ? "inside a Slurm allocation" : "default") : "--launcher");
    if (slurm) sched_job_id = Sourced<std::string>{"slurm-" + slurm->job_id, "SLURM_JOB_ID"};
    if (nproc_flag)
      for (auto& h : hosts) h.slots = *nproc_flag;
    int total = 0;
    for (const auto& h : hosts) total += h.slots;
    int n = o.np.value_or(total);
    if (n > total && !o.oversubscribe)
      throw ConfigError(fmt::format("-n {} is more than the {} slots of {} (--oversubscribe places the rest on the "
                                    "same hosts)",
                                    n, total, hosts_source));
    std::string world_source = o.np ? "-n" : "sum of slots";
    if (n > total) world_source = fmt::format("-n, --oversubscribe: {} more than the {} slots", n - total, total);
    // mpirun's two steps: the mapping says how many processes each host runs, the ranking which ranks
    // they are (consecutive per host by slot; round robin over the hosts by node).
    std::vector<int> slots;
    for (const auto& h : hosts) slots.push_back(h.slots);
    const std::vector<int> counts = map_by.by_node ? mpirun_counts_by_node(slots, n) : mpirun_counts_by_slot(slots, n);
    const std::vector<std::vector<int>> dealt =
        rank_by_node ? mpirun_ranks_by_node(counts) : std::vector<std::vector<int>>{};
    p.mode = Mode::kFanOut;
    int rank = 0;
    int local_nodes = 0;
    p.this_node = -1;
    for (size_t i = 0; i < hosts.size(); ++i) {
      if (counts[i] == 0) continue;  // a host the processes did not reach
      const auto& h = hosts[i];
      NodePlan node;
      node.node_rank = static_cast<int>(p.nodes.size());
      node.host = h.host;
      node.local = (is_local_host(h.host, machine.hostname) || (slurm && h.host == slurm->this_node)) &&
                   local_nodes == 0;
      if (node.local) {
        ++local_nodes;
        p.this_node = node.node_rank;
      }
      node.first_rank = rank;
      node.nproc = counts[i];
      rank += node.nproc;
      if (rank_by_node) {
        // A host whose dealt ranks happen to be consecutive (one host, one process each) keeps the
        // usual form.
        node.first_rank = dealt[i].front();
        if (dealt[i].back() - dealt[i].front() + 1 != node.nproc) node.ranks = dealt[i];
      }
      p.nodes.push_back(node);
    }
    p.nnodes = static_cast<int>(p.nodes.size());
    p.world_size = n;
    source("hosts", hosts_source);
    source("world size", world_source);
    if (nproc_flag) source("slots per host", nproc_flag_name);
    p.master_addr = o.master_addr.value_or(machine.hostname);
    source("store address", o.master_addr ? o.master_addr_flag : "this host's name");
    p.master_port = o.master_port.value_or(0);
    source("store port", o.master_port ? "--master-port" : "chosen by the OS");
    p.host_store = true;
  } else {
    // Per-node (torchrun style) or local. The scheduler environment fills what flags leave open.
    SchedulerInfo sched;
    // With --nnodes the flags say the layout; in an srun step Slurm still says where node 0 is, which
    // node this is and which port the job's nodes agree on.
    const bool in_srun_step = env.count("SLURM_STEP_ID") && env.count("SLURM_STEP_NODELIST");
    // TI-ONE's Ray mode names the head and this node's rank but not the node count: --nnodes gives it,
    // and the platform's variables still say the rest.
    const bool ray_platform = o.ray && env.count("HEAD_ADDR") && !env.at("HEAD_ADDR").empty();
    const bool local_shape = (o.np || nproc_flag) && !o.nnodes && !o.node_rank;
    // The flag that gave the shape, as typed (for the note): "-n 2", "--nproc-per-node 2", "--map-by ppr:2:node".
    const std::string shape = !nproc_flag           ? fmt::format("-n {}", o.np.value_or(0))
                              : o.map_by && !o.nproc_per_node ? nproc_flag_name
                                                    : nproc_flag_name + " " + o.nproc_per_node.value_or("");
    if (!o.nnodes || in_srun_step || ray_platform) sched = placement_env(env, local_shape, shape, machine, p.notes);
    ray_head_address = sched.ray_head_addr;
    ray_head_port = sched.ray_head_port;
    // Without a count (the platform gives none) the head cannot wait for "every node": it starts the driver
    // once its own Ray is up, and the others join it whenever they start (docs/ray.md). This node knows of
    // the head and of itself: nodes 0..RANK, of which it waits for node 0 only.
    const bool ray_uncounted = ray_platform && !o.nnodes && !sched.nnodes;
    p.ray.open_membership = ray_uncounted;
    p.schedulers = sched.scheduler_names;
    sched_job_id = sched.job_id;
    sched_ps_nodes = sched.ps_nodes;
    const int known_nodes = ray_uncounted && sched.node_rank ? sched.node_rank->value + 1 : 1;
    p.nnodes = o.nnodes ? *o.nnodes : sched.nnodes ? sched.nnodes->value : known_nodes;
    source("nnodes", o.nnodes ? (o.min_nodes ? "--nnodes MIN:MAX" : "--nnodes")
                     : sched.nnodes ? sched.nnodes->source
                     : ray_uncounted ? "none given (HEAD_ADDR, HEAD_PORT and RANK alone): the other nodes join the Ray "
                                       "head as they start"
                                     : "default");
    if (p.nnodes < 1) throw ConfigError(fmt::format("--nnodes {}: expected a positive number", p.nnodes));
    if (o.min_nodes) set_elastic(p, o, env, *o.min_nodes, *o.nnodes, fmt::format("--nnodes {}:{}", *o.min_nodes, *o.nnodes));
    else if (!o.nnodes && sched.min_nodes)
      set_elastic(p, o, env, sched.min_nodes->value, p.nnodes, sched.min_nodes->source);
    else if (ranks_at_rendezvous(o, sched))
      // torchrun's documented multi-node line, typed alike on every node: with no node rank anywhere,
      // the agents number themselves as they meet, exactly as --nnodes N:N does (torchrun's c10d).
      set_elastic(p, o, env, p.nnodes, p.nnodes,
                  fmt::format("--nnodes {} with {} and no --node-rank: node ranks are assigned at the rendezvous",
                              p.nnodes, o.rdzv_endpoint ? "--rdzv-endpoint" : "--rdzv-backend c10d"));
    int node_rank = p.elastic ? 0 : o.node_rank ? *o.node_rank : sched.node_rank ? sched.node_rank->value : 0;
    std::string node_rank_source = p.elastic ? "the rendezvous, at each generation" + std::string(o.node_rank ? " (--node-rank is ignored)" : "")
                                   : o.node_rank ? "--node-rank" : sched.node_rank ? sched.node_rank->source : "default";
    source("node rank", node_rank_source);
    if (node_rank < 0 || node_rank >= p.nnodes)
      throw ConfigError(fmt::format("node rank {} ({}) must be below the node count {} ({})", node_rank,
                                    node_rank_source, p.nnodes, p.source_of("nnodes")));
    int nproc = 1;
    std::string nproc_source = "default";
    if (nproc_flag) {
      nproc = *nproc_flag;
      nproc_source = nproc_flag_name + (nproc_how.empty() ? "" : " (" + nproc_how + ")");
    } else if (sched.nproc_per_node) {
      nproc = sched.nproc_per_node->value;
      nproc_source = sched.nproc_per_node->source;
    } else if (o.np) {
      if (*o.np % p.nnodes != 0)
        throw ConfigError(fmt::format("-n {} does not divide evenly over {} nodes", *o.np, p.nnodes));
      nproc = *o.np / p.nnodes;
      nproc_source = "-n";
    } else if (gpus_here) {
      nproc = *gpus_here;
      nproc_source = "--gpus-per-node (one rank per GPU)";
    }
    if (o.np && *o.np != nproc * p.nnodes)
      throw ConfigError(fmt::format("-n {} disagrees with {} processes per node ({}) on {} nodes", *o.np, nproc,
                                    nproc_source, p.nnodes));
    source("nproc per node", nproc_source);
    p.world_size = nproc * p.nnodes;
    p.this_node = node_rank;
    if (sched.rank_table && sched.rank_table->servers.size() == size_t(p.nnodes) &&
        sched.rank_table->servers.front().devices.size() == size_t(nproc)) {
      for (const auto& server : sched.rank_table->servers)
        for (const auto& d : server.devices) p.rank_table_slots.emplace_back(d.device_id, d.rank_id);
      p.rank_table_size = sched.rank_table->rank_size;
    }
    for (int i = 0; i < p.nnodes; ++i)
      p.nodes.push_back(NodePlan{i, i == node_rank ? machine.hostname : fmt::format("node{}", i), i == node_rank,
                                 i * nproc, nproc});
    if (p.elastic) {
      // This node alone until the first generation closes (the job then sets the real layout).
      p.nodes.resize(1);
      p.nnodes = 1;
      p.world_size = nproc;
    }
    if (p.nnodes == 1 && !p.elastic && !ray_uncounted) {
      p.mode = Mode::kLocal;
      p.master_addr = "127.0.0.1";
      source("store address", "local job: loopback");
      p.master_port = o.master_port ? *o.master_port : sched.master_port ? sched.master_port->value : 0;
      source("store port", o.master_port ? "--master-port"
                           : sched.master_port ? sched.master_port->source
                                               : "chosen by the OS");
    } else {
      p.mode = Mode::kPerNode;
      if (o.master_addr) {
        p.master_addr = *o.master_addr;
        source("store address", "--master-addr");
      } else if (sched.master_addr) {
        p.master_addr = sched.master_addr->value;
        source("store address", sched.master_addr->source);
      } else if (o.ray && sched.ray_head_addr) {
        p.master_addr = sched.ray_head_addr->value;
        source("store address", "HEAD_ADDR (node 0: the Ray head hosts the job's store too)");
      } else {
        throw ConfigError(p.elastic ? fmt::format("--nnodes {}:{} needs --master-addr or --rdzv-endpoint (the host "
                                                  "whose agent hosts the job's store) or MASTER_ADDR",
                                                  p.min_nodes, p.max_nodes)
                                    : fmt::format("--nnodes {} needs --master-addr (the address of node 0) or MASTER_ADDR",
                                                  p.nnodes));
      }
      p.master_port = o.master_port           ? *o.master_port
                      : sched.master_port         ? sched.master_port->value
                      : sched.default_master_port ? sched.default_master_port->value
                                                  : 29500;
      source("store port", o.master_port                 ? "--master-port"
                           : sched.master_port         ? sched.master_port->source
                           : sched.default_master_port ? sched.default_master_port->source
                                                       : "default (29500, as torchrun)");
    }
    p.host_store = node_rank == 0;
    if (p.elastic) {
      // The agent on the master address's host hosts the store (the first of several there to bind
      // its port: the others find it in use and join as clients).
      p.host_store = is_local_host(p.master_addr, machine.hostname) ||
                     std::find(machine.addresses.begin(), machine.addresses.end(), p.master_addr) !=
                         machine.addresses.end();
      if (o.ps || sched_ps_nodes)
        throw ConfigError("--nnodes MIN:MAX and a parameter-server job (--ps, TF_CONFIG ps entries) cannot be combined: "
                          "parameter servers hold state that a new generation would lose");
    }
  }

  if ((map_by.by_node || rank_by_node) && p.mode == Mode::kPerNode)
    throw ConfigError(fmt::format("{}: each node of a per-node job ({}) starts its own ranks, numbered consecutively; "
                                  "ranks are dealt over the hosts when one cohort run starts them all (-H, --hostfile)",
                                  map_by.by_node ? "--map-by " + *o.map_by : rank_by_flag,
                                  p.elastic ? p.source_of("elastic") : p.source_of("nnodes")));
  if (o.ray) set_ray_mode(p, o, ray_head_address, ray_head_port);
  place_parameter_servers(p, o, env, sched_ps_nodes);

  // Job id: the same on every node (per-node mode cannot share a random one).
  if (o.run_id) {
    p.job_id = *o.run_id;
    source("job id", "--run-id");
  } else if (sched_job_id) {
    p.job_id = sched_job_id->value;
    source("job id", sched_job_id->source);
  } else if (p.mode == Mode::kPerNode) {
    p.job_id = fmt::format("job-{}-{}", p.master_addr, p.master_port);
    source("job id", "store address");
  } else {
    p.job_id = "job-" + random_token(6);
    source("job id", "random");
  }
  p.token_from_env = env.count("COHORT_JOB_TOKEN") && !env.at("COHORT_JOB_TOKEN").empty();
  set_observability(p, o, env);
  set_rank_logs(p, o, env);
  if (p.mode == Mode::kFanOut) {
    std::error_code ec;
    p.form.working_dir = o.wdir ? *o.wdir : std::filesystem::current_path(ec).string();
    p.form.working_dir_required = o.wdir.has_value();
  }
  p.timestamp_output = o.timestamp_output;
  p.horovod_env = o.horovod_env;
  // mpirun's wall-clock limit: --timeout, else its MPIEXEC_TIMEOUT variable.
  std::optional<double> timeout = o.timeout_s;
  p.timeout_flag = o.timeout_flag;
  if (!timeout && env.count("MPIEXEC_TIMEOUT") && !env.at("MPIEXEC_TIMEOUT").empty()) {
    timeout = env::parse_seconds("MPIEXEC_TIMEOUT", env.at("MPIEXEC_TIMEOUT"));
    p.timeout_flag = "MPIEXEC_TIMEOUT";
  }
  if (timeout) {
    if (!(*timeout > 0))
      throw ConfigError(fmt::format("{} {:g}: expected a wall-clock limit in seconds > 0", p.timeout_flag, *timeout));
    p.timeout_s = *timeout;
    source("wall-clock limit", p.timeout_flag);
  }

  for (const auto& x : o.export_env) {
    auto eq = x.find('=');
    std::string name = x.substr(0, eq);
    if (name.empty()) throw ConfigError(fmt::format("-x '{}': expected VAR or VAR=value", x));
    if (eq != std::string::npos) {
      p.extra_env.emplace_back(name, x.substr(eq + 1));
    } else {
      auto it = env.find(name);
      if (it == env.end()) throw ConfigError(fmt::format("-x {}: {} is not set in this environment", name, name));
      p.extra_env.emplace_back(name, it->second);
    }
  }
  if (o.forward_environment && std::any_of(p.nodes.begin(), p.nodes.end(), [](const NodePlan& n) { return !n.local; }))
    forward_environment(p, env);
  int max_per_node = 0;
  for (const auto& n : p.nodes) max_per_node = std::max(max_per_node, n.nproc);
  bool omp_given = env.count("OMP_NUM_THREADS") ||
                   std::any_of(p.extra_env.begin(), p.extra_env.end(),
                               [](const auto& kv) { return kv.first == "OMP_NUM_THREADS"; });
  // (Ray sets OMP_NUM_THREADS for its own workers from the CPUs each task asks for.)
  p.set_omp_threads = max_per_node > 1 && !omp_given && !p.ray.enabled;

  // More local ranks than GPUs is an error unless --gpu-share (each agent checks its own node again). A Ray
  // node gets them all.
  if (gpus_here && !p.ray.enabled)
    if (const NodePlan* mine = p.node(p.this_node))
      assign_gpus(p.gpus_per_node_spec, p.gpu_share, mine->nproc, machine.gpus, machine.hostname);

  if (!p.logs.all_local_ranks)
    for (int r : p.logs.console_local_ranks)
      if (r >= max_per_node)
        throw ConfigError(fmt::format("--local-ranks-filter: local rank {} does not exist ({} processes per node)", r,
                                      max_per_node));

  // The program is checked last: flag errors come first, and nothing starts without it.
  if (machine.resolve_program) resolve_worker_command(p, machine.resolve_program);
  else p.program_path = p.form.kind == "direct" ? o.program[0] : p.form.python;
  p.tag_output = o.tag_output.value_or(p.world_size > 1 || p.elastic);
  if (o.ranks_to_console) {
    p.all_ranks_to_console = false;
    if (*o.ranks_to_console != "none" && !o.ranks_to_console->empty())
      p.ranks_to_console = str::parse_int_list(*o.ranks_to_console, "--ranks-to-console");
    for (int r : p.ranks_to_console)
      if (r >= p.world_size)
        throw ConfigError(fmt::format("--ranks-to-console: rank {} does not exist (world size {})", r, p.world_size));
  }
  return p;
}

namespace {

// Ray mode: what TI-ONE's Ray mode gives every node (HEAD_ADDR, HEAD_PORT, and RANK: the node's rank, 0 on
// the head), so that a program written for it runs unchanged; and for the driver RAY_ADDRESS, so that
// ray.init() joins this job's cluster and no other cluster running on the same host. Not torchrun's
// variables: the job's processes are Ray's nodes and its driver, not ranks of a communicator (Ray Train
// gives its own workers those).
std::vector<std::pair<std::string, std::string>> ray_process_env(const Plan& plan, const WorkerSlot& s) {
  std::string ip = "<node 0's address, found at start>";
  std::string port = plan.ray.head_port > 0 ? std::to_string(plan.ray.head_port) : "<chosen at start>";
  if (!s.ray_gcs.empty()) {
    auto [host, p] = net::split_host_port(s.ray_gcs);
    ip = host;
    port = std::to_string(p);
  }
  std::vector<std::pair<std::string, std::string>> e;
  e.emplace_back("HEAD_ADDR", plan.ray.head_address.empty() ? ip : plan.ray.head_address);
  e.emplace_back("HEAD_PORT", port);
  e.emplace_back("RANK", std::to_string(s.node_rank));
  if (plan.is_ray_driver(s.rank)) e.emplace_back("RAY_ADDRESS", s.ray_gcs.empty() ? ip + ":" + port : s.ray_gcs);
  for (const auto& kv : plan.extra_env) e.push_back(kv);
  return e;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> worker_env(const Plan& plan, const WorkerSlot& s,
                                                            const std::string& store_addr, int torch_port,
                                                            const std::string& token, int restart_count,
                                                            const EnvMap& launcher_env) {
  if (plan.ray.enabled) return ray_process_env(plan, s);
  std::vector<std::pair<std::string, std::string>> e;
  auto set = [&](const char* k, const std::string& v) { e.emplace_back(k, v); };
  // Host part of "host:port" / "[v6]:port" (the port may still be a placeholder in --dry-run).
  std::string store_host = store_addr.substr(0, store_addr.rfind(':'));
  if (store_host.size() > 2 && store_host.front() == '[') store_host = store_host.substr(1, store_host.size() - 2);
  // In a parameter-server job RANK/WORLD_SIZE/LOCAL_* count the process's own role (the workers'
  // data-parallel group is the workers), and COHORT_ROLE* say which role (docs/parameter-server.md).
  int rank = s.rank, world = plan.world_size, local_rank = s.local_rank, local_world = s.local_world;
  if (plan.ps_servers > 0) {
    ProcessRole role = plan.role_of(s.rank);
    rank = role.index;
    world = role.server ? plan.ps_servers : plan.num_workers;
    local_rank = role.local_index;
    local_world = role.local_count;
  }
  set("RANK", std::to_string(rank));
  set("LOCAL_RANK", std::to_string(local_rank));
  set("WORLD_SIZE", std::to_string(world));
  set("LOCAL_WORLD_SIZE", std::to_string(local_world));
  set("GROUP_RANK", std::to_string(s.node_rank));
  set("GROUP_WORLD_SIZE", std::to_string(plan.nnodes));
  set("ROLE_RANK", std::to_string(rank));
  set("ROLE_WORLD_SIZE", std::to_string(world));
  set("ROLE_NAME", plan.ps_servers > 0 ? (plan.role_of(s.rank).server ? "server" : "worker") : "default");
  set("NODE_RANK", std::to_string(s.node_rank));
  set("MASTER_ADDR", store_host);
  // torch's env:// makes rank 0 host its own TCPStore at MASTER_PORT: a port distinct from cohort's
  // store, chosen free on the store host (see docs/launcher.md).
  set("MASTER_PORT", torch_port > 0 ? std::to_string(torch_port) : "<chosen at start>");
  set("TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count));
  set("TORCHELASTIC_MAX_RESTARTS", std::to_string(plan.max_restarts));
  set("TORCHELASTIC_RUN_ID", plan.job_id);
  set("COHORT_STORE_ADDR", store_addr);
  set("COHORT_JOB_ID", plan.job_id);
  set("COHORT_JOB_TOKEN", token);
  set("COHORT_RANK", std::to_string(rank));
  set("COHORT_WORLD_SIZE", std::to_string(world));
  set("COHORT_LOCAL_RANK", std::to_string(local_rank));
  set("COHORT_LOCAL_WORLD_SIZE", std::to_string(local_world));
  if (plan.horovod_env) {
    // As `horovodrun --gloo` sets them (Horovod's runner, slot by slot): the cross ranks of local rank l
    // are the nodes that have an l-th worker, numbered in node order; with equal nodes, the node rank and
    // the node count. Programs that read them (and Horovod's own probes) see the job as Horovod's.
    int cross_rank = 0, cross_size = 0;
    for (const auto& node : plan.nodes) {
      if (node.nproc - node.nservers <= local_rank) continue;
      if (node.node_rank < s.node_rank) ++cross_rank;
      ++cross_size;
    }
    if (plan.elastic || cross_size == 0) {  // an elastic plan lists this node only: its nodes are equal
      cross_rank = s.node_rank;
      cross_size = plan.nnodes;
    }
    const NodePlan* node = plan.node_of_process(s.rank);
    set("HOROVOD_RANK", std::to_string(rank));
    set("HOROVOD_SIZE", std::to_string(world));
    set("HOROVOD_LOCAL_RANK", std::to_string(local_rank));
    set("HOROVOD_LOCAL_SIZE", std::to_string(local_world));
    set("HOROVOD_CROSS_RANK", std::to_string(cross_rank));
    set("HOROVOD_CROSS_SIZE", std::to_string(cross_size));
    set("HOROVOD_HOSTNAME", node ? node->host : std::string("localhost"));
  }
  if (!plan.rank_table_slots.empty() && size_t(s.rank) < plan.rank_table_slots.size()) {
    // As the Ascend launch scripts set them for each process of a rank table.
    set("DEVICE_ID", std::to_string(plan.rank_table_slots[size_t(s.rank)].first));
    set("RANK_ID", std::to_string(plan.rank_table_slots[size_t(s.rank)].second));
    set("RANK_SIZE", std::to_string(plan.rank_table_size));
  }
  if (plan.ps_servers > 0) {
    set("COHORT_ROLE", plan.role_of(s.rank).server ? "server" : "worker");
    set("COHORT_ROLE_INDEX", std::to_string(rank));
    set("COHORT_NUM_SERVERS", std::to_string(plan.ps_servers));
    set("COHORT_NUM_WORKERS", std::to_string(plan.num_workers));
    set("COHORT_PS_MODE", plan.ps_mode);
  }
  if (launcher_env.count("SLURM_JOB_ID")) {
    // Under Slurm a worker inherits the launcher's (or its srun step's) task variables: SLURM_PROCID=0
    // and SLURM_NTASKS=1 in every worker of an agent. Programs that take their rank from Slurm
    // (Lightning's SLURMEnvironment, submitit, many sbatch-era scripts) would then all be rank 0 of 1:
    // they get the worker's own place instead, as if srun had started each rank.
    set("SLURM_PROCID", std::to_string(rank));
    set("SLURM_LOCALID", std::to_string(local_rank));
    set("SLURM_NODEID", std::to_string(s.node_rank));
    set("SLURM_NTASKS", std::to_string(world));
    set("SLURM_NPROCS", std::to_string(world));
  }
  set("COHORT_NODE_RANK", std::to_string(s.node_rank));
  set("COHORT_NNODES", std::to_string(plan.nnodes));
  set("COHORT_RESTART_COUNT", std::to_string(restart_count));
  if (plan.set_omp_threads) set("OMP_NUM_THREADS", "1");
  if (s.gpu.device >= 0) {
    // torchrun's contract: CUDA_VISIBLE_DEVICES whole, the program picks device LOCAL_RANK. With
    // --gpu-share two ranks map to one device, so the device to use is named explicitly too.
    set("COHORT_GPUS_PER_NODE", std::to_string(plan.gpus_per_node > 0 ? plan.gpus_per_node : 0));
    if (plan.device_per_rank) {
      set("CUDA_VISIBLE_DEVICES", s.gpu.visible_id);
      set("COHORT_LOCAL_GPU", "0");
    } else {
      set("COHORT_LOCAL_GPU", std::to_string(s.gpu.device));
    }
  } else if (plan.device_per_rank) {
    auto ascend_var = launcher_env.find("ASCEND_RT_VISIBLE_DEVICES");
    bool ascend = (ascend_var != launcher_env.end() && !ascend_var->second.empty()) || access("/dev/davinci0", F_OK) == 0;
    const char* var = ascend ? "ASCEND_RT_VISIBLE_DEVICES" : "CUDA_VISIBLE_DEVICES";
    // When the launcher itself sees a subset of devices, rank i gets the i-th of that subset.
    std::string device = std::to_string(s.local_rank);
    if (auto it = launcher_env.find(var); it != launcher_env.end() && !it->second.empty()) {
      auto visible = str::split(it->second, ',');
      if (!visible.empty()) device = visible[static_cast<size_t>(s.local_rank) % visible.size()];
    }
    set(var, device);
  }
  for (const auto& kv : plan.extra_env) e.push_back(kv);
  return e;
}

void resolve_worker_command(Plan& p, std::string (*resolve)(const std::string&)) {
  const std::string& program = p.program.at(0);
  if (p.ray.enabled && p.this_node >= 0) {
    try {
      p.ray.command_path = resolve(p.ray.command);
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("{} (cohort run --ray starts each node's Ray with it: install Ray on every node, "
                                    "or name the executable with --ray-command)",
                                    e.what()));
    }
    // Only node 0 runs the driver (a fan-out head that runs no node checks it before anything starts).
    if (p.this_node > 0) {
      p.program_path = p.form.kind == "direct" ? program : p.form.python;
      return;
    }
  }
  if (p.form.kind == "direct") {
    p.program_path = resolve(program);
    return;
  }
  if (p.form.kind == "script") {
    // Python opens the script itself: no PATH lookup, a relative name means this folder (as torchrun).
    auto here = [] {
      std::error_code ec;
      auto cwd = std::filesystem::current_path(ec);
      return ec ? std::string("the current folder") : cwd.string();
    };
    struct stat st {};
    if (stat(program.c_str(), &st) != 0) {
      if (errno == ENOENT)
        throw ConfigError(program.front() == '/' ? fmt::format("{}: no such file", program)
                                                 : fmt::format("{}: no such file in {}", program, here()));
      throw ConfigError(net::errno_string(program, errno));
    }
    if (S_ISDIR(st.st_mode)) throw ConfigError(fmt::format("{}: is a folder, not a Python script", program));
    if (access(program.c_str(), R_OK) != 0) throw ConfigError(net::errno_string(program + ": cannot read it", errno));
  }
  try {
    p.program_path = resolve(p.form.python);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{} (needed to run {}{}; --python INTERP or COHORT_PYTHON names another)", e.what(),
                                  p.form.kind == "module" ? "-m " : "", program));
  }
}

std::vector<std::string> worker_argv(const Plan& p, int process) {
  std::vector<std::string> argv;
  if (p.form.kind == "direct") {
    argv.push_back(p.program.at(0));
  } else {
    // -u as torchrun: unbuffered output reaches the console and the log files as it is written.
    argv = {p.program_path, "-u"};
    if (p.form.kind == "module") argv.push_back("-m");
    argv.push_back(p.program.at(0));
  }
  // Where torch.distributed.launch put it: before the program's own arguments.
  if (p.form.append_local_rank)
    argv.push_back(fmt::format("{}={}", p.form.local_rank_arg, p.local_rank_of(process)));
  argv.insert(argv.end(), p.program.begin() + 1, p.program.end());
  return argv;
}

std::string shell_line(const std::vector<std::string>& argv) {
  std::vector<std::string> words;
  for (const auto& a : argv) {
    bool plain = !a.empty() && std::all_of(a.begin(), a.end(), [](unsigned char c) {
      return std::isalnum(c) || std::strchr("_-./:=,@%+", c) != nullptr;
    });
    if (plain) {
      words.push_back(a);
      continue;
    }
    std::string q = "'";
    for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    words.push_back(q + "'");
  }
  return str::join(words, " ");
}

std::vector<std::vector<int>> numa_node_cpus() {
  std::vector<std::vector<int>> nodes;
  for (int n = 0; n < 1024; ++n) {
    std::ifstream in(fmt::format("/sys/devices/system/node/node{}/cpulist", n));
    if (!in) break;
    std::string list;
    std::getline(in, list);
    list = std::string(str::trim(list));
    nodes.push_back(list.empty() ? std::vector<int>{} : str::parse_int_list(list, "NUMA cpulist"));
  }
  return nodes;
}

std::vector<std::vector<int>> physical_cores(const std::vector<int>& allowed) {
  std::map<std::pair<int, int>, std::vector<int>> by_core;  // (package, core id) -> logical CPUs
  for (int c : allowed) {
    auto read_id = [&](const char* what) {
      std::ifstream in(fmt::format("/sys/devices/system/cpu/cpu{}/topology/{}", c, what));
      int v = -1;
      if (!(in >> v)) v = -1;
      return v;
    };
    int package = read_id("physical_package_id"), core = read_id("core_id");
    // Unknown topology: the CPU counts as a core of its own.
    by_core[core < 0 ? std::make_pair(-1, c) : std::make_pair(package, core)].push_back(c);
  }
  std::vector<std::vector<int>> cores;
  for (auto& [id, cpus] : by_core) cores.push_back(cpus);
  std::sort(cores.begin(), cores.end());  // by lowest CPU number
  return cores;
}

namespace {

// Blocks of whole cores (of logical CPUs when there are fewer cores than ranks) for `n` ranks.
std::vector<std::vector<int>> core_blocks(size_t n, std::vector<std::vector<int>> cores) {
  std::vector<std::vector<int>> out(n);
  if (n > cores.size()) {
    std::vector<int> flat;
    for (const auto& core : cores) flat.insert(flat.end(), core.begin(), core.end());
    cores.clear();
    for (int c : flat) cores.push_back({c});
  }
  const size_t total = cores.size();
  for (size_t i = 0; i < n; ++i)
    for (size_t k = i * total / n; k < (i + 1) * total / n; ++k) out[i].insert(out[i].end(), cores[k].begin(), cores[k].end());
  return out;
}

// `cpus` restricted to `allowed`, in order.
std::vector<int> within(const std::vector<int>& cpus, const std::vector<int>& allowed) {
  std::vector<int> kept;
  for (int c : cpus)
    if (std::find(allowed.begin(), allowed.end(), c) != allowed.end()) kept.push_back(c);
  return kept;
}

// Each set (a core's CPUs, a NUMA node's) restricted to `allowed`; sets left empty are dropped.
std::vector<std::vector<int>> sets_within(const std::vector<std::vector<int>>& sets, const std::vector<int>& allowed) {
  std::vector<std::vector<int>> out;
  for (const auto& set : sets)
    if (auto kept = within(set, allowed); !kept.empty()) out.push_back(std::move(kept));
  return out;
}

// GPU-near blocks: ranks grouped by their GPU's CPU set (within `allowed`), each group's cores cut
// into blocks. Empty result: the locality is unknown or too small for the ranks it would hold.
std::vector<std::vector<int>> gpu_near_bindings(int nproc, const std::vector<int>& allowed,
                                                const std::vector<std::vector<int>>& cores,
                                                const std::vector<std::vector<int>>& near_cpus) {
  if (near_cpus.size() != static_cast<size_t>(nproc)) return {};
  std::map<std::vector<int>, std::vector<int>> groups;  // usable near CPUs -> local ranks
  for (int l = 0; l < nproc; ++l) {
    std::vector<int> usable = within(near_cpus[l], allowed);
    if (usable.empty()) return {};
    groups[usable].push_back(l);
  }
  std::vector<std::vector<int>> out(static_cast<size_t>(nproc));
  for (const auto& [cpus, ranks] : groups) {
    if (ranks.size() > cpus.size()) return {};
    auto blocks = core_blocks(ranks.size(), sets_within(cores, cpus));
    for (size_t i = 0; i < ranks.size(); ++i) out[ranks[i]] = blocks[i];
  }
  return out;
}

}  // namespace

std::vector<std::vector<int>> compute_bindings(const std::string& bind_to, int nproc, const std::vector<int>& allowed,
                                               const std::vector<std::vector<int>>& numa_nodes,
                                               const std::vector<std::vector<int>>& cores_in,
                                               const std::vector<std::vector<int>>& near_cpus) {
  std::vector<std::vector<int>> out(static_cast<size_t>(nproc));
  if (bind_to == "none" || allowed.empty()) return out;
  std::vector<std::vector<int>> all_cores = cores_in;
  if (all_cores.empty())
    for (int c : allowed) all_cores.push_back({c});
  if (bind_to == "auto" && !near_cpus.empty()) {
    // A GPU job: a rank's threads feed its GPU over PCIe; CPUs on the GPU's NUMA node avoid the
    // cross-socket hop for every copy and kernel launch.
    auto near = gpu_near_bindings(nproc, allowed, all_cores, near_cpus);
    if (!near.empty()) return near;
  }
  if (bind_to == "auto") {
    // Why bind by default: two ranks left to the scheduler on a busy machine migrate, share a CPU for
    // a while and ping-pong cache lines; the shared-memory allreduce then ran 2-6x slower on some runs
    // and not others (docs/performance.md). Blocks of whole cores keep a rank's threads together and
    // off its neighbours' cores.
    if (nproc <= 1 || static_cast<size_t>(nproc) > allowed.size()) return out;
    return core_blocks(static_cast<size_t>(nproc), all_cores);
  }
  if (bind_to == "core") {
    for (int i = 0; i < nproc; ++i) out[i] = {allowed[static_cast<size_t>(i) % allowed.size()]};
    return out;
  }
  // numa: the NUMA nodes that have CPUs this process may use, round-robin over local ranks.
  std::vector<std::vector<int>> usable = sets_within(numa_nodes, allowed);
  if (usable.empty()) usable.push_back(allowed);
  for (int i = 0; i < nproc; ++i) out[i] = usable[static_cast<size_t>(i) % usable.size()];
  return out;
}

int ray_num_cpus() { return std::max<int>(1, static_cast<int>(allowed_cpus().size())); }

int ray_num_gpus(const Plan& plan) { return plan.gpus_per_node > 0 ? plan.gpus_per_node : this_machine(false).gpu_count; }

std::vector<std::string> ray_node_argv(const Plan& p, int node_rank, const std::string& node_ip, const std::string& gcs,
                                       const RayPorts& ports) {
  RayStart start;
  start.head = node_rank == 0;
  start.node_rank = node_rank;
  start.node_ip = node_ip;
  start.num_cpus = ray_num_cpus();
  start.num_gpus = ray_num_gpus(p);
  start.ports = ports;
  if (start.head) {
    auto colon = gcs.rfind(':');
    start.port = colon == std::string::npos ? 0 : std::atoi(gcs.c_str() + colon + 1);
  } else {
    start.gcs = gcs;
  }
  return ray_start_argv(p.ray.command_path.empty() ? p.ray.command : p.ray.command_path, start);
}

namespace {

// --dry-run's account of a Ray job: how the cluster comes up, and what each of this machine's processes runs.
std::string describe_ray(const Plan& p, const EnvMap& env) {
  std::string s;
  const auto [first, last] = p.ray.first_port > 0 ? std::pair{p.ray.first_port, p.ray.last_port}
                                                  : ray_block_range(ray_default_block(p.job_id));
  std::vector<int> others;
  for (int r = 1; r < p.nnodes; ++r) others.push_back(r);
  if (p.ray.open_membership)
    s += fmt::format("  ray             node 0 runs the Ray head; the driver runs on node 0 once the head is up (`ray "
                     "status` lists its Rank:0); the job does not count its nodes: each other node starts its Ray "
                     "when it starts and the head's GCS answers, and stays until the job ends (each wait up to "
                     "--join-timeout {:g} s); the driver's end ends the job, with its exit code\n",
                     p.join_timeout_s);
  else
    s += fmt::format("  ray             node 0 runs the Ray head{}; the driver runs on node 0 once `ray status` lists "
                     "every node's Rank:<n> (each wait up to --join-timeout {:g} s); the driver's end ends the job, "
                     "with its exit code\n",
                     others.empty() ? ""
                                    : fmt::format("; {} {} {} once the head's GCS answers (the job's store says when)",
                                                  others.size() == 1 ? "node" : "nodes", str::format_ranges(others),
                                                  others.size() == 1 ? "starts its Ray" : "start their Ray"),
                     p.join_timeout_s);
  s += fmt::format("  ray command     {}{}\n", p.ray.command,
                   p.ray.command_path.empty() ? " (on each node's PATH)" : " (here " + p.ray.command_path + ")");
  s += fmt::format("  ray ports       GCS {}  [{}]; each node's others in {}-{}{}\n",
                   p.ray.head_port > 0 ? std::to_string(p.ray.head_port) : "<free, chosen at start>",
                   p.ray.head_port_source, first, last,
                   p.ray.first_port > 0 ? "  [--ray-ports]"
                                        : fmt::format(" (from the job id; the next block of {} in {}-{} on a node where "
                                                      "one of them is taken)",
                                                      kRayPortBlock, kRayPortsBase,
                                                      kRayPortsBase + kRayPortBlocks * kRayPortBlock - 1));
  const std::string head_ip = "<node 0's address: " + (p.ray.head_address.empty() ? p.nodes.front().host + ", resolved"
                                                                                   : "HEAD_ADDR " + p.ray.head_address + ", checked") +
                              " there at start>";
  const std::string gcs = p.ray.head_port > 0 ? std::to_string(p.ray.head_port) : "<chosen at start>";
  for (const auto& node : p.nodes) {
    const bool head = node.node_rank == 0;
    if (p.ray.open_membership && !head && !node.local) continue;  // nodes this one neither knows nor waits for
    s += fmt::format("node {} ({}{}): {}\n", node.node_rank, node.host,
                     node.local ? ", this machine" : p.mode == Mode::kFanOut ? ", over ssh" : ", its own launcher",
                     head ? "the Ray head, then the driver" : fmt::format("Ray node {}", node.node_rank));
    if (!node.local) continue;
    for (int l = 0; l < node.nproc; ++l) {
      const int process = node.rank_of(l);
      WorkerSlot slot{process, l, node.nproc, node.node_rank, {}};
      std::vector<std::string> kv;
      for (const auto& [k, v] : worker_env(p, slot, "", 0, "", 0, env)) kv.push_back(k + "=" + env::shown_value(k, v));
      std::vector<std::string> argv;
      if (p.is_ray_driver(process)) {
        argv = worker_argv(p, process);
      } else {
        argv = ray_node_argv(p, node.node_rank, head ? head_ip : "<this node's address on the route to node 0>",
                             head ? "x:0" : "<the head's GCS, from the job's store>", ray_ports_in(first, last));
        for (size_t i = 0; i + 1 < argv.size(); ++i)
          if (argv[i] == "--port") argv[i + 1] = gcs;
      }
      s += fmt::format("  {} ({}): {}\n    command: {}\n", p.process_name(process),
                       p.is_ray_driver(process) ? (p.ray.open_membership ? "once the head is up" : "once every node has joined")
                       : head                   ? "first"
                                                : "once the head's GCS answers",
                       str::join(kv, " "), shell_line(argv));
    }
  }
  return s;
}

}  // namespace

std::string describe_plan(const Plan& p, const EnvMap& env, const std::string& store_addr,
                          const GpuInventory& gpus) {
  std::string s;
  s += fmt::format("cohort run plan (dry run; nothing started)\n");
  s += fmt::format("  mode            {}\n", mode_name(p.mode));
  if (p.form.kind == "direct")
    s += fmt::format("  program         {}{}\n", str::join(p.program, " "),
                     p.program_path != p.program[0] ? " (" + p.program_path + ")" : "");
  else
    s += fmt::format("  program         {}{} ({}: run by {} [{}], here {})\n", p.form.kind == "module" ? "-m " : "",
                     str::join(p.program, " "), p.form.kind == "module" ? "a Python module" : "a .py script",
                     p.form.python, p.form.python_source, p.program_path);
  if (p.form.append_local_rank)
    s += fmt::format("  arguments       {}=<local rank> before the program's own (--append-local-rank; spelling: {})\n",
                     p.form.local_rank_arg, p.form.local_rank_arg_source);
  if (p.form.working_dir_required)
    s += fmt::format("  folder          {} (--wdir: every host's workers run there; a host without it fails)\n",
                     p.form.working_dir);
  else if (!p.form.working_dir.empty())
    s += fmt::format("  folder          {} (every host's workers run there when it exists on the host)\n",
                     p.form.working_dir);
  if (p.timeout_s > 0)
    s += fmt::format("  time limit      {:g} s, then the job is stopped  [{}]\n", p.timeout_s, p.timeout_flag);
  s += fmt::format("  job id          {}  [{}]\n", p.job_id, p.source_of("job id"));
  if (p.elastic)
    s += fmt::format("  nodes           {} to {}, elastic: agents meet in generations; a lost node ends a generation "
                     "and the others go on, a new one joins at the next (rendezvous timeout {:g} s, last call {:g} s, "
                     "agent lease {:g} s)  [{}]\n",
                     p.min_nodes, p.max_nodes, p.join_timeout_s, p.rdzv_last_call_s, p.agent_lease_s,
                     p.source_of("nnodes"));
  else if (p.ray.open_membership)
    s += fmt::format("  nodes           not counted  [{}]\n", p.source_of("nnodes"));
  else
    s += fmt::format("  nodes           {}  [{}]\n", p.nnodes,
                     p.mode == Mode::kFanOut ? p.source_of("hosts") : p.source_of("nnodes"));
  if (p.mode != Mode::kFanOut) {
    s += fmt::format("  this node rank  {}  [{}]\n", p.this_node, p.source_of("node rank"));
    if (!p.ray.enabled)
      s += fmt::format("  nproc per node  {}  [{}]\n", p.nodes.front().nproc - p.nodes.front().nservers,
                       p.source_of("nproc per node"));
  }
  if (p.elastic)
    s += fmt::format("  world size      {} per node times the nodes of each generation\n", p.world_size);
  else if (!p.ray.enabled)  // a Ray job has no world of ranks: its lines below say what runs
    s += fmt::format("  world size      {}{}\n", p.world_size,
                     p.mode == Mode::kFanOut ? "  [" + p.source_of("world size") + "]" : "");
  if (p.ps_servers > 0)
    s += fmt::format("  roles           {} workers, {} parameter servers [{}] running {}; mode {} [{}]\n",
                     p.num_workers, p.ps_servers, p.source_of("parameter servers"),
                     p.ps_server_program ? "the program (--ps-server program)" : "cohort ps serve", p.ps_mode,
                     p.source_of("ps mode"));
  s += fmt::format("  store           {}  [address: {}; port: {}]; hosted by {}\n", store_addr,
                   p.source_of("store address"), p.source_of("store port"),
                   p.elastic ? (p.host_store ? "this agent (the master address is this host), unless another "
                                               "agent here holds the port first"
                                             : "the agent on the master address's host")
                   : p.mode == Mode::kPerNode ? "node 0's launcher" : "this launcher");
  if (p.mode == Mode::kFanOut && std::any_of(p.nodes.begin(), p.nodes.end(), [](const NodePlan& n) { return !n.local; }))
    s += fmt::format("  agents          started {}, the nodes meet within {:g} s (--join-timeout)\n",
                     p.agent_launcher == "srun" ? std::string("as srun steps") : "by `" + p.ssh_command + " HOST`",
                     p.join_timeout_s);
  if (!p.timeline_path.empty())
    s += fmt::format("  timeline        {} (every rank's operations, merged at the end)\n", p.timeline_path);
  s += fmt::format("  job token       {}\n", !p.token_file.empty() ? "from --token-file " + p.token_file
                                          : p.token_from_env          ? std::string("from COHORT_JOB_TOKEN")
                                          : p.mode == Mode::kPerNode && env.count("SLURM_STEP_ID") &&
                                                    env.count("SLURM_STEP_NODELIST") && env.count("SLURMD_NODENAME")
                                              ? std::string("made by node 0's launcher, through munge to the "
                                                            "others (open if munged does not answer)")
                                          : p.mode == Mode::kPerNode
                                              ? std::string("none: the job is open (give every node the same "
                                                            "--token-file PATH or COHORT_JOB_TOKEN)")
                                              : std::string("random, 32 bytes"));
  if (!p.schedulers.empty()) s += fmt::format("  scheduler env   {}\n", str::join(p.schedulers, ", "));
  for (const auto& line : p.notes) s += fmt::format("  note            {}\n", line);
  if (!p.ray.enabled && (env.count("HEAD_ADDR") || env.count("HEAD_PORT")))
    s += "  note            HEAD_ADDR/HEAD_PORT (TI-ONE's Ray mode) are read by --ray jobs only (docs/ray.md)\n";
  s += fmt::format("  failure policy  {}, max restarts {}, kill grace {} s\n",
                   p.ray.enabled           ? "the driver's end ends the job; a node's Ray that ends before it stops it"
                   : p.abort_on_failure    ? "first failure stops the job"
                                           : "others run on (--no-abort-on-failure)",
                   p.max_restarts, p.kill_grace_s);
  std::string log_files;
  if (!p.logs.dir.empty() && (!p.logs.redirects.empty() || !p.logs.tee.empty()))
    log_files = fmt::format(", files under {}/attempt_N/RANK/{{stdout,stderr}}.log ({}{}{})", p.logs.dir,
                            p.logs.redirects.empty() ? "" : "--redirects " + p.logs.redirects + ": files only",
                            !p.logs.redirects.empty() && !p.logs.tee.empty() ? ", " : "",
                            p.logs.tee.empty() ? "" : "--tee " + p.logs.tee + ": files and console");
  s += fmt::format("  output          tags {}{}{}{}{}{}\n", p.tag_output ? "on" : "off",
                   p.output_dir.empty() ? "" : ", files under " + p.output_dir + "/rank.N/", log_files,
                   p.merge_stderr ? ", stderr merged into stdout" : "",
                   p.all_ranks_to_console ? "" : ", console ranks " + str::format_ranges(p.ranks_to_console),
                   p.logs.all_local_ranks ? "" : ", console local ranks " + str::format_ranges(p.logs.console_local_ranks));
  s += fmt::format("  bind-to         {}{}\n", p.bind_to, p.report_bindings ? ", reported at start (--report-bindings)" : "");
  if (!p.gpus_per_node_spec.empty())
    s += fmt::format("  gpus per node   {}{}  [{}]\n", p.gpus_per_node > 0 ? std::to_string(p.gpus_per_node) : p.gpus_per_node_spec,
                     p.gpu_share ? ", shared by ranks (--gpu-share)" : ", one per rank",
                     p.source_of("gpus per node"));
  if (p.set_omp_threads) s += "  note            OMP_NUM_THREADS=1 for every worker (unset, and workers share a node)\n";
  if (p.ray.enabled) return s + describe_ray(p, env);
  auto cpus = allowed_cpus();
  auto numa = numa_node_cpus();
  for (const auto& node : p.nodes) {
    s += fmt::format("node {} ({}{}): ranks {}\n", node.node_rank, node.host,
                     node.local ? ", this machine" : p.mode == Mode::kFanOut ? ", over ssh" : ", its own launcher",
                     node.ranks_text());
    if (!node.local) continue;
    auto assigned = assign_gpus(p.gpus_per_node_spec, p.gpu_share, node.nproc, gpus, node.host);
    auto bindings = compute_bindings(p.bind_to, node.nproc, cpus, numa, physical_cores(cpus), near_cpus_of(assigned));
    for (int l = 0; l < node.nproc; ++l) {
      WorkerSlot slot{node.rank_of(l), l, node.nproc, node.node_rank, assigned[l]};
      auto vars = worker_env(p, slot, store_addr, 0, "<token>", 0, env);
      std::vector<std::string> kv;
      for (const auto& [k, v] : vars) kv.push_back(k + "=" + env::shown_value(k, v));
      s += fmt::format("  {} (local {}){} cpus {}: {}\n", p.process_name(slot.rank), l,
                       assigned[l].device >= 0 ? " " + assigned[l].description + "," : "",
                       bindings[l].empty() ? "any" : str::format_ranges(bindings[l]), str::join(kv, " "));
      const bool builtin_server = p.role_of(slot.rank).server && !p.ps_server_program;
      s += fmt::format("    command: {}\n", builtin_server ? "cohort ps serve" : shell_line(worker_argv(p, slot.rank)));
    }
  }
  return s;
}

std::vector<std::vector<int>> near_cpus_of(const std::vector<GpuAssignment>& gpus) {
  std::vector<std::vector<int>> out;
  for (const auto& g : gpus) {
    if (g.device < 0 || g.near_cpus.empty()) return {};
    out.push_back(g.near_cpus);
  }
  return out;
}

std::string plan_to_json(const Plan& plan) { return nlohmann::json(plan).dump(); }

Plan plan_from_json(const std::string& text) {
  try {
    return nlohmann::json::parse(text).get<Plan>();
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("agent: malformed plan from the head launcher ({})", e.what()));
  }
}

std::string random_token(int bytes) {
  std::vector<unsigned char> buf(static_cast<size_t>(bytes));
  if (RAND_bytes(buf.data(), bytes) != 1) throw Error("OpenSSL RAND_bytes failed to produce a job token");
  std::string hex;
  for (auto b : buf) hex += fmt::format("{:02x}", b);
  return hex;
}

}  // namespace cohort::launch
