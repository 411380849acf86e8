#pragma once
// English text for the BERT example: the glosses (definitions and usage examples) of WordNet 3.0 as
// Debian's wordnet-base ships them (/usr/share/wordnet/data.{noun,verb,adj,adv}), about 117,000
// sentences. With a word-level tokenizer, a vocabulary of the most frequent words and BERT's masking
// (15 % of the tokens: 80 % [MASK], 10 % a random word, 10 % unchanged), drawn from a counter-based
// hash so that the Python twin (bench/bert_twin.py) masks exactly the same tokens.
#include <fmt/core.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cohort/error.h"

namespace cohort::examples {

inline constexpr const char* kWordnetDir = "/usr/share/wordnet";

// Token ids below kFirstWord are special.
enum SpecialToken : int64_t { kPad = 0, kUnk = 1, kCls = 2, kSep = 3, kMask = 4, kFirstWord = 5 };

// Every gloss, in file order (noun, verb, adj, adv): the text after " | " on each synset line.
inline std::vector<std::string> read_wordnet_glosses(const std::string& dir) {
  std::vector<std::string> glosses;
  for (const char* part : {"noun", "verb", "adj", "adv"}) {
    const std::string path = fmt::format("{}/data.{}", dir, part);
    if (!std::filesystem::exists(path))
      throw ConfigError(fmt::format("cannot read {}: no such file (install wordnet-base, or pass --data-dir)", path));
    std::ifstream in(path, std::ios::binary);
    for (std::string line; std::getline(in, line);) {
      if (line.empty() || line[0] == ' ') continue;  // the licence header's lines start with two spaces
      const size_t bar = line.find(" | ");
      if (bar == std::string::npos) continue;
      size_t end = line.size();
      while (end > bar + 3 && (line[end - 1] == ' ' || line[end - 1] == '\r')) --end;
      glosses.push_back(line.substr(bar + 3, end - bar - 3));
    }
  }
  if (glosses.empty()) throw ConfigError(fmt::format("{}: no glosses found in data.noun/verb/adj/adv", dir));
  return glosses;
}

// Lower case; words are runs of letters, digits and bytes >= 0x80; every other non-space byte is a
// token of its own. Python: re.findall(rb"[a-z0-9\x80-\xff]+|[^\sa-z0-9\x80-\xff]", text.lower()).
inline std::vector<std::string> tokenize(const std::string& text) {
  std::vector<std::string> out;
  std::string word;
  auto wordish = [](unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c >= 0x80; };
  for (unsigned char c : text) {
    if (c >= 'A' && c <= 'Z') c = static_cast<unsigned char>(c - 'A' + 'a');
    if (wordish(c)) {
      word.push_back(static_cast<char>(c));
      continue;
    }
    if (!word.empty()) out.push_back(std::move(word)), word.clear();
    // Python's \s: space, \t, \n, \r, \f, \v.
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r' && c != '\f' && c != '\v') out.emplace_back(1, static_cast<char>(c));
  }
  if (!word.empty()) out.push_back(std::move(word));
  return out;
}

struct Vocabulary {
  std::vector<std::string> words;  // id -> word (the specials first)
  std::unordered_map<std::string, int64_t> ids;
  int64_t id(const std::string& w) const {
    auto it = ids.find(w);
    return it == ids.end() ? kUnk : it->second;
  }
  int64_t size() const { return static_cast<int64_t>(words.size()); }
};

// The `size` - 5 most frequent tokens of `texts` (ties: byte order), after the 5 specials.
inline Vocabulary build_vocabulary(const std::vector<std::vector<std::string>>& texts, int64_t size) {
  std::unordered_map<std::string, int64_t> counts;
  for (const auto& t : texts)
    for (const auto& w : t) ++counts[w];
  std::vector<std::pair<std::string, int64_t>> ranked(counts.begin(), counts.end());
  std::sort(ranked.begin(), ranked.end(),
            [](const auto& a, const auto& b) { return a.second != b.second ? a.second > b.second : a.first < b.first; });
  Vocabulary v;
  v.words = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"};
  for (const auto& [w, n] : ranked) {
    if (static_cast<int64_t>(v.words.size()) >= size) break;
    v.words.push_back(w);
  }
  for (size_t i = 0; i < v.words.size(); ++i) v.ids[v.words[i]] = static_cast<int64_t>(i);
  return v;
}

// [CLS] tokens [SEP], cut to `length` and padded with [PAD].
inline std::vector<int64_t> encode(const std::vector<std::string>& tokens, const Vocabulary& v, int64_t length) {
  std::vector<int64_t> ids(static_cast<size_t>(length), kPad);
  ids[0] = kCls;
  int64_t n = std::min<int64_t>(static_cast<int64_t>(tokens.size()), length - 2);
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i + 1)] = v.id(tokens[static_cast<size_t>(i)]);
  ids[static_cast<size_t>(n + 1)] = kSep;
  return ids;
}

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Uniform in [0, 1) from (seed, epoch, sample, position, draw): the same in C++ and Python.
inline double mask_draw(uint64_t seed, uint64_t epoch, uint64_t sample, uint64_t position, uint64_t draw) {
  uint64_t h = splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ sample) ^ (position * 4 + draw));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
}

// BERT's masking of one encoded sequence, in place: returns the labels (-100 where nothing is
// predicted). At least one token is masked (the first word, when the draws chose none).
inline std::vector<int64_t> mask_tokens(std::vector<int64_t>& ids, int64_t vocab, uint64_t seed, uint64_t epoch,
                                        uint64_t sample) {
  std::vector<int64_t> labels(ids.size(), -100);
  bool any = false;
  for (size_t p = 1; p < ids.size() && ids[p] != kSep && ids[p] != kPad; ++p) {
    if (mask_draw(seed, epoch, sample, p, 0) >= 0.15) continue;
    labels[p] = ids[p];
    any = true;
    const double how = mask_draw(seed, epoch, sample, p, 1);
    if (how < 0.8) {
      ids[p] = kMask;
    } else if (how < 0.9) {
      ids[p] = kFirstWord + static_cast<int64_t>(mask_draw(seed, epoch, sample, p, 2) * double(vocab - kFirstWord));
    }
  }
  if (!any && ids.size() > 2 && ids[1] != kSep) {
    labels[1] = ids[1];
    ids[1] = kMask;
  }
  return labels;
}

}  // namespace cohort::examples
