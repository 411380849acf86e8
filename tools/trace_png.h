#pragma once
// Draws a Chrome-trace JSON timeline (the format chrome://tracing and Perfetto load) as a PNG, so a
// trace can be looked at in a CI log, a review or a terminal without a trace viewer: one lane per
// (pid, tid), complete ("X") events as boxes stacked by nesting depth, instant ("i") events as
// ticks, a millisecond axis and a colour legend. layout_timeline() does all the geometry and draws
// nothing, so tests check positions directly instead of decoding pixels. A whole training run is
// thousands of steps, unreadable at any width, so choose_window() picks what `cohort trace plot`
// draws when it is not told: the failure when the trace shows one, else a few steps in the middle.

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
  std::string name;   // as in the trace
  std::string label;  // what its box shows: the name, shortened to fit (fit_text), or "" when nothing legible fits
  bool instant = false;
  bool failed = false;  // an operation that ended in an error ("args": {"ok": false}); drawn with a red frame
  int64_t seq = -1;     // an operation's number on its communicator ("args": {"seq"}), -1 when it has none
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
  std::string name;  // what the events drawn in this colour are (legend_name), or "failed" for the red frame
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
  std::vector<TimelineLegendEntry> legend;  // sorted by name, "failed" last
};

// The window `cohort trace plot` was asked for, in its flags' own terms: choose_window() turns it into
// one on the trace's clock, and its errors name these flags.
struct WindowRequest {
  double start_ms = NAN, end_ms = NAN;  // --start-ms / --end-ms: from the trace's first event
  int first_step = -1, last_step = -1;  // --steps A-B (numbered from 0); -1: not given
  bool all = false;                     // --all: the whole trace
};

struct TimelineWindow {
  double start_us = 0, end_us = 0;  // on the trace's clock (its events' "ts")
  int steps = 0;                    // steps in the whole trace (see choose_window)
  int first_step = -1, last_step = -1;  // the steps drawn, when the window was chosen by steps
  bool around_failure = false;
  // One line: the window, why it was chosen, and the flags that choose another.
  std::string description;
};

// A window that cannot be drawn as asked: the message names the flags (--start-ms, --steps, ...).
class WindowError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
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

