#pragma once
// Fashion-MNIST as Debian's dataset-fashion-mnist ships it (gzip idx files under
// /usr/share/datasets/fashion-mnist), read for the examples (fashion_mnist, ps_ctr): one split's
// images (n x 28 x 28 bytes) and labels (n bytes), with one clear line for a missing or damaged file.
#include <fmt/core.h>
#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "cohort/error.h"

namespace cohort::examples {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

inline std::string read_gzip(const std::string& path) {
  if (!std::filesystem::exists(path))
    throw ConfigError(fmt::format("cannot read {}: no such file (install dataset-fashion-mnist, or pass --data-dir)", path));
  gzFile f = gzopen(path.c_str(), "rb");
  if (!f) throw ConfigError(fmt::format("cannot open {}", path));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    int n = gzread(f, buf, sizeof buf);
    if (n < 0) {
      int err = 0;
      std::string msg = gzerror(f, &err);
      gzclose(f);
      throw ConfigError(fmt::format("cannot read {}: {}", path, msg));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  gzclose(f);
  return out;
}

inline uint32_t big_endian(const std::string& b, size_t at) {
  return (uint32_t(uint8_t(b[at])) << 24) | (uint32_t(uint8_t(b[at + 1])) << 16) | (uint32_t(uint8_t(b[at + 2])) << 8) |
         uint32_t(uint8_t(b[at + 3]));
}

// The uint8 payload of an idx file with `ndim` dimensions, and its dimensions.
inline std::pair<std::string, std::vector<int64_t>> read_idx(const std::string& path, int ndim) {
  std::string raw = read_gzip(path);
  const size_t header = 4 + 4 * static_cast<size_t>(ndim);
  if (raw.size() < header || big_endian(raw, 0) != (0x800u | static_cast<uint32_t>(ndim)))
    throw ConfigError(fmt::format("{} is not an idx file of unsigned bytes with {} dimensions", path, ndim));
  std::vector<int64_t> dims;
  size_t expect = 1;
  for (int i = 0; i < ndim; ++i) {
    dims.push_back(big_endian(raw, 4 + 4 * static_cast<size_t>(i)));
    expect *= static_cast<size_t>(dims.back());
  }
  if (raw.size() - header != expect)
    throw ConfigError(fmt::format("{} is truncated: {} bytes of data, header says {}", path, raw.size() - header, expect));
  return {raw.substr(header), dims};
}

// One split ("train" or "t10k"): images n x 28 x 28 and labels n, as bytes.
struct FashionMnistSplit {
  std::string pixels;
  std::string labels;
  int64_t count = 0;
};

inline FashionMnistSplit read_fashion_mnist(const std::string& dir, const std::string& prefix) {
  auto [pixels, idims] = read_idx(dir + "/" + prefix + "-images-idx3-ubyte.gz", 3);
  auto [labels, ldims] = read_idx(dir + "/" + prefix + "-labels-idx1-ubyte.gz", 1);
  if (idims[0] != ldims[0])
    throw ConfigError(fmt::format("{}/{}: {} images but {} labels", dir, prefix, idims[0], ldims[0]));
  if (idims[1] != 28 || idims[2] != 28)
    throw ConfigError(fmt::format("{}/{}: images are {}x{}, expected 28x28", dir, prefix, idims[1], idims[2]));
  return {std::move(pixels), std::move(labels), idims[0]};
}

}  // namespace cohort::examples
