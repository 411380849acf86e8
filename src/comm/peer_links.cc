#include "comm/peer_links.h"

#include "comm/communicator_impl.h"
#include "comm/settings.h"

namespace cohort::comm {

PeerLinks::PeerLinks(std::shared_ptr<Store> store, const std::string& prefix, int rank,
                     const std::vector<bool>& peers, std::chrono::milliseconds timeout,
                     size_t max_unexpected_bytes) {
  CommOptions options;
  options.timeout = timeout;
  apply_env_overrides(options);  // COHORT_TRANSPORT, COHORT_TIMEOUT
  // A child communicator: it does not take over the process's flight-recorder identity (the
  // worker's own communicator keeps it) and runs no collectives.
  CommSetup s;
  s.root_store = std::move(store);
  s.prefix = prefix;
  s.rank = rank;
  s.size = int(peers.size());
  s.options = options;
  s.child = true;
  s.connections_only = true;
  s.connect_to = peers;
  s.max_unexpected_bytes = max_unexpected_bytes;
  impl_ = std::make_shared<CommunicatorImpl>(std::move(s));
  impl_->bootstrap();
  for (int r = 0; r < int(peers.size()); ++r) route_.push_back(impl_->transport_to(r));
}

PeerLinks::~PeerLinks() = default;

std::string PeerLinks::host_of(int rank) const { return impl_->host_of(rank); }

const std::vector<std::unique_ptr<transport::Transport>>& PeerLinks::transports() const {
  return impl_->transports();
}

}  // namespace cohort::comm
