// `cohort store serve`: runs a rendezvous store server until SIGINT or SIGTERM.
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "cohort/error.h"
#include "command.h"
#include "common/strings.h"
#include "store/tcp_store.h"

namespace cohort::tools {
namespace {

int run_store_serve(std::vector<std::string> args) {
  CLI::App app("Runs a cohort rendezvous store server until SIGINT/SIGTERM. The job token comes from "
               "--token-file or COHORT_JOB_TOKEN; without one, any client is accepted.",
               "cohort store serve");
  StoreServerOptions options;
  int port = -1;
  std::string token_file;
  double handshake_s = 10;
  app.add_option("--port", port, "TCP port to listen on (0: any free port)")->required()->check(CLI::Range(0, 65535));
  app.add_option("--host", options.host, "address to bind (default: all interfaces)");
  app.add_option("--token-file", token_file, "file holding the job token");
  app.add_option("--backlog", options.backlog, "listen backlog (capped by net.core.somaxconn)");
  app.add_option("--handshake-timeout", handshake_s, "seconds a new connection has to authenticate");
  if (!parse_command_line(app, args)) return 0;
  options.port = static_cast<uint16_t>(port);
  options.handshake_timeout = Millis(static_cast<int64_t>(handshake_s * 1000));
  options.token = job_token(token_file);
  // A store serves one connection per process of the job: use every descriptor the hard limit allows.
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  // Block the signals before the server thread starts so that only sigwait below receives them.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::unique_ptr<StoreServer> server;
  try {
    server = StoreServer::start(options);
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}; choose another --port, or --port 0 for any free one", e.what()));
  }
  fmt::print("cohort store serving at {} ({})\n", server->address(),
             options.token.empty() ? "no authentication" : "job token required");
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  server->stop();
  fmt::print("cohort store stopped ({})\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  return 0;
}

Registration reg_store("store serve", "run a rendezvous store server (until SIGINT/SIGTERM)", run_store_serve);

}  // namespace
}  // namespace cohort::tools
