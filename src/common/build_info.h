#pragma once
// Which build this is: the version (CMake's project version) and the commit it was built from, so
// that `cohort --version`, `cohort doctor` and bug reports say exactly which code ran.

#include <string>

namespace cohort::build {

// `git describe` of the source tree at build time ("v0.1.0-3-g1a2b3c4d5e6f", "1a2b3c4d5e6f-dirty"),
// the packager's -DCOHORT_GIT_COMMIT=..., or "unknown". Defined in a file generated at every build.
const char* commit();

// "0.1.0 (1a2b3c4d5e6f)", or "0.1.0" when the commit is unknown.
std::string version_text();

}  // namespace cohort::build
