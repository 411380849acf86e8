#include "ps/wire.h"

#include <fmt/core.h>

#include <algorithm>
#include <map>

#include "cohort/error.h"
#include "comm/peer_links.h"
#include "common/strings.h"

namespace cohort::ps {

namespace {
// The PS world's communicator carries nothing else, so any tag space works; a recognisable one
// helps when reading a transport trace. The signature is constant: the header says what it is.
constexpr uint64_t kTagBase = 0x5053000000000000ull;  // "PS"
constexpr transport::Signature kSignature{0xF5, 0, 0, 0, 0, 0};
}  // namespace

std::string name_roles(const std::string& text, int num_servers) {
  std::string out;
  size_t last = 0;
  for (const auto& m : str::rank_mentions(text)) {
    out.append(text, last, m.pos - last);
    out += m.rank < num_servers ? fmt::format("parameter server {} (", m.rank)
                                : fmt::format("worker {} (", m.rank - num_servers);
    last = m.pos + m.len;
  }
  out.append(text, last, std::string::npos);
  return out;
}

Buffer BufferPool::take(size_t n) {
  size_t best = kept_.size();
  for (size_t i = 0; i < kept_.size(); ++i)
    if (kept_[i].capacity() >= n && (best == kept_.size() || kept_[i].capacity() < kept_[best].capacity())) best = i;
  Buffer b;
  if (best < kept_.size()) {
    b = std::move(kept_[best]);
    kept_.erase(kept_.begin() + long(best));
  }
  b.resize(n);
  return b;
}

void BufferPool::give(Buffer b) {
  if (b.capacity() == 0) return;
  if (kept_.size() == kKeep) {  // keep the larger ones
    auto smallest = std::min_element(kept_.begin(), kept_.end(),
                                     [](const Buffer& x, const Buffer& y) { return x.capacity() < y.capacity(); });
    if (smallest->capacity() >= b.capacity()) return;
    kept_.erase(smallest);
  }
  kept_.push_back(std::move(b));
}

Buffer buffer_of(const std::string& text) {
  Buffer b;
  b.resize(text.size());
  if (!text.empty()) std::memcpy(b.data(), text.data(), text.size());
  return b;
}

Endpoint::Endpoint(std::shared_ptr<Store> store, const std::string& prefix, int rank, const std::vector<bool>& peers,
                   std::chrono::milliseconds timeout, size_t max_unexpected_bytes)
    : rank_(rank), size_(int(peers.size())) {
  links_ = std::make_unique<comm::PeerLinks>(std::move(store), prefix, rank, peers, timeout, max_unexpected_bytes);
  std::map<transport::Transport*, int> served;
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && peers[size_t(r)]) ++served[links_->transport_to(r)];
  // Only transports that serve a peer are polled: an idle one would add a system call per poll
  // (tcp's epoll_wait) and turn waits into the several-transports path below.
  for (const auto& t : links_->transports())
    if (served.count(t.get())) active_.push_back(t.get());
  if (active_.empty()) active_.push_back(links_->transports().front().get());
  sleeper_ = active_.front();
  for (auto [t, n] : served)
    if (n > served[sleeper_]) sleeper_ = t;
}

Endpoint::~Endpoint() = default;

std::string Endpoint::host_of(int rank) const { return links_->host_of(rank); }

bool Endpoint::same_host(int rank) const { return std::strcmp(links_->transport_to(rank)->name(), "shm") == 0; }

Posted Endpoint::isend(int peer, Msg kind, uint64_t sub, const void* data, size_t bytes) {
  transport::Transport* t = links_->transport_to(peer);
  transport::Envelope env{kTagBase | uint64_t(kind), sub, kSignature};
  return Posted{t, t->isend(peer, env, data, bytes), false};
}

Posted Endpoint::irecv(int peer, Msg kind, uint64_t sub, void* data, size_t bytes) {
  transport::Transport* t = links_->transport_to(peer);
  transport::Envelope env{kTagBase | uint64_t(kind), sub, kSignature};
  return Posted{t, t->irecv(peer, env, data, bytes), false};
}

void Endpoint::discard(int peer, Msg kind, uint64_t sub) {
  links_->transport_to(peer)->discard(peer, transport::Envelope{kTagBase | uint64_t(kind), sub, kSignature});
}

size_t Endpoint::buffered_bytes() const {
  size_t n = 0;
  for (const auto& t : links_->transports()) n += t->buffered_bytes();
  return n;
}

bool Endpoint::test(Posted& p) {
  if (!p.done && p.t) p.done = p.t->test(p.id);
  return p.done;
}

bool Endpoint::poll(int timeout_ms) {
  if (active_.size() == 1) return active_.front()->poll(timeout_ms);
  bool progress = false;
  for (auto* t : active_) progress |= t->poll(0);
  // Several transports (shm inside the host, tcp across): sleep in short slices in the one that
  // serves most peers, so that the others are polled again soon.
  if (!progress && timeout_ms > 0) progress = sleeper_->poll(std::min(timeout_ms, 1));
  return progress;
}

}  // namespace cohort::ps
