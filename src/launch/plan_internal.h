#pragma once
// The launch plan, inside: what the files that make a plan (launch/plan.h) hand each other. One file
// per thing that varies between jobs:
//   plan.cc             build_plan: the flags every job shares, then one placement source, then what every
//                       mode shares (job id, observability, logs, time limit); the plan's accessors and JSON
//   plan_hosts.cc       placement by one launcher that starts every host: -H, --hostfile or the Slurm
//                       allocation, with mpirun's mapping and ranking (--map-by, --rank-by)
//   plan_per_node.cc    placement by one launcher per node: flags and scheduler environments, torchrun's
//                       multi-node line and elastic jobs, and the local job of one node
//   plan_ray.cc         Ray mode: the flags it refuses, its layout, each node's `ray start`
//   plan_ps.cc          parameter servers among the nodes
//   plan_program.cc     how a worker runs PROGRAM: its form, what it execs, its argv
//   plan_worker_env.cc  the workers' environment
//   plan_binding.cc     CPU binding of the local ranks
//   plan_describe.cc    the --dry-run text
//   plan_machine.cc     facts about this machine: its name and addresses, CPUs, GPUs, programs on PATH
// Nothing here is used outside launch/.

#include <optional>
#include <string>

#include "launch/parsers.h"
#include "launch/plan.h"

namespace cohort::launch {

// What mpirun's --map-by asks of the placement.
struct MapBy {
  std::optional<int> per_node;  // ppr:N:node: N processes on every host
  bool by_node = false;         // node: the processes dealt round robin over the hosts
};

// What the command line says of each node's processes, read by build_plan before a placement source
// places the nodes.
struct Shape {
  std::optional<int> nproc_flag;  // processes per node (slots per host): --nproc-per-node, -N, --map-by ppr:N:node
  std::string nproc_flag_name;    // the flag that gave it, as typed, for messages
  std::string nproc_how;          // how --nproc-per-node auto counted ("auto: 4 visible GPUs")
  MapBy map_by;
  bool rank_by_node = false;      // ranks dealt round robin over the hosts (--rank-by node, --map-by node)
  std::string rank_by_flag;       // the flag that asked for that, for messages
  std::optional<int> gpus_here;   // --gpus-per-node resolved on this machine (unset: not a GPU job, or unknown here)
};

// What a placement source found besides the nodes, for the steps after it.
struct PlacementFinds {
  std::optional<Sourced<std::string>> sched_job_id;      // the scheduler's job id (Slurm's, Kubeflow's, ...)
  std::optional<Sourced<int>> sched_ps_nodes;            // TF_CONFIG's parameter-server nodes
  std::optional<Sourced<std::string>> ray_head_address;  // TI-ONE's HEAD_ADDR
  std::optional<Sourced<int>> ray_head_port;             // TI-ONE's HEAD_PORT
};

// plan_hosts.cc. mpirun's --map-by and --rank-by into `shape` (--map-by core/numa change `bind_to`).
void read_mapping(Plan& p, const Options& o, Shape& shape, std::string& bind_to);
// The Slurm allocation whose nodes are the hosts (inside one, with no hosts and no per-node flags), after
// checking --launcher; std::nullopt otherwise, and for an allocation of this node alone.
std::optional<SlurmAllocation> fan_out_allocation(const Options& o, const EnvMap& env, const MachineFacts& machine);
// A fan-out: the nodes of -H, --hostfile or `slurm`, this launcher's node among them, and the store here.
void place_on_hosts(Plan& p, const Options& o, const Shape& shape, const std::optional<SlurmAllocation>& slurm,
                    const MachineFacts& machine, PlacementFinds& found);

// plan_per_node.cc: a per-node, elastic or local job, from the flags and the scheduler's environment.
void place_per_node(Plan& p, const Options& o, const EnvMap& env, const Shape& flags, const MachineFacts& machine,
                    PlacementFinds& found);

// plan_ray.cc
void check_ray_flags(const Options& o);
void set_ray_mode(Plan& p, const Options& o, const std::optional<Sourced<std::string>>& head_address,
                  const std::optional<Sourced<int>>& head_port);

// plan_ps.cc
void place_parameter_servers(Plan& p, const Options& o, const EnvMap& env,
                             const std::optional<Sourced<int>>& tf_ps_nodes);

// plan_program.cc
void set_program_form(Plan& p, const Options& o, const EnvMap& env);

// plan_worker_env.cc: -x, horovodrun's forwarded environment and OMP_NUM_THREADS, for every worker.
void set_worker_environment(Plan& p, const Options& o, const EnvMap& env);

// plan_machine.cc: whether `host` names this machine by a name (not by an address: is_this_machine).
bool is_local_host(const std::string& host, const std::string& hostname);

}  // namespace cohort::launch
