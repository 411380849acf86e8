// `cohort run [options] PROGRAM [ARGS...]`: the launcher (torchrun's and mpirun's flags), and
// `cohort agent`: one node of an ssh fan-out, started by the head launcher. docs/launcher.md is the
// reference for every flag and environment variable.
#include <unistd.h>

#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cohort/error.h"
#include "command.h"
#include "common/env.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/job.h"
#include "launch/munge.h"
#include "launch/parsers.h"
#include "launch/plan.h"
#include "launch/torch_version.h"

namespace cohort::tools {
namespace {

const env::BoolSetting kRequireAuth("COHORT_REQUIRE_AUTH", false,
                                    "1: cohort run refuses to start a job without a job token (as --require-auth)");

using launch::Options;

// mpirun spellings CLI11 cannot express directly (multi-letter single-dash options).
std::string normalise(const std::string& arg, const CLI::App& app) {
  if (arg == "-np" || arg == "--np") return "-n";
  if (arg.rfind("-np=", 0) == 0) return "-n=" + arg.substr(4);
  if (arg == "-host" || arg == "--host") return "-H";
  if (arg == "-hostfile" || arg == "-machinefile" || arg == "--machinefile") return "--hostfile";
  if (arg == "-npernode") return "--npernode";
  if (arg == "-wd" || arg == "--wd") return "--wdir";
  // mpirun takes its long options with one dash too (-bind-to none, -map-by, -report-bindings,
  // -output-filename): those that are flags of ours with two dashes mean the same.
  if (arg.size() > 2 && arg[0] == '-' && arg[1] != '-') {
    std::string two = "-" + arg;
    if (app.get_option_no_throw(two.substr(0, two.find('=')))) return two;
  }
  return arg;
}

double seconds_flag(const std::string& name, const std::string& value) { return env::parse_seconds(name, value); }

// "host", "host:port", "[v6]:port" -> host and optional port.
std::pair<std::string, std::optional<int>> split_endpoint(const std::string& text) {
  std::string host = text;
  std::string port;
  if (!text.empty() && text.front() == '[') {
    auto close = text.find(']');
    if (close == std::string::npos) throw ConfigError(fmt::format("--rdzv-endpoint {}: missing ']'", text));
    host = text.substr(1, close - 1);
    if (close + 1 < text.size() && text[close + 1] == ':') port = text.substr(close + 2);
  } else if (auto colon = text.rfind(':'); colon != std::string::npos && text.find(':') == colon) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (host.empty()) throw ConfigError(fmt::format("--rdzv-endpoint {}: expected HOST[:PORT]", text));
  if (port.empty()) return {host, std::nullopt};
  char* end = nullptr;
  long v = std::strtol(port.c_str(), &end, 10);
  if (*end != '\0' || v < 1 || v > 65535)
    throw ConfigError(fmt::format("--rdzv-endpoint {}: expected a port between 1 and 65535", text));
  return {host, static_cast<int>(v)};
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "cohort";
  return std::string(buf, static_cast<size_t>(n));
}

// CLI11 would write "Usage: cohort run [OPTIONS]": the launcher's command line ends with PROGRAM and the
// program's own arguments, which no option of ours describes.
class RunHelp : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string name) const override {
    return "Usage: " + name + " [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

// The MCA parameters of Open MPI that say something cohort can do; the rest of an mpirun line's -mca
// settings choose Open MPI's own components and are ignored with one note.
void apply_mca(const std::vector<std::pair<std::string, std::string>>& mca, Options& o, bool& no_abort) {
  std::vector<std::string> ignored;
  for (const auto& [key, value] : mca) {
    const std::string given = fmt::format("-mca {} {}", key, value);
    if (key == "orte_abort_on_non_zero_status" || key == "prte_abort_on_non_zero_status") {
      // The abort policy (MindSpore's and others' mpirun lines). Open MPI 5 spells it prte_...
      if (value == "0" || value == "false") no_abort = true;
      else if (value != "1" && value != "true")
        throw ConfigError(fmt::format("{}: expected 0 (the job goes on after a failure) or 1 (it stops)", given));
    } else if (key == "btl_tcp_if_include") {
      // The interfaces the ranks' TCP traffic uses: cohort's TCP transport reads COHORT_TCP_IFNAME on
      // each host (same-host ranks use shared memory whatever it says).
      for (const auto& x : o.export_env)
        if (x.rfind("COHORT_TCP_IFNAME", 0) == 0 && (x.size() == 17 || x[17] == '='))
          throw ConfigError(fmt::format("{} and -x {} both given; use one", given, x));
      o.export_env.push_back("COHORT_TCP_IFNAME=" + value);
    } else if (key == "oob_tcp_if_include" && (o.hosts || o.hostfile) && !o.master_addr) {
      // The runtime's own connections: in a fan-out, the job's store (which every agent and worker
      // dials) listens at this host's address on those interfaces.
      o.master_addr = net::interface_addresses(value, "-mca oob_tcp_if_include")[0];
      o.master_addr_flag = given;
    } else {
      ignored.push_back(given);
    }
  }
  if (!ignored.empty())
    fmt::print(stderr,
               "cohort run: note: {}: Open MPI's settings, which mean nothing to cohort (it picks shared memory on a "
               "host and TCP between hosts itself; btl_tcp_if_include and oob_tcp_if_include choose its interfaces, "
               "the latter only for a -H/--hostfile job without --master-addr); ignored\n",
               str::join(ignored, ", "));
}

// A launcher that srun started as a task of a step (per-node mode) and that has no token: the step's
// nodes share a munge realm, so the job gets a token through it (launch/munge.h). This node's place is
// where SLURMD_NODENAME stands in SLURM_STEP_NODELIST, as for its node rank (docs/slurm.md).
launch::JobContext::SlurmMunge slurm_munge(const launch::EnvMap& env) {
  launch::JobContext::SlurmMunge m;
  auto step = env.find("SLURM_STEP_ID"), list = env.find("SLURM_STEP_NODELIST"), me = env.find("SLURMD_NODENAME");
  if (step == env.end() || list == env.end() || me == env.end()) return m;
  const auto nodes = launch::expand_slurm_nodelist(list->second);
  const auto here = std::find(nodes.begin(), nodes.end(), me->second);
  if (here == nodes.end()) return m;
  m.enabled = true;
  m.node = static_cast<int>(here - nodes.begin());
  m.nodes = static_cast<int>(nodes.size());
  m.socket = launch::munge::socket_path(env, &m.socket_source);
  return m;
}

// `cohort run`, and `cohort launch` (`launch_line`): python -m torch.distributed.launch's line, the same
// flags with --local_rank=N passed to every worker unless --use-env (docs/launcher.md).
int run_launcher(std::vector<std::string> args, LaunchLine line) {
  Options o;
  const bool launch_line = line == LaunchLine::kTorchLaunch;
  o.horovod_env = line == LaunchLine::kHorovodrun;
  o.forward_environment = o.horovod_env;
  const std::string command = launch_line ? "cohort launch" : o.horovod_env ? "cohort horovodrun" : "cohort run";
  CLI::App app{launch_line ? "cohort launch: python -m torch.distributed.launch's line; cohort run that passes "
                             "--local_rank=N (torch 2.x: --local-rank=N) to each worker unless --use-env"
                           : "cohort run: start, watch and stop a job of PROGRAM on one machine or many",
               command};
  app.formatter(std::make_shared<RunHelp>());
  app.footer("Everything after PROGRAM is the program's own. mpirun's long flags are taken with one dash too "
             "(-np, -host, -hostfile, -machinefile, -npernode, -wd, -bind-to, -timeout, ...); docs/launcher.md is "
             "the reference.");
  app.set_help_flag("-h,--help", "print this help (docs/launcher.md has the full reference)");
  // mpirun's flags in a group of their own, so that --help shows what an mpirun line may carry.
  const std::string mpirun_group = "mpirun's flags";
  std::string nproc, hosts_joined, join_timeout = "300", kill_grace = "5", ranks_to_console;
  std::vector<std::string> hosts;
  int np = 0, node_rank = 0, master_port = 0;
  std::string nnodes, rdzv_endpoint, rdzv_backend, rdzv_conf, rdzv_timeout;
  std::string master_addr, hostfile, run_id, token_file;
  bool tag = false, no_tag = false, no_abort = false, standalone = false, require_auth = false;
  app.add_option("--nproc-per-node,--nproc_per_node", nproc, "workers per node: N or auto (GPUs, else CPU cores)");
  app.add_option("-n,--num-processes", np, "total number of workers (mpirun -n/-np)")->group(mpirun_group);
  app.add_option("--nnodes", nnodes, "number of nodes, each running this same command (torchrun); MIN:MAX: an elastic "
                 "job that survives lost nodes and admits new ones (docs/launcher.md, Elastic jobs)");
  app.add_option("--node-rank,--node_rank", node_rank, "this node's rank, 0..nnodes-1");
  app.add_option("--master-addr,--master_addr", master_addr, "address of node 0 (it hosts the job's store)");
  app.add_option("--master-port,--master_port", master_port, "port of the job's store (default: OS-chosen on one node, 29500 on several)");
  app.add_flag("--standalone", standalone, "one node (torchrun's --standalone; the default without --nnodes)");
  app.add_option("-H", hosts, "hosts to fan out to: host1:8,host2:8 (mpirun -H/--host)")->group(mpirun_group);
  app.add_option("--hostfile", hostfile, "hostfile: 'host slots=N [max_slots=M]' lines (Open MPI / DeepSpeed)")
      ->group(mpirun_group);
  app.add_option("--ssh-command", o.ssh_command, "command that starts the agent on another host")->capture_default_str();
  app.add_option("--launcher", o.launcher,
                 "how a fan-out starts its agents: ssh, srun (Slurm steps), or auto: srun when the hosts are the "
                 "Slurm allocation's (docs/slurm.md), else ssh")
      ->capture_default_str();
  app.add_option("-x", o.export_env, "forward VAR (or set VAR=value) for every worker; repeatable")->group(mpirun_group);
  app.add_option("--token-file", token_file,
                 "file holding the job token (mode 0600; per-node jobs: the same file, e.g. on a shared filesystem, "
                 "for every node; default: COHORT_JOB_TOKEN)");
  app.add_flag("--require-auth", require_auth,
               "refuse to start a job whose store and connections would be open to anyone (COHORT_REQUIRE_AUTH=1)");
  app.add_option("--join-timeout", join_timeout, "seconds to wait for every node to join (default 300)");
  app.add_option("--rdzv-timeout,--rdzv_timeout", rdzv_timeout, "elastic jobs: how long a generation waits for MIN nodes (the same setting as --join-timeout)");
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", rdzv_endpoint, "HOST[:PORT] of the job's store (torchrun's name for --master-addr/--master-port)");
  app.add_option("--rdzv-backend,--rdzv_backend", rdzv_backend, "c10d or static (torchrun's; cohort's own store serves both)");
  app.add_option("--rdzv-conf,--rdzv_conf", rdzv_conf, "torchrun's rendezvous settings: join_timeout=S,last_call_timeout=S");
  app.add_option("--kill-grace", kill_grace, "seconds between SIGTERM and SIGKILL when stopping workers (default 5)");
  app.add_flag("--tag-output", tag, "prefix each output line with [host:rank] (default with more than one worker)")
      ->group(mpirun_group);
  app.add_flag("--no-tag-output", no_tag, "never prefix output lines");
  app.add_option("--output-filename,--output_filename", o.output_dir, "also write DIR/rank.N/stdout and stderr")
      ->group(mpirun_group);
  app.add_flag("--merge-stderr-to-stdout", o.merge_stderr, "send stderr where stdout goes")->group(mpirun_group);
  app.add_flag("--timestamp-output", o.timestamp_output,
               "start each output line with the local time it was read, to the millisecond")
      ->group(mpirun_group);
  std::string timeout;
  app.add_option("--timeout", timeout,
                 "the job's wall-clock limit (30, 90s, 10m): then every worker on every node is stopped and the job "
                 "exits 124 (MPIEXEC_TIMEOUT too)")
      ->group(mpirun_group);
  std::string wdir;
  app.add_option("--wdir", wdir, "the folder every worker runs in, on every host (mpirun's -wdir/-wd)")
      ->group(mpirun_group);
  app.add_option("--ranks-to-console", ranks_to_console, "ranks that print on the console: 0,2-3 or none (default all)");
  app.add_option("--bind-to", o.bind_to, "auto | none | core | numa (default auto: each local worker gets an equal block of whole cores, unless there is one worker or more workers than CPUs)")
      ->group(mpirun_group);
  std::string gpus_per_node;
  app.add_option("--gpus-per-node,--gpus_per_node", gpus_per_node,
                 "a GPU job: auto (what nvidia-smi -L reports) or N; one GPU per local rank, CPUs bound next to it "
                 "(docs/gpu.md)");
  app.add_flag("--gpu-share", o.gpu_share, "let more local ranks than GPUs share them (rank i uses GPU i mod N)");
  app.add_flag("--device-per-rank", o.device_per_rank, "narrow CUDA_VISIBLE_DEVICES (or ASCEND_RT_VISIBLE_DEVICES) to the local rank's device");
  app.add_flag("--no-abort-on-failure", no_abort, "a failed worker does not stop the others (the exit code still reports it)");
  app.add_option("--max-restarts,--max_restarts", o.max_restarts, "restart every worker up to K times after a failure");
  app.add_flag("--dry-run", o.dry_run, "print the plan (nodes, ranks, where each setting came from, worker environment) and exit");
  app.add_option("--timeline", o.timeline, "record every rank's operations and training steps and merge them into this Chrome-trace/Perfetto JSON file (COHORT_TIMELINE)");
  app.add_flag("--stats", o.stats, "print live per-rank stats every second: operations, bytes, busbw, time in communication, DDP wait share (a table on a terminal, JSON lines otherwise)");
  app.add_option("--trace-dir", o.trace_dir,
                 "where flight recorder dumps and timeline rank files go (COHORT_TRACE_DIR; default "
                 "$TMPDIR/cohort-traces-<uid>/<job id>)");
  int ps_servers = 0;
  std::string ps_mode;
  app.add_option("--ps", ps_servers, "parameter-server job: start N servers besides the workers (docs/parameter-server.md)");
  app.add_option("--ps-mode", ps_mode, "parameter-server consistency: async (default), bsp or stale:K (COHORT_PS_MODE)");
  app.add_option("--ps-server", o.ps_server, "what servers run: builtin (cohort ps serve, default) or program (PROGRAM itself, which calls cohort::ps::serve_from_env() when COHORT_ROLE=server)");
  app.add_option("--run-id,--run_id,--rdzv-id,--rdzv_id", run_id, "job id (default: random; per-node: from the store address)");
  // Ray mode (docs/ray.md).
  int ray_port = 0;
  std::string ray_ports, ray_command;
  app.add_flag("--ray", o.ray, "a Ray job: bring a Ray cluster up on the job's nodes (a Rank:<n> resource each), run PROGRAM (the driver) on node 0 once every node has joined, and take the cluster down when it ends (docs/ray.md)");
  app.add_option("--ray-port", ray_port, "the Ray head's GCS port (default: HEAD_PORT, else a free port the head picks)");
  app.add_option("--ray-ports", ray_ports, "FIRST-LAST: where each node's other Ray ports come from (default: a block of 1000 in 20000-31999 from the job id)");
  app.add_option("--ray-command", ray_command, "the ray executable on every node (default: ray on each node's PATH)");

