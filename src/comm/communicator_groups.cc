// CommunicatorImpl (communicator_impl.h): groups made from a communicator (split, subgroup), memory
// the local peers map (allocate_shared), the link probe of the shared-memory group, and abort.
#include <set>

#include "collectives/shm/group.h"
#include "comm/shm_path.h"
#include "common/env.h"
#include "common/log.h"
#include "common/strings.h"
#include <fmt/core.h>

#include "cohort/error.h"
#include "comm/communicator_impl.h"
#include "comm/communicator_internal.h"

namespace cohort::comm {

namespace algo = cohort::comm::shm_path;

namespace {

const env::BoolSetting kShmSharedBuffers(
    "COHORT_SHM_SHARED_BUFFERS", true,
    "allocate_shared gives memory the local peers map (DDP buckets reduced in place); 0: ordinary memory, staged");
const env::BoolSetting kShmProbe(
    "COHORT_SHM_PROBE", true,
    "measure the link between the local ranks when a shared-memory group starts (well under 1 ms; "
    "Communicator::link_report, the bench's header, debug log)");

}  // namespace

bool shm_shared_buffers_enabled() { return kShmSharedBuffers.get(); }

// ------------------------------------------------------------------------------------------------
// Groups and abort

std::shared_ptr<Communicator> CommunicatorImpl::create_child(const std::string& prefix, int rank, int size,
                                                           const std::vector<int>& members,
                                                           std::vector<int> world_ranks) {
  CommSetup s{root_store_, prefix, rank, size, options_, std::move(world_ranks), /*child=*/true, false, {}, nullptr};
  if (exits_) {
    auto exits = std::make_shared<ExitWatch>();
    exits->store = exits_->store;
    for (int m : members) exits->ranks.push_back(exit_rank(m));
    s.exits = std::move(exits);
  }
  auto child = std::make_shared<CommunicatorImpl>(std::move(s));
  child->bootstrap();
  return child;
}

std::shared_ptr<Communicator> CommunicatorImpl::split(int color, int key) {
  int64_t mine[2] = {color, key};
  std::vector<int64_t> all(2 * size_t(size_));
  OpDesc d{OpKind::kSplit, DataType::kInt64, ReduceOp::kSum, 0, 2, 16};
  run_blocking(d, [&] { algo::allgather(*this, mine, all.data(), 2, DataType::kInt64); });
  int n = split_counter_++;
  if (color < 0) return nullptr;
  std::vector<std::pair<int64_t, int>> members;
  for (int r = 0; r < size_; ++r)
    if (all[2 * size_t(r)] == color) members.emplace_back(all[2 * size_t(r) + 1], r);
  std::sort(members.begin(), members.end());
  int new_rank = 0;
  std::vector<int> ranks;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i].second == rank_) new_rank = int(i);
    ranks.push_back(members[i].second);
  }
  return create_child(fmt::format("{}/split{}/color{}", prefix_, n, color), new_rank, int(members.size()), ranks);
}

std::shared_ptr<Communicator> CommunicatorImpl::subgroup(const std::vector<int>& ranks) {
  std::set<int> seen;
  int new_rank = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    int r = ranks[i];
    if (r < 0 || r >= size_) throw InvalidArgument(fmt::format("subgroup: rank {} out of range [0, {})", r, size_));
    if (!seen.insert(r).second) throw InvalidArgument(fmt::format("subgroup: rank {} listed twice", r));
    if (r == rank_) new_rank = int(i);
  }
  if (new_rank < 0) throw InvalidArgument(fmt::format("subgroup: this rank ({}) is not in the list", rank_));
  std::vector<std::string> parts;
  for (int r : ranks) parts.push_back(std::to_string(r));
  std::string list = str::join(parts, ",");
  int n = subgroup_counter_[list]++;
  return create_child(fmt::format("{}/sub{:08x}/{}", prefix_, hash32(list), n), new_rank, int(ranks.size()), ranks);
}

std::string CommunicatorImpl::copy_report() const {
  if (!shm_group_) return {};
  const uint64_t calls = shm_group_->single_copies();
  const shm::Group::CopiedBytes c = shm_group_->single_copied();
  const double per = calls ? 1.0 / double(calls) : 0.0;
  // "mapped": the share of those bytes copied through the mapping of allocate_shared buffers (plain loads
  // and stores) rather than by the kernel (process_vm_readv/writev): says which path ran.
  return fmt::format(
      "{} single-copy calls; per call read from peers {:.2f} MiB, written into peers {:.2f} MiB ({:.2f} MiB of "
      "them mapped shared memory)",
      calls, double(c.pulled) * per / (1 << 20), double(c.pushed) * per / (1 << 20), double(c.mapped) * per / (1 << 20));
}

std::string CommunicatorImpl::link_report() const {
  // The group's line changes when a slow allreduce has it probe the link again.
  // Which copy the collectives that only move data take at large sizes (the bench prints this line).
  const std::string copies = shm_group_ ? fmt::format("; large transfers: {}", shm_group_->single_copy_why()) : "";
  if (probed_group_)
    return fmt::format("{}; shm group: {}{}", probed_group_->link_line(), probed_group_->wait_policy(), copies);
  return link_report_ + copies;
}

void CommunicatorImpl::probe_link(shm::Group& group) {
  // The group saw only its own members' CPUs; the communicator saw every rank on this machine.
  group.set_wait_policy(yield_choice_);
  if (!kShmProbe.get()) {
    link_report_ = fmt::format("no link probe (COHORT_SHM_PROBE=0); shm group: {}", group.wait_policy());
    return;
  }
  group.probe();  // also chooses how the group writes its slots
  probed_group_ = &group;
  log::debug("communicator '{}': shm link: {}", prefix_, link_report());
}

std::shared_ptr<void> CommunicatorImpl::allocate_shared(size_t bytes) {
  // Only a communicator whose collectives all run on one shm group can reduce the peers' memory
  // directly; a hierarchical one stages (its host group's allreduce is one step of several).
  if (!shm_group_ || !kShmSharedBuffers.get()) return Communicator::allocate_shared(bytes);
  // The segment's handshake only knows its deadline; a barrier first gives the usual errors at once
  // (a lost peer within ~50 ms, abort, a peer in another operation) instead of a wait until then.
  barrier();
  return shm_group_->allocate_shared(bytes);
}

void CommunicatorImpl::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> g(fail_mutex_);
    abort_reason_ = reason;
    if (!failed_.load()) root_cause_ = fmt::format("aborted on rank {}: {}", rank_, reason);
    failed_.store(true, std::memory_order_release);
  }
  abort_requested_.store(true);
}

}  // namespace cohort::comm
