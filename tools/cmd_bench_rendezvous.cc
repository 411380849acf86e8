// `cohort bench rendezvous`: the store's load while an elastic job's agents wait in a rendezvous round
// (launch/rendezvous.h). N agents, each a thread with its own TCP connection to one local store
// server, join generation 0 of a job with --nnodes 1:2N, so the round stays open for the last call
// (--seconds) and every agent looks at it every 100 ms, as `cohort run --nnodes` does. Each agent's
// store calls are counted on its side of the connection (one call is one request: the rendezvous
// uses no pipelined call), so the same harness measures any version of the rendezvous code.
//
// Columns: agents, seconds the round was open, requests in all, requests per second at the store,
// the looks at the round (waits for its "closed" key: one per agent every 100 ms), and requests per
// agent per look.
// bench/results/performance-diary-2026-11.md ("Elastic jobs: the store's load during a rendezvous") has the figures.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "cohort/error.h"
#include "command.h"
#include "common/strings.h"
#include "launch/counting_store.h"
#include "launch/rendezvous.h"
#include "store/tcp_store.h"

namespace cohort::tools {
namespace {

using Clock = std::chrono::steady_clock;
using launch::CountingStore;

int run_bench_rendezvous(std::vector<std::string> args) {
  CLI::App app("Measures the store's load while N elastic agents wait in a rendezvous round (each a thread with its "
               "own connection to a local store server).",
               "cohort bench rendezvous");
  std::string agents_text = "8,32,64";
  double seconds = 3;
  app.add_option("--agents", agents_text, "agent counts, e.g. 64 or 8,32,64");
  app.add_option("--seconds", seconds, "how long the round stays open once the first agent is there (its last call)");
  if (!parse_command_line(app, args)) return 0;
  std::vector<int> counts = str::parse_int_list(agents_text, "--agents");
  if (counts.empty() || seconds <= 0 || *std::min_element(counts.begin(), counts.end()) < 1)
    throw ConfigError("cohort bench rendezvous: --agents and --seconds must be positive");

  fmt::print("# cohort bench rendezvous: N agents join generation 0 of --nnodes 1:2N (the round stays open for its "
             "{:g} s last call), each looks every 100 ms\n",
             seconds);
  fmt::print("{:>7} {:>8} {:>10} {:>12} {:>8} {:>16}\n", "agents", "open_s", "requests", "requests/s", "looks",
             "req/agent/look");
  for (int n : counts) {
    StoreServerOptions so;
    so.host = "127.0.0.1";
    auto server = StoreServer::start(so);
    std::vector<std::shared_ptr<CountingStore>> stores;
    for (int i = 0; i < n; ++i) {
      StoreClientOptions co;
      co.host = "127.0.0.1";
      co.port = server->port();
      co.timeout = std::chrono::seconds(30);
      stores.push_back(std::make_shared<CountingStore>(connect_tcp_store(co)));
    }
    launch::RendezvousSettings s;
    s.min_nodes = 1;
    s.max_nodes = 2 * n;
    s.timeout_s = seconds + 60;
    s.last_call_s = seconds;
    std::atomic<bool> stop{false};
    std::atomic<int> failed{0};
    std::vector<std::thread> threads;
    const auto start = Clock::now();
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        try {
          launch::AgentInfo self;
          self.id = fmt::format("bench-agent-{}", i);
          self.host = fmt::format("h{}", i);
          launch::Rendezvous r(make_prefix_store(stores[static_cast<size_t>(i)], "cohort/launch/bench"), self, s, {});
          if (!r.join(0, stop)) ++failed;
        } catch (const Error& e) {
          if (failed++ == 0) fmt::print(stderr, "cohort bench rendezvous: agent {}: {}\n", i, e.what());
        }
      });
    }
    for (auto& t : threads) t.join();
    const double open_s = std::chrono::duration<double>(Clock::now() - start).count();
    uint64_t calls = 0, looks = 0;
    for (const auto& st : stores) calls += st->calls, looks += st->looks;
    stores.clear();
    server->stop();
    if (failed > 0) {
      fmt::print(stderr, "cohort bench rendezvous: {} of {} agents did not join\n", failed.load(), n);
      return 1;
    }
    fmt::print("{:>7} {:>8.2f} {:>10} {:>12.0f} {:>8} {:>16.2f}\n", n, open_s, calls, calls / open_s, looks,
               looks ? static_cast<double>(calls) / static_cast<double>(looks) : 0.0);
    std::fflush(stdout);
  }
  return 0;
}

Registration reg_bench_rendezvous("bench rendezvous", "measure the store's load while N elastic agents wait in a rendezvous round",
                 run_bench_rendezvous);

}  // namespace
}  // namespace cohort::tools
