#!/usr/bin/env bash
# Loopback TCP throughput with iperf3: 1 and 2 parallel streams, SECONDS_EACH s each, RUNS runs of each.
# One line per run: RESULT streams=P run=R sender_Gbps= receiver_Gbps= cpu_host= cpu_remote=
# Usage: bench/peers/run_iperf.sh   (RUNS=3, SECONDS_EACH=10, PORT=5299)
set -euo pipefail
port=${PORT:-5299}
iperf3 -s -B 127.0.0.1 -p "$port" >/dev/null 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
sleep 1
for ((run = 1; run <= ${RUNS:-3}; run++)); do
  for streams in 1 2; do
    iperf3 -c 127.0.0.1 -p "$port" -t "${SECONDS_EACH:-10}" -P "$streams" -J |
      /usr/bin/python3 -c '
import json, sys
streams, run = sys.argv[1:3]
end = json.load(sys.stdin)["end"]
sent, received = end["sum_sent"]["bits_per_second"], end["sum_received"]["bits_per_second"]
host, remote = end["cpu_utilization_percent"]["host_total"], end["cpu_utilization_percent"]["remote_total"]
print(f"RESULT streams={streams} run={run} sender_Gbps={sent / 1e9:.2f} receiver_Gbps={received / 1e9:.2f} "
      f"cpu_host={host:.0f}% cpu_remote={remote:.0f}%")' "$streams" "$run"
  done
done
