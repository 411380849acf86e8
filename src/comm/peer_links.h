#pragma once
// Connections without collectives, for a layer above comm that speaks its own protocol over the
// transports (the parameter server, src/ps/wire.h). The ranks meet and connect exactly as a
// communicator's do (the same store rendezvous, token proofs, transport choice and COHORT_TIMEOUT /
// COHORT_TRANSPORT settings), but nothing collective is set up: no shared-memory group, no
// hierarchical sub-communicators, so one rank's end ties no other's lifetime. The communicator that
// does this (comm/communicator_impl.h) stays private to comm; this is what the layers above see of it.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cohort/store.h"
#include "transport/transport.h"

namespace cohort::comm {

class CommunicatorImpl;

class PeerLinks {
 public:
  // Collective over the peers.size() ranks meeting under `prefix` of `store`: publishes this rank,
  // waits for every other (bounded by `timeout`, or COHORT_TIMEOUT when set) and connects to the
  // ranks marked true in `peers`. A message over `max_unexpected_bytes` that arrives before its
  // receive is thrown away, not buffered (TransportOptions::max_unexpected_bytes).
  PeerLinks(std::shared_ptr<Store> store, const std::string& prefix, int rank, const std::vector<bool>& peers,
            std::chrono::milliseconds timeout, size_t max_unexpected_bytes = SIZE_MAX);
  ~PeerLinks();
  PeerLinks(const PeerLinks&) = delete;
  PeerLinks& operator=(const PeerLinks&) = delete;

  std::string host_of(int rank) const;
  // The transport that reaches `peer` (a connected one). Inline: the PS asks it for every message.
  transport::Transport* transport_to(int peer) const { return route_[size_t(peer)]; }
  // Every transport this rank opened, whether or not it serves a peer.
  const std::vector<std::unique_ptr<transport::Transport>>& transports() const;

 private:
  std::shared_ptr<CommunicatorImpl> impl_;
  std::vector<transport::Transport*> route_;  // per peer, as the bootstrap chose (it never changes after)
};

}  // namespace cohort::comm
