// `cohort doctor`: the orchestrating half. For each host an ssh session runs
// `cohort doctor --serve-probe` (facts + a probe listener, alive while the session is); for each
// ordered pair (a, b) an ssh session on a runs `cohort doctor --probe-connect b:port` (TCP
// reachability on the address the job uses, RTT, bandwidth, clock offset); then a tiny allreduce
// through `cohort run`. Everything is bounded by deadlines and every session is ended before return.
#include "launch/doctor_checks.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cohort/error.h"
#include "cohort/version.h"
#include "common/build_info.h"
#include "common/env.h"
#include "common/strings.h"
#include "launch/doctor_child.h"
#include "launch/doctor_probe.h"
#include "launch/parsers.h"

namespace cohort::doctor {
namespace {

using namespace std::chrono_literals;

Deadline after_seconds(double s) {
  return Deadline::after(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(s)));
}

std::string self_path() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "cohort";
  return std::string(buf, static_cast<size_t>(n));
}

// Single-quotes a word for the remote shell.
std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

std::vector<std::string> ssh_argv(const DoctorOptions& o, const std::string& host, const std::vector<std::string>& cmd) {
  std::vector<std::string> argv;
  for (auto& w : str::split(o.ssh_command, ' ')) argv.push_back(w);
  argv.push_back(host);
  std::vector<std::string> quoted;
  for (auto& c : cmd) quoted.push_back(shell_quote(c));
  argv.push_back(str::join(quoted, " "));
  return argv;
}

// The command line that runs `cmd` on `host`: over ssh, or directly when the host is this machine.
std::vector<std::string> host_argv(const DoctorOptions& o, const DoctorHost& host, const std::vector<std::string>& cmd) {
  if (host.local) return cmd;
  return ssh_argv(o, host.name, cmd);
}

enum class Status { kOk, kWarn, kFail, kSkip };

const char* status_word(Status s) {
  switch (s) {
    case Status::kOk: return "ok";
    case Status::kWarn: return "WARN";
    case Status::kFail: return "FAIL";
    case Status::kSkip: return "skip";
  }
  return "?";
}

struct HostReport {
  DoctorHost host;
  std::unique_ptr<Child> session;  // the --serve-probe ssh session, kept open during pair tests
  std::optional<HostFacts> facts;
  std::string ssh_error;
  std::optional<double> clock_offset_ms;  // vs the first host, from the pair probe
};

struct Finding {
  Status status;
  std::string where;  // host or link
  std::string what;
  std::string fix;    // a command, or ""
};

std::string human_bytes_per_s(double MBps) {
  if (MBps >= 1000) return fmt::format("{:.2f} GB/s", MBps / 1000);
  return fmt::format("{:.1f} MB/s", MBps);
}

// Starts `cohort doctor --serve-probe` on a host (over ssh, or here) and reads its facts line.
void start_session(const DoctorOptions& o, const std::string& cohort, HostReport& h, bool is_head) {
  // This machine runs this very binary; other hosts the path they were told.
  std::vector<std::string> cmd = {h.host.local ? self_path() : cohort, "doctor", "--serve-probe",
                                  "--serve-seconds", fmt::format("{}", std::max(60.0, o.timeout_s * 20))};
  if (is_head) {
    cmd.push_back("--check-ports");
    cmd.push_back(std::to_string(o.master_port));
  }
  try {
    h.session = std::make_unique<Child>(host_argv(o, h.host, cmd));
  } catch (const std::exception& e) {
    h.ssh_error = e.what();
    return;
  }
  auto deadline = after_seconds(o.timeout_s);
  while (auto line = h.session->read_line(deadline)) {
    try {
      h.facts = HostFacts::from_json(nlohmann::json::parse(*line));
      return;
    } catch (const std::exception&) {
      continue;  // a login banner or shell noise before our line
    }
  }
  // No facts: report why, from what the session said.
  bool expired = deadline.expired();
  h.session->close_stdin();
  int code = h.session->wait(after_seconds(2));
  std::string why = h.session->last_err_line();
  const char* via = h.host.local ? "the local probe" : "ssh";
  if (expired && h.session->timed_out())
    h.ssh_error = fmt::format("no answer {}within {:.0f} s{}", h.host.local ? "" : "over ssh ", o.timeout_s,
                              why.empty() ? "" : " (" + why + ")");
  else
    h.ssh_error = fmt::format("{} exited with {}{}", via, code, why.empty() ? "" : ": " + why);
  h.session.reset();
}

