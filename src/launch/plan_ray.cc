// Ray mode (--ray, docs/ray.md): the flags a Ray job refuses, its layout (one Ray node on each node of
// the job, the driver beside node 0's) and each node's `ray start` line.

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <tuple>

#include "cohort/error.h"
#include "launch/plan_internal.h"
#include "launch/ray.h"

namespace cohort::launch {
namespace {

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

}  // namespace

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

}  // namespace cohort::launch
