#include "transport/transport.h"

#include <algorithm>
#include <mutex>

#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace cohort::transport {
namespace {
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::vector<FactoryInfo>& registry() {
  // Built-in transports are listed here (a static Registration in a static library would be
  // dropped by the linker when nothing else references its object file).
  // shm before tcp: same-host peers move bytes through memory.
  static std::vector<FactoryInfo> r{{"shm", 20, make_shm_transport}, {"tcp", 10, make_tcp_transport}};
  return r;
}
}  // namespace

void register_factory(FactoryInfo info) {
  std::lock_guard<std::mutex> g(registry_mutex());
  auto& r = registry();
  r.erase(std::remove_if(r.begin(), r.end(), [&](const FactoryInfo& f) { return f.name == info.name; }), r.end());
  r.push_back(std::move(info));
}

std::vector<FactoryInfo> factories() {
  std::lock_guard<std::mutex> g(registry_mutex());
  auto r = registry();
  std::stable_sort(r.begin(), r.end(), [](const FactoryInfo& a, const FactoryInfo& b) { return a.priority > b.priority; });
  return r;
}

}  // namespace cohort::transport