  // How PROGRAM runs (torchrun's forms) and torch.distributed.launch's --local_rank argument.
  std::string python;
  app.add_flag("-m,--module", o.module, "PROGRAM is a Python module: each worker runs PYTHON -u -m PROGRAM ARGS (torchrun's -m)");
  app.add_flag("--no-python,--no_python", o.no_python, "run PROGRAM directly even when it ends in .py (torchrun's --no-python)");
  app.add_option("--python", python, "interpreter of a .py PROGRAM and of -m (default: COHORT_PYTHON, else python3 on each host's PATH)");
  app.add_flag("--append-local-rank", o.append_local_rank, "pass --local_rank=N to each worker before its arguments, as python -m torch.distributed.launch does");
  app.add_flag("--use-env,--use_env", o.use_env, "torch.distributed.launch's: the program reads LOCAL_RANK from its environment (what cohort always gives)");
  std::string local_rank_arg;
  app.add_option("--local-rank-arg", local_rank_arg, "the spelling of that argument: local_rank (torch 1.x's launch), "
                 "local-rank (2.x's) or auto (as the installed torch's; cohort launch's default)");
  // mpirun's placement and reporting flags.
  std::string npernode, map_by, rank_by;
  app.add_option("-N,--npernode", npernode, "processes per node (mpirun's -N/-npernode; the same as --nproc-per-node)")
      ->group(mpirun_group);
  app.add_option("--map-by", map_by, "mpirun's placement: slot, node (round robin over the hosts), ppr:N:node, core, "
                 "socket or numa (docs/launcher.md)")
      ->group(mpirun_group);
  app.add_option("--rank-by", rank_by, "mpirun's rank order: slot (each host's ranks in turn) or node (round robin "
                 "over the hosts; the default after --map-by node)")
      ->group(mpirun_group);
  app.add_flag("--report-bindings", o.report_bindings, "print each rank's CPU binding on stderr as it starts (mpirun's --report-bindings)")
      ->group(mpirun_group);
  bool run_as_root = false;
  app.add_flag("--allow-run-as-root", run_as_root, "accepted for mpirun command lines (cohort runs as root without it)")
      ->group(mpirun_group);
  app.add_flag("--oversubscribe", o.oversubscribe,
               "-n may exceed the -H/--hostfile slots: the rest are spread evenly over the hosts")
      ->group(mpirun_group);
  // Listed for --help only: -mca KEY VALUE pairs are taken out of the command line before CLI11 parses it.
  std::vector<std::string> mca_listed;
  app.add_option("--mca", mca_listed,
                 "Open MPI's settings (repeatable): orte_abort_on_non_zero_status 0|1, btl_tcp_if_include and "
                 "oob_tcp_if_include IFACES (cohort's interfaces); the rest are ignored with a note")
      ->type_name("KEY VALUE")
      ->group(mpirun_group);
  // torchrun's log files, console filter and monitor interval.
  std::string log_dir, redirects, tee, local_ranks_filter, monitor_interval;
  app.add_option("--log-dir,--log_dir", log_dir, "with --redirects/--tee: per-rank files DIR/<run id>/attempt_<n>/<rank>/{stdout,stderr}.log (torchrun's)");
  app.add_option("-r,--redirects", redirects, "streams that go to the log files only: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank 0:1,1:2 (torchrun's)");
  app.add_option("-t,--tee", tee, "streams that go to the log files and the console, as --redirects (torchrun's)");
  app.add_option("--local-ranks-filter,--local_ranks_filter", local_ranks_filter, "local ranks that print on the console: 0,1 (torchrun's; files still get every rank)");
  app.add_option("--monitor-interval,--monitor_interval", monitor_interval, "accepted for torchrun command lines (cohort's supervision is event-driven: no interval)");

