#pragma once
// `cohort doctor`: pre-flight checks of the hosts of a planned job, run from one machine over ssh.
// See docs/doctor.md for every check, its threshold and the fix it prints.

#include <cstdint>
#include <string>
#include <vector>

namespace cohort::doctor {

struct DoctorHost {
  std::string name;  // as the job will address it (hostfile / -H entry)
  int slots = 1;
  // This machine (launch::is_this_machine): checked by running the helpers directly, as `cohort run`
  // starts this machine's workers itself; no ssh server is needed.
  bool local = false;
};

// The hosts of -H ("a:2,b,c:4") or of a hostfile, read by the launcher's own parsers
// (launch/parsers.h), so that the doctor accepts and refuses exactly what `cohort run` does.
std::vector<DoctorHost> parse_host_list(const std::string& spec);
std::vector<DoctorHost> parse_hostfile(const std::string& path);

struct DoctorOptions {
  std::vector<DoctorHost> hosts;
  std::string ssh_command = "ssh -o BatchMode=yes -o ConnectTimeout=5";
  int nproc_per_node = 0;          // 0: each host's slots
  int master_port = 29500;         // the store's port on the first host
  std::string remote_cohort;       // path of cohort on the hosts ("" = this binary's path)
  double timeout_s = 15;           // per ssh step
  uint64_t probe_bytes = 8u << 20; // bulk bytes per link for the bandwidth figure
  int pings = 20;
  bool allreduce = true;           // run the tiny allreduce through `cohort run`
  double max_clock_skew_ms = 1000; // above: a warning
};

// Runs every check, prints the tables and the verdict to stdout; returns 0 when nothing failed.
int run_doctor(const DoctorOptions& options);

// Derived requirements of a job of `world` ranks on `nodes` hosts (documented in docs/doctor.md).
struct Requirements {
  int64_t listen_backlog = 0;  // somaxconn and tcp_max_syn_backlog
  uint64_t open_files = 0;     // RLIMIT_NOFILE soft limit per process
};
Requirements requirements_for(int world, int nodes);

}  // namespace cohort::doctor
