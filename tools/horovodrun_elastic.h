#pragma once
// horovodrun's elastic driver (`horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh ...`),
// built on cohort's elastic jobs: the driver runs the discovery script every second and keeps one
// per-node agent (`cohort run --nnodes 1:MAX` with Horovod's variables) running on each listed host:
// a host that appears gets an agent, which joins at the job's next generation; a host that vanishes
// has its agent stopped (SIGTERM), and the others go on at the next generation. docs/horovod.md,
// "Elastic: horovodrun's driver", says what it does and what differs from Horovod's driver.
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cohort::tools {

struct ElasticDriverOptions {
  int min_np = 1;                                    // --min-np (default -np)
  int max_np = 1;                                    // --max-np (default: no cap, as Horovod; here -np x 1024)
  std::string discovery_script;                      // --host-discovery-script, run with /bin/sh -c
  std::vector<std::pair<std::string, int>> hosts;    // -H host:slots,... when there is no script
  int slots_per_host = 1;                            // --slots-per-host: slots of a line without ":N"
  double elastic_timeout_s = 600;                    // --elastic-timeout (Horovod's default, 600 s)
  std::optional<int> reset_limit;                    // --reset-limit (default: none)
  std::optional<std::string> start_timeout;          // --start-timeout: the agents' --join-timeout
  std::vector<std::string> ssh;                      // the ssh line that starts other hosts' agents
  std::vector<std::string> agent_flags;              // cohort run flags every agent gets (-mca, --timeline, ...)
  std::vector<std::string> command;                  // the training command
};

// Runs the elastic job to its end; returns the exit code (0: the training finished on the hosts left).
// Throws ConfigError for a bad line or a discovery script that fails on its first run.
int run_elastic_driver(const ElasticDriverOptions& options);

// The hosts a discovery script printed: "host:slots" lines, or "host" (slots_per_host); blank lines
// are skipped, a host listed twice keeps its first line. Throws ConfigError naming the bad line.
std::vector<std::pair<std::string, int>> parse_discovered_hosts(const std::string& text, int slots_per_host);

}  // namespace cohort::tools
