// cohort_torch: cohort's collectives as a torch.distributed backend.
//
//   import cohort_torch                       # registers backend "cohort"
//   torch.distributed.init_process_group(backend="cohort")
//
// This file is the Python module: what importing it does (register the backend, mend torch's front end
// for a third-party backend) and the functions it offers. docs/pytorch.md has the user-facing part.
//
// Design, and where each part lives:
// - The creator torch calls, creator(store, rank, size, timeout), wraps torch's c10d::Store in a
//   cohort::Store adapter (cohort_torch_store.cc) and builds a cohort::Communicator on it
//   (create_process_group, cohort_torch_group.cc).
// - torch 1.x subclasses c10d::ProcessGroup; torch 2.x subclasses c10d::Backend (registered
//   with devices=["cpu", "cuda"]). The two share every method signature used here, so the class body
//   is the same; only the base class (cohort_torch_common.h) and the registration call below differ.
// - ProcessGroupCohort (cohort_torch_group.h) validates every operation on the calling thread and
//   queues it to one worker thread per process group; its Work (cohort_torch_work.h) completes when
//   the worker is done. The collectives are in cohort_torch_collectives.cc, send/recv in
//   cohort_torch_p2p.cc, monitored_barrier in cohort_torch_monitored_barrier.cc.
// - CUDA tensors (torch 2.x): handed to torch's own NCCL backend, built over the same store, or,
//   without NCCL, staged through host memory (cohort_torch_cuda.cc).
// - Non-contiguous tensors are staged through a contiguous copy and copied back
//   (cohort_torch_tensors.h).
// - A tensor allreduced again and again (DDP's gradient buckets) moves into memory the peers map
//   (cohort_torch_shared_storage.h), so that its allreduce reads their data in place.
//
// The files build as one translation unit (UNITY_BUILD in CMakeLists.txt): each includes torch's
// headers, which cost most of the build time (about a minute and a half per translation unit), so one
// file per concept is for readers, one unit for the compiler. Every name is in namespace cohort_torch
// and the module is built with hidden visibility: only PyInit_cohort_torch leaves the .so.

#include <pybind11/chrono.h>
#include <pybind11/eval.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cohort/error.h"
#include "comm/launch_env.h"
#include "comm/pmix.h"
#include "common/env.h"
#include "common/socket.h"
#include "cohort_torch_group.h"

PYBIND11_MODULE(cohort_torch, m) {
  using cohort_torch::BaseGroup;
  using cohort_torch::ProcessGroupCohort;
  m.doc() = "cohort collectives as a torch.distributed backend; importing registers \"cohort\"";

  // torch's pybind classes (Store, ProcessGroup/Backend) must be registered before ours.
  py::module_ dist = py::module_::import("torch.distributed");

  py::class_<ProcessGroupCohort, BaseGroup, c10::intrusive_ptr<ProcessGroupCohort>>(
      m, "ProcessGroupCohort")
      .def(py::init(&cohort_torch::create_process_group), py::arg("store"), py::arg("rank"),
           py::arg("size"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>());

  m.def("create_process_group", &cohort_torch::create_process_group, py::arg("store"),
        py::arg("rank"), py::arg("size"), py::arg("timeout"),
        py::call_guard<py::gil_scoped_release>(),
        "The creator registered with torch.distributed.Backend.register_backend.");
  // Under mpirun or srun --mpi=pmix, which set no MASTER_ADDR: where rank 0 will host torch's store
  // (host, port), agreed through the job's PMIx server as cohort's own store's address is
  // (comm/pmix.h; docs/launcher.md, "Without cohort run"). Rank 0 picks a free port and publishes it;
  // every rank gets it. cohort.horovod.torch calls it from hvd.init() (docs/horovod.md, "Under mpirun").
  m.def(
      "pmix_master_address",
      [](double timeout_s) {
        auto e = cohort::comm::resolve_launch_env([](const std::string& n) { return cohort::env::get_raw(n); });
        if (!e.pmix)
          throw cohort::ConfigError("no PMIx launcher named in the environment (PMIX_NAMESPACE and PMIX_RANK unset, "
                                    "or MASTER_ADDR set)");
        auto pick_port = [] {
          auto fd = cohort::net::listen_tcp("", 0, 1, false);
          return static_cast<uint16_t>(cohort::net::local_address(fd.get()).port());
        };
        cohort::comm::pmix::exchange_store_address(
            e, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)), pick_port);
        return std::make_pair(e.store_host, static_cast<int>(e.store_port));
      },
      py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>());
  m.attr("BACKEND_NAME") = "cohort";
  m.attr("TORCH_VERSION_MAJOR_BUILT") = TORCH_VERSION_MAJOR;

  // Two Python-side fixes of torch's front end for a third-party backend, each for cohort groups only:
  // torch.distributed.monitored_barrier refuses every backend but gloo before it reaches the process
  // group (distributed_c10d.py, torch 1.13 and 2.x), though ProcessGroupCohort implements
  // monitoredBarrier; and DDP's logging data names a torch 2.x custom backend "custom".
  py::exec(R"(
def _install_monitored_barrier():
    import functools
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    original = c10d.monitored_barrier
    if getattr(original, "_cohort_wrapper", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group=c10d.GroupMember.WORLD, timeout=None, wait_all_ranks=False):
        if c10d._rank_not_in_group(group) or c10d.get_backend(group) != "cohort":
            return original(group, timeout, wait_all_ranks)
        if timeout is None:
            timeout = c10d.default_pg_timeout
        group_to_use = c10d._get_default_group() if group is None else group
        return group_to_use.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._cohort_wrapper = True
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier

_install_monitored_barrier()

# torch 2.x: a process group of a third-party backend is a ProcessGroup whose backend type is CUSTOM,
# whose getBackendName() is "custom"; DDP's logging data (model._get_ddp_logging_data(), which users
# and torch's own suite read) then names the backend "custom". For cohort groups it says "cohort", the
# name dist.get_backend() gives; every other group's data is unchanged.
def _install_ddp_backend_name():
    import functools
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    original = DistributedDataParallel._get_ddp_logging_data
    if getattr(original, "_cohort_wrapper", False):
        return

    @functools.wraps(original)
    def _get_ddp_logging_data(self):
        data = original(self)
        if data.get("backend_name") == "custom" and dist.get_backend(self.process_group) == "cohort":
            data["backend_name"] = "cohort"
        return data

    _get_ddp_logging_data._cohort_wrapper = True
    DistributedDataParallel._get_ddp_logging_data = _get_ddp_logging_data

_install_ddp_backend_name()
)", m.attr("__dict__"));

  py::object backend = dist.attr("Backend");
  // A second import (or a reload) must not register twice: torch asserts on duplicates.
  if (!py::hasattr(backend, "COHORT")) {
#if TORCH_VERSION_MAJOR >= 2
    // CPU and CUDA: CUDA tensors go on to torch's NCCL backend (or are staged), so plain
    // backend="cohort" works for a GPU script; "cpu:cohort,cuda:nccl" gives CUDA to NCCL directly.
    backend.attr("register_backend")("cohort", m.attr("create_process_group"),
                                     py::arg("devices") = std::vector<std::string>{"cpu", "cuda"});
#else
    backend.attr("register_backend")("cohort", m.attr("create_process_group"));
#endif
  }
}
