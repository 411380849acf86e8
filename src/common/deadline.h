#pragma once
// Deadline: a point on the monotonic clock after which a wait must give up.
// Every blocking call in cohort takes one (the habit "nothing waits forever").

#include <algorithm>
#include <chrono>
#include <climits>

namespace cohort {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  static Deadline after(std::chrono::nanoseconds d) { return Deadline(Clock::now() + d); }
  static Deadline never() { return Deadline(Clock::time_point::max()); }
  explicit Deadline(Clock::time_point at) : at_(at) {}

  bool expired() const { return Clock::now() >= at_; }
  bool is_never() const { return at_ == Clock::time_point::max(); }
  Clock::time_point at() const { return at_; }
  std::chrono::milliseconds remaining() const {
    if (is_never()) return std::chrono::milliseconds::max();
    auto r = std::chrono::duration_cast<std::chrono::milliseconds>(at_ - Clock::now());
    return std::max(r, std::chrono::milliseconds(0));
  }
  // Timeout argument for poll(2)/epoll_wait(2), capped at `cap_ms`; -1 never happens.
  int poll_ms(int cap_ms = INT_MAX) const {
    auto r = remaining().count();
    if (r > cap_ms) return cap_ms;
    return static_cast<int>(r);
  }
  // The earlier of two deadlines.
  static Deadline earliest(const Deadline& a, const Deadline& b) { return a.at_ < b.at_ ? a : b; }

 private:
  Clock::time_point at_;
};

// Seconds as a human-readable string ("1.5 s", "300 s").
std::string format_duration(std::chrono::nanoseconds d);

}  // namespace cohort
