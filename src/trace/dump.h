#pragma once
// Flight recorder dumps: one JSON file per rank (rank<N>.json), written by the launcher when a job
// fails or stalls, and by a process without the launcher when its communicator fails. `cohort trace
// show <dir>` reads them back and prints the same diagnosis as the launcher's failure summary.

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trace/flight_ring.h"

namespace cohort::trace {

nlohmann::json to_json(const RankSnapshot& s);
// Throws Error naming what is missing or malformed.
RankSnapshot snapshot_from_json(const nlohmann::json& j);

// Writes atomically (a temporary file renamed over `path`).
void write_dump(const std::string& path, const RankSnapshot& s);
RankSnapshot read_dump(const std::string& path);
// Every rank<N>.json in `dir`, in rank order; throws Error when there is none.
std::vector<RankSnapshot> read_dump_dir(const std::string& dir);

}  // namespace cohort::trace
