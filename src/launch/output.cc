#include "launch/output.h"

#include <errno.h>
#include <unistd.h>

#include <cstdio>

#include "common/console.h"
#include "common/io.h"

namespace cohort::launch {

std::string line_timestamp(const struct timespec& t) {
  struct tm local {};
  localtime_r(&t.tv_sec, &local);
  char text[64];
  size_t n = strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S", &local);
  snprintf(text + n, sizeof text - n, ".%03ld", t.tv_nsec / 1000000);
  return text;
}

void OutputSink::emit_console_line(bool is_stderr, const std::string& line) {
  std::string out;
  out.reserve(t_.tag.size() + line.size() + 32);
  if (t_.timestamp) {
    struct timespec now {};
    clock_gettime(CLOCK_REALTIME, &now);
    out += line_timestamp(now);
    out += ' ';
  }
  out += t_.tag;
  out += line;
  out += '\n';
  console::write(is_stderr && !t_.merge_stderr ? t_.console_err : t_.console_out, out.data(), out.size());
}

void OutputSink::on_data(bool is_stderr, const char* data, size_t n) {
  if (n == 0) return;
  // Files get the raw bytes; a stream without a file of its own (torchrun's --redirects 1) writes none.
  if (is_stderr && !t_.merge_stderr) {
    // A file that cannot be written (ENOSPC): the output is dropped and supervision goes on.
    if (t_.file_err) io::write_all(t_.file_err.get(), data, n);
  } else if (t_.file_out) {
    io::write_all(t_.file_out.get(), data, n);
  }

  if (console_gets(is_stderr)) {
    if (t_.tag.empty() && !t_.line_mode && !t_.timestamp) {
      console::write(is_stderr && !t_.merge_stderr ? t_.console_err : t_.console_out, data, n);
    } else {
      std::string& part = partial_[is_stderr ? 1 : 0];
      size_t start = 0;
      for (size_t i = 0; i < n; ++i) {
        if (data[i] != '\n') continue;
        if (part.empty()) {
          emit_console_line(is_stderr, std::string(data + start, i - start));
        } else {
          part.append(data + start, i - start);
          emit_console_line(is_stderr, part);
          part.clear();
        }
        start = i + 1;
      }
      part.append(data + start, n - start);
      // A worker that never prints a newline must not grow the buffer without bound.
      if (part.size() > 64 * 1024) {
        emit_console_line(is_stderr, part);
        part.clear();
      }
    }
  }
  // The tail follows stderr, or the one merged stream.
  if ((is_stderr || t_.merge_stderr) && tail_lines_ > 0) {
    size_t start = 0;
    for (size_t i = 0; i < n; ++i) {
      if (data[i] != '\n') continue;
      tail_partial_.append(data + start, i - start);
      tail_.push_back(std::move(tail_partial_));
      tail_partial_.clear();
      if (tail_.size() > tail_lines_) tail_.pop_front();
      start = i + 1;
    }
    tail_partial_.append(data + start, n - start);
    if (tail_partial_.size() > 4096) tail_partial_.erase(0, tail_partial_.size() - 4096);
  }
}

void OutputSink::on_eof(bool is_stderr) {
  std::string& part = partial_[is_stderr ? 1 : 0];
  if (!part.empty() && console_gets(is_stderr)) emit_console_line(is_stderr, part);
  part.clear();
  if ((is_stderr || t_.merge_stderr) && !tail_partial_.empty()) {
    tail_.push_back(std::move(tail_partial_));
    tail_partial_.clear();
    if (tail_.size() > tail_lines_) tail_.pop_front();
  }
}

std::vector<std::string> OutputSink::stderr_tail() const {
  std::vector<std::string> out(tail_.begin(), tail_.end());
  if (!tail_partial_.empty()) out.push_back(tail_partial_);
  return out;
}

}  // namespace cohort::launch
