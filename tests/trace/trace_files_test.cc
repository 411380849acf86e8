// The files the flight recorder and the timeline write (a failed attempt's dumps, each rank's
// timeline file) go to folders others may reach (a user's --trace-dir, a shared $TMPDIR): a link
// planted at a name they write is never followed, so the file it points to is never overwritten
// (docs/security.md, "Files and secrets").
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "support/test_support.h"
#include "trace/dump.h"
#include "trace/timeline.h"

namespace cohort::test {
namespace {

std::string contents(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(TraceFiles, ADumpIsNotWrittenThroughALinkPlantedAtItsTemporaryName) {
  TempDir dir, other;
  const std::string victim = other.file("victim");
  write_file(victim, "precious\n");
  // write_dump writes <path>.tmp.<pid>, then renames it to <path>: links at both names.
  const std::string path = dir.file("rank0.json");
  ASSERT_EQ(symlink(victim.c_str(), (path + ".tmp." + std::to_string(getpid())).c_str()), 0);
  ASSERT_EQ(symlink(victim.c_str(), path.c_str()), 0);
  trace::RankSnapshot s;
  s.rank = 0;
  s.world = 1;
  s.host = "h";
  trace::write_dump(path, s);
  EXPECT_EQ(contents(victim), "precious\n");
  EXPECT_FALSE(std::filesystem::is_symlink(path));
  EXPECT_EQ(trace::read_dump(path).world, 1);
}

TEST(TraceFiles, ATimelineRankFileIsNotWrittenThroughALinkPlantedAtItsName) {
  TempDir dir, other;
  const std::string victim = other.file("victim");
  write_file(victim, "precious\n");
  const std::string path = dir.file("rank0.timeline");
  ASSERT_EQ(symlink(victim.c_str(), path.c_str()), 0);
  {
    trace::TimelineWriter w(path);
    w.set_identity(0, 1, "h");
    w.add_instant("step", 0, 1);
    w.flush();
    // A link put there after the first write: the next write refuses it rather than follow it.
    std::filesystem::remove(path);
    ASSERT_EQ(symlink(victim.c_str(), path.c_str()), 0);
    w.add_instant("step", 1, 2);
    EXPECT_THROW(w.flush(), Error);
  }
  EXPECT_EQ(contents(victim), "precious\n");
}

}  // namespace
}  // namespace cohort::test
