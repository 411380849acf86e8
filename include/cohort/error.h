#pragma once
// The exceptions cohort's public calls throw. Inside the layers errors travel as values
// (common/status.h); at the API boundary they become one of these. Every message names its
// cause: the rank and host involved, the operation, what was expected.
//
//   Error                     base; what() is the whole one-line message
//   ├── InvalidArgument       bad input caught before anything was sent; the object stays usable
//   ├── ConfigError           bad flag, environment variable or file (file:line in the message)
//   ├── TimeoutError          a deadline passed; says who or what never came
//   ├── PeerLostError         a peer's process or connection is gone (rank, host)
//   ├── MismatchError         ranks called different collectives (op, size, dtype or order)
//   ├── AuthError             the store refused a missing or wrong job token
//   └── AbortedError          the communicator failed earlier; repeats the first (root) cause
//
// After TimeoutError, PeerLostError, MismatchError or AbortedError a communicator is failed for good
// (every later call throws AbortedError with the root cause); build a new one. InvalidArgument
// leaves it usable. docs/errors.md has the details.

#include <stdexcept>
#include <string>

namespace cohort {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InvalidArgument : public Error {
 public:
  using Error::Error;
};

class ConfigError : public Error {
 public:
  using Error::Error;
};

class TimeoutError : public Error {
 public:
  using Error::Error;
};

class PeerLostError : public Error {
 public:
  using Error::Error;
};

class MismatchError : public Error {
 public:
  using Error::Error;
};

class AuthError : public Error {
 public:
  using Error::Error;
};

class AbortedError : public Error {
 public:
  using Error::Error;
};

}  // namespace cohort
