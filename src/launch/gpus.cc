#include "launch/gpus.h"

#include <dirent.h>
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>

#include "cohort/error.h"
#include "common/strings.h"
#include "launch/doctor_child.h"

namespace cohort::launch {

std::string Gpu::describe() const {
  std::string s = fmt::format("GPU {}", index);
  std::vector<std::string> parts;
  if (!name.empty()) parts.push_back(name);
  if (!pci_bus_id.empty()) parts.push_back(pci_bus_id);
  if (numa_node >= 0) parts.push_back(fmt::format("NUMA {}", numa_node));
  if (!parts.empty()) s += " (" + str::join(parts, ", ") + ")";
  return s;
}

std::vector<Gpu> parse_nvidia_smi_list(const std::string& text) {
  std::vector<Gpu> gpus;
  int line_no = 0;
  for (const auto& raw : str::split(text, '\n')) {
    ++line_no;
    std::string line(str::trim(raw));
    // MIG instances are listed indented under their GPU ("MIG 1g.10gb Device 0: (UUID: MIG-...)").
    if (line.empty() || !str::starts_with(line, "GPU ")) continue;
    auto bad = [&] {
      return ConfigError(fmt::format("nvidia-smi -L, line {}: expected 'GPU <index>: <name> (UUID: GPU-...)', got '{}'",
                                     line_no, line));
    };
    auto colon = line.find(':');
    if (colon == std::string::npos) throw bad();
    std::string index_text(str::trim(std::string_view(line).substr(4, colon - 4)));
    if (index_text.empty() || !std::all_of(index_text.begin(), index_text.end(), ::isdigit)) throw bad();
    Gpu g;
    g.index = std::stoi(index_text);
    std::string rest(str::trim(std::string_view(line).substr(colon + 1)));
    auto uuid_at = rest.rfind("(UUID:");
    if (uuid_at != std::string::npos) {
      auto close = rest.find(')', uuid_at);
      if (close == std::string::npos) throw bad();
      g.uuid = std::string(str::trim(std::string_view(rest).substr(uuid_at + 6, close - uuid_at - 6)));
      rest = std::string(str::trim(std::string_view(rest).substr(0, uuid_at)));
    }
    g.name = rest;
    gpus.push_back(std::move(g));
  }
  return gpus;
}

std::string normalise_pci_bus_id(const std::string& id_in) {
  std::string id;
  for (char c : id_in) id += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  auto parts = str::split(id, ':');
  if (parts.size() == 2) return "0000:" + id;  // "18:00.0": domain 0
  if (parts.size() == 3 && parts[0].size() > 4) return parts[0].substr(parts[0].size() - 4) + ":" + parts[1] + ":" + parts[2];
  return id;
}

namespace {

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "";
  return std::string(str::trim(line));
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (auto* e = readdir(d)) {
      std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// "Model:  NVIDIA H100 80GB HBM3" from /proc/driver/nvidia/gpus/<bus>/information.
std::string proc_model(const std::string& dir) {
  std::ifstream in(dir + "/information");
  for (std::string line; std::getline(in, line);) {
    if (str::starts_with(line, "Model:")) return std::string(str::trim(std::string_view(line).substr(6)));
  }
  return "";
}

}  // namespace

void add_gpu_locality(std::vector<Gpu>& gpus, const std::vector<std::string>& proc_bus_ids,
                      const std::string& sysfs_root) {
  // The driver numbers GPUs in PCI bus order, and the /proc folders sorted by bus id are that order.
  if (proc_bus_ids.size() == gpus.size()) {
    for (size_t i = 0; i < gpus.size(); ++i)
      if (gpus[i].pci_bus_id.empty()) gpus[i].pci_bus_id = normalise_pci_bus_id(proc_bus_ids[i]);
  }
  for (auto& g : gpus) {
    if (g.pci_bus_id.empty()) continue;
    const std::string dev = sysfs_root + "/bus/pci/devices/" + g.pci_bus_id;
    std::string numa = read_first_line(dev + "/numa_node");
    if (!numa.empty()) {
      try {
        g.numa_node = std::max(-1, std::stoi(numa));
      } catch (...) {
        g.numa_node = -1;
      }
    }
    std::string cpus = read_first_line(dev + "/local_cpulist");
    if (!cpus.empty()) {
      try {
        g.local_cpus = str::parse_int_list(cpus, dev + "/local_cpulist");
      } catch (const ConfigError&) {
        g.local_cpus.clear();  // unreadable locality only costs the binding, not the job
      }
    }
  }
}

GpuInventory visible_gpus(std::vector<Gpu> detected, const std::string& detected_source, const EnvMap& env) {
  GpuInventory inv;
  auto it = env.find("CUDA_VISIBLE_DEVICES");
  if (it == env.end()) {
    inv.gpus = std::move(detected);
    inv.source = detected_source;
    for (const auto& g : inv.gpus) inv.visible_ids.push_back(std::to_string(g.index));
    return inv;
  }
  const std::string value(str::trim(it->second));
  inv.source = detected_source + ", CUDA_VISIBLE_DEVICES=" + value;
  if (value.empty() || value == "-1" || value == "NoDevFiles") return inv;
  for (const auto& entry_raw : str::split(value, ',')) {
    std::string entry(str::trim(entry_raw));
    if (detected.empty()) {
      // Nothing detected (no nvidia-smi, no /proc): trust the variable for the count.
      Gpu g;
      g.index = static_cast<int>(inv.gpus.size());
      inv.gpus.push_back(g);
      inv.visible_ids.push_back(entry);
      continue;
    }
    const Gpu* match = nullptr;
    if (!entry.empty() && std::all_of(entry.begin(), entry.end(), ::isdigit)) {
      int idx = std::stoi(entry);
      for (const auto& g : detected)
        if (g.index == idx) match = &g;
    } else if (str::starts_with(entry, "GPU-")) {
      for (const auto& g : detected)
        if (!g.uuid.empty() && str::starts_with(g.uuid, entry)) match = &g;
    }
    if (!match) {
      throw ConfigError(fmt::format("CUDA_VISIBLE_DEVICES={}: '{}' is not one of this machine's GPUs ({} found by {})",
                                    value, entry, detected.size(), detected_source));
    }
    inv.gpus.push_back(*match);
    inv.visible_ids.push_back(entry);
  }
  return inv;
}

GpuInventory detect_gpus(const EnvMap& env) {
  std::vector<Gpu> gpus;
  std::string source;
  std::vector<std::string> tried;
  const std::string proc = "/proc/driver/nvidia/gpus";
  const auto proc_ids = list_dir(proc);
  try {
    auto r = doctor::run_child({"nvidia-smi", "-L"}, Deadline::after(std::chrono::seconds(10)));
    if (r.exit_code == 0) {
      gpus = parse_nvidia_smi_list(r.out);
      source = "nvidia-smi -L";
    } else {
      std::string why = r.timed_out ? "timed out after 10 s" : fmt::format("exit code {}", r.exit_code);
      auto err_lines = str::split(r.err + r.out, '\n');
      if (!err_lines.empty()) why += ": " + std::string(str::trim(err_lines.front()));
      tried.push_back("nvidia-smi -L " + why);
    }
  } catch (const ConfigError&) {
    throw;  // malformed output: say so rather than guess
  } catch (const std::exception& e) {
    tried.push_back(std::string("nvidia-smi: ") + e.what());
  }
  if (source.empty()) {
    if (!proc_ids.empty()) {
      for (size_t i = 0; i < proc_ids.size(); ++i) {
        Gpu g;
        g.index = static_cast<int>(i);
        g.name = proc_model(proc + "/" + proc_ids[i]);
        g.pci_bus_id = normalise_pci_bus_id(proc_ids[i]);
        gpus.push_back(std::move(g));
      }
      source = proc;
    } else {
      tried.push_back(proc + " missing");
      source = "none found (" + str::join(tried, "; ") + ")";
    }
  }
  add_gpu_locality(gpus, proc_ids, "/sys");
  return visible_gpus(std::move(gpus), source, env);
}

std::optional<int> parse_gpus_per_node(const std::string& spec) {
  if (spec == "auto") return std::nullopt;
  int n = 0;
  try {
    size_t used = 0;
    n = std::stoi(spec, &used);
    if (used != spec.size()) n = -1;
  } catch (...) {
    n = -1;
  }
  if (n < 1) throw ConfigError(fmt::format("--gpus-per-node {}: expected a positive number or 'auto'", spec));
  return n;
}

int resolve_gpus_per_node(const std::string& spec, const GpuInventory& inv, const std::string& host) {
  const int have = static_cast<int>(inv.gpus.size());
  auto wanted = parse_gpus_per_node(spec);
  if (!wanted) {
    if (have == 0) throw ConfigError(fmt::format("--gpus-per-node auto: no GPU on {} ({})", host, inv.source));
    return have;
  }
  const int n = *wanted;
  if (n > have)
    throw ConfigError(fmt::format("--gpus-per-node {}: {} has {} GPU{} ({})", n, host, have, have == 1 ? "" : "s",
                                  inv.source));
  return n;
}

std::vector<GpuAssignment> assign_gpus(const std::string& spec, bool share, int nproc, const GpuInventory& inv,
                                       const std::string& host) {
  std::vector<GpuAssignment> out(static_cast<size_t>(nproc));
  if (spec.empty()) return out;
  const int n = resolve_gpus_per_node(spec, inv, host);
  if (nproc > n && !share)
    throw ConfigError(fmt::format("{} local ranks on {} but --gpus-per-node {} gives {} GPU{}: one GPU per rank "
                                  "(lower --nproc-per-node, or pass --gpu-share to let ranks share GPUs)",
                                  nproc, host, spec, n, n == 1 ? "" : "s"));
  for (int l = 0; l < nproc; ++l) {
    const size_t d = static_cast<size_t>(l % n);
    out[l].device = static_cast<int>(d);
    out[l].visible_id = inv.visible_ids[d];
    out[l].near_cpus = inv.gpus[d].local_cpus;
    out[l].description = inv.gpus[d].describe();
  }
  return out;
}

}  // namespace cohort::launch
