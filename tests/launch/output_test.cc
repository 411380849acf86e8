// Unit tests of output routing: line tagging across partial reads, files, merge, the stderr tail.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "launch/output.h"
#include "support/test_support.h"

namespace cohort::launch {
namespace {

struct Pipe {
  int fds[2];
  Pipe() { EXPECT_EQ(pipe2(fds, O_NONBLOCK), 0); }
  ~Pipe() {
    close(fds[0]);
    close(fds[1]);
  }
  std::string drain() {
    std::string s;
    char buf[4096];
    ssize_t n;
    while ((n = read(fds[0], buf, sizeof buf)) > 0) s.append(buf, static_cast<size_t>(n));
    return s;
  }
};

TEST(Output, TagsWholeLinesAcrossPartialReads) {
  Pipe out, err;
  OutputTargets t;
  t.tag = "[h:3] ";
  t.console_out = out.fds[1];
  t.console_err = err.fds[1];
  OutputSink sink(std::move(t));
  sink.on_data(false, "hel", 3);
  EXPECT_EQ(out.drain(), "");  // no half lines on the console
  sink.on_data(false, "lo\nwor", 6);
  sink.on_data(true, "oops\n", 5);
  sink.on_data(false, "ld\nend", 6);
  sink.on_eof(false);
  EXPECT_EQ(out.drain(), "[h:3] hello\n[h:3] world\n[h:3] end\n");
  EXPECT_EQ(err.drain(), "[h:3] oops\n");
}

TEST(Output, FilesGetRawBytesAndTailKeepsLastLines) {
  test::TempDir dir;
  Pipe out;
  OutputTargets t;
  t.to_console = false;
  t.console_out = out.fds[1];
  t.file_out = UniqueFd(open(dir.file("o").c_str(), O_WRONLY | O_CREAT, 0644));
  t.file_err = UniqueFd(open(dir.file("e").c_str(), O_WRONLY | O_CREAT, 0644));
  OutputSink sink(std::move(t), 2);
  sink.on_data(false, "a\n", 2);
  sink.on_data(true, "1\n2\n3\nno newline", 16);
  EXPECT_EQ(out.drain(), "");
  EXPECT_EQ(test::read_file(dir.file("o")), "a\n");
  EXPECT_EQ(test::read_file(dir.file("e")), "1\n2\n3\nno newline");
  EXPECT_EQ(sink.stderr_tail(), (std::vector<std::string>{"2", "3", "no newline"}));
}

TEST(Output, MergedStreamFeedsTheTail) {
  Pipe out;
  OutputTargets t;
  t.merge_stderr = true;
  t.console_out = out.fds[1];
  t.console_err = -1;
  OutputSink sink(std::move(t), 5);
  sink.on_data(false, "x\ny\n", 4);
  EXPECT_EQ(out.drain(), "x\ny\n");
  EXPECT_EQ(sink.stderr_tail(), (std::vector<std::string>{"x", "y"}));
}

}  // namespace
}  // namespace cohort::launch
