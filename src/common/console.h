#pragma once
// The process's console writes (its stdout and stderr), counted, so that a block redrawn in place on
// a terminal (the launcher's live stats table) is only redrawn when nothing else reached that
// terminal since it was drawn. Moving the cursor up over lines someone else printed would erase them.
//
// Everything the launcher writes to its console goes through write(): its workers' relayed output
// (launch/output.h), its own messages and the log (common/log.h).

#include <cstddef>
#include <cstdint>
#include <string>

namespace cohort::console {

// write(2) of the whole buffer to `fd` (1 or 2, normally), retrying on EINTR and short writes, under
// the console lock; errors (a closed console) drop the output. Counted per descriptor.
void write(int fd, const char* data, size_t n);
inline void write(int fd, const std::string& s) { write(fd, s.data(), s.size()); }

// A block that may be redrawn in place: what write_block returns, handed back to the next call.
struct Block {
  uint64_t writes_after = 0;  // the count of writes to the terminal right after the block (0: none yet)
  int lines = 0;              // how many lines it took
};

// Writes `text` (whole lines, each ending in '\n') to `fd`. When `previous` is the last thing written
// to that terminal (no write to any descriptor on the same terminal since), and `redraw` is true, the
// cursor first moves up over it and clears to the end of the screen, so the new block replaces it.
// Otherwise the block is written below everything, on a line of its own (after a '\n' when the last
// write to the terminal ended inside a line). Returns the new block.
Block write_block(int fd, const Block& previous, const std::string& text, bool redraw = true);

}  // namespace cohort::console
