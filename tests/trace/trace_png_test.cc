// tools/trace_png.h: the timeline layout (lanes, nesting depth, pixel spans, window clipping, axis,
// legend, labels) and the window `cohort trace plot` picks, checked as numbers, and the rendered file
// checked only for being a PNG of the asked width.
#include "tools/trace_png.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "collectives/op_kind.h"

namespace cohort::tools::png {
namespace {

using nlohmann::json;

json meta(const std::string& what, int pid, int tid, const json& args) {
  return {{"ph", "M"}, {"name", what}, {"pid", pid}, {"tid", tid}, {"args", args}};
}

json complete(const std::string& name, int pid, int tid, double ts, double dur) {
  return {{"ph", "X"}, {"name", name}, {"cat", "ddp"}, {"pid", pid}, {"tid", tid}, {"ts", ts}, {"dur", dur}};
}

json instant(const std::string& name, int pid, int tid, double ts) {
  return {{"ph", "i"}, {"name", name}, {"cat", "ddp"}, {"pid", pid}, {"tid", tid}, {"ts", ts}, {"s", "t"}};
}

// A communicator operation as the merge writes it: its number, and whether it completed.
json operation(const std::string& name, int pid, double ts, double dur, int seq, bool ok = true) {
  return {{"ph", "X"},   {"name", name}, {"cat", "collective"}, {"pid", pid},
          {"tid", 1},    {"ts", ts},     {"dur", dur},          {"args", {{"seq", seq}, {"ok", ok}}}};
}

// `ranks` ranks training `steps` steps of 10 ms from 1 ms on, as train::GradientSync records them: on
// the training track (tid 0) "backward" then the fused "reduce and update", each step's allreduce on
// the communicator's track (tid 1). Rank r's step starts r * 0.5 ms later than rank 0's.
std::vector<json> training_run(int ranks, int steps) {
  std::vector<json> events;
  for (int r = 0; r < ranks; ++r)
    for (int k = 0; k < steps; ++k) {
      const double t = 1000 + k * 10000.0 + r * 500;
      events.push_back(complete("backward", r, 0, t, 4000));
      events.push_back(complete("reduce and update", r, 0, t + 4000, 3000));
      events.push_back(operation("allreduce", r, t + 4100, 2800, k + 1));
    }
  return events;
}

json trace_of(std::vector<json> events) { return {{"traceEvents", events}, {"displayTimeUnit", "ns"}}; }

const TimelineEvent& find_event(const TimelineLayout& layout, const std::string& name) {
  for (const TimelineEvent& e : layout.events)
    if (e.name == name) return e;
  throw std::runtime_error("no event named " + name);
}

TEST(TracePng, LanesOrderedAndLabelledFromMetadata) {
  const json trace = trace_of({
      meta("process_name", 1, 0, {{"name", "rank 1 (host)"}}),
      meta("process_name", 0, 0, {{"name", "rank 0 (host)"}}),
      meta("thread_name", 0, 7, {{"name", "collectives"}}),
      meta("thread_name", 0, 3, {{"name", "main"}}),
      meta("thread_name", 1, 3, {{"name", "main"}}),
      meta("thread_sort_index", 1, 9, {{"sort_index", -1}}),  // before rank 1's tid 3
      complete("allreduce", 1, 3, 0, 10),
      complete("allreduce", 0, 7, 0, 10),
      complete("backward", 0, 3, 0, 10),
      instant("bucket 0 ready", 1, 9, 5),
      complete("queue wait", 4, 2, 0, 10),  // no metadata at all
  });
  const TimelineLayout layout = layout_timeline(trace, {});
  std::vector<std::string> labels;
  for (const TimelineLane& lane : layout.lanes) labels.push_back(lane.label);
  EXPECT_THAT(labels, testing::ElementsAre("rank 0 (host) / main", "rank 0 (host) / collectives",
                                           "rank 1 (host) / tid 9", "rank 1 (host) / main", "pid 4 tid 2"));
  for (size_t i = 1; i < layout.lanes.size(); ++i)
    EXPECT_EQ(layout.lanes[i].y, layout.lanes[i - 1].y + layout.lanes[i - 1].height);
  EXPECT_EQ(find_event(layout, "backward").lane, 0u);
  EXPECT_EQ(find_event(layout, "bucket 0 ready").lane, 2u);
  EXPECT_EQ(find_event(layout, "queue wait").lane, 4u);
}

TEST(TracePng, NestedEventsGetDepthOne) {
  const json trace = trace_of({
      complete("step", 0, 0, 0, 1000),
      complete("backward", 0, 0, 100, 500),
      complete("allreduce bucket 0", 0, 0, 200, 100),  // inside backward: depth 2
      instant("bucket 0 ready", 0, 0, 150),            // inside backward, outside the allreduce
      complete("optimizer step", 0, 0, 700, 200),
      complete("allreduce", 0, 1, 50, 100),  // another lane, so not nested under "step"
  });
  const TimelineLayout layout = layout_timeline(trace, {});
  EXPECT_EQ(find_event(layout, "step").depth, 0);
  EXPECT_EQ(find_event(layout, "backward").depth, 1);
  EXPECT_EQ(find_event(layout, "optimizer step").depth, 1);
  EXPECT_EQ(find_event(layout, "allreduce bucket 0").depth, 2);
  EXPECT_EQ(find_event(layout, "bucket 0 ready").depth, 2);
  EXPECT_EQ(find_event(layout, "allreduce").depth, 0);
  ASSERT_EQ(layout.lanes.size(), 2u);
  EXPECT_EQ(layout.lanes[0].rows, 3);
  EXPECT_EQ(layout.lanes[1].rows, 1);
  EXPECT_GT(layout.lanes[0].height, layout.lanes[1].height);
  // Sub-rows stack downwards without overlapping.
  EXPECT_GE(find_event(layout, "backward").y0, find_event(layout, "step").y1);
  EXPECT_GE(find_event(layout, "allreduce bucket 0").y0, find_event(layout, "backward").y1);
}

TEST(TracePng, OverlapsThatAreNotNestingNeverShareASubRow) {
  const json trace = trace_of({complete("a", 0, 0, 0, 10), complete("b", 0, 0, 5, 10), complete("c", 0, 0, 12, 10)});
  const TimelineLayout layout = layout_timeline(trace, {});
  EXPECT_EQ(find_event(layout, "a").depth, 0);
  EXPECT_EQ(find_event(layout, "b").depth, 1);
  EXPECT_EQ(find_event(layout, "c").depth, 0);  // "a" has ended; "b" still holds sub-row 1
}

TEST(TracePng, XSpanIsProportionalToTime) {
  const json trace = trace_of({
      complete("backward", 0, 0, 1000, 1000),
      complete("allreduce", 0, 0, 3000, 3000),
      complete("tiny", 0, 1, 2500, 0.001),
      instant("bucket 0 ready", 0, 1, 6000),
  });
  TimelineOptions opt;
  opt.width = 1200;
  const TimelineLayout layout = layout_timeline(trace, opt);
  EXPECT_EQ(layout.start_us, 1000);
  EXPECT_EQ(layout.end_us, 6000);
  EXPECT_GT(layout.plot_x0, 0);
  EXPECT_EQ(layout.plot_x1, opt.width - 8);
  const double px_per_us = (layout.plot_x1 - layout.plot_x0) / 5000.0;
  const TimelineEvent& backward = find_event(layout, "backward");
  const TimelineEvent& allreduce = find_event(layout, "allreduce");
  EXPECT_EQ(backward.x0, layout.plot_x0);
  EXPECT_NEAR(backward.x1 - backward.x0, 1000 * px_per_us, 1);
  EXPECT_NEAR(allreduce.x0 - layout.plot_x0, 2000 * px_per_us, 1);
  EXPECT_NEAR(allreduce.x1 - allreduce.x0, 3000 * px_per_us, 1);
  EXPECT_EQ(allreduce.x1, layout.plot_x1);
  const TimelineEvent& tiny = find_event(layout, "tiny");
  EXPECT_EQ(tiny.x1 - tiny.x0, 1);  // never thinner than a pixel
  EXPECT_NEAR(tiny.x0 - layout.plot_x0, 1500 * px_per_us, 1);
}

TEST(TracePng, WindowClips) {
  const json trace = trace_of({
      complete("before", 0, 0, 0, 1000),
      complete("straddles start", 0, 0, 1000, 1000),
      complete("inside", 0, 0, 2100, 100),
      complete("straddles end", 0, 0, 3000, 3000),
      complete("after", 0, 0, 7000, 10),
      instant("early tick", 0, 0, 100),
      complete("elsewhere", 0, 1, 8000, 10),  // its lane stays, empty, so windows line up
  });
  TimelineOptions opt;
  opt.start_us = 1500;
  opt.end_us = 4000;
  const TimelineLayout layout = layout_timeline(trace, opt);
  std::vector<std::string> names;
  for (const TimelineEvent& e : layout.events) names.push_back(e.name);
  EXPECT_THAT(names, testing::ElementsAre("straddles start", "inside", "straddles end"));
  EXPECT_EQ(layout.lanes.size(), 2u);
  EXPECT_EQ(find_event(layout, "straddles start").x0, layout.plot_x0);
  EXPECT_EQ(find_event(layout, "straddles end").x1, layout.plot_x1);
  const double px_per_us = (layout.plot_x1 - layout.plot_x0) / 2500.0;
  EXPECT_NEAR(find_event(layout, "straddles start").x1 - layout.plot_x0, 500 * px_per_us, 1);
  // Axis labels count from the trace's first event, not from the window.
  ASSERT_FALSE(layout.ticks.empty());
  EXPECT_EQ(layout.ticks.front().label, "1.5 ms");
  EXPECT_EQ(layout.ticks.front().x, layout.plot_x0);
}

TEST(TracePng, AxisHasFiveToTenMillisecondTicks) {
  for (double span_us : {1.0, 37.0, 1000.0, 12500.0, 99999.0, 3.6e9}) {
    const TimelineLayout layout = layout_timeline(trace_of({complete("step", 0, 0, 0, span_us)}), {});
    EXPECT_GE(layout.ticks.size(), 5u) << span_us;
    EXPECT_LE(layout.ticks.size(), 10u) << span_us;
    for (const TimelineTick& tick : layout.ticks) {
      EXPECT_THAT(tick.label, testing::EndsWith(" ms"));
      EXPECT_GE(tick.x, layout.plot_x0);
      EXPECT_LE(tick.x, layout.plot_x1);
    }
  }
  // A 2 ms step would give 12 ticks, so this takes the 2.5 ms one.
  const TimelineLayout layout = layout_timeline(trace_of({complete("step", 0, 0, 0, 22500)}), {});
  ASSERT_EQ(layout.ticks.size(), 10u);
  EXPECT_EQ(layout.ticks[0].label, "0.0 ms");  // not "-0.0 ms"
  EXPECT_EQ(layout.ticks[1].label, "2.5 ms");
  EXPECT_EQ(layout.ticks.back().label, "22.5 ms");
}

TEST(TracePng, ColourFollowsTheFirstWordAndTheLegendListsEachOnce) {
  const json trace = trace_of({
      complete("allreduce bucket 0", 0, 0, 0, 10),
      complete("allreduce bucket 1", 0, 0, 20, 10),
      complete("allreduce", 0, 1, 0, 10),
      complete("backward", 0, 1, 20, 10),
  });
  const TimelineLayout layout = layout_timeline(trace, {});
  const Rgb a = find_event(layout, "allreduce bucket 0").fill, b = find_event(layout, "allreduce").fill;
  const Rgb c = find_event(layout, "backward").fill;
  EXPECT_TRUE(a.r == b.r && a.g == b.g && a.b == b.b);
  EXPECT_FALSE(a.r == c.r && a.g == c.g && a.b == c.b);
  std::vector<std::string> words;
  for (const TimelineLegendEntry& entry : layout.legend) words.push_back(entry.name);
  EXPECT_THAT(words, testing::ElementsAre("allreduce", "backward"));
}

TEST(TracePng, UpToTwelveWordsGetTwelveDistinctColours) {
  std::vector<json> events;
  for (const char* word : {"allreduce", "allgather", "broadcast", "backward", "forward", "step", "optimizer", "wait",
                           "queue", "send", "recv", "bucket"})
    events.push_back(complete(std::string(word) + " 0", 0, 0, static_cast<double>(events.size()) * 10, 5));
  const TimelineLayout layout = layout_timeline(trace_of(events), {});
  std::set<std::tuple<int, int, int>> colours;
  for (const TimelineLegendEntry& entry : layout.legend) colours.insert({entry.fill.r, entry.fill.g, entry.fill.b});
  EXPECT_EQ(layout.legend.size(), 12u);
  EXPECT_EQ(colours.size(), 12u);
}

// A label is the whole name, its leading whole words, or its first word cut to 4 letters or more and
// marked with "."; never a stub like "r.." that says nothing.
TEST(TracePng, LabelsAreTheNameALegibleShorteningOrNothing) {
  using timeline_detail::fit_text;
  const std::vector<std::string> names = {"backward", "fused reduce+SGD step", "wait for buckets", "bucket ready 3",
                                          "allreduce x12", "reduce_scatter", "send/recv", "barrier",
                                          "rank 0 (vm) / communicator 016e929f", "a", "split"};
  for (const std::string& name : names)
    for (int px = 0; px <= 240; ++px) {
      const std::string label = fit_text(name, px);
      EXPECT_LE(Canvas::text_width(label), px) << name;
      EXPECT_THAT(label, testing::Not(testing::EndsWith(".."))) << name << " at " << px;
      if (label.empty() || label == name) continue;
      const bool whole_words = name.compare(0, label.size() + 1, label + " ") == 0;
      const std::string first = name.substr(0, name.find(' '));
      const bool abbreviation = label.back() == '.' && label.size() - 1 >= 4 && label.size() < first.size() &&
                                first.compare(0, label.size() - 1, label, 0, label.size() - 1) == 0;
      EXPECT_TRUE(whole_words || abbreviation) << name << " at " << px << " px: \"" << label << "\"";
      EXPECT_THAT(label, testing::Not(testing::EndsWith(" /"))) << name;
    }
  // The spans the old fitting cut to "r.." and "wai..": nothing, or a shorter whole phrase.
  EXPECT_EQ(fit_text("reduce and update", 18), "");
  EXPECT_EQ(fit_text("wait for buckets", 60), "wait for");
  EXPECT_EQ(fit_text("backward", 40), "backw.");
  EXPECT_EQ(fit_text("allreduce x12", 60), "allreduce");
  EXPECT_EQ(fit_text("rank 0 (vm) / communicator 016e929f", 100), "rank 0 (vm)");
}

TEST(TracePng, BoxesOfTheDefaultWindowShowTheShownNamesLegibly) {
  const json trace = trace_of(training_run(2, 100));
  TimelineOptions opt;
  const TimelineWindow window = choose_window(trace, {});
  opt.start_us = window.start_us, opt.end_us = window.end_us;
  const TimelineLayout layout = layout_timeline(trace, opt);
  int fused_labels = 0;
  for (const TimelineEvent& e : layout.events) {
    if (e.name != "reduce and update") continue;
    // Wide enough at this zoom to say what it is, and never by the collective's name alone.
    EXPECT_EQ(e.label, "fused reduce+SGD step");
    ++fused_labels;
  }
  EXPECT_GE(fused_labels, 2 * kDefaultSteps);
}

// The legend's names for the data-parallel spans are none of the collectives' names, nor start with
// one: "reduce" in the legend is the reduce collective only.
TEST(TracePng, LegendNamesOfTrainingSpansAreNotCollectiveNames) {
  std::set<std::string> collectives;
  for (int k = int(coll::OpKind::kAllreduce); k <= int(coll::kLastOpKind); ++k)
    collectives.insert(coll::op_kind_name(coll::OpKind(k)));
  ASSERT_TRUE(collectives.count("reduce"));
  std::vector<json> events = {complete("backward", 0, 0, 0, 10), complete("reduce and update", 0, 0, 20, 10),
                              complete("wait for buckets", 0, 0, 40, 10), instant("bucket ready 0", 0, 0, 5)};
  double ts = 0;
  for (const std::string& name : collectives) events.push_back(operation(name, 0, ts += 20, 10, 1));
  const TimelineLayout layout = layout_timeline(trace_of(events), {});
  std::set<std::string> legend;
  for (const TimelineLegendEntry& entry : layout.legend) legend.insert(entry.name);
  EXPECT_EQ(legend.size(), collectives.size() + 4);
  for (const std::string& name : legend) {
    if (collectives.count(name)) continue;
    EXPECT_FALSE(collectives.count(name.substr(0, name.find_first_of(" +")))) << name;
  }
  for (const char* span : {"backward", "reduce and update", "wait for buckets", "bucket ready 0"})
    EXPECT_FALSE(collectives.count(timeline_detail::legend_name(span))) << span;
  EXPECT_TRUE(legend.count("fused reduce+SGD step"));

  // And they differ in colour, not only in name.
  const TimelineLayout two = layout_timeline(
      trace_of({operation("reduce", 0, 0, 10, 1), complete("reduce and update", 0, 0, 20, 10)}), {});
  const Rgb a = find_event(two, "reduce").fill, b = find_event(two, "reduce and update").fill;
  EXPECT_FALSE(a.r == b.r && a.g == b.g && a.b == b.b);
  ASSERT_EQ(two.legend.size(), 2u);
}

TEST(TracePng, FailedOperationsAreFramedAndInTheLegend) {
  const TimelineLayout layout = layout_timeline(
      trace_of({operation("allreduce", 0, 0, 10, 1), operation("allreduce", 0, 20, 100, 2, false)}), {});
  EXPECT_FALSE(layout.events[0].failed);
  EXPECT_TRUE(layout.events[1].failed);
  EXPECT_EQ(layout.events[1].seq, 2);
  ASSERT_EQ(layout.legend.size(), 2u);
  EXPECT_EQ(layout.legend.back().name, "failed (ok: false)");
}

TEST(TracePng, DefaultWindowIsAFewStepsInTheMiddleOfALongRun) {
  const json trace = trace_of(training_run(2, 100));
  const TimelineWindow w = choose_window(trace, {});
  EXPECT_EQ(w.steps, 100);
  EXPECT_FALSE(w.around_failure);
  EXPECT_EQ(w.first_step, 48);
  EXPECT_EQ(w.last_step, 50);
  // Step 48 starts with rank 0's backward at 481 ms; step 50 ends where step 51 starts, at 511 ms.
  EXPECT_LE(w.start_us, 481000);
  EXPECT_GT(w.start_us, 471000);  // not a step earlier
  EXPECT_GE(w.end_us, 511000);
  EXPECT_LT(w.end_us, 521000);
  EXPECT_THAT(w.description, testing::HasSubstr("steps 48-50 of 100, the middle of the run"));
  EXPECT_THAT(w.description, testing::HasSubstr("--steps A-B (0-99)"));
  EXPECT_THAT(w.description, testing::HasSubstr("--start-ms/--end-ms"));
  EXPECT_THAT(w.description, testing::StartsWith("window: 479.40-510.60 ms, steps 48-50"));
  TimelineOptions opt;
  opt.start_us = w.start_us, opt.end_us = w.end_us;
  const TimelineLayout layout = layout_timeline(trace, opt);
  EXPECT_LE(layout.events.size(), 4u * 3 * 5);  // 3 steps and their neighbours' edges, not 100 steps
}

TEST(TracePng, DefaultWindowIsAroundTheFailure) {
  std::vector<json> events = training_run(2, 100);
  // Rank 1's allreduce of step 70 never completed: it failed 2 s later, after which nothing ran.
  events.erase(std::remove_if(events.begin(), events.end(),
                              [](const json& e) { return e["ts"].get<double>() > 1000 + 70 * 10000.0 + 500; }),
               events.end());
  events.push_back(operation("allreduce", 1, 1000 + 70 * 10000.0 + 500 + 4100, 2e6, 71, false));
  const TimelineWindow w = choose_window(trace_of(events), {});
  EXPECT_TRUE(w.around_failure);
  EXPECT_EQ(w.first_step, 69);
  EXPECT_EQ(w.last_step, 70);
  const double step_69 = 1000 + 69 * 10000.0, failed_at = 1000 + 70 * 10000.0 + 500 + 4100;
  EXPECT_LE(w.start_us, step_69);
  EXPECT_GT(w.start_us, step_69 - 10000);  // not a step earlier
  // It failed 2 s later: the window goes as far past its start as it begins before it, not 2 s on.
  EXPECT_GE(w.end_us, failed_at + (failed_at - step_69));
  EXPECT_LT(w.end_us, failed_at + (failed_at - step_69) + 2000);
  EXPECT_EQ(w.steps, 71);
  EXPECT_THAT(w.description, testing::HasSubstr("around the failed #71 allreduce on pid 1 tid 1 at 704.60 ms (it "
                                                "failed after 2000.00 ms; steps 69-70 of 71)"));
  TimelineOptions opt;
  opt.start_us = w.start_us, opt.end_us = w.end_us;
  const TimelineLayout layout = layout_timeline(trace_of(events), opt);
  const auto failed =
      std::find_if(layout.events.begin(), layout.events.end(), [](const TimelineEvent& e) { return e.failed; });
  ASSERT_NE(failed, layout.events.end());
  EXPECT_EQ(failed->x1, layout.plot_x1);  // it runs on past the window's end
  EXPECT_NEAR(failed->x0, (layout.plot_x0 + layout.plot_x1) / 2, 10);

  // Without steps: the operations of its lane just before it.
  std::vector<json> ops;
  for (int i = 0; i < 100; ++i) ops.push_back(operation("allreduce", 0, i * 100.0, 50, i + 1, i != 60));
  const TimelineWindow bare = choose_window(trace_of(ops), {});
  EXPECT_TRUE(bare.around_failure);
  EXPECT_EQ(bare.steps, 0);
  EXPECT_LE(bare.start_us, 52 * 100.0);
  EXPECT_GT(bare.start_us, 51 * 100.0);
  EXPECT_GE(bare.end_us, 60 * 100.0 + 50);
  EXPECT_LT(bare.end_us, 61 * 100.0);
}

TEST(TracePng, DefaultWindowOfAShortTraceIsTheWholeAndOfAnUntrainedOneTheBusiestLanesMiddle) {
  const json short_run = trace_of(training_run(2, 3));
  const TimelineWindow whole = choose_window(short_run, {});
  EXPECT_EQ(whole.start_us, 1000);
  EXPECT_EQ(whole.end_us, 1000 + 2 * 10000.0 + 500 + 7000);
  EXPECT_THAT(whole.description, testing::HasSubstr("the whole trace"));

  std::vector<json> ops;
  for (int i = 0; i < 100; ++i) ops.push_back(operation("broadcast", 0, i * 100.0, 50, i + 1));
  ops.push_back(complete("queue wait", 3, 3, 0, 10000));
  const TimelineWindow middle = choose_window(trace_of(ops), {});
  EXPECT_EQ(middle.steps, 0);
  EXPECT_LE(middle.start_us, 38 * 100.0);
  EXPECT_GT(middle.start_us, 37 * 100.0);
  EXPECT_GE(middle.end_us, 61 * 100.0 + 50);
  EXPECT_THAT(middle.description, testing::HasSubstr("24 events of pid 0 tid 1 in the middle of the trace"));
}

TEST(TracePng, AskedWindowsByStepsAndMilliseconds) {
  const json trace = trace_of(training_run(2, 100));
  WindowRequest steps;
  steps.first_step = 10, steps.last_step = 11;
  const TimelineWindow w = choose_window(trace, steps);
  EXPECT_LE(w.start_us, 101000);
  EXPECT_GT(w.start_us, 91000);
  EXPECT_GE(w.end_us, 121000);
  EXPECT_LT(w.end_us, 131000);
  EXPECT_THAT(w.description, testing::HasSubstr("steps 10-11 of 100, as asked"));
  WindowRequest last;
  last.first_step = last.last_step = 99;
  EXPECT_GE(choose_window(trace, last).end_us, 1000 + 99 * 10000.0 + 500 + 7000);  // the last rank's last span

  // Milliseconds count from the trace's first event, here at ts 1000 us.
  WindowRequest ms;
  ms.start_ms = 10, ms.end_ms = 20;
  const TimelineWindow by_ms = choose_window(trace, ms);
  EXPECT_EQ(by_ms.start_us, 11000);
  EXPECT_EQ(by_ms.end_us, 21000);
  EXPECT_THAT(by_ms.description, testing::StartsWith("window: 10.00-20.00 ms, as asked"));
  WindowRequest all;
  all.all = true;
  EXPECT_EQ(choose_window(trace, all).start_us, 1000);
}

// Errors speak in the flags the user typed, in their units: never start_us/end_us.
TEST(TracePng, WindowErrorsNameTheMillisecondFlags) {
  const json trace = trace_of(training_run(1, 100));
  auto error_of = [&](const WindowRequest& req, const json& t) -> std::string {
    try {
      choose_window(t, req);
    } catch (const WindowError& e) {
      EXPECT_THAT(e.what(), testing::Not(testing::HasSubstr("_us")));
      return e.what();
    }
    ADD_FAILURE() << "no WindowError";
    return "";
  };
  WindowRequest backwards;
  backwards.start_ms = 5, backwards.end_ms = 3;
  EXPECT_EQ(error_of(backwards, trace), "--end-ms 3 must be after --start-ms 5");
  WindowRequest late;
  late.start_ms = 5000;
  EXPECT_EQ(error_of(late, trace), "the trace's end (997.0 ms) must be after --start-ms 5000");
  WindowRequest empty;
  empty.start_ms = 8.5, empty.end_ms = 9.5;  // after step 0's reduce and update, before step 1's backward
  EXPECT_EQ(error_of(empty, trace),
            "no events between --start-ms 8.5 and --end-ms 9.5: the trace has events from 0 to 997.0 ms");
  WindowRequest steps;
  steps.first_step = 150, steps.last_step = 160;
  EXPECT_EQ(error_of(steps, trace), "--steps 150-160: the trace has 100 steps, numbered 0-99");
  steps.first_step = 5, steps.last_step = 4;
  EXPECT_EQ(error_of(steps, trace), "--steps 5-4: the first step must not be after the last");
  steps.first_step = steps.last_step = 0;
  EXPECT_THAT(error_of(steps, trace_of({operation("allreduce", 0, 0, 10, 1)})),
              testing::HasSubstr("--steps 0-0: the trace has no steps"));
  WindowRequest both;
  both.start_ms = 1, both.first_step = both.last_step = 2;
  EXPECT_THAT(error_of(both, trace), testing::HasSubstr("give one of them"));
}

TEST(TracePng, ReadsTheBareArrayFormAndSkipsMalformedEvents) {
  const json trace = json::array({
      complete("step", 0, 0, 0, 100),
      json{{"ph", 5}, {"name", "numeric ph"}, {"ts", 1}, {"dur", 1}},
      json{{"ph", "X"}, {"name", "no dur"}, {"ts", 1}},
      json{{"ph", "X"}, {"name", "negative dur"}, {"ts", 1}, {"dur", -1}},
      json{{"ph", "X"}, {"name", "string ts"}, {"ts", "1"}, {"dur", 1}},
      meta("thread_name", 0, 0, "not an object"),
      "not an event",
  });
  const TimelineLayout layout = layout_timeline(trace, {});
  ASSERT_EQ(layout.events.size(), 1u);
  EXPECT_EQ(layout.events[0].name, "step");
  EXPECT_EQ(layout.lanes[0].label, "pid 0 tid 0");  // as if the unusable thread_name were absent
}

TEST(TracePng, TraceWithoutDrawableEventsThrows) {
  EXPECT_THROW(layout_timeline(trace_of({}), {}), std::runtime_error);
  EXPECT_THROW(layout_timeline(json::object(), {}), std::runtime_error);
  const json only_metadata = trace_of({meta("process_name", 0, 0, {{"name", "rank 0"}}),
                                       json{{"ph", "B"}, {"name", "begin"}, {"pid", 0}, {"tid", 0}, {"ts", 1}}});
  try {
    layout_timeline(only_metadata, {});
    FAIL() << "expected a throw";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), testing::HasSubstr("no drawable events"));
  }
  TimelineOptions window;
  window.start_us = 5000;
  window.end_us = 6000;
  EXPECT_THROW(layout_timeline(trace_of({complete("step", 0, 0, 0, 10)}), window), std::runtime_error);
  EXPECT_THROW(render_timeline_png(trace_of({}), testing::TempDir() + "/never.png"), std::runtime_error);
}

