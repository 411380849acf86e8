#pragma once
// Checkpoint files: written atomically (temp file in the same directory, fsync, rename, fsync of
// the directory), so a job killed mid-write leaves the previous checkpoint intact. The payload is
// opaque bytes (the libtorch integration writes a torch archive); the training position travels
// in a small JSON header in front of it.

#include <cstdint>
#include <optional>
#include <string>

namespace cohort::train {

struct TrainingPosition {
  int64_t epoch = 0;          // epoch in progress
  int64_t step_in_epoch = 0;  // optimizer steps already done in that epoch
  int64_t global_step = 0;    // optimizer steps done in total
  int world_size = 1;         // world size that produced it (the sampler split depends on it)
};

// Writes `bytes` to `path` atomically. Throws cohort::Error naming the path and errno text.
void write_file_atomically(const std::string& path, const std::string& bytes);
// Whole file, or nullopt when it does not exist. Throws on other read errors.
std::optional<std::string> read_file_if_exists(const std::string& path);

// "COHORTCKPT1\n" + JSON position line + payload.
std::string encode_checkpoint(const TrainingPosition& pos, const std::string& payload);
// Throws InvalidArgument naming `what` (a path) when the bytes are not a cohort checkpoint.
TrainingPosition decode_checkpoint(const std::string& bytes, std::string& payload, const std::string& what);

// <dir>/checkpoint.bin (one file, replaced atomically each time).
std::string checkpoint_path(const std::string& dir);

}  // namespace cohort::train
