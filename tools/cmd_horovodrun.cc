// `cohort horovodrun [options] COMMAND [ARGS...]` (also the tool run under the name `horovodrun`):
// Horovod's launcher line, mapped onto `cohort run`'s flags and run by it, with Horovod's variables
// (HOROVOD_RANK, ...) in every worker's environment as `horovodrun --gloo` sets them. docs/horovod.md
// has the table of flags. Horovod's elastic line (--min-np, --max-np, --host-discovery-script) runs the
// elastic driver of tools/horovodrun_elastic.h instead: one `cohort run --nnodes 1:MAX` agent per listed host.
#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "cohort/error.h"
#include "command.h"
#include "common/env.h"
#include "common/strings.h"
#include "horovodrun_elastic.h"

namespace cohort::tools {
namespace {

// Read by the Python package `horovod` (integrations/python/wheel/cohort/horovod_shim/horovod/__init__.py),
// declared here so that `cohort env` lists it with the launcher's other settings.
const env::StringSetting kCohortHorovod("COHORT_HOROVOD", "",
                                        "import horovod: 1 = cohort's horovod.torch even where a real Horovod is "
                                        "installed, 0 = never cohort's; unset = cohort's only where no other "
                                        "horovod package is on sys.path");

// horovodrun's flags that take a value, each under every spelling horovodrun accepts (its argparse
// names), mapped to one canonical name.
const std::map<std::string, std::string>& valued_flags() {
  static const std::map<std::string, std::string> m = {
      {"-np", "-np"},
      {"--num-proc", "-np"},
      {"-H", "-H"},
      {"--hosts", "-H"},
      {"-hostfile", "--hostfile"},
      {"--hostfile", "--hostfile"},
      {"-p", "-p"},
      {"--ssh-port", "-p"},
      {"-i", "-i"},
      {"--ssh-identity-file", "-i"},
      {"--network-interface", "--network-interface"},
      {"--network-interfaces", "--network-interface"},
      {"--start-timeout", "--start-timeout"},
      {"--output-filename", "--output-filename"},
      {"--timeline-filename", "--timeline-filename"},
      // cohort's own: the ssh line that -p and -i are added to (default ssh -o BatchMode=yes).
      {"--ssh-command", "--ssh-command"},
      // Horovod's elastic driver (tools/horovodrun_elastic.h).
      {"--min-np", "--min-np"},
      {"--min-num-proc", "--min-np"},
      {"--max-np", "--max-np"},
      {"--max-num-proc", "--max-np"},
      {"--host-discovery-script", "--host-discovery-script"},
      {"--slots-per-host", "--slots-per-host"},
      {"--elastic-timeout", "--elastic-timeout"},
      {"--reset-limit", "--reset-limit"},
  };
  return m;
}

const std::vector<std::string>& switch_flags() {
  static const std::vector<std::string> v = {"--gloo", "--mpi", "--verbose", "--dry-run"};
  return v;
}

const char* kHelp =
    "usage: horovodrun -np N [-H host:slots,... | --hostfile FILE] [options] COMMAND [ARGS...]\n"
    "       (also: cohort horovodrun ...)\n"
    "Horovod's launcher line, run by `cohort run`: each worker gets HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK,\n"
    "HOROVOD_LOCAL_SIZE, HOROVOD_CROSS_RANK, HOROVOD_CROSS_SIZE and HOROVOD_HOSTNAME as under horovodrun --gloo,\n"
    "besides cohort's own variables. docs/horovod.md is the reference.\n\n"
    "options:\n"
    "  -np, --num-proc N               number of processes (required)\n"
    "  -H, --hosts host:slots,...      hosts and their slots (default: localhost:N); others are started over ssh\n"
    "  --hostfile FILE                 'host slots=N' lines\n"
    "  -p, --ssh-port PORT             ssh port of the other hosts\n"
    "  -i, --ssh-identity-file FILE    ssh identity file\n"
    "  --network-interface IFACES      interfaces (eth0 or eth0,ib0) of the ranks' TCP traffic and of the job's store\n"
    "  --start-timeout SECONDS         how long the hosts may take to start and meet (cohort run --join-timeout)\n"
    "  --gloo, --mpi                   accepted: cohort's own transport runs either way\n"
    "  --verbose                       the workers and the launcher log at level info (COHORT_LOG_LEVEL=info)\n"
    "  --output-filename DIR           each rank's output also goes to DIR/rank.N/stdout and stderr\n"
    "  --timeline-filename FILE        cohort's timeline of every rank's operations (cohort run --timeline)\n"
    "  --ssh-command CMD               cohort's: the ssh line that starts the other hosts' agents (-p and -i are added)\n"
    "  --dry-run                       cohort's: print the plan (hosts, ranks, every worker's environment), start nothing\n"
    "  -h, --help                      this help\n"
    "elastic (Horovod's driver: one elastic cohort run agent per listed host, docs/horovod.md):\n"
    "  --min-np, --max-np N            bounds on the number of processes (default: -np, and no upper bound)\n"
    "  --host-discovery-script SCRIPT  prints 'host:slots' lines; run every second: hosts that appear join at the\n"
    "                                  job's next generation, hosts that vanish are stopped\n"
    "  --slots-per-host N              slots of a script's line without ':N' (default 1)\n"
    "  --elastic-timeout SECONDS       how long to wait for --min-np slots, or for a failing script (default 600)\n"
    "  --reset-limit N                 how many generations may end before the job fails (cohort run --max-restarts)\n";

// What was given on horovodrun's line, by canonical flag name.
struct HorovodLine {
  std::map<std::string, std::string> values;
  std::map<std::string, std::string> spelled;  // canonical name -> the spelling given, for messages
  std::vector<std::string> switches;
  std::vector<std::string> command;
};

HorovodLine parse_line(const std::vector<std::string>& args) {
  HorovodLine line;
  size_t i = 1;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.size() < 2 || a[0] != '-') break;  // the command: everything from here on is its own
    std::string name = a, value;
    bool has_value = false;
    if (auto eq = a.find('='); eq != std::string::npos && a.rfind("--", 0) == 0) {
      name = a.substr(0, eq);
      value = a.substr(eq + 1);
      has_value = true;
    }
    if (auto flag = valued_flags().find(name); flag != valued_flags().end()) {
      if (!has_value) {
        if (i + 1 >= args.size()) throw ConfigError(fmt::format("{}: expected a value after it", name));
        value = args[++i];
      }
      const std::string& canonical = flag->second;
      if (line.values.count(canonical))
        throw ConfigError(fmt::format("{} given twice ({} {}, {} {}); give it once", name, line.spelled[canonical],
                                      line.values[canonical], name, value));
      line.values[canonical] = value;
      line.spelled[canonical] = name;
      continue;
    }
    if (std::find(switch_flags().begin(), switch_flags().end(), a) != switch_flags().end()) {
      line.switches.push_back(a);
      continue;
    }
    std::vector<std::string> known;
    for (const auto& [spelling, canonical] : valued_flags()) known.push_back(spelling);
    known.insert(known.end(), switch_flags().begin(), switch_flags().end());
    std::string guess = closest_match(name, known);
    throw ConfigError(fmt::format("unknown flag {}{}: cohort serves horovodrun's -np, -H, --hostfile, -p, -i, "
                                  "--network-interface, --start-timeout, --gloo, --mpi, --verbose, --output-filename, "
                                  "--timeline-filename and the elastic --min-np, --max-np, --host-discovery-script, --slots-per-host, "
                                  "--elastic-timeout and --reset-limit, and cohort's --ssh-command and --dry-run (docs/horovod.md)",
                                  name, guess.empty() ? "" : fmt::format(" (did you mean {}?)", guess)));
  }
  line.command.assign(args.begin() + static_cast<long>(i), args.end());
  return line;
}

