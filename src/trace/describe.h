#pragma once
// How an operation is named in every message a user reads: the communicator's errors and slow-rank
// warnings, and the flight recorder's reports (so both say the same thing for the same operation).

#include <string>

#include "transport/transport.h"

namespace cohort::trace {

// "allreduce(count=1024, float32, sum)" from a message signature.
std::string describe_signature(const transport::Signature& s);

}  // namespace cohort::trace
