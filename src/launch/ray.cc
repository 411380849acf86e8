#include "launch/ray.h"

#include <fmt/core.h>

#include <cctype>
#include <cstdlib>

#include "cohort/error.h"
#include "common/strings.h"

namespace cohort::launch {

std::string ray_rank_resource(int node_rank) { return fmt::format("Rank:{}", node_rank); }

RayPorts ray_ports_in(int first, int last) {
  RayPorts p;
  int next = first;
  for (int* port : {&p.node_manager, &p.object_manager, &p.dashboard_agent_listen, &p.dashboard_agent_grpc,
                    &p.metrics_export, &p.runtime_env_agent, &p.client_server})
    *port = next++;
  p.min_worker = next;
  p.max_worker = last;
  return p;
}

int ray_default_block(const std::string& job_id) {
  // FNV-1a: the same block on every node of the job, whatever the platform's std::hash.
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : job_id) h = (h ^ c) * 1099511628211ull;
  return static_cast<int>(h % kRayPortBlocks);
}

std::pair<int, int> ray_block_range(int block) {
  const int first = kRayPortsBase + block * kRayPortBlock;
  return {first, first + kRayPortBlock - 1};
}

namespace {

// The first port of [first, last] that is not free here (or `avoid`), 0 when all are.
int first_taken(int first, int last, int avoid, bool (*port_free)(int)) {
  for (int port = first; port <= last; ++port)
    if (port == avoid || !port_free(port)) return port;
  return 0;
}

}  // namespace

RayPorts pick_ray_ports(int first, int last, const std::string& job_id, int avoid, const std::string& host,
                        bool (*port_free)(int)) {
  if (first > 0) {
    if (int taken = first_taken(first, last, avoid, port_free))
      throw ConfigError(fmt::format("--ray-ports {}-{}: port {} is in use on {}{}; choose a range that is free on "
                                    "every node, or leave --ray-ports out",
                                    first, last, taken, host, taken == avoid ? " (it is the Ray head's GCS port)" : ""));
    return ray_ports_in(first, last);
  }
  const int start = ray_default_block(job_id);
  std::vector<std::string> why;
  for (int i = 0; i < kRayPortBlocks; ++i) {
    auto [lo, hi] = ray_block_range((start + i) % kRayPortBlocks);
    int taken = first_taken(lo, hi, avoid, port_free);
    if (!taken) return ray_ports_in(lo, hi);
    why.push_back(fmt::format("{}-{}: {}", lo, hi, taken));
  }
  throw ConfigError(fmt::format("no free block of {} ports for Ray on {} in {}-{} (the first port in use in each: {}); "
                                "give --ray-ports FIRST-LAST",
                                kRayPortBlock, host, kRayPortsBase, kRayPortsBase + kRayPortBlocks * kRayPortBlock - 1,
                                str::join(why, ", ")));
}

std::string ray_address(const std::string& ip, int port) {
  return ip.find(':') != std::string::npos ? fmt::format("[{}]:{}", ip, port) : fmt::format("{}:{}", ip, port);
}

std::vector<std::string> ray_start_argv(const std::string& ray, const RayStart& s) {
  std::vector<std::string> argv{ray, "start"};
  auto add = [&](const char* flag, const std::string& value) {
    argv.push_back(flag);
    argv.push_back(value);
  };
  if (s.head) {
    argv.push_back("--head");
    add("--port", std::to_string(s.port));
  } else {
    add("--address", s.gcs);
  }
  add("--node-ip-address", s.node_ip);
  add("--num-cpus", std::to_string(s.num_cpus));
  add("--num-gpus", std::to_string(s.num_gpus));
  add("--resources", fmt::format("{{\"{}\": 1}}", ray_rank_resource(s.node_rank)));
  add("--node-manager-port", std::to_string(s.ports.node_manager));
  add("--object-manager-port", std::to_string(s.ports.object_manager));
  add("--dashboard-agent-listen-port", std::to_string(s.ports.dashboard_agent_listen));
  add("--dashboard-agent-grpc-port", std::to_string(s.ports.dashboard_agent_grpc));
  add("--metrics-export-port", std::to_string(s.ports.metrics_export));
  add("--runtime-env-agent-port", std::to_string(s.ports.runtime_env_agent));
  add("--min-worker-port", std::to_string(s.ports.min_worker));
  add("--max-worker-port", std::to_string(s.ports.max_worker));
  if (s.head) {
    add("--ray-client-server-port", std::to_string(s.ports.client_server));
    add("--include-dashboard", "false");
  }
  argv.push_back("--disable-usage-stats");
  argv.push_back("--block");
  return argv;
}

std::vector<std::string> ray_status_argv(const std::string& ray, const std::string& gcs) {
  return {ray, "status", "--address", gcs};
}

namespace {

// A decimal count or rank of at most 9 digits (no overflow), or -1.
int small_number(std::string_view digits) {
  if (digits.empty() || digits.size() > 9) return -1;
  int v = 0;
  for (char c : digits) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

// " 1 node_<id>" (a count, then a node type).
bool node_line(std::string_view line, int* count) {
  auto words = str::split(str::trim(line), ' ');
  if (words.size() != 2) return false;
  *count = small_number(words[0]);
  return *count >= 0;
}

// " 0.0/1.0 Rank:3": the rank, when the resource is a Rank:<n> one with a total above 0; -1 otherwise.
int rank_of_usage_line(std::string_view line) {
  auto words = str::split(str::trim(line), ' ');
  if (words.size() != 2 || words[1].rfind("Rank:", 0) != 0) return -1;
  auto slash = words[0].find('/');
  if (slash == std::string::npos || std::strtod(words[0].c_str() + slash + 1, nullptr) <= 0) return -1;
  return small_number(std::string_view(words[1]).substr(5));
}

}  // namespace

RayStatus parse_ray_status(const std::string& text) {
  // Ray's format (ray/autoscaler/_private/util.py, format_info_string; the v2 autoscaler's is alike):
  //   Node status / ---- / Active: (or Healthy:, then Idle: in the v2 autoscaler) / " 1 node_<id>" ... /
  //   Pending: / Recent failures: ... / Resources / ---- / Usage: / " 0.0/8.0 CPU" / " 0.0/1.0 Rank:1" ...
  RayStatus s;
  enum { kNone, kNodes, kUsage } section = kNone;
  for (const auto& raw : str::split(text, '\n', /*keep_empty=*/true)) {
    std::string_view line = raw;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const std::string_view t = str::trim(line);
    if (t == "Node status") {
      s.understood = true;
      continue;
    }
    if (t == "Active:" || t == "Healthy:" || t == "Idle:") {
      section = kNodes;
      continue;
    }
    if (t == "Usage:" || t == "Total Usage:") {
      section = kUsage;
      continue;
    }
    // Any other heading (Pending:, Recent failures:, Resources, Demands:) or a blank line ends a section.
    if (t.empty() || line.front() != ' ') {
      section = kNone;
      continue;
    }
    int count = 0;
    if (section == kNodes && node_line(line, &count) && s.nodes <= (1 << 30) - count) s.nodes += count;
    if (section == kUsage)
      if (int rank = rank_of_usage_line(line); rank >= 0) s.ranks.insert(rank);
  }
  return s;
}

}  // namespace cohort::launch
