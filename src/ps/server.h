#pragma once
// The server's loop (server.cc); include/cohort/ps.h's serve() and serve_from_env() call it.

#include <chrono>
#include <memory>
#include <string>

#include "cohort/ps.h"

namespace cohort::ps {

// Serves until every worker said bye. `prefix`: the PS world's key prefix in `store`.
void run_server(std::shared_ptr<Store> store, const std::string& prefix, int index, const Roles& roles,
                ConsistencyMode mode, std::chrono::milliseconds timeout, uint64_t max_request);

// COHORT_PS_MAX_REQUEST: the largest request payload a server accepts (bytes).
uint64_t max_request_setting();

}  // namespace cohort::ps
