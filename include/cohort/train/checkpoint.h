#pragma once
// Checkpoint files: written atomically (temp file in the same directory, fsync, rename, fsync of
// the directory), so a job killed mid-write leaves the previous checkpoint intact. The payload is
// opaque bytes (the libtorch integration writes a torch archive); the training position travels
// in a small JSON header in front of it.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace cohort::train {

struct TrainingPosition {
  int64_t epoch = 0;          // epoch in progress
  int64_t step_in_epoch = 0;  // optimizer steps already done in that epoch
  int64_t global_step = 0;    // optimizer steps done in total
  int world_size = 1;         // world size that produced it
  // Where the epoch's sample order stands (DistributedSampler::indices_from): positions consumed,
  // and the world size that began the epoch (its order's padding depends on it). A checkpoint from
  // before these fields reads as cursor -1 (unknown) and epoch_world = world_size.
  int64_t epoch_cursor = 0;
  int epoch_world = 1;
};

// Writes `bytes` to `path` atomically. Throws cohort::Error naming the path and errno text.
void write_file_atomically(const std::string& path, const std::string& bytes);
// Whole file, or nullopt when it does not exist. Throws on other read errors.
std::optional<std::string> read_file_if_exists(const std::string& path);

// "COHORTCKPT1\n" + JSON position line + payload.
std::string encode_checkpoint(const TrainingPosition& pos, const std::string& payload);
// Throws InvalidArgument naming `what` (a path) when the bytes are not a cohort checkpoint.
TrainingPosition decode_checkpoint(const std::string& bytes, std::string& payload, const std::string& what);

// <dir>/checkpoint.bin, the newest (replaced atomically each time); the one before it is kept as
// <dir>/checkpoint.1.bin, so that a newest one that is incomplete (a copy cut short, a file system
// without atomic rename) still leaves a checkpoint to resume from.
std::string checkpoint_path(const std::string& dir);
std::string previous_checkpoint_path(const std::string& dir);

// Writes a checkpoint into `dir`: the newest becomes the previous, then the new one is written
// atomically.
void write_checkpoint(const std::string& dir, const TrainingPosition& pos, const std::string& payload);

struct LoadedCheckpoint {
  std::string path;
  TrainingPosition position;
  std::string payload;
  std::vector<std::string> skipped;  // "<path>: why" for newer files that were not complete
};
// The newest complete checkpoint in `dir` (header, length and digest check out), or nullopt when
// there is none. Files that exist but are not complete are listed in `skipped`; when no file is
// complete, InvalidArgument names each and why.
std::optional<LoadedCheckpoint> newest_complete_checkpoint(const std::string& dir);

}  // namespace cohort::train
