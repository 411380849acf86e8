#include "common/host_identity.h"

#include <sys/stat.h>

#include <fstream>

#include "common/env.h"
#include "common/socket.h"
#include "common/strings.h"

namespace cohort {
namespace {
const env::StringSetting kHostId("COHORT_HOST_ID", "",
                                 "extra host identity (tests: simulate several hosts on one machine)");
thread_local bool t_has_override = false;
thread_local std::string t_override;
}

ScopedHostIdOverride::ScopedHostIdOverride(std::string id) : previous_(t_override), had_previous_(t_has_override) {
  t_override = std::move(id);
  t_has_override = true;
}
ScopedHostIdOverride::~ScopedHostIdOverride() {
  t_override = previous_;
  t_has_override = had_previous_;
}

std::string HostIdentity::serialize() const {
  return hostname + "\n" + boot_id + "\n" + net_ns + "\n" + shm_dev;
}

HostIdentity HostIdentity::parse(const std::string& s) {
  auto parts = str::split(s, '\n', /*keep_empty=*/true);
  HostIdentity h;
  if (parts.size() > 0) h.hostname = parts[0];
  if (parts.size() > 1) h.boot_id = parts[1];
  if (parts.size() > 2) h.net_ns = parts[2];
  if (parts.size() > 3) h.shm_dev = parts[3];
  return h;
}

HostIdentity local_host_identity() {
  HostIdentity h;
  h.hostname = net::hostname();
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, h.boot_id);
  struct stat st {};
  if (stat("/proc/self/ns/net", &st) == 0) h.net_ns = std::to_string(st.st_ino);
  if (stat("/dev/shm", &st) == 0) h.shm_dev = std::to_string(st.st_dev);
  std::string extra = t_has_override ? t_override : kHostId.get();
  if (!extra.empty()) {
    h.boot_id += "+" + extra;
    h.hostname += "+" + extra;
  }
  return h;
}

}  // namespace cohort
