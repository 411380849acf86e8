#pragma once
// What a launcher tells the ranks when one of its workers' processes ends (docs/launcher.md, "When a
// rank's process ends"), and how a rank reads it.
//
// Why: a rank that waits for a peer to join, or whose operation failed because a peer went away, sees
// only that the peer is missing or that its channel closed. The launcher that reaped the peer knows
// more: that it ended, with which exit code or signal, and (from its flight recorder) after which
// operation. It publishes that in the job's store, under the world communicator's prefix:
//   exit/<rank>   one ExitRecord (JSON), set before
//   exit/count    is incremented, so that a waiting rank reads one counter per check, not a key per rank.
// <rank> is the rank in the world communicator the process belonged to (COHORT_RANK: in a
// parameter-server job, its role's world, under that role's prefix).

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trace/flight_ring.h"

namespace cohort::comm {

inline constexpr char kExitCountKey[] = "exit/count";
std::string exit_key(int rank);

struct ExitRecord {
  int rank = -1;
  std::string host;
  int pid = 0;
  int code = -1;       // its exit code; -1 when a signal killed it
  int signal = 0;      // the signal that killed it; 0 when it exited
  double seconds = 0;  // how long it ran
  // The launcher read the rank's flight recorder: `ops` holds each communicator's last collective in
  // the ring, most recent first. `complete`: the ring never wrapped, so a communicator missing from
  // `ops` ran no collective at all.
  bool recorded = false;
  bool complete = false;
  struct LastOp {
    uint32_t comm = 0;
    uint64_t seq = 0;
    trace::OpState state = trace::OpState::kEmpty;
  };
  std::vector<LastOp> ops;
};

// The record of a process that ended with wait status `status`, `ring` its flight recorder (null when
// it had none). At most `max_comms` communicators are kept.
ExitRecord make_exit_record(int rank, const std::string& host, int pid, int status, double seconds,
                            const trace::RankSnapshot* ring, size_t max_comms = 16);
std::string to_json(const ExitRecord& r);
// Throws std::exception on a malformed record.
ExitRecord exit_record_from_json(const std::string& text);

// "exited (code 0)", "exited (killed by SIGKILL)".
std::string exit_text(const ExitRecord& r);
// Where the process stopped relative to communicator `comm`, whose current operation is `current`:
// "before operation #5" (its last there was #4, done), "during operation #5", "before its first
// operation"; without a flight recorder, "before or during operation #<current>".
std::string exit_point(const ExitRecord& r, uint32_t comm, uint64_t current);

}  // namespace cohort::comm
