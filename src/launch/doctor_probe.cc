// The remote half of `cohort doctor`: host facts, the probe server and the link probe.
#include "launch/doctor_probe.h"

#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>

#include "cohort/error.h"
#include "cohort/gpu.h"
#include "cohort/version.h"
#include "common/build_info.h"
#include "gpu/runtime.h"
#include "common/socket.h"

namespace cohort::doctor {
namespace {

int64_t read_sysctl_int(const char* path) {
  std::ifstream in(path);
  int64_t v = -1;
  if (!(in >> v)) return -1;
  return v;
}

uint64_t realtime_ns() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

constexpr size_t kChunk = 1 << 20;

// Serves one client until it sends 'Q', closes, or the per-connection deadline passes.
void serve_client(int fd, const std::string& peer) {
  const Deadline deadline = Deadline::after(std::chrono::seconds(60));
  std::vector<uint8_t> buf(kChunk);
  for (;;) {
    uint8_t op = 0;
    try {
      net::recv_all(fd, &op, 1, deadline, peer);
    } catch (const Error&) {
      return;  // the client went away: nothing to report on this side
    }
    if (op == 'Q') return;
    uint8_t arg[8];
    net::recv_all(fd, arg, 8, deadline, peer);
    if (op == 'P') {
      uint8_t reply[16];
      std::memcpy(reply, arg, 8);
      put_u64(reply + 8, realtime_ns());
      net::send_all(fd, reply, sizeof reply, deadline, peer);
    } else if (op == 'B') {
      uint64_t n = get_u64(arg), got = 0;
      while (got < n) {
        size_t want = static_cast<size_t>(std::min<uint64_t>(n - got, kChunk));
        net::recv_all(fd, buf.data(), want, deadline, peer);
        got += want;
      }
      uint8_t reply[8];
      put_u64(reply, got);
      net::send_all(fd, reply, sizeof reply, deadline, peer);
    } else {
      return;  // not a probe client
    }
  }
}

}  // namespace

nlohmann::json HostFacts::to_json() const {
  return {{"version", version},          {"hostname", hostname},
          {"somaxconn", somaxconn},      {"tcp_max_syn_backlog", tcp_max_syn_backlog},
          {"nofile_soft", nofile_soft},  {"nofile_hard", nofile_hard},
          {"port_range_low", port_range_low}, {"port_range_high", port_range_high},
          {"ports_checked", ports_checked},   {"ports_free", ports_free},
          {"probe_port", probe_port},
          {"gpus", gpus},                     {"gpu_bus_ids", gpu_bus_ids},
          {"cuda_driver", cuda_driver},       {"cuda_runtime", cuda_runtime},
          {"nccl_version", nccl_version},     {"gpu_note", gpu_note},
          {"nccl_note", nccl_note},           {"nccl_allreduce", nccl_allreduce}};
}

HostFacts HostFacts::from_json(const nlohmann::json& j) {
  HostFacts f;
  f.version = j.at("version").get<std::string>();
  f.hostname = j.at("hostname").get<std::string>();
  f.somaxconn = j.at("somaxconn").get<int64_t>();
  f.tcp_max_syn_backlog = j.at("tcp_max_syn_backlog").get<int64_t>();
  f.nofile_soft = j.at("nofile_soft").get<uint64_t>();
  f.nofile_hard = j.at("nofile_hard").get<uint64_t>();
  f.port_range_low = j.at("port_range_low").get<int>();
  f.port_range_high = j.at("port_range_high").get<int>();
  f.ports_checked = j.at("ports_checked").get<std::vector<int>>();
  f.ports_free = j.at("ports_free").get<std::vector<bool>>();
  f.probe_port = j.at("probe_port").get<int>();
  // GPU facts came later: a host running an older cohort simply has none (its version differs anyway).
  f.gpus = j.value("gpus", 0);
  f.gpu_bus_ids = j.value("gpu_bus_ids", std::vector<std::string>{});
  f.cuda_driver = j.value("cuda_driver", "");
  f.cuda_runtime = j.value("cuda_runtime", "");
  f.nccl_version = j.value("nccl_version", "");
  f.gpu_note = j.value("gpu_note", "");
  f.nccl_note = j.value("nccl_note", "");
  f.nccl_allreduce = j.value("nccl_allreduce", "");
  return f;
}

bool port_is_free(int port) {
  try {
    net::listen_tcp("0.0.0.0", static_cast<uint16_t>(port), 1, false);
    return true;
  } catch (const Error&) {
    return false;
  }
}

HostFacts collect_host_facts(const std::vector<int>& ports_to_check) {
  HostFacts f;
  f.version = build::version_text();  // version and commit: hosts must run the same build
  f.hostname = net::hostname();
  f.somaxconn = read_sysctl_int("/proc/sys/net/core/somaxconn");
  f.tcp_max_syn_backlog = read_sysctl_int("/proc/sys/net/ipv4/tcp_max_syn_backlog");
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    f.nofile_soft = rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : rl.rlim_cur;
    f.nofile_hard = rl.rlim_max == RLIM_INFINITY ? UINT64_MAX : rl.rlim_max;
  }
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  range >> f.port_range_low >> f.port_range_high;
  for (int p : ports_to_check) {
    f.ports_checked.push_back(p);
    f.ports_free.push_back(port_is_free(p));
  }
  auto g = gpu::check_local_gpus(std::chrono::seconds(30));
  f.gpus = g.status.devices;
  f.gpu_bus_ids = g.bus_ids;
  if (g.status.driver_version > 0) f.cuda_driver = gpu::cuda_version_text(g.status.driver_version);
  if (g.status.runtime_version > 0) f.cuda_runtime = gpu::cuda_version_text(g.status.runtime_version);
  if (g.status.nccl) f.nccl_version = gpu::nccl_version_text(g.status.nccl_version);
  f.gpu_note = g.status.why_no_gpu;
  f.nccl_note = g.status.why_no_nccl;
  f.nccl_allreduce = g.nccl_allreduce;
  return f;
}

