#pragma once
// What the tests against the fake CUDA runtime and NCCL (fake_cuda.cc) share: cohort pointed at the
// fake before anything reads its settings, the fake's own entry points, a device communicator per
// rank thread, and a bounded wait for a flag.

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "cohort/communicator.h"
#include "cohort/gpu.h"

namespace cohort::test {

// Before anything reads them (settings are read once, on first use): load the fake libraries. An
// inline variable, so every test file that includes this header gets it, initialised once.
inline const bool kFakeLibraries = [] {
  setenv("COHORT_CUDA_RUNTIME", COHORT_FAKE_CUDA, 1);
  setenv("COHORT_NCCL_LIBRARY", COHORT_FAKE_CUDA, 1);
  return true;
}();

// A function of the fake library by name: CUDA's and NCCL's, or a test hook (the end of fake_cuda.cc).
template <typename Fn>
Fn fake_function(const char* name) {
  static void* const library = dlopen(COHORT_FAKE_CUDA, RTLD_NOW);
  EXPECT_NE(library, nullptr) << dlerror();
  void* f = library ? dlsym(library, name) : nullptr;
  EXPECT_NE(f, nullptr) << "the fake has no " << name;
  return reinterpret_cast<Fn>(f);
}

// Rank `rank`'s device communicator on GPU `rank` of the fake, over a host communicator on `store`.
inline std::shared_ptr<Communicator> device_comm(std::shared_ptr<Store> store, int rank, int world,
                                                 std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  CommOptions o;
  o.timeout = timeout;
  static const auto set_device = fake_function<int (*)(int)>("cudaSetDevice");
  set_device(rank);  // each rank's thread works on its own GPU, as each process would
  return gpu::make_device_communicator(Communicator::create(store, rank, world, o),
                                       gpu::DeviceOptions{rank, gpu::DevicePath::kAuto});
}

// Waits (polling every millisecond) until `flag` is set or `within` has passed; returns the flag.
inline bool becomes_true(const std::atomic<bool>& flag, std::chrono::milliseconds within) {
  const auto end = std::chrono::steady_clock::now() + within;
  while (!flag && std::chrono::steady_clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return flag;
}

}  // namespace cohort::test
