#pragma once
// What the single-copy tests share (shm_single_copy_test.cc, shm_shared_buffers_test.cc): groups whose
// every call takes the single-copy path, made by ranks as threads, and the byte a rank contributes.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collectives/shm/group.h"
#include "support/test_support.h"

namespace cohort::shm::test_single_copy {

// Tiny slots (many chunks on the staged paths) and single copy from the first byte, so that every call
// of these tests takes it.
inline GroupOptions single_copy_options() {
  GroupOptions o{4096, 256, std::chrono::microseconds(20)};
  o.single_copy_bytes = 1;
  return o;
}

// One group per rank of `world`, created by ranks as threads at a fresh address named after `name`.
inline std::vector<std::unique_ptr<Group>> make_groups(int world, const GroupOptions& opt, const std::string& name) {
  std::vector<std::unique_ptr<Group>> groups(static_cast<size_t>(world));
  const std::string address = random_address(name);
  test::run_ranks(world, [&](int r) {
    groups[r] = Group::create_at(address, r, world, std::chrono::milliseconds(20000), opt);
  });
  return groups;
}

// The byte that rank `from` contributes at position i of what it sends to rank `to` (alltoall), or of
// its contribution (to = -1).
inline uint8_t byte_of(int from, int to, size_t i) {
  return static_cast<uint8_t>(from * 53 + (to + 1) * 17 + i * 7 + 1);
}

}  // namespace cohort::shm::test_single_copy
