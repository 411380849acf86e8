// The worker side's pull, push and push_pull (client_impl.h): a call's ids split by the server that
// owns them and deduplicated, each server's request payload built with the gradients summed into it,
// and the replies' rows copied to every position that asked. Servers whose shards this worker has
// mapped (client_direct.cc) are served in place, without a message. This is the per-step path.
#include <fmt/core.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "ps/client_impl.h"
#include "ps/sharding.h"

namespace cohort::ps::client_internal {

int ClientImpl::owner(const TableConfig& c, uint64_t id) const {
  if (roles_.num_servers == 1) return 0;
  return c.dense ? (id < c.rows ? shard_of_row(id, c.rows, roles_.num_servers) : 0)
                 : shard_of_id(id, roles_.num_servers);
}

// pull (push_ids null), push (pull_ids null) or push_pull. Duplicate ids are merged here: a
// pulled row is asked once and copied to every position; pushed gradients of one id are summed.
// A server whose shard this worker has mapped (same host, async mode: direct_shard) is served
// here, without a message: its pushes are applied to the shared rows and its rows read from them.
std::shared_ptr<Operation> ClientImpl::start_pull_push(Op kind, const std::string& table, const TableConfig& c,
                                                       const uint64_t* push_ids, size_t n, const float* grads,
                                                       const uint64_t* pull_ids, size_t m, float* rows) {
  const size_t d = c.dim;
  const int S = roles_.num_servers;
  auto op = std::make_shared<Operation>();
  op->what = fmt::format("{} of '{}'", op_name(kind), table);
  if (c.dense) {  // caught here, as no shard holds such a row (the servers check it too)
    for (const auto& [ids, count] : {std::pair{push_ids, n}, std::pair{pull_ids, m}})
      for (size_t i = 0; ids && i < count; ++i)
        if (ids[i] >= c.rows)
          throw InvalidArgument(fmt::format("{}: row {} is outside the dense table's {} rows", op->what, ids[i], c.rows));
  }

  // Unique ids per server, and for every position which (server, index there) it became. The
  // request to server s is [its push ids][their gradients, summed over duplicates][its pull ids]:
  // the gradients are added straight into that payload, so they are copied once.
  std::vector<std::vector<uint64_t>> push_by(static_cast<size_t>(S));
  std::vector<Place> push_at;
  if (push_ids) index_ids(c, push_ids, n, push_by, push_at);
  std::vector<std::vector<uint64_t>> pull_by(static_cast<size_t>(S));
  auto from = std::make_shared<std::vector<Place>>();
  if (pull_ids) index_ids(c, pull_ids, m, pull_by, *from);

  // Every server's request is built and checked before any is sent: a refused call leaves
  // nothing in flight.
  if (!table.empty()) {
    RequestHeader probe;
    set_table_name(probe, table);
  }
  for (int s = 0; s < S; ++s) {
    const size_t k = push_by[size_t(s)].size(), q = pull_by[size_t(s)].size();
    const size_t bytes = k * 8 + k * d * 4 + q * 8;
    if (bytes > max_request_ || q * d * 4 > max_request_)
      throw InvalidArgument(fmt::format("{} of '{}': {} ids make a request of {} bytes to server {}, more than "
                                        "the servers' limit of {} bytes (COHORT_PS_MAX_REQUEST); split the call",
                                        op_name(kind), table, k + q, std::max(bytes, q * d * 4), s, max_request_));
  }
  std::vector<TableShard*> direct(static_cast<size_t>(S), nullptr);
  bool any_direct = false;
  for (int s = 0; s < S; ++s) {
    if (push_by[size_t(s)].empty() && pull_by[size_t(s)].empty()) continue;
    direct[size_t(s)] = direct_shard(table, c, s);
    any_direct |= direct[size_t(s)] != nullptr;
  }
  if (any_direct) check_servers_alive(op->what);

  // Direct servers first: pushes (a push_pull's pull sees them), then rows. Nothing is copied
  // on the way: a gradient is read from the caller's row where its id occurs once (a sum in
  // scratch where it recurs), and a row is read into the caller's buffer at the id's first position.
  if (any_direct) {
    // first[s][k]: the first position of server s's k-th unique id.
    std::vector<std::vector<uint32_t>> first(static_cast<size_t>(S));
    if (push_ids) {
      std::vector<std::vector<const float*>> src(static_cast<size_t>(S));
      for (int s = 0; s < S; ++s)
        if (direct[size_t(s)]) {
          src[size_t(s)].resize(push_by[size_t(s)].size());
          first[size_t(s)].resize(push_by[size_t(s)].size());
        }
      for (size_t i = 0; i < push_at.size(); ++i) {
        const Place at = push_at[i];
        if (!direct[at.server]) continue;
        const float*& from_row = src[at.server][at.index];
        if (at.first) {
          from_row = grads + i * d;
          first[at.server][at.index] = uint32_t(i);
          continue;
        }
        const size_t f = first[at.server][at.index];
        if (push_scratch_.size() < n * d) push_scratch_.resize(n * d);
        float* sum = push_scratch_.data() + f * d;  // the first position's row: one per id
        if (from_row != sum) {
          std::memcpy(sum, grads + f * d, d * 4);
          from_row = sum;
        }
        for (size_t j = 0; j < d; ++j) sum[j] += grads[i * d + j];
      }
      for (int s = 0; s < S; ++s)
        if (direct[size_t(s)] && !push_by[size_t(s)].empty())
          direct[size_t(s)]->apply(push_by[size_t(s)].data(), push_by[size_t(s)].size(), src[size_t(s)].data());
    }
    if (pull_ids) {
      std::vector<std::vector<float*>> dst(static_cast<size_t>(S));
      for (int s = 0; s < S; ++s) {
        first[size_t(s)].clear();
        if (direct[size_t(s)]) {
          dst[size_t(s)].resize(pull_by[size_t(s)].size());
          first[size_t(s)].resize(pull_by[size_t(s)].size());
        }
      }
      for (size_t i = 0; i < from->size(); ++i) {
        const Place at = (*from)[i];
        if (!direct[at.server] || !at.first) continue;
        dst[at.server][at.index] = rows + i * d;
        first[at.server][at.index] = uint32_t(i);
      }
      for (int s = 0; s < S; ++s)
        if (direct[size_t(s)] && !pull_by[size_t(s)].empty())
          direct[size_t(s)]->read(pull_by[size_t(s)].data(), pull_by[size_t(s)].size(), dst[size_t(s)].data());
      for (size_t i = 0; i < from->size(); ++i) {
        const Place at = (*from)[i];
        if (direct[at.server] && !at.first)
          std::memcpy(rows + i * d, rows + size_t(first[at.server][at.index]) * d, d * 4);
      }
    }
  }

  std::vector<Buffer> payloads(static_cast<size_t>(S));
  std::vector<float*> grads_at(static_cast<size_t>(S), nullptr);
  for (int s = 0; s < S; ++s) {
    if (direct[size_t(s)]) continue;
    const auto& pi = push_by[size_t(s)];
    const auto& qi = pull_by[size_t(s)];
    Buffer& payload = payloads[size_t(s)];
    payload = pool_.take(pi.size() * 8 + pi.size() * d * 4 + qi.size() * 8);
    // (memcpy is skipped for empty parts: their pointers may be null, which memcpy may not get.)
    uint8_t* p = payload.data();
    if (!pi.empty()) std::memcpy(p, pi.data(), pi.size() * 8);
    grads_at[size_t(s)] = reinterpret_cast<float*>(p + pi.size() * 8);  // 8-aligned: ids before it
    if (!qi.empty()) std::memcpy(p + pi.size() * 8 + pi.size() * d * 4, qi.data(), qi.size() * 8);
  }
  for (size_t i = 0; i < push_at.size(); ++i) {
    if (direct[push_at[i].server]) continue;
    float* g = grads_at[push_at[i].server] + size_t(push_at[i].index) * d;
    if (push_at[i].first) std::memcpy(g, grads + i * d, d * 4);
    else
      for (size_t j = 0; j < d; ++j) g[j] += grads[i * d + j];
  }
  std::vector<int> call_of(static_cast<size_t>(S), -1);
  for (int s = 0; s < S; ++s) {
    if (direct[size_t(s)]) continue;
    const auto& pi = push_by[size_t(s)];
    const auto& qi = pull_by[size_t(s)];
    // push_pull goes to every server outside async mode: each must hear that the step ended.
    if ((kind != Op::kPushPull || mode_.mode == Mode::kAsync) && pi.empty() && qi.empty()) continue;
    call_of[size_t(s)] = int(op->calls.size());
    post(*op, s, kind, table, std::move(payloads[size_t(s)]), [&](RequestHeader& h) {
      h.dim = c.dim;
      h.n = kind == Op::kPull ? qi.size() : pi.size();
      h.m = kind == Op::kPushPull ? qi.size() : 0;
    });
  }
  if (kind == Op::kPushPull) ++clock_;
  op->recycle = true;
  inflight_.push_back(op);
  if (pull_ids) {
    op->finish = [from, call_of, rows, d](Operation& o) {
      for (size_t i = 0; i < from->size(); ++i) {
        const Place at = (*from)[i];
        if (call_of[at.server] < 0) continue;  // a direct server's rows are in place already
        const uint8_t* src = o.calls[size_t(call_of[at.server])]->reply_payload.data();
        std::memcpy(rows + i * d, src + size_t(at.index) * d * 4, d * 4);
      }
    };
  }
  return op;
}

// Dedups ids[0..n) per server into by[server] and sets at[i] for each position. The index is an
// open-addressing table kept between calls and stamped per call, so nothing is allocated or cleared
// per call once it has grown (a std::unordered_map cost a node allocation per id).
void ClientImpl::index_ids(const TableConfig& c, const uint64_t* ids, size_t n,
                           std::vector<std::vector<uint64_t>>& by, std::vector<Place>& at) {
  // A push usually names the ids of the pull before it (a step pulls a batch's rows and pushes
  // their gradients): then that pull's split serves again. Comparing the ids is one sequential read.
  if (n > 0 && n == last_ids_.size() && c.dense == last_dense_ && c.rows == last_rows_ &&
      std::memcmp(ids, last_ids_.data(), n * 8) == 0) {
    by = last_by_;
    at = last_at_;
    return;
  }
  index_ids_uncached(c, ids, n, by, at);
  if (n > kCacheIds) {  // not kept: a huge call's copies would stay allocated
    last_ids_ = {};
    return;
  }
  last_ids_.assign(ids, ids + n);
  last_dense_ = c.dense;
  last_rows_ = c.rows;
  last_by_ = by;
  last_at_ = at;
}

void ClientImpl::index_ids_uncached(const TableConfig& c, const uint64_t* ids, size_t n,
                                    std::vector<std::vector<uint64_t>>& by, std::vector<Place>& at) {
  size_t cap = 16;
  while (cap < 2 * n) cap *= 2;
  if (dedup_keys_.size() < cap) {
    dedup_keys_.assign(cap, 0);
    dedup_places_.assign(cap, Place{});
    dedup_stamps_.assign(cap, 0);
    dedup_stamp_ = 0;
  }
  cap = dedup_keys_.size();
  if (++dedup_stamp_ == 0) {  // wrapped: no slot may look current
    std::fill(dedup_stamps_.begin(), dedup_stamps_.end(), 0);
    dedup_stamp_ = 1;
  }
  at.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t id = ids[i];
    size_t h = mix64(id) & (cap - 1);
    while (dedup_stamps_[h] == dedup_stamp_ && dedup_keys_[h] != id) h = (h + 1) & (cap - 1);
    if (dedup_stamps_[h] == dedup_stamp_) {
      at[i] = dedup_places_[h];
      at[i].first = false;
      continue;
    }
    const auto s = static_cast<uint32_t>(owner(c, id));
    const Place place{s, static_cast<uint32_t>(by[s].size()), true};
    by[s].push_back(id);
    dedup_stamps_[h] = dedup_stamp_;
    dedup_keys_[h] = id;
    dedup_places_[h] = place;
    at[i] = place;
  }
  // A table for a huge call is not kept: 24 bytes a slot would stay allocated for good.
  constexpr size_t kKeepSlots = size_t{1} << 20;
  if (dedup_keys_.size() > kKeepSlots) {
    dedup_keys_ = {};
    dedup_places_ = {};
    dedup_stamps_ = {};
  }
}

}  // namespace cohort::ps::client_internal