void end_session(HostReport& h) {
  if (!h.session) return;
  h.session->close_stdin();
  h.session->wait(after_seconds(3));
  h.session.reset();
}

}  // namespace

Requirements requirements_for(int world, int nodes) {
  Requirements r;
  // The store on the head accepts one connection per rank and per agent, possibly all at once.
  r.listen_backlog = world + nodes;
  // A worker holds up to two sockets per peer (data + control) plus the store connection, its log
  // pipes and what the C++ runtime and libraries open; 64 covers the latter with room.
  r.open_files = static_cast<uint64_t>(2 * world + 64);
  return r;
}

namespace {
std::vector<DoctorHost> doctor_hosts(const std::vector<launch::HostSlots>& listed) {
  std::vector<DoctorHost> hosts;
  for (const auto& h : listed) hosts.push_back({h.host, h.slots});
  return hosts;
}
}  // namespace

std::vector<DoctorHost> parse_host_list(const std::string& spec) {
  if (str::trim(spec).empty()) throw ConfigError("-H: no hosts given");
  return doctor_hosts(launch::parse_host_list(spec));
}

std::vector<DoctorHost> parse_hostfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("--hostfile {}: cannot read it: {}", path, std::strerror(errno)));
  std::stringstream text;
  text << in.rdbuf();
  return doctor_hosts(launch::parse_hostfile(text.str(), path));
}

// The GPU table and its findings, when any host has a GPU: GPUs per host equal everywhere, the same
// driver, NCCL present, and the tiny NCCL allreduce over each host's GPUs.
static void judge_gpus(const std::vector<HostReport>& reports, std::vector<Finding>& findings) {
  bool any = false;
  for (const auto& r : reports) any = any || (r.facts && r.facts->gpus > 0);
  if (!any) {
    std::string why = "no GPU on any host";
    if (!reports.empty() && reports[0].facts && !reports[0].facts->gpu_note.empty())
      why += " (" + reports[0].host.name + ": " + reports[0].facts->gpu_note + ")";
    fmt::print("gpus: {}\n\n", why);
    return;
  }
  fmt::print("{:<22} {:<5} {:<8} {:<8} {:<8} {}\n", "host", "gpus", "driver", "runtime", "nccl", "nccl allreduce (local GPUs)");
  std::map<int, std::vector<std::string>> by_count;
  std::map<std::string, std::vector<std::string>> by_driver;
  for (const auto& r : reports) {
    if (!r.facts) continue;
    const HostFacts& f = *r.facts;
    fmt::print("{:<22} {:<5} {:<8} {:<8} {:<8} {}\n", r.host.name, f.gpus, f.cuda_driver.empty() ? "-" : f.cuda_driver,
               f.cuda_runtime.empty() ? "-" : f.cuda_runtime, f.nccl_version.empty() ? "none" : f.nccl_version,
               f.nccl_allreduce);
    by_count[f.gpus].push_back(r.host.name);
    if (!f.cuda_driver.empty()) by_driver[f.cuda_driver].push_back(r.host.name);
    if (f.gpus > 0 && f.nccl_version.empty())
      findings.push_back({Status::kWarn, r.host.name, "GPUs but no NCCL (" + f.nccl_note + "); GPU buffers would be "
                                                      "staged through host memory",
                          "install NCCL (e.g. the nvidia-nccl wheel torch uses) or set COHORT_NCCL_LIBRARY"});
    if (str::starts_with(f.nccl_allreduce, "FAIL"))
      findings.push_back({Status::kFail, r.host.name, "NCCL allreduce over the local GPUs: " + f.nccl_allreduce.substr(6),
                          "run with NCCL_DEBUG=INFO to see where NCCL stops"});
  }
  fmt::print("\n");
  if (by_count.size() > 1) {
    std::vector<std::string> parts;
    for (const auto& [count, hosts] : by_count) parts.push_back(fmt::format("{} on {}", count, str::join(hosts, ", ")));
    findings.push_back({Status::kFail, "gpus", "GPUs per host differ: " + str::join(parts, "; ") +
                                                   " (--gpus-per-node auto would give the hosts different rank counts)",
                        fmt::format("pass --gpus-per-node {} (the smallest count) or fix the hosts", by_count.begin()->first)});
  }
  if (by_driver.size() > 1) {
    std::vector<std::string> parts;
    for (const auto& [driver, hosts] : by_driver) parts.push_back(fmt::format("{} on {}", driver, str::join(hosts, ", ")));
    findings.push_back({Status::kWarn, "gpus", "CUDA drivers differ: " + str::join(parts, "; "),
                        "install the same NVIDIA driver on every host"});
  }
}