// The flags that are the same for a static job and for each agent of an elastic one.
std::vector<std::string> common_run_flags(const HorovodLine& line) {
  auto given = [&](const char* flag) { return line.values.count(flag) > 0; };
  auto value = [&](const char* flag) { return line.values.at(flag); };
  std::vector<std::string> out;
  if (given("--network-interface")) {
    // Horovod's --network-interface chooses the interfaces of its own traffic: cohort's counterparts are
    // the ranks' TCP interfaces and the address of the job's store (mpirun's two -mca settings).
    const std::string& ifaces = value("--network-interface");
    out.insert(out.end(), {"-mca", "btl_tcp_if_include", ifaces, "-mca", "oob_tcp_if_include", ifaces});
  }
  if (given("--output-filename")) out.insert(out.end(), {"--output-filename", value("--output-filename")});
  if (given("--timeline-filename")) out.insert(out.end(), {"--timeline", value("--timeline-filename")});
  if (std::find(line.switches.begin(), line.switches.end(), "--verbose") != line.switches.end())
    out.insert(out.end(), {"-x", "COHORT_LOG_LEVEL=info"});
  return out;
}

// The ssh line that starts the other hosts' agents, with -p and -i added ("" when none was given).
std::string ssh_line(const HorovodLine& line) {
  auto given = [&](const char* flag) { return line.values.count(flag) > 0; };
  auto value = [&](const char* flag) { return line.values.at(flag); };
  if (!given("-p") && !given("-i")) return given("--ssh-command") ? value("--ssh-command") : "";
  // cohort run --ssh-command splits the line on spaces, so an identity file whose path has one cannot be
  // named there.
  std::string ssh = given("--ssh-command") ? value("--ssh-command") : "ssh -o BatchMode=yes";
  if (given("-p")) {
    const std::string& port = value("-p");
    if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
        std::stol(port) < 1 || std::stol(port) > 65535)
      throw ConfigError(fmt::format("{} {}: expected a port between 1 and 65535", line.spelled.at("-p"), port));
    ssh += " -p " + port;
  }
  if (given("-i")) {
    const std::string& identity = value("-i");
    if (identity.empty() || identity.find_first_of(" \t") != std::string::npos)
      throw ConfigError(fmt::format("{} '{}': expected a file path without spaces", line.spelled.at("-i"), identity));
    ssh += " -i " + identity;
  }
  return ssh;
}

