#pragma once
// The transport conformance suite: every transport must pass it. A transport joins by
// instantiating the parameterised suite with its factory, e.g. in tests/transport/shm_test.cc:
//
//   INSTANTIATE_TEST_SUITE_P(Shm, TransportConformance,
//       ::testing::Values(cohort::test::TransportParam{"shm", cohort::transport::make_shm_transport}));
//
// Ranks are threads; each drives its own transport instance (one thread per transport, as the
// communicator's drive lock guarantees).

#include <gtest/gtest.h>

#include <string>

#include "transport/transport.h"

namespace cohort::test {

struct TransportParam {
  std::string name;
  transport::Factory make;
};

inline std::string PrintToString(const TransportParam& p) { return p.name; }

class TransportConformance : public ::testing::TestWithParam<TransportParam> {};

}  // namespace cohort::test
