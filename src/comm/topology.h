#pragma once
// Topology: which ranks share a host, derived at bootstrap from every rank's HostIdentity.
//
// This is also the hook for intra-host fast paths (the shared-memory group of src/transport/shm/):
// `hosts[h]` lists the ranks of host h in rank order, `host_of_rank[r]` indexes it, and
// `all_local()` says the whole communicator is on one host. See docs/thread_model.md
// ("Plugging in an intra-host group").

#include <string>
#include <vector>

#include "common/host_identity.h"

namespace cohort::comm {

struct Topology {
  std::vector<HostIdentity> identity;      // per rank
  std::vector<std::vector<int>> hosts;     // ranks per host, hosts ordered by their lowest rank
  std::vector<int> host_of_rank;           // rank -> index into hosts
  int local_rank = 0;
  int local_size = 1;

  bool all_local() const { return hosts.size() == 1; }
  bool same_host(int a, int b) const { return host_of_rank[size_t(a)] == host_of_rank[size_t(b)]; }
  const std::vector<int>& my_host_ranks(int rank) const { return hosts[size_t(host_of_rank[size_t(rank)])]; }

  static Topology build(int rank, std::vector<HostIdentity> identities);
};

}  // namespace cohort::comm