void serve_probe(const std::vector<int>& ports_to_check, const std::string& bind_host, Deadline lifetime) {
  // Facts first, while the job's ports are not yet touched by our own listener.
  HostFacts facts = collect_host_facts(ports_to_check);
  UniqueFd listener = net::listen_tcp(bind_host, 0, 64, false);
  facts.probe_port = net::local_address(listener.get()).port();
  std::string line = facts.to_json().dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);

  for (;;) {
    if (lifetime.expired()) return;
    pollfd fds[2] = {{listener.get(), POLLIN, 0}, {STDIN_FILENO, POLLIN, 0}};
    int n = ::poll(fds, 2, lifetime.poll_ms(1000));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error(net::errno_string("doctor --serve-probe: poll", errno));
    }
    if (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) {
      char c[256];
      ssize_t r = ::read(STDIN_FILENO, c, sizeof c);
      if (r <= 0) return;  // the session that started us is gone: so are we
    }
    if (fds[0].revents & POLLIN) {
      int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      UniqueFd client(fd);
      std::string peer = net::peer_address(client.get()).to_string();
      try {
        serve_client(client.get(), peer);
      } catch (const Error&) {
        // A probe that breaks off is the client's finding to report, not ours.
      }
    }
  }
}

nlohmann::json LinkResult::to_json() const {
  return {{"ok", ok},         {"error", error},
          {"rtt_us", rtt_us}, {"rtt_min_us", rtt_min_us},
          {"clock_offset_ms", clock_offset_ms}, {"bandwidth_MBps", bandwidth_MBps},
          {"bytes", bytes}};
}

LinkResult LinkResult::from_json(const nlohmann::json& j) {
  LinkResult r;
  r.ok = j.at("ok").get<bool>();
  r.error = j.at("error").get<std::string>();
  r.rtt_us = j.at("rtt_us").get<double>();
  r.rtt_min_us = j.at("rtt_min_us").get<double>();
  r.clock_offset_ms = j.at("clock_offset_ms").get<double>();
  r.bandwidth_MBps = j.at("bandwidth_MBps").get<double>();
  r.bytes = j.at("bytes").get<uint64_t>();
  return r;
}

LinkResult probe_link(const std::string& host, int port, uint64_t bytes, int pings, Deadline deadline) {
  using Clock = std::chrono::steady_clock;
  LinkResult r;
  r.bytes = bytes;
  std::string peer = host + ":" + std::to_string(port);
  try {
    UniqueFd fd = net::connect_tcp(net::resolve(host, static_cast<uint16_t>(port)), deadline);
    std::vector<double> rtts;
    double best_rtt = 1e18;
    for (int i = 0; i < std::max(pings, 1); ++i) {
      uint8_t req[9], reply[16];
      req[0] = 'P';
      put_u64(req + 1, static_cast<uint64_t>(i));
      uint64_t sent_real = realtime_ns();
      auto t0 = Clock::now();
      net::send_all(fd.get(), req, sizeof req, deadline, peer);
      net::recv_all(fd.get(), reply, sizeof reply, deadline, peer);
      double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      uint64_t recv_real = realtime_ns();
      rtts.push_back(us);
      if (us < best_rtt) {
        best_rtt = us;
        // The server read its clock somewhere in the round trip: assume the middle.
        double mid = (static_cast<double>(sent_real) + static_cast<double>(recv_real)) / 2;
        r.clock_offset_ms = (static_cast<double>(get_u64(reply + 8)) - mid) / 1e6;
      }
    }
    std::sort(rtts.begin(), rtts.end());
    r.rtt_us = rtts[rtts.size() / 2];
    r.rtt_min_us = rtts.front();
    if (bytes > 0) {
      uint8_t req[9];
      req[0] = 'B';
      put_u64(req + 1, bytes);
      std::vector<uint8_t> chunk(kChunk, 0x5a);
      auto t0 = Clock::now();
      net::send_all(fd.get(), req, sizeof req, deadline, peer);
      for (uint64_t sent = 0; sent < bytes;) {
        size_t n = static_cast<size_t>(std::min<uint64_t>(bytes - sent, kChunk));
        net::send_all(fd.get(), chunk.data(), n, deadline, peer);
        sent += n;
      }
      uint8_t ack[8];
      net::recv_all(fd.get(), ack, sizeof ack, deadline, peer);
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (get_u64(ack) != bytes) throw Error("probe server at " + peer + " acknowledged a wrong byte count");
      r.bandwidth_MBps = static_cast<double>(bytes) / s / 1e6;
    }
    uint8_t quit = 'Q';
    net::send_all(fd.get(), &quit, 1, deadline, peer);
    r.ok = true;
  } catch (const std::exception& e) {
    r.ok = false;
    r.error = e.what();
  }
  return r;
}

}  // namespace cohort::doctor
