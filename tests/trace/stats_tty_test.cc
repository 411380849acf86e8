// `cohort run --stats` on a terminal: the launcher runs on a pseudo-terminal, and everything it wrote
// is played through a small terminal emulator (the cursor moves and clears the table uses) to get the
// screen a user would see at the end. Every line a worker printed must still be on it, a job shorter
// than a tick still shows a table, and every job ends with a summary of each rank's totals. Without a
// terminal the summary is one JSON line.
#include <errno.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "support/test_support.h"

namespace cohort::test {
namespace {

constexpr int kRows = 50, kCols = 200;
// No slow-operation warning on a loaded machine: it would be printed between two tables.
const std::vector<std::string> kEnv = {"COHORT_TIMEOUT=20", "COHORT_SLOW_WARNING=60"};

// A terminal of kRows rows with scrollback: text, '\r', '\n', and the CSI sequences the launcher
// uses (n F: up n lines to column 0, J: clear to the end of the screen; also A, K). Others are skipped.
class Screen {
 public:
  void feed(const std::string& bytes) {
    for (size_t i = 0; i < bytes.size(); ++i) {
      char c = bytes[i];
      if (c == '\x1b' && i + 1 < bytes.size() && bytes[i + 1] == '[') {
        size_t j = i + 2;
        std::string params;
        while (j < bytes.size() &&
               (std::isdigit(static_cast<unsigned char>(bytes[j])) || bytes[j] == ';' || bytes[j] == '?'))
          params += bytes[j++];
        if (j >= bytes.size()) break;
        csi(bytes[j], params);
        i = j;
      } else if (c == '\r') {
        col_ = 0;
      } else if (c == '\n') {
        ++row_;
        ensure_row();
      } else if (static_cast<unsigned char>(c) >= 0x20) {
        ensure_row();
        std::string& line = lines_[row_];
        if (line.size() < col_) line.resize(col_, ' ');
        if (col_ < line.size()) line[col_] = c;
        else line += c;
        ++col_;
      }
    }
  }
  std::vector<std::string> lines() const { return lines_; }
  std::string text() const {
    std::string out;
    for (const auto& l : lines_) out += l + "\n";
    return out;
  }

