#include "common/private_files.h"

#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <ext/stdio_filebuf.h>

#include <fmt/core.h>

#include "cohort/error.h"

namespace cohort::files {
namespace {

std::string user_of(uid_t uid) {
  struct passwd pw, *found = nullptr;
  char buf[1024];
  if (getpwuid_r(uid, &pw, buf, sizeof buf, &found) == 0 && found) return fmt::format("{} (uid {})", pw.pw_name, uid);
  return fmt::format("uid {}", uid);
}

// An ostream that owns its buffer (the buffer owns the descriptor).
class FdStream : public std::ostream {
 public:
  explicit FdStream(int fd) : std::ostream(nullptr), buf_(fd, std::ios::out, 1 << 16) { rdbuf(&buf_); }

 private:
  __gnu_cxx::stdio_filebuf<char> buf_;
};

}  // namespace

UniqueFd create_new(const std::string& path, mode_t mode) {
  struct stat st;
  // What is there already: an earlier run's file, or something planted. A folder is not replaced.
  if (lstat(path.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) ::unlink(path.c_str());
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode));
  if (!fd) {
    int err = errno;
    throw Error(fmt::format("cannot create {}: {}{}", path, std::strerror(err),
                            err == EEXIST ? " (something was put there while it was being replaced)" : ""));
  }
  return fd;
}

UniqueFd open_append(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) throw Error(fmt::format("cannot append to {}: {}", path, std::strerror(errno)));
  struct stat st;
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid())
    throw Error(fmt::format("cannot append to {}: it is no longer the regular file of {} that was created there",
                            path, user_of(geteuid())));
  return fd;
}

std::unique_ptr<std::ostream> ostream_of(UniqueFd fd) { return std::make_unique<FdStream>(fd.release()); }

bool ensure_private_dir(const std::string& dir, bool create) {
  if (create && ::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error(fmt::format("cannot create the folder {}: {}", dir, std::strerror(errno)));
  // Opened without following a link, then checked through the descriptor: what is checked is what is used.
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd) {
    int err = errno;
    if (err == ENOENT && !create) return false;
    struct stat st;
    if ((err == ELOOP || err == ENOTDIR) && lstat(dir.c_str(), &st) == 0)
      throw Error(fmt::format("refusing the folder {}: it is {} of {}, not a folder of yours (another user may have "
                              "put it there)",
                              dir, S_ISLNK(st.st_mode) ? "a symbolic link" : "a file", user_of(st.st_uid)));
    throw Error(fmt::format("cannot open the folder {}: {}", dir, std::strerror(err)));
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) throw Error(fmt::format("cannot stat the folder {}: {}", dir, std::strerror(errno)));
  if (st.st_uid != geteuid())
    throw Error(fmt::format("refusing the folder {}: it belongs to {}, not to you ({}); another user made it (a "
                            "folder of yours there is expected, mode 0700)",
                            dir, user_of(st.st_uid), user_of(geteuid())));
  if ((st.st_mode & 077) != 0 && fchmod(fd.get(), 0700) != 0)
    throw Error(fmt::format("cannot make the folder {} private (mode 0700): {}", dir, std::strerror(errno)));
  return true;
}

}  // namespace cohort::files