  // Split at PROGRAM: everything from the first positional argument on is the program's, untouched.
  std::vector<std::string> opts;
  std::vector<std::pair<std::string, std::string>> mca;  // mpirun's -mca KEY VALUE
  size_t i = 1;
  for (; i < args.size(); ++i) {
    std::string a = normalise(args[i], app);
    if (a == "--") {
      ++i;
      break;
    }
    if (a == "-mca" || a == "--mca") {
      if (i + 2 >= args.size()) throw ConfigError(fmt::format("{}: expected KEY VALUE", a));
      mca.emplace_back(args[i + 1], args[i + 2]);
      i += 2;
      continue;
    }
    if (a.size() < 2 || a[0] != '-') break;
    opts.push_back(a);
    if (a.find('=') != std::string::npos) continue;
    const CLI::Option* opt = app.get_option_no_throw(a);
    if (opt && opt->get_expected_max() > 0 && opt->get_type_size_max() > 0 && i + 1 < args.size()) {
      opts.push_back(args[++i]);
    }
  }
  o.program.assign(args.begin() + static_cast<long>(i), args.end());
  opts.insert(opts.begin(), args[0]);
  if (!parse_command_line(app, opts, "")) return 0;
  if (app.count("--local-rank-arg")) o.local_rank_arg = local_rank_arg;
  if (launch_line) {
    // torch.distributed.launch: --local_rank=N unless --use_env, in the installed torch's spelling.
    if (o.no_python && !o.use_env)
      throw ConfigError("--no-python without --use-env: a program run directly gets no --local_rank argument "
                        "(torch.distributed.launch refuses this too); add --use-env and read LOCAL_RANK");
    o.append_local_rank = o.append_local_rank || !o.use_env;  // both given: refused by the plan, as in cohort run
    if (o.append_local_rank && !o.local_rank_arg) o.local_rank_arg = "auto";
  }
  if (!nproc.empty()) o.nproc_per_node = nproc;
  if (app.count("-N")) {
    if (o.nproc_per_node && *o.nproc_per_node != npernode)
      throw ConfigError(fmt::format("--nproc-per-node {} and -N/--npernode {} both given; use one", *o.nproc_per_node,
                                    npernode));
    o.nproc_per_node = npernode;
    o.nproc_per_node_flag = "-N/--npernode";
  }
  if (app.count("--python")) o.python = python;
  if (app.count("--map-by")) o.map_by = map_by;
  if (app.count("--log-dir")) o.log_dir = log_dir;
  if (app.count("--redirects")) o.redirects = redirects;
  if (app.count("--tee")) o.tee = tee;
  if (app.count("--local-ranks-filter")) o.local_ranks_filter = local_ranks_filter;
  if (app.count("--monitor-interval")) {
    double s = seconds_flag("--monitor-interval", monitor_interval);
    if (s <= 0) throw ConfigError(fmt::format("--monitor-interval {}: expected seconds > 0", monitor_interval));
  }
  if (app.count("--gpus-per-node")) o.gpus_per_node = gpus_per_node;
  if (app.count("-n")) o.np = np;
  if (app.count("--nnodes")) {
    // N, or MIN:MAX (torchrun's elastic form).
    auto colon = nnodes.find(':');
    auto number = [&](const std::string& text) {
      char* end = nullptr;
      long v = std::strtol(text.c_str(), &end, 10);
      if (text.empty() || *end != '\0' || v < 1 || v > 100000)
        throw ConfigError(fmt::format("--nnodes {}: expected a node count N or MIN:MAX (positive numbers)", nnodes));
      return static_cast<int>(v);
    };
    if (colon == std::string::npos) {
      o.nnodes = number(nnodes);
    } else {
      o.min_nodes = number(nnodes.substr(0, colon));
      o.nnodes = number(nnodes.substr(colon + 1));
    }
  }
  if (app.count("--rdzv-endpoint")) {
    if (app.count("--master-addr") || app.count("--master-port"))
      throw ConfigError("--rdzv-endpoint and --master-addr/--master-port both given; use one");
    auto [host, port] = split_endpoint(rdzv_endpoint);
    o.rdzv_endpoint = true;
    o.master_addr = host;
    if (port) o.master_port = *port;
  }
  if (app.count("--rdzv-backend")) {
    if (rdzv_backend != "c10d" && rdzv_backend != "static")
      throw ConfigError(fmt::format("--rdzv-backend {}: cohort's own store is the rendezvous; expected c10d or static",
                                    rdzv_backend));
    o.rdzv_backend = rdzv_backend;
  }
  if (app.count("--rdzv-timeout")) join_timeout = rdzv_timeout;
  for (const auto& item : str::split(rdzv_conf, ',')) {
    if (item.empty()) continue;
    auto eq = item.find('=');
    std::string key = item.substr(0, eq), value = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (key == "join_timeout" && !value.empty()) join_timeout = value;
    else if (key == "last_call_timeout" && !value.empty()) o.rdzv_last_call_s = seconds_flag("--rdzv-conf last_call_timeout", value);
    else
      throw ConfigError(fmt::format("--rdzv-conf {}: expected join_timeout=SECONDS or last_call_timeout=SECONDS", item));
  }
  if (standalone) {
    if (o.nnodes && *o.nnodes != 1) throw ConfigError("--standalone and --nnodes > 1 both given");
    o.nnodes = 1;
  }
  if (app.count("--node-rank")) o.node_rank = node_rank;
  if (app.count("--master-addr")) o.master_addr = master_addr;
  if (app.count("--master-port")) o.master_port = master_port;
  if (!hosts.empty()) {
    std::string joined;
    for (const auto& h : hosts) joined += (joined.empty() ? "" : ",") + h;
    o.hosts = joined;
  }
  if (app.count("--hostfile")) {
    o.hostfile = hostfile;
    std::ifstream in(hostfile);
    if (!in) throw ConfigError(fmt::format("--hostfile {}: cannot read: {}", hostfile, strerror(errno)));
    std::stringstream ss;
    ss << in.rdbuf();
    o.hostfile_text = ss.str();
  }
  o.join_timeout_s = seconds_flag("--join-timeout", join_timeout);
  o.kill_grace_s = seconds_flag("--kill-grace", kill_grace);
  if (tag && no_tag) throw ConfigError("--tag-output and --no-tag-output both given");
  if (tag) o.tag_output = true;
  if (no_tag) o.tag_output = false;
  if (app.count("--ranks-to-console")) o.ranks_to_console = ranks_to_console;
  apply_mca(mca, o, no_abort);
  o.abort_on_failure = !no_abort;
  if (app.count("--timeout")) o.timeout_s = seconds_flag("--timeout", timeout);
  if (app.count("--rank-by")) o.rank_by = rank_by;
  if (app.count("--wdir")) {
    // As mpirun -wdir: the workers run in DIR. The launcher works from there too (after reading the
    // hostfile), so that PROGRAM and every other relative path mean what they mean to the workers.
    if (chdir(wdir.c_str()) != 0) throw ConfigError(fmt::format("--wdir {}: cannot enter it: {}", wdir, strerror(errno)));
    std::error_code ec;
    o.wdir = std::filesystem::current_path(ec).string();
  }
  if (app.count("--run-id")) o.run_id = run_id;
  if (app.count("--ps")) o.ps = ps_servers;
  if (app.count("--ray-port")) o.ray_port = ray_port;
  if (app.count("--ray-ports")) o.ray_ports = ray_ports;
  if (app.count("--ray-command")) o.ray_command = ray_command;
  if (app.count("--ps-mode")) o.ps_mode = ps_mode;

