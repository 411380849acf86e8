#include "comm/topology.h"

#include <map>

namespace cohort::comm {

Topology Topology::build(int rank, std::vector<HostIdentity> identities) {
  Topology t;
  t.identity = std::move(identities);
  std::map<std::string, int> index;
  t.host_of_rank.resize(t.identity.size());
  for (size_t r = 0; r < t.identity.size(); ++r) {
    auto [it, fresh] = index.emplace(t.identity[r].shm_key(), int(t.hosts.size()));
    if (fresh) t.hosts.emplace_back();
    t.hosts[size_t(it->second)].push_back(int(r));
    t.host_of_rank[r] = it->second;
  }
  const auto& mine = t.hosts[size_t(t.host_of_rank[size_t(rank)])];
  t.local_size = int(mine.size());
  for (size_t i = 0; i < mine.size(); ++i)
    if (mine[i] == rank) t.local_rank = int(i);
  return t;
}

}  // namespace cohort::comm
