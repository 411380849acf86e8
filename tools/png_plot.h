#pragma once
// A small line-plot writer for `cohort bench --plot`: draws series of (bytes, GB/s) points on a
// log2 size axis and a linear bandwidth axis and saves an 8-bit RGB PNG (deflate via zlib). Text
// uses a built-in 5x7 pixel font (letters, digits and the punctuation labels need); the timeline
// renderer (trace_png.h) draws with the same Canvas. Kept header-only and dependency-light so the
// tools need nothing beyond zlib.

#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace cohort::tools::png {

struct Rgb {
  uint8_t r, g, b;
};

struct Series {
  std::vector<double> bytes;
  std::vector<double> gbps;
  Rgb color;
};

class Canvas {
 public:
  Canvas(int w, int h) : w_(w), h_(h), px_(static_cast<size_t>(w) * static_cast<size_t>(h) * 3, 255) {}
  int width() const { return w_; }
  int height() const { return h_; }
  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    size_t i = (static_cast<size_t>(y) * static_cast<size_t>(w_) + static_cast<size_t>(x)) * 3;
    px_[i] = c.r, px_[i + 1] = c.g, px_[i + 2] = c.b;
  }
  void line(int x0, int y0, int x1, int y1, Rgb c, int thick = 1) {
    int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    for (;;) {
      for (int a = -(thick / 2); a <= thick / 2; ++a)
        for (int b = -(thick / 2); b <= thick / 2; ++b) set(x0 + a, y0 + b, c);
      if (x0 == x1 && y0 == y1) break;
      int e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }
  void box(int x, int y, int half, Rgb c) {
    for (int a = -half; a <= half; ++a)
      for (int b = -half; b <= half; ++b) set(x + a, y + b, c);
  }
  // Filled and outlined rectangles covering pixels [x, x + w) x [y, y + h).
  void fill(int x, int y, int w, int h, Rgb c) {
    for (int row = y; row < y + h; ++row)
      for (int col = x; col < x + w; ++col) set(col, row, c);
  }
  void frame(int x, int y, int w, int h, Rgb c) {
    if (w <= 0 || h <= 0) return;
    line(x, y, x + w - 1, y, c);
    line(x, y + h - 1, x + w - 1, y + h - 1, c);
    line(x, y, x, y + h - 1, c);
    line(x + w - 1, y, x + w - 1, y + h - 1, c);
  }
  // 5x7 glyphs, 1 pixel spacing, scaled by `scale`; a character without a glyph (space included)
  // leaves its cell blank.
  void text(int x, int y, const std::string& s, Rgb c, int scale = 1) {
    for (char ch : s) {
      const uint8_t* g = glyph(ch);
      if (g) {
        for (int row = 0; row < 7; ++row)
          for (int col = 0; col < 5; ++col)
            if (g[row] & (0x10 >> col))
              for (int a = 0; a < scale; ++a)
                for (int b = 0; b < scale; ++b) set(x + col * scale + a, y + row * scale + b, c);
      }
      x += 6 * scale;
    }
  }
  static int text_width(const std::string& s, int scale = 1) { return static_cast<int>(s.size()) * 6 * scale; }

  void save(const std::string& path) const {
    std::vector<uint8_t> raw;
    raw.reserve(static_cast<size_t>(h_) * (static_cast<size_t>(w_) * 3 + 1));
    for (int y = 0; y < h_; ++y) {
      raw.push_back(0);  // filter: none
      auto row = px_.begin() + static_cast<ptrdiff_t>(static_cast<size_t>(y) * static_cast<size_t>(w_) * 3);
      raw.insert(raw.end(), row, row + w_ * 3);
    }
    uLongf zlen = compressBound(static_cast<uLong>(raw.size()));
    std::vector<uint8_t> z(zlen);
    if (compress2(z.data(), &zlen, raw.data(), static_cast<uLong>(raw.size()), 9) != Z_OK) {
      throw std::runtime_error("png: zlib compress failed");
    }
    z.resize(zlen);
    std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    std::vector<uint8_t> ihdr;
    put32(ihdr, static_cast<uint32_t>(w_));
    put32(ihdr, static_cast<uint32_t>(h_));
    ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit, RGB, deflate, no filter, no interlace
    chunk(out, "IHDR", ihdr);
    chunk(out, "IDAT", z);
    chunk(out, "IEND", {});
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) throw std::runtime_error("cannot write " + path);
    size_t n = std::fwrite(out.data(), 1, out.size(), f);
    bool ok = n == out.size();
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) throw std::runtime_error("short write to " + path);
  }

 private:
  static void put32(std::vector<uint8_t>& v, uint32_t x) {
    v.insert(v.end(), {static_cast<uint8_t>(x >> 24), static_cast<uint8_t>(x >> 16), static_cast<uint8_t>(x >> 8),
                       static_cast<uint8_t>(x)});
  }
  static void chunk(std::vector<uint8_t>& out, const char* type, const std::vector<uint8_t>& data) {
    put32(out, static_cast<uint32_t>(data.size()));
    std::vector<uint8_t> body(type, type + 4);
    body.insert(body.end(), data.begin(), data.end());
    out.insert(out.end(), body.begin(), body.end());
    put32(out, static_cast<uint32_t>(crc32(0, body.data(), static_cast<uInt>(body.size()))));
  }
  struct Glyph {
    char ch;
    uint8_t rows[7];  // top to bottom; bit 0x10 is the leftmost column
  };
  // The HD44780 LCD character set (descenders squeezed into the 7 rows), except '/', which keeps
  // the steeper shape the bandwidth plots have always used.
  static const uint8_t* glyph(char c) {
    static const Glyph font[] = {
        {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}}, {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
        {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}}, {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}},
        {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}}, {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
        {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}}, {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
        {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}}, {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
        {'A', {0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11}}, {'B', {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E}},
        {'C', {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}}, {'D', {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C}},
        {'E', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}}, {'F', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10}},
        {'G', {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}}, {'H', {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}},
        {'I', {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}}, {'J', {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}},
        {'K', {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}}, {'L', {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F}},
        {'M', {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}}, {'N', {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}},
        {'O', {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}}, {'P', {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10}},
        {'Q', {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}}, {'R', {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11}},
        {'S', {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}}, {'T', {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}},
        {'U', {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}}, {'V', {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04}},
        {'W', {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}}, {'X', {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11}},
        {'Y', {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04}}, {'Z', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}},
        {'a', {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F}}, {'b', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E}},
        {'c', {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E}}, {'d', {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F}},
        {'e', {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E}}, {'f', {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08}},
        {'g', {0x00, 0x00, 0x0F, 0x11, 0x0F, 0x01, 0x0E}}, {'h', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11}},
        {'i', {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E}}, {'j', {0x02, 0x00, 0x06, 0x02, 0x02, 0x12, 0x0C}},
        {'k', {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12}}, {'l', {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}},
        {'m', {0x00, 0x00, 0x1A, 0x15, 0x15, 0x11, 0x11}}, {'n', {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11}},
        {'o', {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E}}, {'p', {0x00, 0x00, 0x1E, 0x11, 0x1E, 0x10, 0x10}},
        {'q', {0x00, 0x00, 0x0D, 0x13, 0x0F, 0x01, 0x01}}, {'r', {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10}},
        {'s', {0x00, 0x00, 0x0E, 0x10, 0x0E, 0x01, 0x1E}}, {'t', {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06}},
        {'u', {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D}}, {'v', {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04}},
        {'w', {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A}}, {'x', {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11}},
        {'y', {0x00, 0x00, 0x11, 0x11, 0x0F, 0x01, 0x0E}}, {'z', {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F}},
        {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}}, {',', {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}},
        {':', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}}, {'#', {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A}},
        {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}}, {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}},
        {'[', {0x0E, 0x08, 0x08, 0x08, 0x08, 0x08, 0x0E}}, {']', {0x0E, 0x02, 0x02, 0x02, 0x02, 0x02, 0x0E}},
        {'-', {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00}}, {'+', {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00}},
        {'=', {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00}}, {'_', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F}},
        {'/', {0x01, 0x01, 0x02, 0x04, 0x08, 0x10, 0x10}}, {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}},
        {'<', {0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02}}, {'>', {0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08}},
        {'\'', {0x0C, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00}}, {'"', {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00}},
        {'?', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04}}, {'!', {0x04, 0x04, 0x04, 0x04, 0x00, 0x00, 0x04}},
        {'*', {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00}}, {'@', {0x0E, 0x11, 0x01, 0x0D, 0x15, 0x15, 0x0E}},
        {'&', {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D}}, {'|', {0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}},
    };
    for (const Glyph& g : font)
      if (g.ch == c) return g.rows;
    return nullptr;
  }
  int w_, h_;
  std::vector<uint8_t> px_;
};

