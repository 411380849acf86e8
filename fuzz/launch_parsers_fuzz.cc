// libFuzzer target: the launcher's parsers of user input (src/launch/parsers.cc): hostfiles, -H lists,
// Slurm node lists and counts, TF_CONFIG, and the scheduler environments (Slurm, torchrun/Kubeflow,
// Open MPI, TI-ONE, TF_CONFIG) read from KEY=VALUE lines; and what `ray status` prints, as a Ray job
// reads it (src/launch/ray.cc). The first input byte picks the parser.
// Invariants beyond "no crash, no sanitizer report":
//  - bad input is a ConfigError with a message, never another exception;
//  - what parses is sane: hosts named and with >= 1 slot, counts >= 1, node ranks inside the node
//    count, no more than a bounded number of hosts from a bounded input.
#include <cstdint>
#include <string>

#include "cohort/error.h"
#include "launch/parsers.h"
#include "launch/ray.h"

using namespace cohort;
using namespace cohort::launch;

namespace {

void check(bool ok) {
  if (!ok) __builtin_trap();
}

// Every host a list of n bytes can name without ranges is shorter than it; ranges may expand, but
// the parser must bound them (a list that expands past this is a bug).
constexpr size_t kMaxHosts = 1'000'000;

void check_hosts(const std::vector<HostSlots>& hosts) {
  check(hosts.size() <= kMaxHosts);
  for (const auto& h : hosts) check(!h.host.empty() && h.slots >= 1 && h.max_slots >= 0);
}

EnvMap env_from_lines(const std::string& text) {
  EnvMap env;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (auto eq = line.find('='); eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
    start = end + 1;
  }
  return env;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 8) {
      case 0: check_hosts(parse_hostfile(text, "fuzz-hostfile")); break;
      case 1: check_hosts(parse_host_list(text)); break;
      case 2: {
        auto names = expand_slurm_nodelist(text);
        check(names.size() <= kMaxHosts);
        for (const auto& n : names) check(!n.empty());
        break;
      }
      case 3: {
        auto counts = expand_slurm_counts(text, "fuzz");
        check(counts.size() <= kMaxHosts);
        for (int c : counts) check(c >= 0);
        break;
      }
      case 4: {
        auto tf = parse_tf_config(text);
        check(tf.node_rank >= 0 && static_cast<size_t>(tf.node_rank) < tf.nodes.size());
        break;
      }
      case 5: {
        auto info = read_scheduler_env(env_from_lines(text));
        if (info.nnodes) check(info.nnodes->value >= 1 && !info.nnodes->source.empty());
        if (info.nnodes && info.node_rank) check(info.node_rank->value >= 0 && info.node_rank->value < info.nnodes->value);
        if (info.nproc_per_node) check(info.nproc_per_node->value >= 1);
        if (info.master_port) check(info.master_port->value >= 1 && info.master_port->value <= 65535);
        break;
      }
      case 6: {
        auto table = parse_rank_table(text, "fuzz-rank-table");
        size_t ranks = 0;
        check(!table.servers.empty());
        for (const auto& server : table.servers) {
          check(!server.server_id.empty() && !server.devices.empty());
          for (const auto& d : server.devices) check(d.rank_id >= 0 && d.rank_id < table.rank_size && d.device_id >= 0);
          ranks += server.devices.size();
        }
        check(ranks == static_cast<size_t>(table.rank_size));
        break;
      }
      case 7: {
        auto status = parse_ray_status(text);
        check(status.nodes >= 0);
        for (int rank : status.ranks) check(rank >= 0);
        break;
      }
    }
  } catch (const ConfigError& e) {
    check(e.what()[0] != '\0');
  }
  return 0;
}