int run_doctor(const DoctorOptions& o) {
  const std::string cohort = o.remote_cohort.empty() ? self_path() : o.remote_cohort;
  const int nodes = static_cast<int>(o.hosts.size());
  int world = 0;
  for (auto& h : o.hosts) world += o.nproc_per_node > 0 ? o.nproc_per_node : h.slots;
  const Requirements need = requirements_for(world, nodes);
  fmt::print("cohort doctor {}: {} host(s), world size {}, store on {}:{}\n\n", build::version_text(), nodes, world,
             o.hosts[0].name, o.master_port);
  std::fflush(stdout);

  // 1. One session per host (ssh, or a child process on this machine), in parallel: facts + probe server.
  std::vector<HostReport> reports(o.hosts.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < o.hosts.size(); ++i) {
      reports[i].host = o.hosts[i];
      threads.emplace_back([&, i] { start_session(o, cohort, reports[i], i == 0); });
    }
    for (auto& t : threads) t.join();
  }

  // 2. Every ordered pair of reachable hosts, one at a time (bandwidth figures must not share links).
  struct Link {
    size_t from, to;
    LinkResult result;
    std::string skipped;
  };
  std::vector<Link> links;
  for (size_t a = 0; a < reports.size(); ++a) {
    for (size_t b = 0; b < reports.size(); ++b) {
      if (a == b && reports.size() > 1) continue;
      Link l{a, b, {}, {}};
      if (!reports[a].facts || !reports[b].facts) {
        const HostReport& down = reports[a].facts ? reports[b] : reports[a];
        l.skipped = fmt::format("not tested: {} {}", down.host.name, down.host.local ? "could not be checked" : "unreachable over ssh");
        links.push_back(l);
        continue;
      }
      std::vector<std::string> cmd = {reports[a].host.local ? self_path() : cohort, "doctor", "--probe-connect",
                                      fmt::format("{}:{}", reports[b].host.name, reports[b].facts->probe_port),
                                      "--probe-bytes", std::to_string(o.probe_bytes),
                                      "--pings", std::to_string(o.pings),
                                      "--timeout", fmt::format("{}", o.timeout_s)};
      auto res = run_child(host_argv(o, reports[a].host, cmd), after_seconds(o.timeout_s + 5));
      bool parsed = false;
      for (auto& line : str::split(res.out, '\n')) {
        try {
          l.result = LinkResult::from_json(nlohmann::json::parse(line));
          parsed = true;
        } catch (const std::exception&) {
        }
      }
      if (!parsed) {
        auto errs = str::split(res.err, '\n');
        l.result.ok = false;
        l.result.error = res.timed_out ? fmt::format("probe from {} gave no answer within {:.0f} s", reports[a].host.name, o.timeout_s + 5)
                                       : fmt::format("probe from {} exited with {}: {}", reports[a].host.name, res.exit_code,
                                                     errs.empty() ? "" : std::string(str::trim(errs.back())));
      }
      if (a == 0 && l.result.ok) reports[b].clock_offset_ms = l.result.clock_offset_ms;
      links.push_back(l);
    }
  }
  for (auto& r : reports) end_session(r);

  // 3. Judge.
  std::vector<Finding> findings;
  std::vector<std::string> host_rows;
  host_rows.push_back(fmt::format("{:<22} {:<5} {:<9} {:<12} {:<10} {:<12} {:<14} {:<11} {}", "host", "ssh", "version",
                                  "store port", "somaxconn", "syn_backlog", "nofile", "clock skew", "verdict"));
  for (size_t i = 0; i < reports.size(); ++i) {
    auto& r = reports[i];
    Status worst = Status::kOk;
    auto add = [&](Status s, std::string what, std::string fix = "") {
      findings.push_back({s, r.host.name, std::move(what), std::move(fix)});
      if (static_cast<int>(s) > static_cast<int>(worst) && s != Status::kSkip) worst = s;
    };
    if (!r.facts) {
      add(Status::kFail, (r.host.local ? "could not be checked: " : "unreachable over ssh: ") + r.ssh_error);
      host_rows.push_back(fmt::format("{:<22} {:<5} {}", r.host.name, "FAIL", r.ssh_error));
      continue;
    }
    const HostFacts& f = *r.facts;
    if (f.version != build::version_text())
      add(Status::kFail, fmt::format("cohort {} there, {} here", f.version, build::version_text()),
          "install the same cohort build on every host");
    std::string port_cell = "-";
    for (size_t p = 0; p < f.ports_checked.size(); ++p) {
      port_cell = fmt::format("{} {}", f.ports_checked[p], f.ports_free[p] ? "free" : "BUSY");
      if (!f.ports_free[p])
        add(Status::kFail, fmt::format("port {} (the store's) is in use", f.ports_checked[p]),
            fmt::format("choose another with --master-port, or find the owner: ss -ltnp 'sport = :{}'", f.ports_checked[p]));
    }
    if (f.somaxconn >= 0 && f.somaxconn < need.listen_backlog)
      add(Status::kFail, fmt::format("net.core.somaxconn is {}, the job needs >= {} (world {} + {} agents connect at once)",
                                     f.somaxconn, need.listen_backlog, world, nodes),
          fmt::format("sysctl -w net.core.somaxconn={}", std::max<int64_t>(4096, need.listen_backlog)));
    if (f.tcp_max_syn_backlog >= 0 && f.tcp_max_syn_backlog < need.listen_backlog)
      add(Status::kFail, fmt::format("net.ipv4.tcp_max_syn_backlog is {}, the job needs >= {}", f.tcp_max_syn_backlog,
                                     need.listen_backlog),
          fmt::format("sysctl -w net.ipv4.tcp_max_syn_backlog={}", std::max<int64_t>(4096, need.listen_backlog)));
    if (f.nofile_soft < need.open_files)
      add(Status::kFail, fmt::format("RLIMIT_NOFILE soft limit is {}, a worker may open {} files/sockets (2 x world + 64)",
                                     f.nofile_soft, need.open_files),
          f.nofile_hard >= need.open_files
              ? fmt::format("ulimit -n {} in the ssh login environment (hard limit {} allows it)", need.open_files, f.nofile_hard)
              : fmt::format("raise the hard limit: '* hard nofile {}' in /etc/security/limits.conf, then ulimit -n {}",
                            need.open_files, need.open_files));
    std::string skew_cell = "-";
    if (r.clock_offset_ms) {
      skew_cell = fmt::format("{:+.1f} ms", *r.clock_offset_ms);
      if (std::fabs(*r.clock_offset_ms) > o.max_clock_skew_ms)
        add(Status::kWarn, fmt::format("clock differs from {} by {:.0f} ms (timestamps in logs will disagree)",
                                       o.hosts[0].name, *r.clock_offset_ms),
            "synchronise clocks (chrony / systemd-timesyncd)");
    } else if (i == 0) {
      skew_cell = "reference";
    }
    auto nofile = f.nofile_soft == UINT64_MAX ? std::string("unlimited") : std::to_string(f.nofile_soft);
    host_rows.push_back(fmt::format("{:<22} {:<5} {:<9} {:<12} {:<10} {:<12} {:<14} {:<11} {}", r.host.name,
                                    r.host.local ? "local" : "ok",
                                    f.version.substr(0, f.version.find(' ')), port_cell, f.somaxconn, f.tcp_max_syn_backlog, nofile, skew_cell,
                                    status_word(worst)));
  }
  std::vector<std::string> link_rows;
  link_rows.push_back(fmt::format("{:<42} {:<5} {:<11} {}", "link (from -> to, TCP on the job's address)", "tcp", "rtt",
                                  "bandwidth"));
  for (auto& l : links) {
    std::string name = fmt::format("{} -> {}", reports[l.from].host.name, reports[l.to].host.name);
    if (!l.skipped.empty()) {
      link_rows.push_back(fmt::format("{:<42} {:<5} {}", name, "skip", l.skipped));
      continue;
    }
    if (!l.result.ok) {
      // A name that does not resolve is not a firewall's doing (a root without /etc/hosts has no
      // "localhost").
      const bool unresolved = l.result.error.find("cannot resolve host") != std::string::npos;
      findings.push_back({Status::kFail, name, "TCP: " + l.result.error,
                          unresolved ? fmt::format("make '{}' resolve on {} (/etc/hosts or DNS), or name the host by "
                                                   "its address", reports[l.to].host.name, reports[l.from].host.name)
                                     : "open the firewall between the hosts for TCP (cohort uses the store port and "
                                       "ephemeral ports)"});
      link_rows.push_back(fmt::format("{:<42} {:<5} {}", name, "FAIL", l.result.error));
      continue;
    }
    link_rows.push_back(fmt::format("{:<42} {:<5} {:<11} {}", name, "ok", fmt::format("{:.0f} us", l.result.rtt_us),
                                    human_bytes_per_s(l.result.bandwidth_MBps)));
  }

  for (auto& row : host_rows) fmt::print("{}\n", row);
  fmt::print("\n");
  judge_gpus(reports, findings);
  for (auto& row : link_rows) fmt::print("{}\n", row);
  fmt::print("\n");
  std::fflush(stdout);

  // 4. A tiny allreduce through the real stack, when everything above passed.
  bool failed_so_far = std::any_of(findings.begin(), findings.end(), [](auto& f) { return f.status == Status::kFail; });
  if (o.allreduce) {
    auto help = run_child({self_path(), "--help"}, after_seconds(5));
    bool have = help.out.find("  run ") != std::string::npos && help.out.find("bench allreduce") != std::string::npos;
    if (failed_so_far) {
      fmt::print("allreduce: skipped (the checks above failed)\n");
    } else if (!have) {
      fmt::print("allreduce: skipped (this cohort build has no 'run' and 'bench allreduce' commands)\n");
    } else {
      std::vector<std::string> hs;
      for (auto& h : o.hosts) hs.push_back(fmt::format("{}:{}", h.name, o.nproc_per_node > 0 ? o.nproc_per_node : h.slots));
      std::vector<std::string> argv = {self_path(), "run", "-H", str::join(hs, ","), "--ssh-command", o.ssh_command,
                                       "--master-port", std::to_string(o.master_port), cohort, "bench", "allreduce",
                                       "-b", "8", "-e", "8", "-n", "1", "--check"};
      fmt::print("allreduce: {} ... ", str::join(argv, " "));
      std::fflush(stdout);
      auto res = run_child(argv, after_seconds(std::max(60.0, o.timeout_s * 4)));
      if (res.exit_code == 0) {
        fmt::print("ok\n");
      } else {
        auto errs = str::split(res.err, '\n');
        std::string why = res.timed_out ? "timed out" : fmt::format("exit {}", res.exit_code);
        fmt::print("FAIL ({})\n{}", why, res.err);
        findings.push_back({Status::kFail, "allreduce", why, "see the launcher's summary above"});
      }
    }
  } else {
    fmt::print("allreduce: not run (--no-allreduce)\n");
  }

  int fails = 0, warns = 0;
  for (auto& f : findings) {
    if (f.status == Status::kFail) ++fails;
    if (f.status == Status::kWarn) ++warns;
  }
  if (!findings.empty()) {
    fmt::print("\nfindings:\n");
    for (auto& f : findings) {
      fmt::print("  {:<4} {}: {}\n", status_word(f.status), f.where, f.what);
      if (!f.fix.empty()) fmt::print("       fix: {}\n", f.fix);
    }
  }
  if (fails)
    fmt::print("\nverdict: FAIL ({} problem(s), {} warning(s))\n", fails, warns);
  else
    fmt::print("\nverdict: {} ({} host(s), {} link(s) checked{})\n", warns ? "PASS with warnings" : "PASS", nodes,
               links.size(), warns ? fmt::format(", {} warning(s)", warns) : "");
  std::fflush(stdout);
  return fails ? 1 : 0;
}

}  // namespace cohort::doctor
