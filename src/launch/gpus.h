#pragma once
// GPUs of this node as the launcher sees them, and which GPU each local rank gets.
//
// The launcher never talks to the CUDA driver: it reads what `nvidia-smi -L` prints (names, UUIDs, in
// the driver's PCI bus order) and /proc/driver/nvidia/gpus/<bus id>/ (one folder per GPU, named by its
// PCI bus id), then sysfs for each GPU's NUMA node and nearby CPUs. CUDA_VISIBLE_DEVICES, when set in
// the launcher's environment, narrows and orders the list exactly as CUDA will for the workers.
//
// The parsers are pure functions of their text (unit-tested with fake `nvidia-smi -L` output); only
// detect_gpus() touches the machine. docs/gpu.md describes the rules.

#include <optional>
#include <string>
#include <vector>

#include "launch/parsers.h"

namespace cohort::launch {

struct Gpu {
  int index = 0;                // the driver's index (nvidia-smi's), PCI bus order
  std::string name;             // "NVIDIA H100 80GB HBM3" ("" unknown)
  std::string uuid;             // "GPU-5e0c..." ("" unknown)
  std::string pci_bus_id;       // "0000:18:00.0", lower case, 4-digit domain ("" unknown)
  int numa_node = -1;           // -1: unknown
  std::vector<int> local_cpus;  // CPUs close to the GPU (sysfs local_cpulist); empty: unknown
  // "GPU 0 (NVIDIA H100, 0000:18:00.0, NUMA 0)" for plans and messages.
  std::string describe() const;
};

// The GPUs the workers will see, in the order CUDA numbers them for the workers (device 0 first).
struct GpuInventory {
  std::vector<Gpu> gpus;
  // Where the list came from: "nvidia-smi -L", "/proc/driver/nvidia/gpus", "CUDA_VISIBLE_DEVICES"
  // (count only), or "none found (...)" naming what was tried.
  std::string source;
  // The CUDA_VISIBLE_DEVICES entry naming each GPU (what --device-per-rank hands to one rank), or
  // the driver index when the variable is unset.
  std::vector<std::string> visible_ids;
};

// "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-3c8a...)" lines; MIG sub-device lines are skipped.
// Throws ConfigError naming the line when a "GPU" line does not have that form.
std::vector<Gpu> parse_nvidia_smi_list(const std::string& text);

// "00000000:18:00.0" / "0000:18:00.0" / "18:00.0" -> "0000:18:00.0" (lower case).
std::string normalise_pci_bus_id(const std::string& id);

// Fills bus ids (from /proc/driver/nvidia/gpus folder names, sorted, matched by position when the
// counts agree), NUMA nodes and nearby CPUs (from <sysfs_root>/bus/pci/devices/<bus id>/).
void add_gpu_locality(std::vector<Gpu>& gpus, const std::vector<std::string>& proc_bus_ids,
                      const std::string& sysfs_root);

// Applies CUDA_VISIBLE_DEVICES (indices, or GPU-UUID prefixes, as CUDA accepts them; CUDA stops at
// the first entry it does not know, and so does this). Unset: every GPU. Set but nothing detected:
// as many GPUs of unknown kind as it has entries. "" or "-1": none.
GpuInventory visible_gpus(std::vector<Gpu> detected, const std::string& detected_source, const EnvMap& env);

// Runs `nvidia-smi -L` (bounded: 10 s), else reads /proc/driver/nvidia/gpus; then sysfs locality and
// CUDA_VISIBLE_DEVICES. Never throws for a machine without GPUs (an empty inventory says why).
GpuInventory detect_gpus(const EnvMap& env);

// What each local rank gets: its GPU's position in the inventory (the device number the worker passes
// to torch.cuda.set_device / cudaSetDevice), or -1 for a CPU job.
struct GpuAssignment {
  int device = -1;
  std::string visible_id;       // CUDA_VISIBLE_DEVICES value for --device-per-rank
  std::vector<int> near_cpus;   // the GPU's nearby CPUs (empty: unknown)
  std::string description;      // Gpu::describe()
};

// --gpus-per-node's value: nullopt for "auto", else N >= 1 (ConfigError otherwise).
std::optional<int> parse_gpus_per_node(const std::string& spec);
// `spec` is --gpus-per-node ("auto" or N). Local rank i gets GPU i mod N. Throws ConfigError when
// N GPUs are not there, or when there are more local ranks than GPUs and `share` is off.
int resolve_gpus_per_node(const std::string& spec, const GpuInventory& inventory, const std::string& host);
std::vector<GpuAssignment> assign_gpus(const std::string& spec, bool share, int nproc, const GpuInventory& inventory,
                                       const std::string& host);

}  // namespace cohort::launch
