// `cohort trace show|merge|plot`: the flight recorder dumps and timelines after the fact
// (docs/observability.md).
#include <filesystem>
#include <fstream>
#include <regex>
#include <tuple>
#include <utility>

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "cohort/error.h"
#include "command.h"
#include "trace/diagnose.h"
#include "trace/dump.h"
#include "trace/timeline.h"
#include "trace_png.h"

namespace cohort::tools {
namespace {

int run_trace_show(std::vector<std::string> args) {
  CLI::App app("Prints the diagnosis of a failed or stalled job from its flight recorder dumps (the directory "
               "`cohort run` named in its failure summary), then each rank's last operations.",
               "cohort trace show");
  std::string dir;
  size_t last = 5;
  app.add_option("dir", dir, "directory with rank<N>.json dumps")->required();
  app.add_option("--last", last, "operations listed per rank (default 5)");
  if (!parse_command_line(app, args)) return 0;
  auto ranks = trace::read_dump_dir(dir);
  auto lines = trace::diagnose(ranks);
  for (const auto& l : lines) fmt::print("{}\n", l);
  if (lines.empty()) fmt::print("the ranks' flight recorders agree: no rank is behind, none called something else\n");
  for (const auto& s : ranks) {
    fmt::print("\nrank {} on {} (pid {}, {}): {} operations recorded\n", s.rank, s.host, s.pid,
               s.process_state.empty() ? "state unknown" : s.process_state, s.total);
    size_t from = s.entries.size() > last ? s.entries.size() - last : 0;
    for (size_t i = from; i < s.entries.size(); ++i) {
      const auto& e = s.entries[i];
      // Lengths: measured ones (timeline, stats, failures), and how long a running one had run.
      std::string length;
      if (e.t_end > 0) length = fmt::format(" took {:.3f} ms", double(e.t_end - e.t_start) / 1e6);
      else if (e.state == trace::OpState::kRunning)
        length = fmt::format(" running for {:.3f} ms", double(s.taken_at - e.t_start) / 1e6);
      fmt::print("  {:<8} {}{}\n", trace::op_state_name(e.state), trace::describe(e), length);
    }
  }
  return 0;
}

int run_trace_merge(std::vector<std::string> args) {
  CLI::App app("Merges per-rank timeline files (rank<N>.timeline, written with COHORT_TIMELINE by processes started "
               "without the launcher) into one Chrome-trace/Perfetto JSON file.",
               "cohort trace merge");
  std::string out;
  std::vector<std::string> inputs;
  app.add_option("-o,--output", out, "the merged trace")->required();
  app.add_option("inputs", inputs, "rank files, or a directory holding rank<N>.timeline")->required();
  if (!parse_command_line(app, args)) return 0;
  std::vector<std::string> files;
  for (const auto& in : inputs) {
    if (std::filesystem::is_directory(in)) {
      auto found = trace::timeline_rank_files(in);
      if (found.empty()) throw ConfigError(fmt::format("{}: no rank<N>.timeline timeline files in it", in));
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.push_back(in);
    }
  }
  std::ofstream o(out, std::ios::trunc);
  if (!o) throw Error(fmt::format("cannot write {}", out));
  auto merged = trace::merge_timelines(files, o);
  fmt::print("{} rank(s), {} events -> {}\n", merged.ranks, merged.events, out);
  return 0;
}

// "A-B" or "A": the steps --steps names, numbered from 0.
std::pair<int, int> parse_steps(const std::string& text) {
  const std::regex form(R"(\s*([0-9]{1,9})\s*(?:-\s*([0-9]{1,9})\s*)?)");
  std::smatch m;
  if (!std::regex_match(text, m, form))
    throw ConfigError(fmt::format("--steps {}: expected A-B or A, step numbers from 0", text));
  const int first = std::stoi(m[1]);
  return {first, m[2].matched ? std::stoi(m[2]) : first};
}

int run_trace_plot(std::vector<std::string> args) {
  CLI::App app("Draws a merged timeline (Chrome-trace JSON) as a PNG: one lane per rank and track. Without a "
               "window it draws the failure when the trace shows one, else a few steps in the middle of the run "
               "(the whole trace when it is short), and says which.",
               "cohort trace plot");
  std::string in, out, steps;
  png::TimelineOptions opt;
  png::WindowRequest window;
  app.add_option("trace", in, "merged timeline (cohort run --timeline)")->required();
  app.add_option("-o,--output", out, "PNG file to write")->required();
  app.add_option("--start-ms", window.start_ms, "window start, in ms from the trace's start");
  app.add_option("--end-ms", window.end_ms, "window end, in ms from the trace's start");
  app.add_option("--steps", steps, "window: training steps A-B (or one, A), numbered from 0");
  app.add_flag("--all", window.all, "window: the whole trace");
  app.add_option("--width", opt.width, "image width in pixels (default 1600)");
  app.add_option("--title", opt.title, "title drawn at the top");
  if (!parse_command_line(app, args)) return 0;
  if (!steps.empty()) std::tie(window.first_step, window.last_step) = parse_steps(steps);
  std::ifstream f(in);
  if (!f) throw ConfigError(fmt::format("{}: cannot read", in));
  nlohmann::json trace;
  try {
    trace = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(fmt::format("{}: not JSON ({})", in, e.what()));
  }
  png::TimelineWindow chosen;
  try {
    chosen = png::choose_window(trace, window);
  } catch (const png::WindowError& e) {
    throw ConfigError(fmt::format("{}: {}", in, e.what()));
  }
  opt.start_us = chosen.start_us;
  opt.end_us = chosen.end_us;
  png::render_timeline_png(trace, out, opt);
  fmt::print("{}\n{} -> {}\n", chosen.description, in, out);
  return 0;
}

Registration reg_show("trace show", "diagnose a failed or stalled job from its flight recorder dumps", run_trace_show);
Registration reg_merge("trace merge", "merge per-rank timeline files into one Chrome-trace file", run_trace_merge);
Registration reg_plot("trace plot", "draw a merged timeline as a PNG", run_trace_plot);

}  // namespace
}  // namespace cohort::tools