  auto env = launch::current_env();
  launch::MachineFacts machine = launch::this_machine(o.gpus_per_node.has_value());
  launch::Plan plan = launch::build_plan(o, env, machine);
  plan.token_file = token_file;
  launch::choose_local_rank_arg(plan);  // --local-rank-arg auto: asks the workers' Python for its torch
  auto note = [&](const std::string& line) { fmt::print(stderr, "{}: note: {}\n", command, line); };
  for (const auto& line : plan.notes) note(line);  // what the plan left out or chose on its own
  // Flags accepted from torchrun's and mpirun's command lines that cohort has no use for, or does
  // otherwise: one line each, so that nobody counts on them.
  if (run_as_root)
    note("--allow-run-as-root means nothing to cohort: it runs as root without it (mpirun refuses to)");
  if (o.oversubscribe && plan.mode != launch::Mode::kFanOut)
    note("--oversubscribe means nothing to a job without -H/--hostfile: cohort never caps a node's workers at its "
         "CPU cores (--bind-to auto binds none when the workers outnumber them)");
  if (app.count("--monitor-interval"))
    note(fmt::format("--monitor-interval {}: cohort's supervision is event-driven (a worker's exit is seen the moment "
                     "the kernel reports it), so there is no interval to set; ignored",
                     monitor_interval));
  if (o.use_env && !launch_line)
    note("--use-env: every worker gets LOCAL_RANK in its environment anyway; cohort passes --local_rank=N only with "
         "--append-local-rank");
  if (o.log_dir && o.redirects.value_or("0") == "0" && o.tee.value_or("0") == "0")
    note(fmt::format("--log-dir {} without --redirects or --tee: no output is written there (as with torchrun); "
                     "--tee 3 writes both streams to files and the console",
                     *o.log_dir));
  else if (!o.log_dir && !plan.logs.dir.empty())
    note(fmt::format("the ranks' log files go under {} (--log-dir chooses the folder)", plan.logs.dir));
  // The token file is checked (owner-only, not empty) before anything starts, --dry-run included.
  const std::string file_token = token_file.empty() ? std::string() : job_token(token_file);
  if (o.dry_run) {
    std::string store = plan.mode == launch::Mode::kPerNode || plan.master_port != 0
                            ? fmt::format("{}:{}", plan.master_addr, plan.master_port)
                            : fmt::format("{}:<port chosen by the OS at start>", plan.master_addr);
    fmt::print("{}", launch::describe_plan(plan, env, store, machine.gpus));
    return 0;
  }
  launch::JobContext ctx;
  ctx.env = env;
  // The job token keys the store's and the ranks' connections (docs/security.md). A local or fan-out job
  // makes one (it reaches the agents on ssh's or srun's stdin); the launchers of a per-node job start apart
  // and share only what they are given: --token-file or COHORT_JOB_TOKEN.
  // Under srun they have the cluster's munge realm in common: node 0's launcher makes the token and the
  // others decode it from munge credentials (launch/munge.h) when the job starts.
  auto token = env.find("COHORT_JOB_TOKEN");
  if (!token_file.empty()) ctx.token = file_token;
  else if (token != env.end() && !token->second.empty()) ctx.token = token->second;
  else if (plan.mode != launch::Mode::kPerNode) ctx.token = launch::random_token(32);
  else ctx.munge = slurm_munge(env);
  auto required = env.find(kRequireAuth.name());
  ctx.require_auth =
      require_auth || kRequireAuth.from(required == env.end() ? std::nullopt : std::optional(required->second));
  if (ctx.token.empty() && !ctx.munge.enabled) {
    if (ctx.require_auth)
      throw ConfigError(fmt::format("this per-node job has no job token, and {} refuses to start it open: "
                                    "give every node's launcher the same --token-file PATH (mode 0600) or "
                                    "COHORT_JOB_TOKEN",
                                    require_auth ? "--require-auth" : "COHORT_REQUIRE_AUTH=1"));
  }
  if (o.gpus_per_node) ctx.gpus = machine.gpus;
  ctx.plan = std::move(plan);
  ctx.self_exe = self_exe();
  return launch::run_job(std::move(ctx));
}

int run_agent(std::vector<std::string> args) {
  if (args.size() > 1) {
    fmt::print(args[1] == "-h" || args[1] == "--help" ? stdout : stderr,
               "usage: cohort agent\nOne node of a `cohort run -H/--hostfile` job, started by the head launcher over "
               "--ssh-command; reads its plan from stdin. Not meant to be run by hand.\n");
    return args[1] == "-h" || args[1] == "--help" ? 0 : 2;
  }
  return launch::run_agent_from_stdin();
}

int run_run(std::vector<std::string> args) { return run_launcher(std::move(args), LaunchLine::kRun); }
int run_launch(std::vector<std::string> args) { return run_launcher(std::move(args), LaunchLine::kTorchLaunch); }

Registration reg_run("run", "start, watch and stop a job (torchrun / mpirun replacement)", run_run);
Registration reg_launch("launch",
                        "python -m torch.distributed.launch's line: cohort run passing --local_rank=N unless --use-env",
                        run_launch);
Registration reg_agent("agent", "one node of an ssh fan-out (started by `cohort run -H`)", run_agent);

}  // namespace

int run_launcher_line(std::vector<std::string> args, LaunchLine line) { return run_launcher(std::move(args), line); }

}  // namespace cohort::tools
