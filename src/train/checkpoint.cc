#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cohort/error.h"

namespace cohort::train {

namespace {
constexpr std::string_view kMagic = "COHORTCKPT1\n";

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw Error(fmt::format("checkpoint: {} {}: {}", what, path, std::strerror(errno)));
}
}  // namespace

void write_file_atomically(const std::string& path, const std::string& bytes) {
  namespace fs = std::filesystem;
  fs::path target(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(fmt::format("checkpoint: cannot create directory {}: {}", dir.string(), ec.message()));
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create", tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int saved = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      errno = saved;
      fail("cannot write", tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    ::unlink(tmp.c_str());
    fail("cannot fsync", tmp);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    fail("cannot rename to", path);
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::optional<std::string> read_file_if_exists(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (!std::filesystem::exists(path)) return std::nullopt;
    fail("cannot open", path);
  }
  std::ostringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

std::string encode_checkpoint(const TrainingPosition& pos, const std::string& payload) {
  nlohmann::json j = {{"epoch", pos.epoch},
                      {"step_in_epoch", pos.step_in_epoch},
                      {"global_step", pos.global_step},
                      {"world_size", pos.world_size},
                      {"payload_bytes", payload.size()}};
  std::string out(kMagic);
  out += j.dump();
  out += '\n';
  out += payload;
  return out;
}

TrainingPosition decode_checkpoint(const std::string& bytes, std::string& payload, const std::string& what) {
  if (bytes.compare(0, kMagic.size(), kMagic) != 0)
    throw InvalidArgument(fmt::format("{} is not a cohort checkpoint (bad header)", what));
  size_t eol = bytes.find('\n', kMagic.size());
  if (eol == std::string::npos) throw InvalidArgument(fmt::format("{}: truncated checkpoint header", what));
  TrainingPosition pos;
  size_t payload_bytes = 0;
  try {
    auto j = nlohmann::json::parse(bytes.substr(kMagic.size(), eol - kMagic.size()));
    pos.epoch = j.at("epoch").get<int64_t>();
    pos.step_in_epoch = j.at("step_in_epoch").get<int64_t>();
    pos.global_step = j.at("global_step").get<int64_t>();
    pos.world_size = j.at("world_size").get<int>();
    payload_bytes = j.at("payload_bytes").get<size_t>();
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(fmt::format("{}: bad checkpoint header: {}", what, e.what()));
  }
  if (bytes.size() - eol - 1 != payload_bytes)
    throw InvalidArgument(fmt::format("{}: checkpoint truncated ({} payload bytes, header says {})", what,
                                      bytes.size() - eol - 1, payload_bytes));
  payload = bytes.substr(eol + 1);
  return pos;
}

std::string checkpoint_path(const std::string& dir) { return dir + "/checkpoint.bin"; }

}  // namespace cohort::train
