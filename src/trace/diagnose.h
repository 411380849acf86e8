#pragma once
// Reading the ranks' flight recorders together: who is late, in which operation, since when; who
// called something else. Used live by the launcher's stall inspector, after a failure by its summary,
// and offline by `cohort trace show` (docs/observability.md).
//
// Each communicator numbers its collectives 1, 2, 3, ... on every rank in call order, so ranks that
// agree have the same operation at the same number. For each communicator the diagnosis compares
// every rank's latest number: the ranks behind are the ones the others wait for.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trace/flight_ring.h"

namespace cohort::trace {

// Ranks that entered a collective while others have not (or have not finished the one before).
struct Stall {
  uint32_t comm = 0;
  OpRecord op;                    // the operation the leading ranks are in (from the lowest such rank)
  std::vector<int> waiting;       // ranks inside `op`
  std::vector<int> missing;       // ranks that have not entered it
  std::vector<std::string> missing_last;  // per missing rank: "last: allreduce #9 ... done" / process state
  // Ranks whose snapshot is stale (their node stopped publishing it): where they are now is unknown.
  // Each is named with the age of its snapshot and what it showed.
  std::vector<int> silent;
  std::vector<std::string> silent_last;
  double waited_s = 0;            // since the first waiting rank entered `op`
  bool all_inside = false;        // every rank entered `op` and none finished it (missing: stopped ones)
  std::string text() const;       // one line
};

// Two ranks at the same operation number with different operations.
struct Mismatch {
  uint32_t comm = 0;
  int rank_a = -1, rank_b = -1;
  OpRecord a, b;
  std::string text() const;
};

// A stall at least `threshold_s` old at `now` (CLOCK_MONOTONIC ns), in the communicator with the most
// ranks first; nullopt when every communicator is in step. A snapshot taken more than `stale_s` before
// `now` (0: none is stale) is another node's that stopped coming: its ranks are never counted as
// inside the operation, and are named as silent (with its age) unless it showed them past it.
std::optional<Stall> find_stall(const std::vector<RankSnapshot>& ranks, int64_t now, double threshold_s,
                                double stale_s = 0);
std::optional<Mismatch> find_mismatch(const std::vector<RankSnapshot>& ranks);

// The flight recorder's part of a failure summary: a few lines naming the first rank whose sequence
// stopped or diverged, its operation, and who waited for it and how long. Empty when the rings hold
// nothing to compare.
std::vector<std::string> diagnose(const std::vector<RankSnapshot>& ranks);

}  // namespace cohort::trace
