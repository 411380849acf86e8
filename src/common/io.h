#pragma once
// Whole-buffer writes and whole-file reads and replacements: the loops every caller would otherwise
// write again (short writes, EINTR, the temporary file of an atomic replacement).

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace cohort::io {

// Writes all `n` bytes of `data` to `fd`, retrying on EINTR and short writes. False when write(2)
// fails (errno says why; EIO when it wrote nothing without an error).
bool write_all(int fd, const void* data, size_t n);

// The whole file at `path`, or nullopt when it cannot be opened or read.
std::optional<std::string> read_file(const std::string& path);

// Replaces the file at `path` with `bytes` so that readers, also after a crash, see the old file or the
// new one, never a part: writes `tmp` (same folder), fsyncs it, renames it to `path`, then fsyncs the
// folder (best effort: a failed folder sync loses durability, not the file). Returns "" or one line
// naming the file and the step that failed: "<tmp>: cannot write it: No space left on device"; `tmp`
// is removed then.
std::string replace_file(const std::string& path, const std::string& tmp, std::string_view bytes);

}  // namespace cohort::io
