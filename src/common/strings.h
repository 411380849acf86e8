#pragma once
// String utilities used by parsers across layers.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cohort::str {

std::vector<std::string> split(std::string_view s, char sep, bool keep_empty = false);
std::string_view trim(std::string_view s);
bool starts_with(std::string_view s, std::string_view prefix);
std::string join(const std::vector<std::string>& parts, std::string_view sep);
// "0,2-4,7" -> {0,2,3,4,7}; throws ConfigError naming `what` on malformed input.
std::vector<int> parse_int_list(std::string_view s, std::string_view what);
// Compresses a sorted list of ints to "0-3,5,7-9" (for "ranks 0-3,5 are missing" messages).
std::string format_ranges(const std::vector<int>& sorted_values);
// The places where `text` names a rank as cohort's messages do, "rank N (" (with "rank" at the start
// of a word): each one's offset, length and N, in order. Written by hand rather than with std::regex,
// whose word-boundary test races in libstdc++'s shared ctype cache when threads match at once.
struct RankMention {
  size_t pos = 0;
  size_t len = 0;
  long rank = 0;
};
std::vector<RankMention> rank_mentions(std::string_view text);
// "1.5 KiB", "64.0 MiB", "8 B"
std::string format_bytes(uint64_t bytes);

}  // namespace cohort::str
