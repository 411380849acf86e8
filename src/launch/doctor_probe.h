#pragma once
// The remote half of `cohort doctor`: what one host reports about itself, a TCP probe server that
// peers measure against, and the client that measures one link. `cohort doctor` runs these on each
// host over ssh (`cohort doctor --serve-probe`, `cohort doctor --probe-connect`), so every figure is
// taken on the host and with the addresses that a job would use.
//
// Probe wire protocol (one TCP connection, client drives, all integers little-endian uint64):
//   'P' seq            -> seq, server CLOCK_REALTIME ns      (ping: round-trip time and clock offset)
//   'B' n, n bytes     -> n                                  (bulk: bandwidth client -> server)
//   'Q'                -> connection closed                  (done)

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/deadline.h"

namespace cohort::doctor {

// Facts about the host this process runs on (as the ssh session sees it: limits are inherited by
// the workers a launcher would start from the same kind of session).
struct HostFacts {
  std::string version;            // COHORT_VERSION of this binary
  std::string hostname;
  int64_t somaxconn = -1;         // net.core.somaxconn of this network namespace (-1: unreadable)
  int64_t tcp_max_syn_backlog = -1;
  uint64_t nofile_soft = 0;       // RLIMIT_NOFILE
  uint64_t nofile_hard = 0;
  int port_range_low = 0;         // net.ipv4.ip_local_port_range
  int port_range_high = 0;
  std::vector<int> ports_checked; // ports asked about, and whether each could be bound on 0.0.0.0
  std::vector<bool> ports_free;
  int probe_port = 0;             // where --serve-probe listens (0 when not serving)
  // GPUs (cohort/gpu.h's check_local_gpus): count, PCI bus ids, versions ("" unknown), why none or
  // no NCCL, and the tiny NCCL allreduce over the host's GPUs ("ok: ...", "FAIL: ...", "skipped: ...").
  int gpus = 0;
  std::vector<std::string> gpu_bus_ids;
  std::string cuda_driver, cuda_runtime, nccl_version;
  std::string gpu_note, nccl_note;
  std::string nccl_allreduce;

  nlohmann::json to_json() const;
  static HostFacts from_json(const nlohmann::json& j);
};

HostFacts collect_host_facts(const std::vector<int>& ports_to_check);

// True when a TCP listener could be bound to 0.0.0.0:port right now.
bool port_is_free(int port);

// Serves probes until stdin reaches EOF (the ssh session that started us ended) or `lifetime`
// passes. Prints the facts (with probe_port set) as one JSON line on stdout first.
void serve_probe(const std::vector<int>& ports_to_check, const std::string& bind_host, Deadline lifetime);

// One measured link.
struct LinkResult {
  bool ok = false;
  std::string error;          // why not ok (one line)
  double rtt_us = 0;          // median TCP round trip of `pings` pings
  double rtt_min_us = 0;
  double clock_offset_ms = 0; // server clock minus client clock, from the fastest ping
  double bandwidth_MBps = 0;  // bulk send of `bytes` bytes, client -> server (1 MB = 1e6 B)
  uint64_t bytes = 0;

  nlohmann::json to_json() const;
  static LinkResult from_json(const nlohmann::json& j);
};

// Connects to a probe server at host:port and measures the link; never throws (errors go in
// LinkResult::error).
LinkResult probe_link(const std::string& host, int port, uint64_t bytes, int pings, Deadline deadline);

}  // namespace cohort::doctor
