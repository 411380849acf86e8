// `cohort trace plot` as a user runs it: the window it picks on its own and the line saying so, for a
// real failed job's timeline (comm_worker ranks under `cohort run`) and a long synthetic run, and its
// errors in the flags' own terms.
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/test_support.h"

namespace cohort::test {
namespace {

using nlohmann::json;

// Two ranks training 100 steps of 10 ms, as the merge writes train::GradientSync's spans (training
// track, tid 0) and the communicator's operations (tid 1).
std::string write_long_run(const TempDir& dir) {
  json events = json::array();
  for (int rank = 0; rank < 2; ++rank) {
    events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", rank}, {"tid", 0},
                      {"args", {{"name", "rank " + std::to_string(rank) + " (host)"}}}});
    for (int step = 0; step < 100; ++step) {
      const double t = step * 10000.0 + rank * 500;
      events.push_back({{"ph", "X"}, {"name", "backward"}, {"cat", "ddp"}, {"pid", rank}, {"tid", 0}, {"ts", t},
                        {"dur", 4000}});
      events.push_back({{"ph", "X"}, {"name", "reduce and update"}, {"cat", "ddp"}, {"pid", rank}, {"tid", 0},
                        {"ts", t + 4000}, {"dur", 3000}});
      events.push_back({{"ph", "X"}, {"name", "allreduce"}, {"cat", "collective"}, {"pid", rank}, {"tid", 1},
                        {"ts", t + 4100}, {"dur", 2800}, {"args", {{"seq", step + 1}, {"ok", true}}}});
    }
  }
  const std::string path = dir.file("long.json");
  write_file(path, json{{"traceEvents", events}, {"displayTimeUnit", "ns"}}.dump());
  return path;
}

ProcessResult plot(const std::string& trace, const std::string& png, std::vector<std::string> flags = {}) {
  std::vector<std::string> argv{cohort_tool(), "trace", "plot", trace, "-o", png};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return run_process(argv, {}, 60);
}

TEST(TracePlotCli, AFailedJobIsDrawnAroundItsFailure) {
  TempDir dir;
  const std::string trace = dir.file("trace.json");
  // Rank 1 skips its 5th allreduce and exits after 9; rank 0's 10th fails when rank 1 is gone.
  auto job = run_process({cohort_tool(), "run", "-n", "2", "--timeline", trace, "--trace-dir", dir.file("tmp"),
                          COHORT_COMM_WORKER, "skip", "env", "0", "0"},
                         {"COHORT_TIMEOUT=20"}, 60);
  ASSERT_NE(job.exit_code, 0) << job.err;
  ASSERT_TRUE(std::filesystem::exists(trace)) << job.err;
  auto r = plot(trace, dir.file("failure.png"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, testing::ContainsRegex("window: [0-9.]+-[0-9.]+ ms, around the failed #10 allreduce on rank 0 "
                                            "\\([^)]+\\) / communicator [0-9a-f]+ at [0-9.]+ ms \\(it failed "
                                            "after [0-9.]+ ms\\); choose another with --start-ms/--end-ms "
                                            "\\(0-[0-9.]+\\) or --all\n"));
  EXPECT_TRUE(std::filesystem::file_size(dir.file("failure.png")) > 0);
}

TEST(TracePlotCli, ALongRunIsDrawnAFewStepsFromItsMiddle) {
  TempDir dir;
  const std::string trace = write_long_run(dir);
  auto r = plot(trace, dir.file("middle.png"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, testing::HasSubstr("window: 479.40-510.60 ms, steps 48-50 of 100, the middle of the run; choose "
                                        "another with --steps A-B (0-99), --start-ms/--end-ms (0-997.5) or --all\n"));
  r = plot(trace, dir.file("steps.png"), {"--steps", "10-11"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, testing::HasSubstr(", steps 10-11 of 100, as asked;"));
  r = plot(trace, dir.file("ms.png"), {"--start-ms", "100", "--end-ms", "125"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, testing::HasSubstr("window: 100.00-125.00 ms, as asked;"));
}

// The flags are in milliseconds and steps; so are the errors (not the renderer's start_us/end_us).
TEST(TracePlotCli, ErrorsNameTheFlagsInTheirUnits) {
  TempDir dir;
  const std::string trace = write_long_run(dir);
  const std::string png = dir.file("never.png");
  struct Case {
    std::vector<std::string> flags;
    std::string error;
  };
  const std::vector<Case> cases = {
      {{"--start-ms", "5", "--end-ms", "3"}, "--end-ms 3 must be after --start-ms 5"},
      {{"--start-ms", "5000"}, "the trace's end (997.5 ms) must be after --start-ms 5000"},
      {{"--start-ms", "8.5", "--end-ms", "9.5"},
       "no events between --start-ms 8.5 and --end-ms 9.5: the trace has events from 0 to 997.5 ms"},
      {{"--steps", "100-101"}, "--steps 100-101: the trace has 100 steps, numbered 0-99"},
      {{"--steps", "7-x"}, "--steps 7-x: expected A-B or A, step numbers from 0"},
      {{"--steps", "3", "--end-ms", "40"},
       "--steps, --start-ms/--end-ms and --all each choose the window: give one of them"},
  };
  for (const Case& c : cases) {
    auto r = plot(trace, png, c.flags);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, testing::HasSubstr(c.error)) << c.flags[0];
    EXPECT_THAT(r.err, testing::Not(testing::HasSubstr("_us"))) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;  // one line
  }
  EXPECT_FALSE(std::filesystem::exists(png));
}

}  // namespace
}  // namespace cohort::test
