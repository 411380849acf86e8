#pragma once
// TCP transport: non-blocking sockets, several connections per peer, epoll.
//
// Wire format: every fragment is a 56-byte header (tag, sub, signature, total size, offset,
// fragment size) followed by its payload, written with one writev(). Messages larger than
// COHORT_TCP_SPLIT_BYTES are cut into one fragment per connection (COHORT_TCP_CONNECTIONS) so
// large transfers use several streams at once. The receiver reads headers into a small staging
// buffer and payloads straight into the posted receive buffer (readv of payload + next header);
// a message that arrives before its receive is posted is buffered whole ("unexpected") and copied
// once when the receive comes. Reading never stops while anything is pending, so a large send and
// a large receive between the same two ranks never deadlock (full duplex).
//
// Connection set-up: rank i dials every rank j > i (COHORT_TCP_CONNECTIONS sockets each) in
// rotated order (i+1, i+2, ...) so that ranks do not all dial rank 0 first, then accepts the
// connections of lower ranks. A hello (magic, scope hash, rank, connection index) is checked.
// Keep-alive is on, so a dead host is noticed even when no data flows.

#include <memory>

#include "transport/transport.h"

namespace cohort::transport {

std::unique_ptr<Transport> make_tcp_transport(const TransportOptions& options);

}  // namespace cohort::transport
