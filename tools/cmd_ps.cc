// `cohort ps serve`: the built-in parameter server. `cohort run --ps N` starts it for the server
// role unless the program serves itself (--ps-server program); see docs/parameter-server.md.
#include <fmt/core.h>

#include "cohort/ps.h"
#include "command.h"

namespace cohort::tools {
namespace {

int run_ps_serve(std::vector<std::string> args) {
  CLI::App app{"Runs this process as a parameter server of a job started by `cohort run --ps N` (it reads "
               "COHORT_ROLE=server, COHORT_ROLE_INDEX, COHORT_NUM_SERVERS, COHORT_NUM_WORKERS and the job's store "
               "from the environment the launcher sets). It serves until every worker has closed its client.",
               "cohort ps serve"};
  if (!parse_command_line(app, args,
                          "Settings: COHORT_PS_MODE (async | bsp | stale:K), COHORT_PS_MAX_REQUEST, COHORT_TIMEOUT."))
    return 0;
  ps::serve_from_env();
  return 0;
}

Registration reg_ps("ps serve", "run the built-in parameter server (started by cohort run --ps N)", run_ps_serve);

}  // namespace
}  // namespace cohort::tools
