#pragma once
// The worker side's constructor (client.cc); include/cohort/ps.h's Client::create and from_env call it.

#include <chrono>
#include <memory>
#include <string>

#include "cohort/ps.h"

namespace cohort::ps {

std::unique_ptr<Client> make_client(std::shared_ptr<Store> store, const std::string& prefix, int worker,
                                    const Roles& roles, std::chrono::milliseconds timeout);

}  // namespace cohort::ps
