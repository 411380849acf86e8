#pragma once
// Shared test helpers: ranks as threads, temporary directories, running the `cohort` tool.

#include <functional>
#include <string>
#include <vector>

// The sanitizer a test was built with, whichever the compiler: GCC defines __SANITIZE_ADDRESS__ and
// __SANITIZE_THREAD__, clang (the ASan + UBSan build's compiler) answers __has_feature instead.
#if defined(__SANITIZE_ADDRESS__)
#define COHORT_TEST_UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COHORT_TEST_UNDER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define COHORT_TEST_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define COHORT_TEST_UNDER_TSAN 1
#endif
#endif

namespace cohort::test {

// Runs body(rank) on `world` threads and waits for all of them. An exception or failed assertion in
// any rank is reported with the rank number; the first exception is rethrown after all threads end.
void run_ranks(int world, const std::function<void(int rank)>& body);

// A fresh directory under $TMPDIR, removed with its contents when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct ProcessResult {
  int exit_code = -1;   // 128+signal when killed by a signal
  std::string out;      // stdout
  std::string err;      // stderr
  double seconds = 0;   // wall time
};

// Runs argv (argv[0] is looked up on PATH unless it has a '/'), with extra environment entries
// ("NAME=value"), captures its output, and kills it (SIGKILL) if it runs past timeout_s.
ProcessResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
                          double timeout_s = 60);

// Path of the built `cohort` tool.
std::string cohort_tool();
// Writes `content` to `path`.
void write_file(const std::string& path, const std::string& content);
std::string read_file(const std::string& path);

// True when `pid` is a live process (not a zombie).
bool process_alive(int pid);

// A TCP port that was free a moment ago (bound to 0 and released); prefer passing port 0 directly.
int free_port();

}  // namespace cohort::test
