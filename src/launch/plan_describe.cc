// The --dry-run text: what `cohort run` would do (mode, program, nodes, ranks, where each setting came
// from, each local worker's argv and environment), from a plan alone; nothing starts.

#include <fmt/core.h>

#include <algorithm>
#include <cctype>
#include <cstring>

#include "common/env.h"
#include "common/strings.h"
#include "launch/plan_internal.h"

namespace cohort::launch {

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

}  // namespace cohort::launch
