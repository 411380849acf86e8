#include "common/build_info.h"

#include <cstring>

#include "cohort/version.h"

namespace cohort::build {

std::string version_text() {
  if (std::strcmp(commit(), "unknown") == 0) return COHORT_VERSION;
  return std::string(COHORT_VERSION) + " (" + commit() + ")";
}

}  // namespace cohort::build
