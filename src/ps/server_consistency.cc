// The parameter server's consistency (include/cohort/ps.h; server_impl.h): the server knows each
// worker's clock (its step() count, sent with every request). bsp holds a step's pushes until every
// worker has ended the step; pulls that may not be answered yet (bsp, stale:K) wait in `deferred_`
// and are retried whenever a clock moves. In async mode pulls are answered and pushes applied at once.
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <unordered_map>
#include <vector>

#include "cohort/error.h"
#include "common/log.h"
#include "ps/server_impl.h"

namespace cohort::ps::server_internal {

void Server::pull_or_defer(int w, uint64_t seq, TableShard& t, uint64_t clock, const uint64_t* ids, uint64_t n) {
  if (may_pull(clock)) return answer_pull(w, seq, t, ids, n);
  auto answer = [this, w, seq, table = t.name(), kept = std::vector<uint64_t>(ids, ids + n)] {
    auto it = tables_.find(table);
    if (it == tables_.end())  // replaced by a load meanwhile
      reply_error(w, seq, fmt::format("parameter server {}: table '{}' is gone", index_, table));
    else
      answer_pull(w, seq, *it->second, kept.data(), kept.size());
  };
  deferred_.push_back(Deferred{w, seq, clock, pull_lag(), fmt::format("pull of '{}'", t.name()), answer});
}

void Server::answer_pull(int w, uint64_t seq, TableShard& t, const uint64_t* ids, uint64_t n) {
  Buffer rows = pool_.take(n * t.dim() * 4);
  t.read(ids, n, reinterpret_cast<float*>(rows.data()));
  reply(w, seq, std::move(rows));
}

void Server::push(int w, TableShard& t, uint64_t clock, const uint64_t* ids, uint64_t n, const float* grads) {
  if (mode_.mode != Mode::kBsp) return t.apply(ids, n, grads);
  held_[clock].resize(size_t(roles_.num_workers));
  held_[clock][size_t(w)].push_back(
      HeldPush{t.name(), std::vector<uint64_t>(ids, ids + n), std::vector<float>(grads, grads + n * t.dim())});
}

void Server::advance_clock(int w, uint64_t clock) {
  uint64_t before = min_clock();
  clock_[size_t(w)] = std::max(clock_[size_t(w)], clock);
  uint64_t now = min_clock();
  if (now == before) return;
  // bsp: every worker has ended the steps below `now`: apply what they pushed in them.
  while (!held_.empty() && held_.begin()->first < now) {
    apply_step(held_.begin()->second);
    held_.erase(held_.begin());
  }
  // In arrival order: a worker's deferred requests are answered in the order it sent them.
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    if (!may_answer(it->clock, it->lag)) {
      ++it;
      continue;
    }
    Deferred d = std::move(*it);
    it = deferred_.erase(it);
    answer_deferred(d);
  }
}

// A deferred answer runs inside another worker's request (the one whose clock moved): an error of
// it is its own worker's, under its own request number, never a second reply to the worker
// being handled.
void Server::answer_deferred(Deferred& d) {
  try {
    d.answer();
  } catch (const InvalidArgument& e) {
    reply_error(d.worker, d.seq, fmt::format("parameter server {}: {}", index_, e.what()));
  }
}

// Sums one step's pushes per row, in worker order (reproducible), and applies each row once.
void Server::apply_step(std::vector<std::vector<HeldPush>>& per_worker) {
  struct Sum {
    std::unordered_map<uint64_t, size_t> at;
    std::vector<uint64_t> ids;
    std::vector<float> grads;
  };
  std::map<std::string, Sum> sums;
  for (auto& pushes : per_worker) {
    for (auto& p : pushes) {
      auto t = tables_.find(p.table);
      if (t == tables_.end()) continue;
      const size_t d = t->second->dim();
      Sum& s = sums[p.table];
      for (size_t i = 0; i < p.ids.size(); ++i) {
        auto [pos, fresh] = s.at.try_emplace(p.ids[i], s.ids.size());
        if (fresh) {
          s.ids.push_back(p.ids[i]);
          s.grads.insert(s.grads.end(), p.grads.begin() + long(i * d), p.grads.begin() + long((i + 1) * d));
        } else {
          for (size_t j = 0; j < d; ++j) s.grads[pos->second * d + j] += p.grads[i * d + j];
        }
      }
    }
  }
  for (auto& [name, s] : sums) tables_[name]->apply(s.ids.data(), s.ids.size(), s.grads.data());
}

void Server::warn_deferred() {
  auto now = std::chrono::steady_clock::now();
  for (auto& d : deferred_) {
    if (d.warned || now - d.since < std::chrono::seconds(10)) continue;
    d.warned = true;
    std::vector<int> behind;
    for (int w = 0; w < roles_.num_workers; ++w)
      if (clock_[size_t(w)] + d.lag < d.clock) behind.push_back(w);
    log::warn("parameter server {}: worker {}'s {} in step {} has waited 10 s for worker(s) {} to end step {} ({} "
              "mode)",
              index_, d.worker, d.what, d.clock, fmt::join(behind, ","), d.clock - d.lag - 1, mode_.to_string());
  }
}

}  // namespace cohort::ps::server_internal
