// Tests of common/io.h (whole writes, whole reads, atomic replacement) and common/proc_stat.h
// (/proc/<pid>/stat), the one home of loops that the PS, the launcher and checkpoints each had.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <thread>

#include "common/fd.h"
#include "common/io.h"
#include "common/proc_stat.h"
#include "support/test_support.h"

namespace cohort {
namespace {

TEST(Io, WriteAllWritesEveryByteThroughShortWrites) {
  // 4 MiB into a pipe (64 KiB of buffer): write(2) returns short counts until the reader drains it.
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd rd(p[0]), wr(p[1]);
  std::string data(4 << 20, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = char(i * 131 + (i >> 12));
  std::string got;
  std::thread reader([&] {
    char buf[65536];
    for (ssize_t n; (n = ::read(rd.get(), buf, sizeof buf)) > 0;) got.append(buf, size_t(n));
  });
  const bool ok = io::write_all(wr.get(), data.data(), data.size());
  wr.reset();
  reader.join();
  EXPECT_TRUE(ok);
  EXPECT_TRUE(got == data) << "read back " << got.size() << " of " << data.size() << " bytes";
}

TEST(Io, WriteAllFailsWithErrnoWhenTheReaderIsGone) {
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd rd(p[0]), wr(p[1]);
  rd.reset();
  struct sigaction ignore {}, old {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGPIPE, &ignore, &old), 0);
  errno = 0;
  EXPECT_FALSE(io::write_all(wr.get(), "x", 1));
  EXPECT_EQ(errno, EPIPE);
  ::sigaction(SIGPIPE, &old, nullptr);
}

TEST(Io, ReplaceFileSwapsInTheNewBytesOrLeavesTheOldFile) {
  test::TempDir dir;
  const std::string path = dir.file("state.json"), tmp = path + ".tmp";
  EXPECT_EQ(io::replace_file(path, tmp, "first\n"), "");
  EXPECT_EQ(io::read_file(path).value_or("(none)"), "first\n");
  EXPECT_EQ(io::replace_file(path, tmp, "second\n"), "");
  EXPECT_EQ(io::read_file(path).value_or("(none)"), "second\n");
  EXPECT_FALSE(std::filesystem::exists(tmp));
  // The temporary file cannot be made (a folder is in its way): one line naming it and why, and the
  // old file as it was.
  std::filesystem::create_directories(tmp + "/in-the-way");
  EXPECT_EQ(io::replace_file(path, tmp, "third\n"), tmp + ": cannot create it: Is a directory");
  EXPECT_EQ(io::read_file(path).value_or("(none)"), "second\n");
  std::filesystem::remove_all(tmp);
  // The rename fails (the target is a non-empty folder): the temporary file does not stay behind.
  const std::string folder = dir.file("folder");
  std::filesystem::create_directories(folder + "/x");
  const std::string why = io::replace_file(folder, folder + ".tmp", "bytes");
  EXPECT_EQ(why.rfind(folder + ".tmp: cannot rename it to " + folder + ": ", 0), 0u) << why;
  EXPECT_FALSE(std::filesystem::exists(folder + ".tmp"));
  EXPECT_FALSE(io::read_file(dir.file("missing")).has_value());
}

TEST(ProcStat, ParsesANameWithSpacesAndParentheses) {
  // Fields 1-22 as the kernel writes them; the name is "a) (b c".
  const std::string text = "4242 (a) (b c) S 17 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 123 45\n";
  const auto st = parse_proc_stat(text);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->name, "a) (b c");
  EXPECT_EQ(st->state, 'S');
  EXPECT_EQ(st->ppid, 17);
  EXPECT_EQ(st->start_ticks, 987654u);
  EXPECT_FALSE(parse_proc_stat("4242 (no end S 1 2 3").has_value());
  EXPECT_FALSE(parse_proc_stat("4242 (short) S 1 2").has_value());
}

TEST(ProcStat, ReadsAStoppedChildAndForgetsItOnceReaped) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::raise(SIGSTOP);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, WUNTRACED), child);  // until it has stopped: no sleep
  ASSERT_TRUE(WIFSTOPPED(status));
  const auto st = read_proc_stat(child);
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->state, 'T');
  EXPECT_EQ(st->ppid, ::getpid());
  const auto self = read_proc_stat(::getpid());
  ASSERT_TRUE(self.has_value());
  EXPECT_EQ(st->name, self->name);  // a fork keeps the name
  EXPECT_GE(st->start_ticks, self->start_ticks);
  EXPECT_GT(self->start_ticks, 0u);
  ::kill(child, SIGKILL);
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(read_proc_stat(child).has_value());
}

}  // namespace
}  // namespace cohort