TEST(TracePng, RenderWritesAPngOfTheRequestedWidth) {
  const json trace = trace_of({
      meta("process_name", 0, 0, {{"name", "rank 0 (host)"}}),
      meta("thread_name", 0, 1, {{"name", "collectives"}}),
      complete("step", 0, 1, 0, 1000),
      complete("backward", 0, 1, 100, 500),
      instant("bucket 0 ready", 0, 1, 300),
  });
  TimelineOptions opt;
  opt.width = 777;
  opt.title = "TracePng test";
  const std::string path = testing::TempDir() + "/trace_png_test.png";
  render_timeline_png(trace, path, opt);
  std::ifstream in(path, std::ios::binary);
  const std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  ASSERT_GE(bytes.size(), 24u);
  const std::vector<unsigned char> signature = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  EXPECT_TRUE(std::equal(signature.begin(), signature.end(), bytes.begin()));
  EXPECT_EQ(std::string(bytes.begin() + 12, bytes.begin() + 16), "IHDR");
  auto be32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t i = 0; i < 4; ++i) v = (v << 8) | bytes[at + i];
    return v;
  };
  EXPECT_EQ(be32(16), 777u);
  EXPECT_EQ(be32(20), static_cast<uint32_t>(layout_timeline(trace, opt).height));
}

}  // namespace
}  // namespace cohort::tools::png
