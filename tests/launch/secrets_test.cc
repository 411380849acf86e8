// Secret settings are never printed (docs/security.md, "Files and secrets"): `cohort env` runs inside
// workers and in CI logs, and a job's --dry-run lists every worker's environment; either would hand
// the store's token (COHORT_JOB_TOKEN) or a user's -x HF_TOKEN to whoever reads the output.
#include <gtest/gtest.h>

#include "support/test_support.h"

namespace cohort::test {
namespace {

const std::string kToken = "tok-3f9a1c77e0b24d5e";

TEST(Secrets, CohortEnvSaysATokenIsSetButNotWhatItIs) {
  auto r = run_process({cohort_tool(), "env"}, {"COHORT_JOB_TOKEN=" + kToken, "COHORT_TIMEOUT=45"}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find(kToken), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find(kToken), std::string::npos) << r.err;
  // It is set, and the other values are shown as before.
  EXPECT_NE(r.out.find("[set here: <secret, not shown>]"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("[set here: 45]"), std::string::npos) << r.out;
}

TEST(Secrets, ADryRunShowsNoSecretOfTheWorkersEnvironment) {
  auto r = run_process({cohort_tool(), "run", "--dry-run", "-n", "2", "-x", "HF_TOKEN=" + kToken, "-x",
                        "MY_PASSWORD", "-x", "PLAIN=visible", "/bin/true"},
                       {"COHORT_JOB_TOKEN=" + kToken, "MY_PASSWORD=" + kToken}, 30);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find(kToken), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find(kToken), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("HF_TOKEN=<secret, not shown>"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("MY_PASSWORD=<secret, not shown>"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("COHORT_JOB_TOKEN=<secret, not shown>"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("PLAIN=visible"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace cohort::test
