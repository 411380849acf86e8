// Facts about this machine that a plan depends on (injected as MachineFacts so that tests control
// them): its name and addresses, its CPUs and GPUs, whether a host names it, and programs on its PATH.

#include <arpa/inet.h>
#include <dirent.h>
#include <fmt/core.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "cohort/error.h"
#include "common/socket.h"
#include "common/strings.h"
#include "launch/plan_internal.h"

namespace cohort::launch {

std::string resolve_program(const std::string& program) {
  auto check = [&](const std::string& path) -> bool {
    struct stat st {};
    if (stat(path.c_str(), &st) != 0) return false;
    if (S_ISDIR(st.st_mode)) throw ConfigError(fmt::format("program '{}' is a directory", path));
    if (access(path.c_str(), X_OK) != 0)
      throw ConfigError(fmt::format("program '{}' is not executable (chmod +x, or name its interpreter first)", path));
    // A script whose interpreter is missing would only fail in exec: check the "#!" line now.
    std::ifstream in(path, std::ios::binary);
    char magic[2] = {0, 0};
    if (in.read(magic, 2) && magic[0] == '#' && magic[1] == '!') {
      std::string line;
      std::getline(in, line);
      auto words = str::split(str::trim(line), ' ');
      if (!words.empty() && access(words[0].c_str(), X_OK) != 0)
        throw ConfigError(fmt::format("program '{}' cannot run: its interpreter '{}' (first line) is missing or not "
                                      "executable",
                                      path, words[0]));
    }
    return true;
  };
  if (program.empty()) throw ConfigError("no PROGRAM given (usage: cohort run [options] PROGRAM [ARGS...])");
  if (program.find('/') != std::string::npos) {
    if (!check(program)) throw ConfigError(fmt::format("program '{}' does not exist", program));
    return program;
  }
  const char* path = getenv("PATH");
  for (const auto& dir : str::split(path ? path : "/usr/local/bin:/usr/bin:/bin", ':')) {
    std::string candidate = dir + "/" + program;
    if (check(candidate)) return candidate;
  }
  // A file of that name right here is not run (a shell would not run it either), but the user most
  // likely meant it.
  struct stat here {};
  if (stat(program.c_str(), &here) == 0 && S_ISREG(here.st_mode))
    throw ConfigError(fmt::format("program '{}' not found on PATH (there is one in this folder: name it ./{})",
                                  program, program));
  throw ConfigError(fmt::format("program '{}' not found on PATH", program));
}

MachineFacts this_machine(bool with_gpus) {
  MachineFacts m;
  m.hostname = net::hostname();
  m.cpu_count = static_cast<int>(allowed_cpus().size());
  if (m.cpu_count <= 0) m.cpu_count = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  m.resolve_program = &resolve_program;
  m.addresses = {m.hostname};
  struct ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (auto* a = list; a; a = a->ifa_next) {
      if (!a->ifa_addr || (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6)) continue;
      char text[INET6_ADDRSTRLEN] = {};
      const void* raw = a->ifa_addr->sa_family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ifa_addr)->sin6_addr);
      if (inet_ntop(a->ifa_addr->sa_family, raw, text, sizeof text)) m.addresses.push_back(text);
    }
    freeifaddrs(list);
  }
  if (with_gpus) {
    EnvMap env;
    if (const char* v = getenv("CUDA_VISIBLE_DEVICES")) env["CUDA_VISIBLE_DEVICES"] = v;
    m.gpus = detect_gpus(env);
    m.gpu_count = static_cast<int>(m.gpus.gpus.size());
    return m;
  }
  // Visible GPUs: CUDA_VISIBLE_DEVICES when set, else the /dev/nvidiaN device nodes.
  if (const char* v = getenv("CUDA_VISIBLE_DEVICES")) {
    m.gpu_count = static_cast<int>(str::split(v, ',').size());
  } else if (DIR* d = opendir("/dev")) {
    while (auto* e = readdir(d)) {
      std::string name = e->d_name;
      if (name.size() > 6 && name.rfind("nvidia", 0) == 0 &&
          std::all_of(name.begin() + 6, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
        ++m.gpu_count;
    }
    closedir(d);
  }
  return m;
}

bool is_local_host(const std::string& host, const std::string& hostname) {
  if (host == "localhost" || host == "127.0.0.1" || host == "::1" || host == hostname) return true;
  auto short_name = hostname.substr(0, hostname.find('.'));
  return host == short_name;
}

bool is_this_machine(const std::string& host, const MachineFacts& machine) {
  if (is_local_host(host, machine.hostname)) return true;
  return std::find(machine.addresses.begin(), machine.addresses.end(), host) != machine.addresses.end();
}

}  // namespace cohort::launch