// The first of Horovod's elastic flags on the line, as it was spelled ("" when there is none).
std::string first_elastic_flag(const HorovodLine& line) {
  for (const char* elastic : {"--min-np", "--max-np", "--host-discovery-script", "--slots-per-host",
                              "--elastic-timeout", "--reset-limit"})
    if (line.values.count(elastic)) return line.spelled.at(elastic);
  return "";
}

bool is_elastic(const HorovodLine& line) { return !first_elastic_flag(line).empty(); }

// `cohort run`'s arguments for a horovodrun line ("horovodrun" first, as a command's argv[0]).
std::vector<std::string> run_arguments(const HorovodLine& line) {
  auto given = [&](const char* flag) { return line.values.count(flag) > 0; };
  auto value = [&](const char* flag) { return line.values.at(flag); };
  if (!given("-np"))
    throw ConfigError("-np N is required (the number of processes), as with horovodrun");
  if (line.command.empty()) throw ConfigError("no command to run: horovodrun -np N ... python3 train.py");
  if (given("-H") && given("--hostfile")) throw ConfigError("-H and --hostfile both given; use one");

  std::vector<std::string> out = {"horovodrun", "-n", value("-np")};
  if (given("-H")) out.insert(out.end(), {"-H", value("-H")});
  if (given("--hostfile")) out.insert(out.end(), {"--hostfile", value("--hostfile")});
  if (std::string ssh = ssh_line(line); !ssh.empty()) out.insert(out.end(), {"--ssh-command", ssh});
  if (given("--start-timeout")) out.insert(out.end(), {"--join-timeout", value("--start-timeout")});
  auto common = common_run_flags(line);
  out.insert(out.end(), common.begin(), common.end());
  if (std::find(line.switches.begin(), line.switches.end(), "--dry-run") != line.switches.end())
    out.push_back("--dry-run");
  out.push_back("--");
  out.insert(out.end(), line.command.begin(), line.command.end());
  return out;
}

int positive_number(const HorovodLine& line, const char* flag) {
  const std::string& v = line.values.at(flag);
  if (v.empty() || v.size() > 9 || v.find_first_not_of("0123456789") != std::string::npos || std::stoi(v) < 1)
    throw ConfigError(fmt::format("{} {}: expected a whole number of at least 1", line.spelled.at(flag), v));
  return std::stoi(v);
}

