// The plan: build_plan reads the flags every job shares, lets one placement source place the nodes
// (plan_hosts.cc or plan_per_node.cc; Ray's and the parameter servers' layouts on top of it), then
// settles what every mode shares (job id, observability, logs, time limit, GPUs, the program). Also the
// plan's own accessors and its JSON form for `cohort agent`. plan_internal.h lists the other parts.

#include "launch/plan.h"

#include <fmt/core.h>
#include <openssl/rand.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "cohort/error.h"
#include "common/env.h"
#include "common/strings.h"
#include "launch/plan_internal.h"
#include "launch/trace_dirs.h"

namespace cohort::launch {

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
  // What the command line says of each node's processes, for the placement sources below.
  Shape shape;
  shape.nproc_flag_name = o.nproc_per_node_flag;
  if (o.nproc_per_node)
    shape.nproc_flag = parse_nproc(o.nproc_per_node_flag, *o.nproc_per_node, machine, shape.nproc_how);
  std::string bind_to = o.bind_to;
  read_mapping(p, o, shape, bind_to);
  // GPUs: resolved against this machine's inventory when it has any; a fan-out head without GPUs
  // leaves "auto" to each node's agent (which checks its own GPUs before starting workers).
  if (o.gpu_share && !o.gpus_per_node) throw ConfigError("--gpu-share needs --gpus-per-node");
  if (o.gpus_per_node) {
    p.gpus_per_node_spec = *o.gpus_per_node;
    p.gpu_share = o.gpu_share;
    const bool remote_only = (o.hosts || o.hostfile) && machine.gpus.gpus.empty();
    if (!remote_only) shape.gpus_here = resolve_gpus_per_node(*o.gpus_per_node, machine.gpus, machine.hostname);
    else parse_gpus_per_node(*o.gpus_per_node);  // the syntax, at least
    p.gpus_per_node = shape.gpus_here.value_or(0);
    source("gpus per node", "--gpus-per-node " + *o.gpus_per_node +
                                (shape.gpus_here ? " (" + machine.gpus.source + ")" : " (each host's own count)"));
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

  // One placement source places the nodes: one launcher starting every host (-H, --hostfile, a Slurm
  // allocation: plan_hosts.cc), or one launcher per node (flags and scheduler environments:
  // plan_per_node.cc).
  PlacementFinds found;
  const std::optional<SlurmAllocation> slurm = fan_out_allocation(o, env, machine);
  if (o.hosts || o.hostfile || slurm) place_on_hosts(p, o, shape, slurm, machine, found);
  else place_per_node(p, o, env, shape, machine, found);

  if ((shape.map_by.by_node || shape.rank_by_node) && p.mode == Mode::kPerNode)
    throw ConfigError(fmt::format("{}: each node of a per-node job ({}) starts its own ranks, numbered consecutively; "
                                  "ranks are dealt over the hosts when one cohort run starts them all (-H, --hostfile)",
                                  shape.map_by.by_node ? "--map-by " + *o.map_by : shape.rank_by_flag,
                                  p.elastic ? p.source_of("elastic") : p.source_of("nnodes")));
  if (o.ray) set_ray_mode(p, o, found.ray_head_address, found.ray_head_port);
  place_parameter_servers(p, o, env, found.sched_ps_nodes);

  // Job id: the same on every node (per-node mode cannot share a random one).
  if (o.run_id) {
    p.job_id = *o.run_id;
    source("job id", "--run-id");
  } else if (found.sched_job_id) {
    p.job_id = found.sched_job_id->value;
    source("job id", found.sched_job_id->source);
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

  set_worker_environment(p, o, env);
  int max_per_node = 0;
  for (const auto& n : p.nodes) max_per_node = std::max(max_per_node, n.nproc);

  // More local ranks than GPUs is an error unless --gpu-share (each agent checks its own node again). A Ray
  // node gets them all.
  if (shape.gpus_here && !p.ray.enabled)
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
