#include "common/io.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/core.h>

#include <cerrno>
#include <cstring>

#include "common/fd.h"

namespace cohort::io {

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      if (k == 0) errno = EIO;
      return false;
    }
    p += k;
    n -= size_t(k);
  }
  return true;
}

std::optional<std::string> read_file(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return std::nullopt;
  std::string text;
  char chunk[65536];
  for (;;) {
    const ssize_t k = ::read(fd.get(), chunk, sizeof chunk);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return std::nullopt;
    if (k == 0) return text;
    text.append(chunk, size_t(k));
  }
}

std::string replace_file(const std::string& path, const std::string& tmp, std::string_view bytes) {
  auto failed = [&](const std::string& what) {
    const std::string line = fmt::format("{}: {}: {}", tmp, what, std::strerror(errno));
    ::unlink(tmp.c_str());  // what a full disk let it write
    return line;
  };
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd) return fmt::format("{}: cannot create it: {}", tmp, std::strerror(errno));
    if (!write_all(fd.get(), bytes.data(), bytes.size())) return failed("cannot write it");
    if (::fsync(fd.get()) != 0) return failed("cannot sync it");
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) return failed(fmt::format("cannot rename it to {}", path));
  const size_t slash = path.rfind('/');
  const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  UniqueFd dir(::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dir) ::fsync(dir.get());
  return "";
}

}  // namespace cohort::io
