#!/usr/bin/env bash
# The stand-in `ray` (tests/ray/ray) keeps Ray's command-line contract strictly: cohort's Ray tests are only
# as good as that. On this host's loopback, without cohort: unknown and conflicting flags are refused as
# click refuses them, a head listens on its GCS port and refuses a second head there, a worker joins it with
# its Rank:<n> resource, `ray status` prints Ray's format, --block stops on SIGTERM and reports a process of
# its own that dies, `ray stop` leaves nothing, and every call is logged.
#   tests/ray/standin_contract.sh
set -euo pipefail
here=$(dirname "$(readlink -f "$0")")
tmp=$(mktemp -d "${TMPDIR:-/tmp}/cohort-ray-standin.XXXXXX")
ray=$tmp/ray
cleanup() { "$ray" stop --force >/dev/null 2>&1 || true; rm -rf "$tmp"; }
trap cleanup EXIT
cp "$here/ray" "$ray"
fails=0
fail() { echo "FAIL: $*" >&2; fails=$((fails + 1)); }
pass() { echo "ok: $*"; }
# expect NAME WANT_RC WANT_TEXT CMD...: runs CMD, checks its exit code and that its output has WANT_TEXT.
expect() {
  local name=$1 want_rc=$2 want=$3 rc=0 out
  shift 3
  out=$("$@" 2>&1) || rc=$?
  if [[ $rc == "$want_rc" && $out == *"$want"* ]]; then pass "$name"; else
    fail "$name: exit $rc (expected $want_rc), output:"; echo "$out" | sed 's/^/    | /' >&2
  fi
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

expect "unknown flag" 2 "Error: No such option: --gcs-port" "$ray" start --head --gcs-port 1
expect "flag value of the wrong type" 2 "Invalid value for '--num-cpus': 'four' is not a valid integer." \
  "$ray" start --head --num-cpus four
expect "--head with --address" 2 "--head and --address both given" "$ray" start --head --address 127.0.0.1:1
expect "--port without --head" 2 "--port should only be specified when starting head node" \
  "$ray" start --address 127.0.0.1:1 --port 1
expect "--resources not JSON" 2 "Unable to parse the --resources argument" "$ray" start --head --resources '{Rank:0: 1}'
expect "CPU in --resources" 2 "Use the --num-cpus and --num-gpus flags" "$ray" start --head --resources '{"CPU": 1}'
expect "a node address that is not this host's" 2 "is not an address of this node" \
  "$ray" start --head --node-ip-address 192.0.2.1
expect "an unknown command" 2 "No such command 'up'" "$ray" up

port=$(free_port)
expect "a head starts" 0 "Ray runtime started." "$ray" start --head --port "$port" --node-ip-address 127.0.0.1 \
  --num-cpus 2 --resources '{"Rank:0": 1}' --disable-usage-stats
expect "a second head on its port is refused" 1 "but the GCS port $port is already in use" \
  "$ray" start --head --port "$port" --node-ip-address 127.0.0.1
expect "a worker joins" 0 "Ray runtime started." "$ray" start --address "127.0.0.1:$port" --node-ip-address 127.0.0.1 \
  --num-cpus 3 --resources '{"Rank:1": 1}'
status=$("$ray" status --address "127.0.0.1:$port")
echo "$status"
[[ $(grep -c '^ 1 node_[0-9a-f]\{56\}$' <<<"$status") == 2 ]] && pass "status: 2 active nodes as ' 1 node_<id>'" ||
  fail "status does not list 2 active nodes"
for want in "Node status" "Active:" " 0.0/5.0 CPU" " 0.0/1.0 Rank:0" " 0.0/1.0 Rank:1" "Pending:" "Usage:"; do
  [[ $status == *"$want"* ]] && pass "status has '$want'" || fail "status lacks '$want'"
done
expect "ray stop stops both" 0 "Stopped all 2 Ray processes." "$ray" stop
expect "status after stop" 1 "ConnectionError" "$ray" status --address "127.0.0.1:$port"

# --block: in the foreground; SIGTERM stops the node's process and exits 1, as Ray's shutdown hook.
port=$(free_port)
"$ray" start --head --port "$port" --node-ip-address 127.0.0.1 --block >"$tmp/block.out" 2>&1 &
block=$!
for _ in $(seq 100); do grep -q "block forever" "$tmp/block.out" && break; sleep 0.05; done
gcs=$(pgrep -P "$block" || true)
[[ -n $gcs ]] && pass "--block: its GCS process runs as its child" || fail "--block: no child process"
kill -TERM "$block"
rc=0; wait "$block" || rc=$?
[[ $rc == 1 ]] && pass "--block: SIGTERM exits 1" || fail "--block: SIGTERM exit code $rc"
[[ -n $gcs && ! -e /proc/$gcs ]] || [[ -z $gcs ]] && pass "--block: SIGTERM stopped its process" || fail "--block: its process $gcs outlived it"

# --block: a process of its own that dies is reported, exit 1.
port=$(free_port)
"$ray" start --head --port "$port" --node-ip-address 127.0.0.1 --block >"$tmp/block2.out" 2>&1 &
block=$!
for _ in $(seq 100); do grep -q "block forever" "$tmp/block2.out" && break; sleep 0.05; done
kill -KILL "$(pgrep -P "$block")"
rc=0; wait "$block" || rc=$?
[[ $rc == 1 && $(cat "$tmp/block2.out") == *"Some Ray subprocesses exited unexpectedly"* ]] &&
  pass "--block: a dead process of its own is reported, exit 1" || fail "--block: exit $rc, output: $(cat "$tmp/block2.out")"

log=$tmp/calls.log
[[ $(grep -c '"event": "refused"' "$log") -ge 8 && $(grep -c '"event": "joined"' "$log") == 1 ]] &&
  pass "every call is in calls.log" || { fail "calls.log incomplete:"; cat "$log" >&2; }
((fails == 0)) || { echo "$fails check(s) failed" >&2; exit 1; }
echo "the stand-in keeps the contract"
