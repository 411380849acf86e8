#pragma once
// Draws a Chrome-trace JSON timeline (the format chrome://tracing and Perfetto load) as a PNG, so a
// trace can be looked at in a CI log, a review or a terminal without a trace viewer: one lane per
// (pid, tid), complete ("X") events as boxes stacked by nesting depth, instant ("i") events as
// ticks, a millisecond axis and a colour legend. layout_timeline() does all the geometry and draws
// nothing, so tests check positions directly instead of decoding pixels.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "png_plot.h"

namespace cohort::tools::png {

struct TimelineOptions {
  int width = 1600;
  // The window drawn, on the trace's own clock (the events' "ts", in microseconds). NAN means from
  // the first event's start, or to the last event's end.
  double start_us = NAN;
  double end_us = NAN;
  std::string title;
};

struct TimelineLane {
  int64_t pid = 0, tid = 0;
  std::string label;  // "<process name> / <thread name>", or "pid P tid T" without metadata
  int rows = 1;       // sub-rows: one per nesting depth of its events in the window
  int y = 0, height = 0;
};

struct TimelineEvent {
  std::string name;
  bool instant = false;
  double ts_us = 0, dur_us = 0;
  size_t lane = 0;  // index into TimelineLayout::lanes
  int depth = 0;    // sub-row within the lane: how many of the lane's events enclose this one
  int x0 = 0, x1 = 0;  // pixel columns [x0, x1), clipped to the plot area, at least one wide
  int y0 = 0, y1 = 0;  // pixel rows [y0, y1)
  Rgb fill{};
};

struct TimelineTick {
  int x = 0;
  std::string label;  // e.g. "12.5 ms", measured from the trace's first event
};

struct TimelineLegendEntry {
  std::string word;  // the first word of the event names drawn in this colour
  Rgb fill{};
  int x = 0, y = 0;
};

struct TimelineLayout {
  int width = 0, height = 0;
  int plot_x0 = 0, plot_x1 = 0;     // pixel columns [plot_x0, plot_x1) of the time area
  double start_us = 0, end_us = 0;  // the window drawn
  std::string title;
  int title_y = 0, axis_y = 0;
  std::vector<TimelineLane> lanes;    // in display order, top to bottom
  std::vector<TimelineEvent> events;  // by lane, then start time
  std::vector<TimelineTick> ticks;
  std::vector<TimelineLegendEntry> legend;  // sorted by word
};

namespace timeline_detail {

using nlohmann::json;

constexpr int kMargin = 8, kRowHeight = 16, kLanePad = 3, kTitleHeight = 26, kAxisHeight = 30,
              kLegendRowHeight = 16, kSwatch = 10, kMinWidth = 200;

// FNV-1a rather than std::hash: the same on every platform and run, so a name keeps its colour.
inline uint32_t fnv1a(const std::string& s) {
  uint32_t h = 2166136261u;
  for (unsigned char ch : s) h = (h ^ ch) * 16777619u;
  return h;
}

inline std::string first_word(const std::string& name) { return name.substr(0, name.find(' ')); }

// ColorBrewer's Set3: twelve light colours that are easy to tell apart, black text readable on each.
inline constexpr Rgb kPalette[] = {{141, 211, 199}, {255, 255, 179}, {190, 186, 218}, {251, 128, 114},
                                   {128, 177, 211}, {253, 180, 98},  {179, 222, 105}, {252, 205, 229},
                                   {217, 217, 217}, {188, 128, 189}, {204, 235, 197}, {255, 237, 111}};

// Each word takes the palette slot its hash picks or, when a word before it (in sorted order) holds
// that slot, the next free one: a trace with up to 12 words never shows two in one colour.
inline std::map<std::string, Rgb> colours_for(const std::set<std::string>& words) {
  constexpr size_t n = std::size(kPalette);
  std::map<std::string, Rgb> colours;
  bool taken[n] = {};
  for (const std::string& word : words) {
    size_t slot = fnv1a(word) % n;
    for (size_t i = 0; i < n; ++i)
      if (!taken[(slot + i) % n]) {
        slot = (slot + i) % n;
        break;
      }
    taken[slot] = true;
    colours[word] = kPalette[slot];
  }
  return colours;
}

inline Rgb darker(Rgb c) {
  return {static_cast<uint8_t>(c.r * 0.55), static_cast<uint8_t>(c.g * 0.55), static_cast<uint8_t>(c.b * 0.55)};
}

// `s`, or its longest prefix ending in ".." that fits in `max_px` pixels ("" when none does).
inline std::string fit_text(const std::string& s, int max_px) {
  if (Canvas::text_width(s) <= max_px) return s;
  const int chars = max_px / Canvas::text_width(" ") - 2;
  return chars <= 0 ? std::string() : s.substr(0, static_cast<size_t>(chars)) + "..";
}

inline std::optional<double> number(const json& e, const char* key) {
  auto it = e.find(key);
  if (it == e.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

inline int64_t id(const json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_number() ? it->get<int64_t>() : 0;
}

// "" where the key is missing or not a string, so an odd event is skipped rather than thrown on.
inline std::string text(const json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
}

using LaneId = std::pair<int64_t, int64_t>;  // (pid, tid)

struct LaneEvent {
  LaneId lane;
  TimelineEvent event;  // event.lane is set once the lanes are ordered
};

struct Trace {
  std::vector<LaneEvent> events;
  std::map<int64_t, std::string> process_names;
  std::map<LaneId, std::string> thread_names;
  std::map<int64_t, int64_t> process_order;
  std::map<LaneId, int64_t> thread_order;
};

// Both the object form ({"traceEvents": [...]}) and the bare-array form of the format are read.
inline Trace parse(const json& trace) {
  static const json kEmpty = json::array();
  const json* list = &kEmpty;
  if (trace.is_array()) list = &trace;
  if (auto it = trace.find("traceEvents"); it != trace.end() && it->is_array()) list = &*it;
  Trace t;
  for (const json& e : *list) {
    if (!e.is_object()) continue;
    const std::string ph = text(e, "ph"), name = text(e, "name");
    const LaneId lane{id(e, "pid"), id(e, "tid")};
    if (ph == "M") {
      const json& args = e.contains("args") ? e.at("args") : kEmpty;
      const std::string given = text(args, "name");  // an empty one keeps the "pid P" / "tid T" fallback
      if (name == "process_name" && !given.empty()) t.process_names[lane.first] = given;
      if (name == "thread_name" && !given.empty()) t.thread_names[lane] = given;
      if (auto order = number(args, "sort_index")) {
        if (name == "process_sort_index") t.process_order[lane.first] = static_cast<int64_t>(*order);
        if (name == "thread_sort_index") t.thread_order[lane] = static_cast<int64_t>(*order);
      }
      continue;
    }
    const bool instant = ph == "i" || ph == "I";  // "I" is the format's older spelling
    const auto ts = number(e, "ts"), dur = instant ? std::optional<double>(0.0) : number(e, "dur");
    if ((ph != "X" && !instant) || !ts || !dur || *dur < 0) continue;
    TimelineEvent ev;
    ev.name = name, ev.instant = instant, ev.ts_us = *ts, ev.dur_us = *dur;
    t.events.push_back({lane, std::move(ev)});
  }
  return t;
}

inline std::string lane_label(const Trace& t, LaneId lane) {
  auto proc = t.process_names.find(lane.first);
  auto thread = t.thread_names.find(lane);
  const std::string pid = "pid " + std::to_string(lane.first), tid = "tid " + std::to_string(lane.second);
  if (proc == t.process_names.end() && thread == t.thread_names.end()) return pid + " " + tid;
  return (proc != t.process_names.end() ? proc->second : pid) + " / " +
         (thread != t.thread_names.end() ? thread->second : tid);
}

// Ticks at a round step (1, 2, 2.5 or 5 times a power of ten, in ms): the finest giving at most 10
// ticks. The next finer step gave more than 10 and is at most twice as fine, so there are 5 or more.
template <class XOf>
std::vector<TimelineTick> ticks(double origin_us, double start_us, double end_us, const XOf& x_of) {
  const double from_ms = (start_us - origin_us) / 1000, to_ms = (end_us - origin_us) / 1000;
  auto first = [&](double step) { return std::ceil(from_ms / step - 1e-9); };
  auto last = [&](double step) { return std::floor(to_ms / step + 1e-9); };
  double step = 0;
  for (double decade = std::pow(10.0, std::floor(std::log10((to_ms - from_ms) / 100))); step == 0; decade *= 10)
    for (double m : {1.0, 2.0, 2.5, 5.0})
      if (step == 0 && last(decade * m) - first(decade * m) + 1 <= 10) step = decade * m;
  auto is_whole = [](double v) { return std::fabs(v - std::round(v)) <= 1e-6 * v; };
  int decimals = 0;
  while (decimals < 6 && !is_whole(step * std::pow(10.0, decimals))) ++decimals;
  std::vector<TimelineTick> out;
  for (double k = first(step); k <= last(step); ++k) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "%.*f ms", decimals, k * step + 0.0);  // + 0.0: -0 prints as 0
    out.push_back({x_of(origin_us + k * step * 1000), buf});
  }
  return out;
}

}  // namespace timeline_detail

// Everything render_timeline_png draws, as positions. Throws std::runtime_error when the trace has
// no complete or instant events, when none falls in the window, or when the window is empty.
inline TimelineLayout layout_timeline(const nlohmann::json& trace, const TimelineOptions& opt) {
  using namespace timeline_detail;
  if (opt.width < kMinWidth) throw std::runtime_error("timeline width must be at least " + std::to_string(kMinWidth));
  Trace t = parse(trace);
  if (t.events.empty())
    throw std::runtime_error("trace has no drawable events (complete \"X\" or instant \"i\" events with a ts)");

  TimelineLayout L;
  L.width = opt.width, L.title = opt.title;
  double origin = INFINITY, last = -INFINITY;
  for (const LaneEvent& le : t.events)
    origin = std::min(origin, le.event.ts_us), last = std::max(last, le.event.ts_us + le.event.dur_us);
  L.start_us = std::isnan(opt.start_us) ? origin : opt.start_us;
  L.end_us = std::isnan(opt.end_us) ? last : opt.end_us;
  if (L.end_us <= L.start_us) {
    if (!std::isnan(opt.start_us) || !std::isnan(opt.end_us))
      throw std::runtime_error("timeline window is empty: end_us must be after start_us");
    L.end_us = L.start_us + 1;  // a trace of only instants at one time still gets a 1 us axis
  }

  // Lanes: every (pid, tid) with events anywhere in the trace, so windows of one trace line up.
  auto order = [&](LaneId lane) {
    auto p = t.process_order.find(lane.first);
    auto th = t.thread_order.find(lane);
    return std::make_tuple(p != t.process_order.end() ? p->second : lane.first, lane.first,
                           th != t.thread_order.end() ? th->second : lane.second, lane.second);
  };
  std::vector<LaneId> lane_ids;
  for (const LaneEvent& le : t.events) lane_ids.push_back(le.lane);
  std::sort(lane_ids.begin(), lane_ids.end(), [&](LaneId a, LaneId b) { return order(a) < order(b); });
  lane_ids.erase(std::unique(lane_ids.begin(), lane_ids.end()), lane_ids.end());
  for (LaneId lane : lane_ids) L.lanes.push_back({lane.first, lane.second, lane_label(t, lane)});

  // Colours over the whole trace, not the window, so every window of a trace uses the same ones.
  std::set<std::string> all_words;
  for (const LaneEvent& le : t.events) all_words.insert(first_word(le.event.name));
  const std::map<std::string, Rgb> colours = colours_for(all_words);
  for (LaneEvent& le : t.events) {
    TimelineEvent& e = le.event;
    e.fill = colours.at(first_word(e.name));
    const bool visible = e.dur_us > 0 ? e.ts_us < L.end_us && e.ts_us + e.dur_us > L.start_us
                                      : e.ts_us >= L.start_us && e.ts_us <= L.end_us;
    if (!visible) continue;
    e.lane = static_cast<size_t>(std::find(lane_ids.begin(), lane_ids.end(), le.lane) - lane_ids.begin());
    L.events.push_back(std::move(e));
  }
  if (L.events.empty()) throw std::runtime_error("trace has no events between the window's start_us and end_us");

  // Encloser first: by start, then the longer first, instants last. Each event takes the first
  // sub-row free at its start; with properly nested events that is the number of enclosing ones,
  // and overlaps that are not nesting still never draw over each other.
  auto placement_order = [](const TimelineEvent& e) { return std::make_tuple(e.lane, e.ts_us, -e.dur_us, e.instant); };
  std::sort(L.events.begin(), L.events.end(),
            [&](const TimelineEvent& a, const TimelineEvent& b) { return placement_order(a) < placement_order(b); });
  std::vector<std::vector<double>> row_end(L.lanes.size());  // per lane, per sub-row: end of its last event
  for (TimelineEvent& e : L.events) {
    std::vector<double>& rows = row_end[e.lane];
    auto free = std::find_if(rows.begin(), rows.end(), [&](double end) { return end <= e.ts_us; });
    e.depth = static_cast<int>(free - rows.begin());
    if (free == rows.end()) rows.push_back(0);
    rows[static_cast<size_t>(e.depth)] = e.ts_us + e.dur_us;
    L.lanes[e.lane].rows = std::max(L.lanes[e.lane].rows, e.depth + 1);
  }

  int label_px = 0;
  for (const TimelineLane& lane : L.lanes) label_px = std::max(label_px, Canvas::text_width(lane.label));
  L.plot_x0 = std::min(label_px + 2 * kMargin, L.width / 3);
  L.plot_x1 = L.width - kMargin;
  const double px_per_us = (L.plot_x1 - L.plot_x0) / (L.end_us - L.start_us);
  auto x_of = [&](double ts) { return L.plot_x0 + static_cast<int>(std::lround((ts - L.start_us) * px_per_us)); };

  int y = kMargin;
  L.title_y = y;
  if (!L.title.empty()) y += kTitleHeight;
  for (TimelineLane& lane : L.lanes) {
    lane.y = y, lane.height = lane.rows * kRowHeight + 2 * kLanePad;
    y += lane.height;
  }
  for (TimelineEvent& e : L.events) {
    e.x0 = std::clamp(x_of(e.ts_us), L.plot_x0, L.plot_x1 - 1);
    e.x1 = e.instant ? e.x0 + 1 : std::max(e.x0 + 1, std::min(x_of(e.ts_us + e.dur_us), L.plot_x1));
    e.y0 = L.lanes[e.lane].y + kLanePad + e.depth * kRowHeight + 1;
    e.y1 = e.y0 + kRowHeight - 2;
  }
  L.axis_y = y;
  L.ticks = ticks(origin, L.start_us, L.end_us, x_of);
  y += kAxisHeight;

  std::set<std::string> words;
  for (const TimelineEvent& e : L.events) words.insert(first_word(e.name));
  int x = kMargin;
  for (const std::string& word : words) {
    const int entry_px = kSwatch + 4 + Canvas::text_width(word) + 3 * kMargin;
    if (x > kMargin && x + entry_px > L.width - kMargin) x = kMargin, y += kLegendRowHeight;
    L.legend.push_back({word, colours.at(word), x, y});
    x += entry_px;
  }
  L.height = y + kLegendRowHeight + kMargin;
  return L;
}

inline void render_timeline_png(const nlohmann::json& trace, const std::string& png_path,
                                const TimelineOptions& opt = {}) {
  using namespace timeline_detail;
  const TimelineLayout L = layout_timeline(trace, opt);
  const Rgb ink{0, 0, 0}, grid{215, 215, 215}, shade{244, 244, 244}, separator{200, 200, 200};
  Canvas c(L.width, L.height);
  if (!L.title.empty()) c.text(kMargin, L.title_y, L.title, ink, 2);

  const int lanes_top = L.lanes.front().y;
  for (size_t i = 0; i < L.lanes.size(); ++i) {
    const TimelineLane& lane = L.lanes[i];
    if (i % 2) c.fill(0, lane.y, L.width, lane.height, shade);
    c.line(0, lane.y + lane.height - 1, L.width - 1, lane.y + lane.height - 1, separator);
    c.text(kMargin, lane.y + (lane.height - 7) / 2, fit_text(lane.label, L.plot_x0 - 2 * kMargin), ink);
  }
  for (const TimelineTick& tick : L.ticks) c.line(tick.x, lanes_top, tick.x, L.axis_y, grid);

  for (const TimelineEvent& e : L.events) {
    const Rgb outline = darker(e.fill);
    if (e.instant) {
      // A stem with a small downward arrowhead, so a tick stays visible next to a box edge.
      c.line(e.x0, e.y0, e.x0, e.y1 - 1, outline);
      for (int half = 2; half >= 0; --half) c.line(e.x0 - half, e.y0 + 2 - half, e.x0 + half, e.y0 + 2 - half, outline);
      continue;
    }
    c.fill(e.x0, e.y0, e.x1 - e.x0, e.y1 - e.y0, e.fill);
    c.frame(e.x0, e.y0, e.x1 - e.x0, e.y1 - e.y0, outline);
    const std::string name = fit_text(e.name, e.x1 - e.x0 - 6);
    if (!name.empty()) c.text(e.x0 + 3, e.y0 + (e.y1 - e.y0 - 7) / 2, name, ink);
  }

  c.line(L.plot_x0, L.axis_y, L.plot_x1 - 1, L.axis_y, ink);
  for (const TimelineTick& tick : L.ticks) {
    c.line(tick.x, L.axis_y, tick.x, L.axis_y + 4, ink);
    c.text(tick.x - Canvas::text_width(tick.label) / 2, L.axis_y + 9, tick.label, ink);
  }
  for (const TimelineLegendEntry& entry : L.legend) {
    c.fill(entry.x, entry.y, kSwatch, kSwatch, entry.fill);
    c.frame(entry.x, entry.y, kSwatch, kSwatch, darker(entry.fill));
    c.text(entry.x + kSwatch + 4, entry.y + 2, entry.word, ink);
  }
  c.save(png_path);
}

}  // namespace cohort::tools::png
