#pragma once
// Running a plan: the agent that starts this node's workers, routes their output, supervises them,
// and coordinates with the other nodes' agents through the job's store. docs/launcher.md describes
// the protocol (store keys per attempt) and the failure policy.
//
// One thread runs an epoll loop over: a signalfd (SIGCHLD and the forwarded signals), the workers'
// output pipes, a timerfd (kill grace, waiting for remote agents), an eventfd fed by the store
// watcher thread (multi-node only), the control pipe from the head (remote agents), and the output
// of ssh children (fan-out head). No polling interval anywhere on the supervision path.

#include <optional>
#include <string>

#include "launch/plan.h"

namespace cohort::launch {

struct JobContext {
  Plan plan;
  EnvMap env;               // the launcher's environment
  std::string token;        // job token ("" = store without authentication)
  // A Slurm per-node job given no token (tools/cmd_run.cc): node 0's launcher makes one and the others
  // decode it from munge credentials that node 0's store serves (launch/munge.h).
  struct SlurmMunge {
    bool enabled = false;
    int node = 0;            // this node's place in SLURM_STEP_NODELIST
    int nodes = 0;           // the step's node count: node 0 makes a credential for each other node
    std::string socket;      // munged's socket ("" = munge's default)
    std::string socket_source;
  } munge;
  // --require-auth / COHORT_REQUIRE_AUTH=1 where the token is settled only when the job starts (munge).
  bool require_auth = false;
  int torch_port = 0;       // remote agents: MASTER_PORT chosen by the head
  bool agent_mode = false;  // a remote agent: stdin is the control channel from the head
  std::string self_exe;     // this cohort binary (the head starts the same path over ssh)
  // This node's GPUs when the caller detected them already (a GPU job detects them otherwise).
  std::optional<GpuInventory> gpus;
};

// Runs the job (all restart attempts); returns the launcher's exit code. Throws ConfigError for
// problems found before any worker started (port in use, store unreachable at start...).
int run_job(JobContext ctx);

// `cohort agent`: reads the head's plan line from stdin and runs this node's part of the job.
int run_agent_from_stdin();

// Current environment as a map.
EnvMap current_env();

// "exited with code 3" / "was killed by SIGKILL (...)" and the launcher's exit code for a wait status.
std::string describe_status(int status);
int exit_code_of(int status);

}  // namespace cohort::launch