// Horovod's elastic line (--min-np, --max-np, --host-discovery-script, ...) as the elastic driver's
// settings (tools/horovodrun_elastic.h).
ElasticDriverOptions elastic_options(const HorovodLine& line) {
  auto given = [&](const char* flag) { return line.values.count(flag) > 0; };
  auto value = [&](const char* flag) { return line.values.at(flag); };
  ElasticDriverOptions o;
  if (line.command.empty()) throw ConfigError("no command to run: horovodrun -np N ... python3 train.py");
  if (given("--hostfile"))
    throw ConfigError("--hostfile with Horovod's elastic flags: list the hosts with --host-discovery-script (or -H)");
  if (given("-H") && given("--host-discovery-script"))
    throw ConfigError("-H and --host-discovery-script both given: the script lists the hosts of an elastic job; use one");
  if (!given("-H") && !given("--host-discovery-script"))
    throw ConfigError(fmt::format("{}: an elastic job needs --host-discovery-script SCRIPT (or a fixed -H list), as "
                                  "with horovodrun",
                                  first_elastic_flag(line)));
  const int np = given("-np") ? positive_number(line, "-np") : 0;
  o.min_np = given("--min-np") ? positive_number(line, "--min-np") : np;
  if (o.min_np == 0) throw ConfigError("-np N or --min-np N is required (the number of processes), as with horovodrun");
  // Horovod's max-np has no default bound; cohort's elastic jobs need one (the nodes' MAX): a generous one.
  o.max_np = given("--max-np") ? positive_number(line, "--max-np") : std::max(np, o.min_np) * 1024;
  if (o.max_np < o.min_np)
    throw ConfigError(fmt::format("--max-np {} is below --min-np {}", o.max_np, o.min_np));
  if (np && (np < o.min_np || np > o.max_np))
    throw ConfigError(fmt::format("-np {} is outside --min-np {} .. --max-np {}", np, o.min_np, o.max_np));
  if (given("--slots-per-host")) o.slots_per_host = positive_number(line, "--slots-per-host");
  if (given("--elastic-timeout")) o.elastic_timeout_s = positive_number(line, "--elastic-timeout");
  if (given("--reset-limit")) {
    const std::string& v = value("--reset-limit");
    if (v.empty() || v.size() > 9 || v.find_first_not_of("0123456789") != std::string::npos)
      throw ConfigError(fmt::format("{} {}: expected a whole number", line.spelled.at("--reset-limit"), v));
    o.reset_limit = std::stoi(v);
  }
  if (given("--start-timeout")) o.start_timeout = std::to_string(positive_number(line, "--start-timeout"));
  if (given("--host-discovery-script")) o.discovery_script = value("--host-discovery-script");
  if (given("-H")) {
    std::string listed;
    for (const auto& h : str::split(value("-H"), ',')) listed += h + "\n";
    o.hosts = parse_discovered_hosts(listed, o.slots_per_host);
  }
  std::string ssh = ssh_line(line);
  o.ssh = str::split(ssh.empty() ? "ssh -o BatchMode=yes" : ssh, ' ');
  o.agent_flags = common_run_flags(line);
  // The store's address of an elastic job is the first host's (the driver names it): an agent has no
  // use for oob_tcp_if_include, and would print a note saying so.
  for (size_t i = 0; i + 2 < o.agent_flags.size(); ++i)
    if (o.agent_flags[i] == "-mca" && o.agent_flags[i + 1] == "oob_tcp_if_include")
      o.agent_flags.erase(o.agent_flags.begin() + static_cast<long>(i), o.agent_flags.begin() + static_cast<long>(i) + 3);
  o.command = line.command;
  if (std::find(line.switches.begin(), line.switches.end(), "--dry-run") != line.switches.end())
    throw ConfigError("--dry-run with Horovod's elastic flags: an elastic job's hosts are known only once it runs");
  return o;
}

int run_horovodrun(std::vector<std::string> args) {
  for (size_t i = 1; i < args.size() && args[i].size() > 1 && args[i][0] == '-'; ++i)
    if (args[i] == "-h" || args[i] == "--help") {
      fmt::print("{}", kHelp);
      return 0;
    }
  HorovodLine line = parse_line(args);
  for (const auto& s : line.switches)
    if (s == "--gloo" || s == "--mpi")
      fmt::print(stderr,
                 "cohort horovodrun: note: {}: accepted; the job runs on cohort's own transport (shared memory on a "
                 "host, TCP between hosts) either way\n",
                 s);
  if (is_elastic(line)) return run_elastic_driver(elastic_options(line));
  return run_launcher_line(run_arguments(line), LaunchLine::kHorovodrun);
}

Registration reg_horovodrun("horovodrun",
                            "horovodrun's line (-np, -H, --hostfile, ...): cohort run with Horovod's variables",
                            run_horovodrun);

}  // namespace
}  // namespace cohort::tools
