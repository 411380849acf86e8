// Parameter-server mode (docs/parameter-server.md): where the servers run among the nodes the placement
// gave (--ps N, or TF_CONFIG's ps entries), and the consistency mode they keep.

#include <fmt/core.h>

#include "cohort/error.h"
#include "launch/plan_internal.h"

namespace cohort::launch {

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

}  // namespace cohort::launch
