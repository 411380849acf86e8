// `cohort doctor`: pre-flight checks of the hosts of a planned job (docs/doctor.md).
// Also the remote helpers it runs over ssh: --serve-probe and --probe-connect.
#include <cstdio>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "cohort/error.h"
#include "command.h"
#include "common/env.h"
#include "common/socket.h"
#include "launch/doctor_checks.h"
#include "launch/doctor_probe.h"
#include "launch/plan.h"

namespace cohort::tools {
namespace {

int run_doctor_command(std::vector<std::string> args) {
  CLI::App app{"cohort doctor: check the hosts of a job before running it (ssh, versions, ports, "
               "somaxconn, open-file limits, clock skew, TCP links both ways, a tiny allreduce)",
               "cohort doctor"};
  doctor::DoctorOptions o;
  std::string hosts_spec, hostfile, probe_connect, serve_bind = "0.0.0.0", probe_bytes_text = "8M";
  std::vector<int> check_ports;
  bool serve = false, no_allreduce = false;
  double serve_seconds = 600;
  app.add_option("-H,--host", hosts_spec, "hosts as host:N,host:N (N = processes on that host; default: this machine, "
                 "checked without ssh, as is any host that names this machine)");
  app.add_option("--hostfile", hostfile, "Open MPI / DeepSpeed hostfile ('host slots=N')");
  app.add_option("--ssh-command", o.ssh_command, "ssh command line used to reach the hosts")->capture_default_str();
  app.add_option("--nproc-per-node", o.nproc_per_node, "processes per host (default: the host's slots)");
  app.add_option("--master-port", o.master_port, "the store's port on the first host")->capture_default_str();
  app.add_option("--remote-cohort", o.remote_cohort, "path of cohort on the hosts (default: this binary's path)");
  app.add_option("--timeout", o.timeout_s, "seconds allowed for each ssh step")->capture_default_str();
  app.add_option("--probe-bytes", probe_bytes_text, "bytes sent per link for the bandwidth figure (e.g. 8M)")
      ->capture_default_str();
  app.add_option("--pings", o.pings, "round trips per link for the RTT figure")->capture_default_str();
  app.add_option("--max-clock-skew-ms", o.max_clock_skew_ms, "clock difference that gives a warning")
      ->capture_default_str();
  app.add_flag("--no-allreduce", no_allreduce, "skip the tiny allreduce through `cohort run`");
  // Remote helpers (what the doctor runs on each host over ssh).
  app.add_flag("--serve-probe", serve, "(remote helper) print this host's facts as JSON and serve link probes until stdin closes");
  app.add_option("--serve-seconds", serve_seconds, "(remote helper) longest time --serve-probe stays up");
  app.add_option("--bind", serve_bind, "(remote helper) address --serve-probe listens on");
  app.add_option("--check-ports", check_ports, "(remote helper) ports --serve-probe checks are free");
  app.add_option("--probe-connect", probe_connect, "(remote helper) measure the link to a --serve-probe at host:port");

  if (!parse_command_line(app, args)) return 0;
  uint64_t probe_bytes = env::parse_bytes("--probe-bytes", probe_bytes_text);

  if (serve) {
    doctor::serve_probe(check_ports, serve_bind,
                        Deadline::after(std::chrono::milliseconds(static_cast<int64_t>(serve_seconds * 1000))));
    return 0;
  }
  if (!probe_connect.empty()) {
    auto [host, port] = net::split_host_port(probe_connect);
    auto r = doctor::probe_link(host, port, probe_bytes, o.pings,
                                Deadline::after(std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000))));
    fmt::print("{}\n", r.to_json().dump());
    return r.ok ? 0 : 1;
  }
  if (!hosts_spec.empty() && !hostfile.empty()) throw ConfigError("give -H or --hostfile, not both");
  if (!hosts_spec.empty()) o.hosts = doctor::parse_host_list(hosts_spec);
  else if (!hostfile.empty()) o.hosts = doctor::parse_hostfile(hostfile);
  else o.hosts = {{"localhost", 1}};
  // This machine is checked without ssh, as `cohort run` starts its workers without ssh.
  const launch::MachineFacts machine = launch::this_machine();
  for (auto& h : o.hosts) h.local = launch::is_this_machine(h.name, machine);
  o.probe_bytes = probe_bytes;
  o.allreduce = !no_allreduce;
  return doctor::run_doctor(o);
}

Registration reg_doctor("doctor", "pre-flight checks of hosts, ports, limits, links and versions", run_doctor_command);

}  // namespace
}  // namespace cohort::tools
