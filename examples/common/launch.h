#pragma once
// What every example needs to start the same way (fashion_mnist, ps_ctr, bert, resnet): whether a
// launcher started it, its rank before any communicator exists (so that only rank 0 reports bad
// arguments), CLI11 validators that say what is wanted, and main()'s parse-run-report tail.
#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "cohort/error.h"

namespace cohort::examples {

// Rank variables of the launchers cohort's Communicator::from_env reads (PMIX_RANK: a PMIx launcher
// that sets no other, prterun).
inline constexpr const char* kRankVariables[] = {"COHORT_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID",
                                                 "PMIX_RANK"};

inline bool launched() {
  for (const char* v : kRankVariables)
    if (std::getenv(v)) return true;
  return false;
}

inline int env_rank() {
  for (const char* v : kRankVariables)
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return 0;
}

// CLI11's PositiveNumber says "Value 0 not in range 0.000000 to 1.79...e308"; this says what is wanted.
inline CLI::Validator number_check(bool (*ok)(double), const char* wanted) {
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        char* end = nullptr;
        const double value = std::strtod(text.c_str(), &end);
        if (text.empty() || *end != '\0') return fmt::format("'{}' is not a number", text);
        return ok(value) ? "" : fmt::format("must be {}, got {}", wanted, text);
      },
      wanted);
}
inline const CLI::Validator kPositive = number_check([](double v) { return v > 0; }, "positive");
inline const CLI::Validator kAtLeastOne = number_check([](double v) { return v >= 1; }, "at least 1");
inline const CLI::Validator kNotNegative = number_check([](double v) { return v >= 0; }, "0 or more");

// main()'s tail in the data-parallel examples: parses the flags, runs, and turns what went wrong into
// one line and an exit status. 2: the user's flags or configuration (ConfigError, InvalidArgument);
// 1: anything else (a lost peer, a timeout, a mismatch). Flags and configuration are the same on every
// rank, so only rank 0 says what is wrong with them and a launched job prints it once; any other
// failure may be one rank's, so every rank says its own, with its rank.
template <typename Run>
int parse_and_run(const char* program, CLI::App& app, int argc, char** argv, Run&& run) {
  const bool report = env_rank() == 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (report) std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 2;
  }
  try {
    return run();
  } catch (const ConfigError& e) {
    if (report) std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 2;
  } catch (const InvalidArgument& e) {
    std::fprintf(stderr, "%s: rank %d: %s\n", program, env_rank(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: rank %d: %s\n", program, env_rank(), e.what());
    return 1;
  }
}

}  // namespace cohort::examples
