#include "common/strings.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include <fmt/core.h>

#include "cohort/error.h"

namespace cohort::str {

std::vector<std::string> split(std::string_view s, char sep, bool keep_empty) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t pos = s.find(sep, start);
    std::string_view part = s.substr(start, pos == std::string_view::npos ? std::string_view::npos : pos - start);
    if (keep_empty || !part.empty()) out.emplace_back(part);
    if (pos == std::string_view::npos) break;
    start = pos + 1;
  }
  return out;
}

std::string_view trim(std::string_view s) {
  const char* ws = " \t\r\n";
  size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  size_t e = s.find_last_not_of(ws);
  return s.substr(b, e - b + 1);
}

bool starts_with(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

std::vector<int> parse_int_list(std::string_view s, std::string_view what) {
  std::vector<int> out;
  for (const auto& item : split(s, ',')) {
    auto t = std::string(trim(item));
    auto dash = t.find('-', 1);
    char* end = nullptr;
    if (dash == std::string::npos) {
      long v = std::strtol(t.c_str(), &end, 10);
      if (t.empty() || *end != '\0' || v < 0) throw ConfigError(fmt::format("{}: '{}' is not a number or range", what, t));
      out.push_back(static_cast<int>(v));
    } else {
      std::string a = t.substr(0, dash), b = t.substr(dash + 1);
      long lo = std::strtol(a.c_str(), &end, 10);
      bool ok = !a.empty() && *end == '\0';
      long hi = std::strtol(b.c_str(), &end, 10);
      ok = ok && !b.empty() && *end == '\0' && lo >= 0 && hi >= lo;
      if (!ok) throw ConfigError(fmt::format("{}: '{}' is not a range such as 2-5", what, t));
      for (long v = lo; v <= hi; ++v) out.push_back(static_cast<int>(v));
    }
  }
  return out;
}

std::string format_ranges(const std::vector<int>& v) {
  std::string out;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j == i ? fmt::format("{}", v[i]) : fmt::format("{}-{}", v[i], v[j]);
    i = j + 1;
  }
  return out;
}

std::string format_bytes(uint64_t b) {
  if (b >= (uint64_t(1) << 30)) return fmt::format("{:.1f} GiB", double(b) / double(1 << 30));
  if (b >= (uint64_t(1) << 20)) return fmt::format("{:.1f} MiB", double(b) / double(1 << 20));
  if (b >= 1024) return fmt::format("{:.1f} KiB", double(b) / 1024.0);
  return fmt::format("{} B", b);
}

std::vector<RankMention> rank_mentions(std::string_view text) {
  std::vector<RankMention> out;
  constexpr std::string_view kWord = "rank ";
  auto is_word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t at = text.find(kWord); at != std::string_view::npos; at = text.find(kWord, at + 1)) {
    if (at > 0 && is_word(text[at - 1])) continue;
    size_t i = at + kWord.size(), digits = i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
    if (i == digits || i - digits > 9 || i + 1 >= text.size() || text[i] != ' ' || text[i + 1] != '(') continue;
    out.push_back({at, i + 2 - at, std::stol(std::string(text.substr(digits, i - digits)))});
  }
  return out;
}

}  // namespace cohort::str
