#include "trace/diagnose.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include <fmt/core.h>

#include "common/strings.h"

namespace cohort::trace {
namespace {

bool is_numbered(const OpRecord& r) { return r.kind != coll::OpKind::kSendRecv && r.seq != 0; }

// One communicator as seen by every rank: each rank's latest numbered operation in it.
struct CommView {
  uint32_t comm = 0;
  std::map<int, const OpRecord*> last;  // rank -> latest operation
  uint64_t ops = 0;
};

// Communicators by the number of ranks that used them, most first (the world communicator as a rule).
std::vector<CommView> comm_views(const std::vector<RankSnapshot>& ranks) {
  std::map<uint32_t, CommView> views;
  for (const auto& s : ranks)
    for (const auto& r : s.entries) {
      if (!is_numbered(r)) continue;
      auto& v = views[r.comm];
      v.comm = r.comm;
      ++v.ops;
      auto& slot = v.last[s.rank];
      if (!slot || r.index > slot->index) slot = &r;
    }
  std::vector<CommView> out;
  for (auto& [id, v] : views) out.push_back(std::move(v));
  std::sort(out.begin(), out.end(), [](const CommView& a, const CommView& b) {
    return std::make_pair(a.last.size(), a.ops) > std::make_pair(b.last.size(), b.ops);
  });
  return out;
}

const RankSnapshot* find_rank(const std::vector<RankSnapshot>& ranks, int rank) {
  for (const auto& s : ranks)
    if (s.rank == rank) return &s;
  return nullptr;
}

std::string ranks_text(std::vector<int> v) {
  std::sort(v.begin(), v.end());
  return fmt::format("{} {}", v.size() == 1 ? "rank" : "ranks", str::format_ranges(v));
}

std::string process_note(const RankSnapshot* s) {
  if (!s || s->process_state.empty() || s->process_state == "running") return "";
  return fmt::format(", process {}", s->process_state);
}

double seconds(int64_t ns) { return double(ns) / 1e9; }

// How long `r` has been (or was) running as of the snapshot.
int64_t running_ns(const OpRecord& r, const RankSnapshot& s) {
  int64_t end = r.t_end > 0 ? r.t_end : s.taken_at;
  return std::max<int64_t>(0, end - r.t_start);
}

bool same_call(const OpRecord& a, const OpRecord& b) {
  if (a.kind != b.kind || a.dtype != b.dtype) return false;
  if ((a.kind == coll::OpKind::kAllreduce || a.kind == coll::OpKind::kReduce ||
       a.kind == coll::OpKind::kReduceScatter) && a.redop != b.redop)
    return false;
  if (a.count != 0 && b.count != 0 && a.count != b.count) return false;
  return !coll::is_rooted(a.kind) || a.peer == b.peer;
}

// The ranks of a communicator that never recorded an operation in it: only meaningful for the
// communicator every rank uses, which is the one with all `world` ranks when some recorded nothing.
std::vector<int> silent_ranks(const CommView& v, const std::vector<RankSnapshot>& ranks) {
  std::vector<int> out;
  for (const auto& s : ranks)
    if (!v.last.count(s.rank) && s.world > 0 && int(v.last.size()) >= s.world / 2) out.push_back(s.rank);
  return out;
}

}  // namespace

std::string Stall::text() const {
  std::string silent_text =
      silent.empty() ? ""
                     : fmt::format("; {} silent (no flight recorder news from their node): {}", ranks_text(silent),
                                   str::join(silent_last, "; "));
  if (all_inside) {
    std::string who = missing.empty() ? "no rank is stopped; a peer may be unreachable or the operation slow"
                                       : fmt::format("{} not progressing: {}", ranks_text(missing),
                                                     str::join(missing_last, "; "));
    return fmt::format("stall: every rank has been in {} for {:.1f} s ({})", describe(op), waited_s, who);
  }
  std::string not_entered =
      missing.empty() ? "" : fmt::format("; {} not: {}", ranks_text(missing), str::join(missing_last, "; "));
  return fmt::format("stall: {} entered {} {:.1f} s ago{}{}", ranks_text(waiting), describe(op), waited_s, not_entered,
                     silent_text);
}

std::string Mismatch::text() const {
  return fmt::format("mismatch at operation #{}: rank {} called {} but rank {} called {}", a.seq, rank_a,
                     describe(a), rank_b, describe(b));
}

std::optional<Stall> find_stall(const std::vector<RankSnapshot>& ranks, int64_t now, double threshold_s,
                                double stale_s) {
  auto stale = [&](const RankSnapshot* s) { return s && stale_s > 0 && seconds(now - s->taken_at) > stale_s; };
  for (const auto& v : comm_views(ranks)) {
    // The operation the leading ranks are in: as far as the ranks whose news is current say.
    uint64_t top = 0;
    for (auto& [rank, r] : v.last)
      if (!stale(find_rank(ranks, rank))) top = std::max(top, r->seq);
    if (top == 0) continue;
    Stall st;
    st.comm = v.comm;
    int64_t first_start = INT64_MAX;
    bool all_inside = true;
    for (auto& [rank, r] : v.last) {
      const RankSnapshot* s = find_rank(ranks, rank);
      if (stale(s)) {
        // It may have moved on since: named with what it last showed, unless that was past `top`.
        bool past = r->seq > top || (r->seq == top && (r->state == OpState::kDone || r->state == OpState::kFailed));
        if (!past) {
          st.silent.push_back(rank);
          st.silent_last.push_back(fmt::format("rank {} since {:.1f} s ago, last seen in {} {}{}", rank,
                                               seconds(now - s->taken_at), describe(*r), op_state_name(r->state),
                                               process_note(s)));
        }
        all_inside = false;
        continue;
      }
      if (r->seq == top && r->state == OpState::kRunning) {
        st.waiting.push_back(rank);
        if (r->t_start < first_start) first_start = r->t_start, st.op = *r;
      } else if (r->seq < top || r->state == OpState::kQueued) {
        st.missing.push_back(rank);
        st.missing_last.push_back(
            fmt::format("rank {} last {} {}{}", rank, describe(*r), op_state_name(r->state), process_note(s)));
      }
      if (!(r->seq == top && r->state == OpState::kRunning)) all_inside = false;
    }
    for (int rank : silent_ranks(v, ranks)) {
      const RankSnapshot* s = find_rank(ranks, rank);
      if (stale(s)) {
        st.silent.push_back(rank);
        st.silent_last.push_back(
            s->unreported ? fmt::format("rank {} since {:.1f} s ago, its node has published nothing", rank,
                                        seconds(now - s->taken_at))
                          : fmt::format("rank {} since {:.1f} s ago, with no operation recorded{}", rank,
                                        seconds(now - s->taken_at), process_note(s)));
      } else if (s->unreported) {
        all_inside = false;  // its node has not published yet: nothing is known of it
        continue;
      } else {
        st.missing.push_back(rank);
        st.missing_last.push_back(fmt::format("rank {} has recorded no operation{}", rank, process_note(s)));
      }
      all_inside = false;
    }
    if (st.waiting.empty()) continue;
    st.waited_s = seconds(now - first_start);
    if (st.waited_s < threshold_s) continue;
    if (st.missing.empty() && st.silent.empty()) {
      if (!all_inside) continue;  // the others finished it; the waiting ones are on their way out
      st.all_inside = true;
      for (int rank : st.waiting) {
        const RankSnapshot* s = find_rank(ranks, rank);
        if (!process_note(s).empty()) {
          st.missing.push_back(rank);
          st.missing_last.push_back(fmt::format("rank {}{}", rank, process_note(s)));
        }
      }
    }
    // A rank whose process is stopped or stuck in the kernel is the likeliest cause: name it first.
    std::vector<std::tuple<bool, int, std::string>> order;
    for (size_t i = 0; i < st.missing.size(); ++i)
      order.emplace_back(process_note(find_rank(ranks, st.missing[i])).empty(), st.missing[i], st.missing_last[i]);
    std::stable_sort(order.begin(), order.end(),
                     [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
    for (size_t i = 0; i < order.size(); ++i) st.missing_last[i] = std::get<2>(order[i]);
    return st;
  }
  return std::nullopt;
}

std::optional<Mismatch> find_mismatch(const std::vector<RankSnapshot>& ranks) {
  std::optional<Mismatch> best;
  // (comm, seq) -> the first rank's call there
  std::map<std::pair<uint32_t, uint64_t>, std::pair<int, const OpRecord*>> first;
  for (const auto& s : ranks)
    for (const auto& r : s.entries) {
      if (!is_numbered(r)) continue;
      auto [it, fresh] = first.emplace(std::make_pair(r.comm, r.seq), std::make_pair(s.rank, &r));
      if (fresh || same_call(*it->second.second, r)) continue;
      if (!best || r.seq < best->a.seq) best = Mismatch{r.comm, it->second.first, s.rank, *it->second.second, r};
    }
  return best;
}

std::vector<std::string> diagnose(const std::vector<RankSnapshot>& ranks) {
  std::vector<std::string> lines;
  if (auto m = find_mismatch(ranks)) lines.push_back(m->text());
  auto views = comm_views(ranks);
  if (views.empty()) return lines;  // nothing to compare (point-to-point only, or no operation yet)
  const CommView& v = views.front();
  uint64_t lo = UINT64_MAX, hi = 0;
  for (auto& [rank, r] : v.last) lo = std::min(lo, r->seq), hi = std::max(hi, r->seq);
  std::vector<int> silent = silent_ranks(v, ranks);
  if (!silent.empty()) {
    std::vector<std::string> notes;
    for (int rank : silent) notes.push_back(fmt::format("rank {}{}", rank, process_note(find_rank(ranks, rank))));
    lines.push_back(fmt::format("{} recorded no operation while the others reached #{} ({})", ranks_text(silent), hi,
                                str::join(notes, "; ")));
  }
  if (lo == hi) {
    // Every rank reached the same operation: say how each of them left it.
    std::map<std::string, std::vector<int>> by_state;
    const OpRecord* op = nullptr;
    for (auto& [rank, r] : v.last) {
      const RankSnapshot* s = find_rank(ranks, rank);
      op = op ? op : r;
      std::string how = op_state_name(r->state);
      if (r->state != OpState::kDone) how += fmt::format(" after {:.1f} s", seconds(running_ns(*r, *s)));
      by_state[how + process_note(s)].push_back(rank);
    }
    std::vector<std::string> parts;
    for (auto& [how, who] : by_state) parts.push_back(fmt::format("{} {}", ranks_text(who), how));
    lines.push_back(fmt::format("every rank reached {}: {}", describe(*op), str::join(parts, "; ")));
    return lines;
  }
  // The ranks furthest behind stopped first; the ones at the newest operation waited for them. Among
  // the ranks behind, one still inside its operation when the job ended never noticed anything (it was
  // stopped, or stuck in user code inside a callback) while the others there failed waiting: the
  // former are the cause when both kinds are there (a hierarchical allreduce holds back its group).
  std::vector<int> behind, stuck, ahead;
  const OpRecord *behind_op = nullptr, *ahead_op = nullptr;
  double waited = 0;
  for (auto& [rank, r] : v.last) {
    const RankSnapshot* s = find_rank(ranks, rank);
    if (r->seq == lo) {
      behind.push_back(rank);
      if (r->state == OpState::kRunning) stuck.push_back(rank);
      behind_op = behind_op ? behind_op : r;
    }
    if (r->seq == hi) {
      ahead.push_back(rank);
      ahead_op = ahead_op ? ahead_op : r;
      if (r->state != OpState::kDone) waited = std::max(waited, seconds(running_ns(*r, *s)));
    }
  }
  std::vector<int> first = !stuck.empty() && stuck.size() < behind.size() ? stuck : behind;
  std::vector<int> also;
  for (int rank : behind)
    if (std::find(first.begin(), first.end(), rank) == first.end()) also.push_back(rank);
  std::vector<std::string> notes;
  for (int rank : first) {
    const RankSnapshot* s = find_rank(ranks, rank);
    notes.push_back(fmt::format("rank {}: {}{}", rank, op_state_name(v.last.at(rank)->state), process_note(s)));
  }
  std::string line = fmt::format("{} stopped first, at {} ({}); {} waited for it in {} for {:.1f} s", ranks_text(first),
                                 describe(*behind_op), str::join(notes, "; "), ranks_text(ahead), describe(*ahead_op),
                                 waited);
  if (!also.empty()) line += fmt::format("; {} failed in #{} waiting too", ranks_text(also), lo);
  lines.push_back(std::move(line));
  return lines;
}

}  // namespace cohort::trace
