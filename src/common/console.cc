#include "common/console.h"

#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>

#include <fmt/core.h>

#include "common/io.h"

namespace cohort::console {
namespace {

// What was written to one descriptor: stdin, stdout and stderr get a slot each (a terminal is
// usually all three), every other descriptor shares the last one.
struct Slot {
  uint64_t writes = 0;
  uint64_t last_seq = 0;    // when it was last written (the lock's order)
  bool ended_line = true;   // its last write ended with '\n'
};

struct State {
  std::mutex mutex;
  Slot slots[4];
  uint64_t seq = 0;
};

State& state() {
  static State s;
  return s;
}

Slot& slot_of(State& s, int fd) { return s.slots[fd >= 0 && fd < 3 ? fd : 3]; }

void note(State& s, int fd, const char* data, size_t n) {
  Slot& slot = slot_of(s, fd);
  ++slot.writes;
  slot.last_seq = ++s.seq;
  if (n > 0) slot.ended_line = data[n - 1] == '\n';
}

// Whether two descriptors reach the same terminal (or file): a terminal may be opened under two names
// (/dev/tty and /dev/pts/N), which share the device number.
bool same_target(int a, int b) {
  if (a == b) return true;
  struct stat sa, sb;
  if (fstat(a, &sa) != 0 || fstat(b, &sb) != 0) return false;
  if (S_ISCHR(sa.st_mode) && S_ISCHR(sb.st_mode)) return sa.st_rdev == sb.st_rdev;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

}  // namespace

void write(int fd, const char* data, size_t n) {
  if (n == 0) return;
  State& s = state();
  std::lock_guard<std::mutex> g(s.mutex);
  io::write_all(fd, data, n);  // the console gone (EPIPE): the output is dropped
  note(s, fd, data, n);
}

Block write_block(int fd, const Block& previous, const std::string& text, bool redraw) {
  State& s = state();
  std::lock_guard<std::mutex> g(s.mutex);
  // Every write that reached this terminal, through any of the standard descriptors.
  uint64_t writes = 0, latest = 0;
  bool ended_line = true;
  for (int other = 0; other < 3; ++other) {
    if (!same_target(fd, other)) continue;
    const Slot& slot = s.slots[other];
    writes += slot.writes;
    if (slot.last_seq > latest) latest = slot.last_seq, ended_line = slot.ended_line;
  }
  if (fd < 0 || fd > 2) {
    const Slot& slot = s.slots[3];
    writes += slot.writes;
    if (slot.last_seq > latest) ended_line = slot.ended_line;
  }
  std::string out;
  if (redraw && previous.lines > 0 && previous.writes_after != 0 && previous.writes_after == writes)
    out = fmt::format("\x1b[{}F\x1b[J", previous.lines);  // up to the block's first line, clear below
  else if (!ended_line)
    out = "\n";
  out += text;
  io::write_all(fd, out.data(), out.size());
  note(s, fd, out.data(), out.size());
  return Block{writes + 1, int(std::count(text.begin(), text.end(), '\n'))};
}

}  // namespace cohort::console
