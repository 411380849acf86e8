// tools/trace_png.h: the timeline layout (lanes, nesting depth, pixel spans, window clipping, axis,
// legend) checked as numbers, and the rendered file checked only for being a PNG of the asked width.
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
  for (const TimelineLegendEntry& entry : layout.legend) words.push_back(entry.word);
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