// `name` without a trailing " <number>" (a bucket's or a span's index).
inline std::string without_index(const std::string& name) {
  const size_t space = name.rfind(' ');
  if (space == std::string::npos || space + 1 == name.size()) return name;
  for (size_t i = space + 1; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return name;
  return name.substr(0, space);
}

// The data-parallel layer's spans and instants (train::GradientSync) under the names the legend and
// their boxes show. In the trace, the fused step is "reduce and update", whose first word is the
// name of a collective: a legend of first words listed both as "reduce".
struct TrainingName {
  const char* in_trace;
  const char* shown;
};
inline constexpr TrainingName kTrainingNames[] = {
    {"backward", "backward"},
    {"reduce and update", "fused reduce+SGD step"},
    {"wait for buckets", "wait for buckets"},
    {"bucket ready", "bucket ready"},
};

inline const TrainingName* training_name(const std::string& name) {
  const std::string bare = without_index(name);
  for (const TrainingName& t : kTrainingNames)
    if (bare == t.in_trace) return &t;
  return nullptr;
}

// What the legend calls an event, and so its colour: a training span's shown name, else the first word
// of its name ("allreduce x12" and "allreduce" are both "allreduce").
inline std::string legend_name(const std::string& name) {
  const TrainingName* t = training_name(name);
  return t ? t->shown : first_word(name);
}

// What an event's box says before fitting: a training span's shown name (with its index), else its name.
inline std::string shown_name(const std::string& name) {
  const TrainingName* t = training_name(name);
  if (!t) return name;
  const std::string bare = without_index(name);
  return t->shown + name.substr(bare.size());
}

// Failed operations keep their colour and get a frame of this red; the legend says what it means.
inline constexpr Rgb kFailedFrame{215, 25, 28};
inline constexpr const char* kFailedName = "failed (ok: false)";

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

// The fewest letters a shortened word keeps: "backw." still reads as backward, "r.." reads as nothing.
constexpr size_t kMinAbbreviation = 4;

// The longest legible form of `s` that fits in `max_px` pixels: `s` itself; else its leading whole
// words ("wait for buckets" -> "wait for" -> "wait", a trailing separator dropped); else its first
// word cut to kMinAbbreviation letters or more and marked with "." ("backward" -> "backw."); else "".
inline std::string fit_text(const std::string& s, int max_px) {
  auto fits = [&](const std::string& t) { return Canvas::text_width(t) <= max_px; };
  if (fits(s)) return s;
  std::vector<std::string> words;
  for (size_t from = 0; from <= s.size();) {
    const size_t to = std::min(s.find(' ', from), s.size());
    if (to > from) words.push_back(s.substr(from, to - from));
    from = to + 1;
  }
  if (words.empty()) return std::string();
  auto is_separator = [](const std::string& w) { return w.find_first_not_of("/-+:,|") == std::string::npos; };
  for (size_t n = words.size() - 1; n >= 1; --n) {
    size_t kept = n;
    while (kept > 0 && is_separator(words[kept - 1])) --kept;  // "rank 0 (vm)", not "rank 0 (vm) /"
    std::string prefix;
    for (size_t i = 0; i < kept; ++i) prefix += (i ? " " : "") + words[i];
    if (kept > 0 && fits(prefix)) return prefix;
  }
  const std::string& word = words.front();
  for (size_t keep = word.size() >= 2 ? word.size() - 2 : 0; keep >= kMinAbbreviation; --keep) {
    const std::string cut = word.substr(0, keep) + ".";
    if (fits(cut)) return cut;
  }
  return std::string();
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
    if (auto args = e.find("args"); args != e.end() && args->is_object()) {
      if (auto ok = args->find("ok"); ok != args->end() && ok->is_boolean()) ev.failed = !ok->get<bool>();
      if (auto seq = number(*args, "seq")) ev.seq = static_cast<int64_t>(*seq);
    }
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

// Every (pid, tid) with events, in display order: by the metadata's sort indexes, then by id.
inline std::vector<LaneId> ordered_lanes(const Trace& t) {
  auto order = [&](LaneId lane) {
    auto p = t.process_order.find(lane.first);
    auto th = t.thread_order.find(lane);
    return std::make_tuple(p != t.process_order.end() ? p->second : lane.first, lane.first,
                           th != t.thread_order.end() ? th->second : lane.second, lane.second);
  };
  std::vector<LaneId> lanes;
  for (const LaneEvent& le : t.events) lanes.push_back(le.lane);
  std::sort(lanes.begin(), lanes.end(), [&](LaneId a, LaneId b) { return order(a) < order(b); });
  lanes.erase(std::unique(lanes.begin(), lanes.end()), lanes.end());
  return lanes;
}

struct Extent {
  double start_us = INFINITY, end_us = -INFINITY;
};

inline Extent extent(const Trace& t) {
  Extent x;
  for (const LaneEvent& le : t.events)
    x.start_us = std::min(x.start_us, le.event.ts_us), x.end_us = std::max(x.end_us, le.event.ts_us + le.event.dur_us);
  return x;
}

inline bool visible(const TimelineEvent& e, double start_us, double end_us) {
  return e.dur_us > 0 ? e.ts_us < end_us && e.ts_us + e.dur_us > start_us : e.ts_us >= start_us && e.ts_us <= end_us;
}

// The most events any one lane has in [start_us, end_us]: how crowded a picture of it is.
inline size_t busiest_lane(const Trace& t, double start_us, double end_us) {
  std::map<LaneId, size_t> count;
  size_t most = 0;
  for (const LaneEvent& le : t.events)
    if (visible(le.event, start_us, end_us)) most = std::max(most, ++count[le.lane]);
  return most;
}

// Steps of data-parallel training, from the "backward" spans (one per synchronized step on each rank's
// training track): step k runs from the earliest start of any lane's k-th one to the earliest start of
// a (k+1)-th, the last step to the end of the last event of a lane with steps. The ranks' steps line
// up, held together by their allreduces, but one that waits for the others starts its step earlier.
inline std::vector<Extent> steps_of(const Trace& t) {
  std::map<LaneId, std::vector<double>> starts;  // per lane: its "backward" starts
  for (const LaneEvent& le : t.events)
    if (!le.event.instant && le.event.name == "backward") starts[le.lane].push_back(le.event.ts_us);
  if (starts.empty()) return {};
  std::vector<double> first;  // per step: the earliest start
  for (auto& [lane, s] : starts) {
    std::sort(s.begin(), s.end());
    if (first.size() < s.size()) first.resize(s.size(), INFINITY);
    for (size_t k = 0; k < s.size(); ++k) first[k] = std::min(first[k], s[k]);
  }
  double end = -INFINITY;
  for (const LaneEvent& le : t.events)
    if (starts.count(le.lane)) end = std::max(end, le.event.ts_us + le.event.dur_us);
  std::vector<Extent> steps;
  for (size_t k = 0; k < first.size(); ++k) steps.push_back({first[k], k + 1 < first.size() ? first[k + 1] : end});
  return steps;
}

// Milliseconds from the trace's first event, with as many decimals as a window of `span_ms` needs.
inline std::string ms_text(double ms, double span_ms) {
  const int decimals = span_ms >= 100 ? 1 : span_ms >= 1 ? 2 : 3;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, ms + 0.0);
  return buf;
}

// A number the user typed, as short as it reads ("5000", "12.5").
inline std::string typed(double v) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
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

// How many events of one lane a picture holds legibly at the default width (a box per ~60 pixels),
// the steps a default window shows, and the events of its lane shown before a failure without steps.
inline constexpr size_t kReadableEvents = 24;
inline constexpr int kDefaultSteps = 3;
inline constexpr size_t kContextEvents = 8;

// The window `cohort trace plot` draws. Asked for one (`req`), that one: errors name the flags. Not
// asked:
// - around the first failed operation ("ok": false), from the step before the one it failed in (or
//   kContextEvents events of its lane before it, without steps) to its end, or, when it ran longer,
//   to as far after its start as the window begins before it;
// - else the whole trace, when no lane has more than kReadableEvents events in it;
// - else kDefaultSteps steps in the middle of the run (fewer when they still crowd a lane);
// - else, without steps, kReadableEvents events of the busiest lane around its middle.
// The description says which, and the flags that choose another.
inline TimelineWindow choose_window(const nlohmann::json& trace, const WindowRequest& req) {
  using namespace timeline_detail;
  const Trace t = parse(trace);
  if (t.events.empty())
    throw std::runtime_error("trace has no drawable events (complete \"X\" or instant \"i\" events with a ts)");
  const Extent whole = extent(t);
  const double origin = whole.start_us, whole_ms = (whole.end_us - origin) / 1000;
  const std::vector<Extent> steps = steps_of(t);
  TimelineWindow w;
  w.steps = static_cast<int>(steps.size());
  auto step_range = [](int a, int b) {
    return a == b ? "step " + std::to_string(a) : "steps " + std::to_string(a) + "-" + std::to_string(b);
  };
  const std::string last_step = steps.empty() ? std::string() : std::to_string(steps.size() - 1);
  const std::string others = "; choose another with " +
                             (steps.empty() ? std::string() : "--steps A-B (0-" + last_step + "), ") +
                             "--start-ms/--end-ms (0-" + ms_text(whole_ms, whole_ms) + ") or --all";
  // The window's bounds in ms from the trace's first event, and the line that says so.
  auto describe = [&](const std::string& what) {
    const double from = (w.start_us - origin) / 1000, to = (w.end_us - origin) / 1000;
    w.description = "window: " + ms_text(from, to - from) + "-" + ms_text(to, to - from) + " ms, " + what + others;
  };
  // A little room either side, so that the first and last boxes do not sit on the frame.
  auto padded = [&](double start_us, double end_us) {
    const double pad = (end_us - start_us) * 0.02;
    w.start_us = std::max(whole.start_us, start_us - pad), w.end_us = std::min(whole.end_us, end_us + pad);
    if (w.end_us <= w.start_us) w.end_us = w.start_us + 1;
  };

  const bool by_ms = !std::isnan(req.start_ms) || !std::isnan(req.end_ms), by_steps = req.first_step >= 0;
  if (int(by_ms) + int(by_steps) + int(req.all) > 1)
    throw WindowError("--steps, --start-ms/--end-ms and --all each choose the window: give one of them");
  if (req.all) {
    w.start_us = whole.start_us, w.end_us = std::max(whole.end_us, whole.start_us + 1);
    describe("the whole trace (--all)");
    return w;
  }
  if (by_ms) {
    const std::string from = std::isnan(req.start_ms) ? "the trace's start" : "--start-ms " + typed(req.start_ms);
    const std::string to = std::isnan(req.end_ms) ? "the trace's end (" + ms_text(whole_ms, whole_ms) + " ms)"
                                                   : "--end-ms " + typed(req.end_ms);
    w.start_us = std::isnan(req.start_ms) ? whole.start_us : origin + req.start_ms * 1000;
    w.end_us = std::isnan(req.end_ms) ? whole.end_us : origin + req.end_ms * 1000;
    if (!(w.end_us > w.start_us)) throw WindowError(to + " must be after " + from);
    bool any = false;
    for (const LaneEvent& le : t.events) any = any || visible(le.event, w.start_us, w.end_us);
    if (!any)
      throw WindowError("no events between " + from + " and " + to + ": the trace has events from 0 to " +
                        ms_text(whole_ms, whole_ms) + " ms");
    describe("as asked");
    return w;
  }
  if (by_steps) {
    const std::string flag = "--steps " + std::to_string(req.first_step) + "-" + std::to_string(req.last_step);
    if (steps.empty())
      throw WindowError(flag + ": the trace has no steps (no \"backward\" spans of data-parallel training); "
                               "choose the window with --start-ms/--end-ms");
    if (req.last_step < req.first_step) throw WindowError(flag + ": the first step must not be after the last");
    if (req.last_step >= w.steps)
      throw WindowError(flag + ": the trace has " + std::to_string(w.steps) + " steps, numbered 0-" + last_step);
    w.first_step = req.first_step, w.last_step = req.last_step;
    padded(steps[size_t(w.first_step)].start_us, steps[size_t(w.last_step)].end_us);
    describe(step_range(w.first_step, w.last_step) + " of " + std::to_string(w.steps) + ", as asked");
    return w;
  }

  const LaneEvent* failed = nullptr;
  for (const LaneEvent& le : t.events)
    if (le.event.failed && (!failed || le.event.ts_us < failed->event.ts_us)) failed = &le;
  if (failed) {
    const TimelineEvent& f = failed->event;
    w.around_failure = true;
    int in_step = -1;
    for (size_t k = 0; k < steps.size(); ++k)
      if (steps[k].start_us <= f.ts_us) in_step = static_cast<int>(k);
    double from = f.ts_us;
    std::string where;
    if (in_step >= 0) {
      w.first_step = std::max(0, in_step - 1), w.last_step = in_step;
      from = steps[size_t(w.first_step)].start_us;
      where = "; " + step_range(w.first_step, w.last_step) + " of " + std::to_string(w.steps);
    } else {
      std::vector<double> before;  // starts of the events of its lane that started before it
      for (const LaneEvent& le : t.events)
        if (le.lane == failed->lane && le.event.ts_us < f.ts_us) before.push_back(le.event.ts_us);
      std::sort(before.begin(), before.end());
      if (!before.empty()) from = before[before.size() > kContextEvents ? before.size() - kContextEvents : 0];
    }
    // A failed operation may have waited out a whole timeout, seconds against steps of milliseconds:
    // the window ends as long after its start as it begins before, so that what led to it stays
    // readable, and its box runs on past the edge.
    const double f_end = f.ts_us + f.dur_us;
    padded(from, f.ts_us > from ? std::min(f_end, f.ts_us + (f.ts_us - from)) : f_end);
    const double at_ms = (f.ts_us - origin) / 1000, span_ms = (w.end_us - w.start_us) / 1000;
    describe("around the failed " + (f.seq >= 0 ? "#" + std::to_string(f.seq) + " " : std::string()) + f.name +
             " on " + lane_label(t, failed->lane) + " at " + ms_text(at_ms, span_ms) + " ms (it failed after " +
             ms_text(f.dur_us / 1000, span_ms) + " ms" + where + ")");
    return w;
  }
  if (busiest_lane(t, whole.start_us, whole.end_us) <= kReadableEvents) {
    w.start_us = whole.start_us, w.end_us = std::max(whole.end_us, whole.start_us + 1);
    describe("the whole trace");
    return w;
  }
  if (!steps.empty()) {
    int n = std::min(kDefaultSteps, w.steps);
    for (;; --n) {
      w.first_step = (w.steps - n) / 2, w.last_step = w.first_step + n - 1;
      padded(steps[size_t(w.first_step)].start_us, steps[size_t(w.last_step)].end_us);
      if (n == 1 || busiest_lane(t, w.start_us, w.end_us) <= kReadableEvents) break;
    }
    describe(step_range(w.first_step, w.last_step) + " of " + std::to_string(w.steps) + ", the middle of the run");
    return w;
  }
  // No steps: the busiest lane's middle events.
  std::map<LaneId, std::vector<const TimelineEvent*>> by_lane;
  for (const LaneEvent& le : t.events) by_lane[le.lane].push_back(&le.event);
  const auto busiest = std::max_element(by_lane.begin(), by_lane.end(), [](const auto& a, const auto& b) {
    return a.second.size() < b.second.size();
  });
  std::vector<const TimelineEvent*>& events = busiest->second;
  std::sort(events.begin(), events.end(),
            [](const TimelineEvent* a, const TimelineEvent* b) { return a->ts_us < b->ts_us; });
  const size_t first = events.size() / 2 - kReadableEvents / 2;  // more than kReadableEvents, or drawn whole
  double end_us = -INFINITY;
  for (size_t i = first; i < first + kReadableEvents; ++i)
    end_us = std::max(end_us, events[i]->ts_us + events[i]->dur_us);
  padded(events[first]->ts_us, end_us);
  describe(std::to_string(kReadableEvents) + " events of " + lane_label(t, busiest->first) +
           " in the middle of the trace");
  return w;
}

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
  const Extent whole = extent(t);
  const double origin = whole.start_us;
  L.start_us = std::isnan(opt.start_us) ? origin : opt.start_us;
  L.end_us = std::isnan(opt.end_us) ? whole.end_us : opt.end_us;
  if (L.end_us <= L.start_us) {
    if (!std::isnan(opt.start_us) || !std::isnan(opt.end_us))
      throw std::runtime_error("timeline window is empty: its end is not after its start");
    L.end_us = L.start_us + 1;  // a trace of only instants at one time still gets a 1 us axis
  }

  // Lanes: every (pid, tid) with events anywhere in the trace, so windows of one trace line up.
  const std::vector<LaneId> lane_ids = ordered_lanes(t);
  for (LaneId lane : lane_ids) L.lanes.push_back({lane.first, lane.second, lane_label(t, lane)});

  // Colours over the whole trace, not the window, so every window of a trace uses the same ones.
  std::set<std::string> all_names;
  for (const LaneEvent& le : t.events) all_names.insert(legend_name(le.event.name));
  const std::map<std::string, Rgb> colours = colours_for(all_names);
  for (LaneEvent& le : t.events) {
    TimelineEvent& e = le.event;
    e.fill = colours.at(legend_name(e.name));
    if (!visible(e, L.start_us, L.end_us)) continue;
    e.lane = static_cast<size_t>(std::find(lane_ids.begin(), lane_ids.end(), le.lane) - lane_ids.begin());
    L.events.push_back(std::move(e));
  }
  if (L.events.empty()) throw std::runtime_error("trace has no events in the window");

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
    if (!e.instant) e.label = fit_text(shown_name(e.name), e.x1 - e.x0 - 6);
  }
  L.axis_y = y;
  L.ticks = ticks(origin, L.start_us, L.end_us, x_of);
  y += kAxisHeight;

  std::set<std::string> names;
  bool any_failed = false;
  for (const TimelineEvent& e : L.events) names.insert(legend_name(e.name)), any_failed |= e.failed;
  std::vector<std::pair<std::string, Rgb>> entries;
  for (const std::string& name : names) entries.emplace_back(name, colours.at(name));
  if (any_failed) entries.emplace_back(kFailedName, kFailedFrame);
  int x = kMargin;
  for (const auto& [name, fill] : entries) {
    const int entry_px = kSwatch + 4 + Canvas::text_width(name) + 3 * kMargin;
    if (x > kMargin && x + entry_px > L.width - kMargin) x = kMargin, y += kLegendRowHeight;
    L.legend.push_back({name, fill, x, y});
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
    c.frame(e.x0, e.y0, e.x1 - e.x0, e.y1 - e.y0, e.failed ? kFailedFrame : outline);
    if (e.failed) c.frame(e.x0 + 1, e.y0 + 1, e.x1 - e.x0 - 2, e.y1 - e.y0 - 2, kFailedFrame);
    if (!e.label.empty()) c.text(e.x0 + 3, e.y0 + (e.y1 - e.y0 - 7) / 2, e.label, ink);
  }

  c.line(L.plot_x0, L.axis_y, L.plot_x1 - 1, L.axis_y, ink);
  for (const TimelineTick& tick : L.ticks) {
    c.line(tick.x, L.axis_y, tick.x, L.axis_y + 4, ink);
    c.text(tick.x - Canvas::text_width(tick.label) / 2, L.axis_y + 9, tick.label, ink);
  }
  for (const TimelineLegendEntry& entry : L.legend) {
    c.fill(entry.x, entry.y, kSwatch, kSwatch, entry.fill);
    c.frame(entry.x, entry.y, kSwatch, kSwatch, darker(entry.fill));
    c.text(entry.x + kSwatch + 4, entry.y + 2, entry.name, ink);
  }
  c.save(png_path);
}

}  // namespace cohort::tools::png
