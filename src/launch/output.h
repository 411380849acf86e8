#pragma once
// Output routing for one worker (or one remote agent): tags lines "[host:rank] " on the console,
// copies the raw bytes to per-rank files, and keeps the last lines of stderr for the failure summary.
// Console writes are whole lines (one write(2) each) so output of many workers never interleaves
// inside a line.

#include <time.h>

#include <deque>
#include <string>
#include <vector>

#include "common/fd.h"

namespace cohort::launch {

struct OutputTargets {
  std::string tag;           // "[host:rank] " or "" (no tagging)
  bool line_mode = false;    // split into lines even without a tag (relaying agents)
  // mpirun's --timestamp-output: each console line starts with the local time it was read,
  // "2026-11-28 10:56:04.123 " (before the tag). Implies line mode.
  bool timestamp = false;
  bool to_console = true;
  bool merge_stderr = false;  // stderr goes where stdout goes (console and file)
  // torchrun's --redirects: this stream goes to its file only, never to the console.
  bool redirect_out = false;
  bool redirect_err = false;
  int console_out = 1;
  int console_err = 2;
  UniqueFd file_out;  // DIR/rank.N/stdout (or invalid)
  UniqueFd file_err;  // DIR/rank.N/stderr (invalid when merged or no files)
};

class OutputSink {
 public:
  explicit OutputSink(OutputTargets targets, size_t tail_lines = 10)
      : t_(std::move(targets)), tail_lines_(tail_lines) {}
  // Bytes read from the worker's stdout (is_stderr=false) or stderr.
  void on_data(bool is_stderr, const char* data, size_t n);
  // The stream ended: emits an unterminated last line.
  void on_eof(bool is_stderr);
  // The last lines of stderr (for the failure summary).
  std::vector<std::string> stderr_tail() const;

 private:
  void emit_console_line(bool is_stderr, const std::string& line);
  bool console_gets(bool is_stderr) const { return t_.to_console && !(is_stderr ? t_.redirect_err : t_.redirect_out); }
  OutputTargets t_;
  size_t tail_lines_;
  std::string partial_[2];       // unfinished console line per stream
  std::string tail_partial_;     // unfinished stderr line for the tail
  std::deque<std::string> tail_;
};

// "2026-11-28 10:56:04.123": the local time `t`, to the millisecond (--timestamp-output's prefix).
std::string line_timestamp(const struct timespec& t);

}  // namespace cohort::launch