 private:
  // The first row the cursor can reach: lines above the screen have scrolled into the scrollback.
  size_t top() const { return lines_.size() > size_t(kRows) ? lines_.size() - kRows : 0; }
  void ensure_row() {
    if (lines_.size() <= row_) lines_.resize(row_ + 1);
  }
  void csi(char final, const std::string& params) {
    int n = params.empty() ? 0 : std::atoi(params.c_str());
    switch (final) {
      case 'F':
      case 'A': {
        size_t up = size_t(std::max(n, 1));
        row_ = row_ >= top() + up ? row_ - up : top();
        if (final == 'F') col_ = 0;
        break;
      }
      case 'J':
        if (n == 0) {
          ensure_row();
          lines_[row_].resize(std::min(lines_[row_].size(), col_));
          lines_.resize(row_ + 1);
        }
        break;
      case 'K':
        ensure_row();
        if (n == 0) lines_[row_].resize(std::min(lines_[row_].size(), col_));
        break;
      default:
        break;
    }
  }
  std::vector<std::string> lines_;
  size_t row_ = 0, col_ = 0;
};

struct TtyResult {
  int exit_code = -1;
  std::string bytes;  // everything written to the terminal
};

// Runs argv with stdin, stdout and stderr on a new pseudo-terminal of kRows x kCols.
TtyResult run_on_terminal(const std::vector<std::string>& argv, const std::vector<std::string>& env, double timeout_s) {
  winsize ws{};
  ws.ws_row = kRows;
  ws.ws_col = kCols;
  int master = -1;
  pid_t pid = forkpty(&master, nullptr, nullptr, &ws);
  if (pid < 0) throw std::runtime_error(std::string("forkpty: ") + strerror(errno));
  if (pid == 0) {
    for (const auto& kv : env) putenv(const_cast<char*>(kv.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
  TtyResult r;
  auto start = std::chrono::steady_clock::now();
  bool killed = false;
  char buf[4096];
  for (;;) {
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!killed && elapsed > timeout_s) {
      kill(pid, SIGKILL);
      killed = true;
    }
    if (elapsed > timeout_s + 5) break;
    pollfd p{master, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    ssize_t n = read(master, buf, sizeof buf);
    if (n <= 0) break;  // EIO: every process holding the terminal is gone
    r.bytes.append(buf, size_t(n));
  }
  close(master);
  int status = 0;
  waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

std::vector<std::string> cohort_stats(int n, std::vector<std::string> program) {
  std::vector<std::string> argv{cohort_tool(), "run", "-n", std::to_string(n), "--stats"};
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

std::vector<std::string> comm_worker(const std::string& mode) {
  return {COHORT_COMM_WORKER, mode, "env", "0", "0"};
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The summary's row of `rank` on the screen: its ops column (the third).
long summary_ops(const std::string& screen, int rank) {
  auto at = screen.find("cohort stats summary");
  if (at == std::string::npos) return -1;
  std::istringstream in(screen.substr(at));
  std::string line;
  std::getline(in, line);  // title
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream f(line);
    int r;
    std::string host;
    long ops;
    if (f >> r >> host >> ops && r == rank) return ops;
  }
  return -1;
}

TEST(StatsTerminal, EveryLineAWorkerPrintedBetweenTablesStaysOnTheScreen) {
  // Steps printed every 0.7 s for 4.2 s while tables come every second, then one allreduce per rank.
  std::string script = "for i in 1 2 3 4 5 6; do echo \"rank $RANK step $i\"; sleep 0.7; done; exec " +
                       std::string(COHORT_COMM_WORKER) + " once env 0 0";
  auto r = run_on_terminal(cohort_stats(2, {"/bin/sh", "-c", script}), kEnv, 60);
  Screen screen;
  screen.feed(r.bytes);
  std::string text = screen.text();
  ASSERT_EQ(r.exit_code, 0) << text;
  for (int rank = 0; rank < 2; ++rank) {
    for (int step = 1; step <= 6; ++step)
      EXPECT_EQ(count(text, "rank " + std::to_string(rank) + " step " + std::to_string(step) + "\n"), 1)
          << "rank " << rank << " step " << step << " is not on the final screen:\n" << text;
    EXPECT_EQ(count(text, "rank " + std::to_string(rank) + " of 2: sum 2\n"), 1) << text;
  }
  // Tables came while the steps were printed (the job runs about 4 s), each below the steps before it.
  EXPECT_GE(count(text, "cohort stats, "), 2) << text;
  EXPECT_EQ(count(text, "cohort stats summary, "), 1) << text;
  EXPECT_GE(summary_ops(text, 0), 1) << text;
  EXPECT_GE(summary_ops(text, 1), 1) << text;
}

TEST(StatsTerminal, AJobShorterThanATickShowsATableAndASummary) {
  auto r = run_on_terminal(cohort_stats(2, comm_worker("once")), kEnv, 60);
  Screen screen;
  screen.feed(r.bytes);
  std::string text = screen.text();
  ASSERT_EQ(r.exit_code, 0) << text;
  EXPECT_EQ(count(text, "cohort stats, "), 1) << text;
  EXPECT_TRUE(std::regex_search(text, std::regex(R"(\n +0 \S+ +\d+ +[0-9.]+ +[0-9.]+ )"))) << text;
  EXPECT_EQ(count(text, "cohort stats summary, "), 1) << text;
  // One allreduce each, 4 KiB.
  EXPECT_GE(summary_ops(text, 0), 1) << text;
  EXPECT_GE(summary_ops(text, 1), 1) << text;
  EXPECT_EQ(count(text, "exited with code 0"), 2) << text;
}

TEST(StatsTerminal, TheTableIsRedrawnInPlaceWhileNothingElseIsPrinted) {
  // 3 s of allreduces and no output: three ticks, one table on the final screen, then the summary.
  // (No slow-operation warning on a loaded machine: it would be printed between two tables.)
  auto r = run_on_terminal(cohort_stats(2, comm_worker("timed")), kEnv, 60);
  Screen screen;
  screen.feed(r.bytes);
  std::string text = screen.text();
  ASSERT_EQ(r.exit_code, 0) << text;
  EXPECT_GE(count(r.bytes, "cohort stats, "), 2) << "fewer ticks than expected:\n" << text;
  EXPECT_EQ(count(text, "cohort stats, "), 1) << text;
  EXPECT_EQ(count(text, "cohort stats summary, "), 1) << text;
  EXPECT_GT(summary_ops(text, 0), 100) << text;
}

TEST(StatsPipe, TheSummaryIsAFinalJsonLine) {
  auto r = run_process(cohort_stats(2, comm_worker("once")), kEnv, 60);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // A job shorter than a tick still gets its figures, then the summary, last.
  EXPECT_NE(r.err.find("{\"cohort_stats\":"), std::string::npos) << r.err;
  std::istringstream in(r.err);
  std::string line, last_stats;
  while (std::getline(in, line))
    if (line.rfind("{\"cohort_stats", 0) == 0) last_stats = line;
  ASSERT_EQ(last_stats.rfind("{\"cohort_stats_summary\":", 0), 0u) << r.err;
  auto j = nlohmann::json::parse(last_stats)["cohort_stats_summary"];
  EXPECT_GT(j["seconds"].get<double>(), 0) << last_stats;
  ASSERT_EQ(j["ranks"].size(), 2u) << last_stats;
  for (int rank = 0; rank < 2; ++rank) {
    const auto& row = j["ranks"][size_t(rank)];
    EXPECT_EQ(row["rank"].get<int>(), rank) << last_stats;
    EXPECT_GE(row["ops"].get<uint64_t>(), 1u) << last_stats;
    EXPECT_GE(row["bytes"].get<uint64_t>(), 4096u) << last_stats;
    EXPECT_GT(row["comm_s"].get<double>(), 0) << last_stats;
    EXPECT_EQ(row["state"].get<std::string>(), "exited with code 0") << last_stats;
  }
}

}  // namespace
}  // namespace cohort::test