inline std::string size_label(double bytes) {
  const char* units[] = {"", "K", "M", "G"};
  int u = 0;
  while (bytes >= 1024 && u < 3) bytes /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f%s", bytes, units[u]);
  return buf;
}

// Plots busbw (GB/s) against message size (log2 axis). Series share the axes.
inline void plot_bandwidth(const std::string& path, const std::vector<Series>& series) {
  const int W = 900, H = 560, left = 70, right = 20, top = 20, bottom = 50;
  Canvas c(W, H);
  double xmin = 1e300, xmax = 0, ymax = 0;
  for (const auto& s : series)
    for (size_t i = 0; i < s.bytes.size(); ++i) {
      if (s.bytes[i] <= 0) continue;
      xmin = std::min(xmin, s.bytes[i]), xmax = std::max(xmax, s.bytes[i]), ymax = std::max(ymax, s.gbps[i]);
    }
  if (xmax <= 0) xmin = 1, xmax = 2;
  double lx0 = std::floor(std::log2(xmin)), lx1 = std::ceil(std::log2(xmax));
  if (lx1 <= lx0) lx1 = lx0 + 1;
  // A round y step: 1, 2 or 5 times a power of ten, about 6 lines.
  double raw = std::max(ymax, 1e-3) / 6, mag = std::pow(10, std::floor(std::log10(raw)));
  double step = raw / mag < 2 ? 2 * mag : raw / mag < 5 ? 5 * mag : 10 * mag;
  double ytop = step * std::ceil(std::max(ymax, 1e-3) / step);
  const int pw = W - left - right, ph = H - top - bottom;
  auto X = [&](double b) { return left + static_cast<int>((std::log2(b) - lx0) / (lx1 - lx0) * pw); };
  auto Y = [&](double g) { return top + ph - static_cast<int>(g / ytop * ph); };
  const Rgb grid{225, 225, 225}, axis{0, 0, 0};
  for (double y = 0; y <= ytop + step / 2; y += step) {
    c.line(left, Y(y), left + pw, Y(y), grid);
    char buf[32];
    std::snprintf(buf, sizeof buf, step < 0.1 ? "%.2f" : step < 1 ? "%.1f" : "%.0f", y);
    c.text(left - 8 - Canvas::text_width(buf), Y(y) - 3, buf, axis);
  }
  const int every = (lx1 - lx0) > 16 ? 4 : (lx1 - lx0) > 8 ? 2 : 1;
  for (int e = static_cast<int>(lx0); e <= static_cast<int>(lx1); ++e) {
    double b = std::ldexp(1.0, e);
    c.line(X(b), top, X(b), top + ph, grid);
    if ((e - static_cast<int>(lx0)) % every == 0) {
      std::string l = size_label(b);
      c.text(X(b) - Canvas::text_width(l) / 2, top + ph + 8, l, axis);
    }
  }
  c.line(left, top, left, top + ph, axis, 2);
  c.line(left, top + ph, left + pw, top + ph, axis, 2);
  c.text(8, top - 12 + 4, "GB/s", axis);
  c.text(left + pw - Canvas::text_width("B", 2), top + ph + 24, "B", axis, 2);
  for (const auto& s : series) {
    int px = -1, py = -1;
    for (size_t i = 0; i < s.bytes.size(); ++i) {
      if (s.bytes[i] <= 0) continue;
      int x = X(s.bytes[i]), y = Y(s.gbps[i]);
      if (px >= 0) c.line(px, py, x, y, s.color, 2);
      c.box(x, y, 3, s.color);
      px = x, py = y;
    }
  }
  c.save(path);
}

}  // namespace cohort::tools::png
