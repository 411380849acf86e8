#!/usr/bin/env bash
# A test cluster of K "hosts" on this machine: each host is a network namespace with its own address
# on a private bridge, its own sshd, and a link that can be slowed (tc netem/tbf) or cut.
#
#   cluster.sh up [-k K] [-d DIR]     create the cluster; prints DIR (state, keys, ssh wrapper, hostfile)
#   cluster.sh down DIR               kill everything started in the cluster's namespaces and delete them
#   cluster.sh exec DIR I CMD...      run CMD inside host I (its network namespace and hostname h<I>)
#   cluster.sh ssh DIR I CMD...       run CMD on host I over ssh (from host 0)
#   cluster.sh shape DIR I|all DELAY RATE   e.g. shape DIR all 1ms 1gbit (delay on the host's egress,
#                                     rate on both directions of its link)
#   cluster.sh unshape DIR I|all
#   cluster.sh cut DIR I              cut host I's link (peer end down: its packets go nowhere)
#   cluster.sh heal DIR I
#   cluster.sh cut-pair DIR I J       cut the path between hosts I and J only (each drops what it sends the
#                                     other; both stay reachable from every other host)
#   cluster.sh heal-pair DIR I J
#   cluster.sh pids DIR [I]           processes still running in the hosts' namespaces
#   cluster.sh run [-k K] -- CMD...   up, run CMD with the cluster's environment, down (always, via trap)
#   cluster.sh selftest [-k K]        namespaces up, ssh between all pairs, tc applies, teardown leaves nothing
#   cluster.sh gc                     delete leftovers of runs whose owning process is gone
#   cluster.sh check                  exit 0 if namespaces + sshd can be used here, 77 (with the reason) if not
#
# Addresses: 198.18.0.1 .. 198.18.0.K/24 (RFC 2544 benchmarking range). The bridge lives in a namespace of
# its own, so nothing is added to the machine's own network namespace and parallel runs (which each have
# their own bridge namespace) can reuse the same addresses without seeing each other.
# Names: coh<id>b (bridge) and coh<id>h<i> (hosts), <id> = the pid of the owning process (the `run`
# process, a keeper process that `up` leaves running while the cluster's directory exists, or
# COHORT_CLUSTER_OWNER): unique per run. `gc` deletes clusters whose owner is gone (a test killed by
# ctest's timeout cannot tear its cluster down); run_test.sh calls it before each test.
# The DIR/env file (sourceable) describes the cluster to tests:
#   COHORT_CLUSTER_DIR, COHORT_CLUSTER_K, COHORT_CLUSTER_NS_<i>, COHORT_CLUSTER_ADDR_<i>,
#   COHORT_CLUSTER_SSH (the ssh wrapper: usable as cohort's --ssh-command), COHORT_CLUSTER_HOSTFILE
#   (addresses, slots=2), COHORT_CLUSTER_HOSTFILE_NAMES (names h0..h<K-1>, resolvable on the hosts).
set -euo pipefail

SUBNET_PREFIX=198.18.0
SELF=$(readlink -f "$0")
SSHD=${COHORT_SSHD:-/usr/sbin/sshd}

die() { echo "cluster.sh: $*" >&2; exit 1; }
log() { [[ -n ${COHORT_CLUSTER_QUIET:-} ]] || echo "cluster.sh: $*" >&2; }

# Why this machine cannot host the cluster, or nothing if it can.
why_unsupported() {
  [[ $(id -u) -eq 0 ]] || { echo "needs root (network namespaces); running as uid $(id -u)"; return; }
  command -v ip >/dev/null || { echo "iproute2 ('ip') is not installed"; return; }
  command -v tc >/dev/null || { echo "'tc' (iproute2) is not installed"; return; }
  [[ -x $SSHD ]] || { echo "$SSHD not found (install openssh-server)"; return; }
  command -v ssh >/dev/null || { echo "ssh client not found (install openssh-client)"; return; }
  command -v ssh-keygen >/dev/null || { echo "ssh-keygen not found"; return; }
  local probe="cohprobe$$" err
  if ! err=$(ip netns add "$probe" 2>&1); then echo "cannot create a network namespace: $err"; return; fi
  if ! err=$(ip -n "$probe" link add v0 type veth peer name v1 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    echo "cannot create a veth pair in a namespace: $err"; return
  fi
  ip netns del "$probe"
}

ns_of() { echo "coh${1}h${2}"; }   # id, host index
bridge_ns_of() { echo "coh${1}b"; }

load() {  # DIR -> sources DIR/env
  local dir=$1
  [[ -f $dir/env ]] || die "$dir/env not found (not a cluster directory, or already torn down)"
  # shellcheck disable=SC1091
  source "$dir/env"
}

host_ns() { local v="COHORT_CLUSTER_NS_$1"; [[ -n ${!v:-} ]] || die "no host $1 (K=$COHORT_CLUSTER_K)"; echo "${!v}"; }

hosts_arg() {  # I|all -> list of indices
  if [[ $1 == all ]]; then seq 0 $((COHORT_CLUSTER_K - 1)); else echo "$1"; fi
}

# Kills every process in namespace $1 (SIGKILL, repeated until none is left or 5 s pass) and deletes it.
kill_and_delete_ns() {
  local ns=$1 pids tries=0
  ip netns list | awk '{print $1}' | grep -qx "$ns" || return 0
  while pids=$(ip netns pids "$ns" 2>/dev/null) && [[ -n $pids ]]; do
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    tries=$((tries + 1))
    if ((tries > 50)); then echo "cluster.sh: processes still alive in $ns after 5 s: $pids" >&2; break; fi
    sleep 0.1
  done
  ip netns del "$ns" 2>/dev/null || true
}

teardown_id() {  # id, K
  local id=$1 k=$2 i
  for ((i = 0; i < k; i++)); do kill_and_delete_ns "$(ns_of "$id" "$i")"; done
  kill_and_delete_ns "$(bridge_ns_of "$id")"
}

# Milliseconds to open a TCP connection from namespace $1 to $2:$3 (one round trip), or fails after 2 s.
connect_ms() {
  local t0 t1
  t0=$(date +%s%N)
  timeout 2 ip netns exec "$1" bash -c "exec 3<>/dev/tcp/$2/$3" 2>/dev/null || return 1
  t1=$(date +%s%N)
  echo $(((t1 - t0) / 1000000))
}

wait_port() {  # ns addr port timeout_s
  local ns=$1 addr=$2 port=$3 deadline=$((SECONDS + $4))
  until ip netns exec "$ns" bash -c "exec 3<>/dev/tcp/$addr/$port" 2>/dev/null; do
    ((SECONDS < deadline)) || return 1
    sleep 0.05
  done
}

cmd_up() {
  local k=4 dir=""
  while (($#)); do
    case $1 in
      -k) k=$2; shift 2 ;;
      -d) dir=$2; shift 2 ;;
      *) die "up: unknown argument '$1'" ;;
    esac
  done
  [[ $k =~ ^[0-9]+$ ]] && ((k >= 1 && k <= 200)) || die "up: K must be 1..200, not '$k'"
  local why; why=$(why_unsupported)
  [[ -z $why ]] || die "cannot build the cluster: $why"
  # The cluster's id names its namespaces and is the pid of the process that owns it (gc removes the
  # clusters whose owner is gone): this process, or COHORT_CLUSTER_OWNER when a wrapper (slurm.sh) that
  # outlives this `up` owns it.
  local id=${COHORT_CLUSTER_OWNER:-$$}
  [[ -n $dir ]] || dir=$(mktemp -d "${TMPDIR:-/tmp}/cohort-cluster-$id.XXXXXX")
  mkdir -p "$dir"
  dir=$(readlink -f "$dir")
  # Anything that fails from here on removes what was already made.
  local keeper=${COHORT_CLUSTER_KEEPER:-} pointer=${COHORT_CLUSTER_POINTER:-}
  trap 'teardown_id '"$id $k"'; rm -rf "'"$dir"'"; stop_keeper "'"$keeper"'" "'"$pointer"'"; echo "cluster.sh: up failed; partial cluster removed" >&2' EXIT
  echo "$id $k $keeper $pointer" >"$dir/owner"
  [[ -z $pointer ]] || echo "$dir" >"$pointer"  # the keeper lives while $dir/owner does

  # Keys: one host key for all sshds, one user key; both only for this run.
  ssh-keygen -q -t ed25519 -N '' -C "cohort-cluster-host-$id" -f "$dir/host_key"
  ssh-keygen -q -t ed25519 -N '' -C "cohort-cluster-user-$id" -f "$dir/user_key"
  : >"$dir/ssh_config"
  for ((i = 0; i < k; i++)); do printf 'Host h%d\n  HostName %s.%d\n' "$i" "$SUBNET_PREFIX" $((i + 1)) >>"$dir/ssh_config"; done
  cat >>"$dir/ssh_config" <<EOF
Host *
  User root
  IdentityFile $dir/user_key
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  GlobalKnownHostsFile /dev/null
  BatchMode yes
  LogLevel ERROR
  ConnectTimeout 5
  ServerAliveInterval 2
  ServerAliveCountMax 3
EOF
  cat >"$dir/ssh" <<EOF
#!/bin/sh
# ssh into the cohort test cluster $id (usable as cohort's --ssh-command).
exec ssh -F $dir/ssh_config -i $dir/user_key -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "\$@"
EOF
  chmod +x "$dir/ssh"
  # sshd refuses to start without its privilege-separation directory.
  mkdir -p /run/sshd && chmod 0755 /run/sshd

  local br; br=$(bridge_ns_of "$id")
  ip netns add "$br"
  ip -n "$br" link add br0 type bridge
  ip -n "$br" link set br0 up
  ip -n "$br" link set lo up

  local envf="$dir/env.tmp" i ns addr
  {
    echo "COHORT_CLUSTER_DIR=$dir"
    echo "COHORT_CLUSTER_ID=$id"
    echo "COHORT_CLUSTER_K=$k"
    echo "COHORT_CLUSTER_BRIDGE_NS=$br"
    echo "COHORT_CLUSTER_SSH=$dir/ssh"
    echo "COHORT_CLUSTER_HOSTFILE=$dir/hostfile"
    echo "COHORT_CLUSTER_HOSTFILE_NAMES=$dir/hostfile.names"
  } >"$envf"
  : >"$dir/hostfile"
  : >"$dir/hostfile.names"
  { echo "127.0.0.1 localhost"; echo "::1 localhost"; } >"$dir/hosts"
  for ((i = 0; i < k; i++)); do echo "$SUBNET_PREFIX.$((i + 1)) h$i" >>"$dir/hosts"; done
  for ((i = 0; i < k; i++)); do
    ns=$(ns_of "$id" "$i")
    addr="$SUBNET_PREFIX.$((i + 1))"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # veth: eth0 inside the host, v<i> on the bridge.
    ip -n "$br" link add "v$i" type veth peer name eth0 netns "$ns"
    ip -n "$br" link set "v$i" master br0
    ip -n "$br" link set "v$i" up
    ip -n "$ns" addr add "$addr/24" dev eth0
    ip -n "$ns" link set eth0 up
    cat >"$dir/sshd_config.$i" <<EOF
ListenAddress $addr
Port 22
HostKey $dir/host_key
PidFile $dir/sshd.$i.pid
AuthorizedKeysFile $dir/user_key.pub
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
UseDNS no
PrintMotd no
PrintLastLog no
MaxStartups 200:30:400
# A session whose client is gone (link cut) ends within 6 s, so what it ran sees EOF on stdin.
ClientAliveInterval 2
ClientAliveCountMax 3
MaxSessions 200
LogLevel ERROR
EOF
    # sshd gets a UTS namespace with hostname h<i> and a mount namespace whose /etc/hosts names every
    # host of this cluster, so ssh sessions (and Open MPI, which tells nodes apart by hostname) see K
    # distinct machines that can resolve each other by name. The machine's own /etc/hosts is untouched.
    ip netns exec "$ns" unshare --uts --mount --propagation private sh -c \
      "mount --bind $dir/hosts /etc/hosts && hostname h$i && exec $SSHD -f $dir/sshd_config.$i -E $dir/sshd.$i.log"
    echo "COHORT_CLUSTER_NS_$i=$ns" >>"$envf"
    echo "COHORT_CLUSTER_ADDR_$i=$addr" >>"$envf"
    echo "$addr slots=2" >>"$dir/hostfile"
    echo "h$i slots=2" >>"$dir/hostfile.names"
  done
  for ((i = 0; i < k; i++)); do
    wait_port "$(ns_of "$id" "$i")" "$SUBNET_PREFIX.$((i + 1))" 22 10 ||
      die "sshd of host $i did not listen within 10 s (log: $dir/sshd.$i.log)"
  done
  mv "$envf" "$dir/env"
  trap - EXIT
  log "up: $k hosts ($SUBNET_PREFIX.1-$k) in namespaces coh${id}h*, state in $dir"
  echo "$dir"
}

# Stops `up`'s keeper (its process group: the shell and its sleep) and removes its pointer file.
stop_keeper() {  # keeper-pid pointer-file (either may be empty)
  [[ -z ${1:-} ]] || kill -- "-$1" 2>/dev/null || true
  [[ -z ${2:-} ]] || rm -f "$2"
}

cmd_down() {
  local dir=${1:?down DIR}
  [[ -f $dir/owner ]] || die "$dir/owner not found: not a cluster directory"
  local id k keeper pointer
  read -r id k keeper pointer <"$dir/owner"
  teardown_id "$id" "$k"
  stop_keeper "$keeper" "$pointer"
  rm -rf "$dir"
  log "down: cluster $id removed"
}

cmd_exec() {
  local dir=${1:?exec DIR I CMD...} i=${2:?exec DIR I CMD...}
  shift 2
  load "$dir"
  # Same network namespace, hostname and /etc/hosts (namespaces of its sshd) as an ssh session on host I.
  exec ip netns exec "$(host_ns "$i")" nsenter --uts --mount --wd="$PWD" -t "$(cat "$dir/sshd.$i.pid")" "$@"
}

cmd_ssh() {
  local dir=${1:?ssh DIR I CMD...} i=${2:?ssh DIR I CMD...}
  shift 2
  load "$dir"
  local v="COHORT_CLUSTER_ADDR_$i"
  exec ip netns exec "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_SSH" "${!v}" "$@"
}

have_netem() {  # ns: 0 if the kernel offers sch_netem (some minimal kernels build only tbf/htb)
  if tc -n "$1" qdisc add dev lo root netem delay 0ms 2>/dev/null; then
    tc -n "$1" qdisc del dev lo root 2>/dev/null || true
    return 0
  fi
  return 1
}

cmd_shape() {
  local dir=${1:?shape DIR I|all DELAY RATE} which=${2:?} delay=${3:?} rate=${4:?}
  load "$dir"
  local i ns netem=1
  have_netem "$COHORT_CLUSTER_BRIDGE_NS" || netem=0
  if ((!netem)) && [[ $delay != 0 && $delay != 0ms ]]; then
    echo "cluster.sh: WARNING: this kernel has no sch_netem qdisc; links get the rate ($rate) but not the delay ($delay)" >&2
  fi
  for i in $(hosts_arg "$which"); do
    ns=$(host_ns "$i")
    if ((netem)); then
      # Host egress: netem adds the one-way delay, tbf under it caps the rate.
      tc -n "$ns" qdisc replace dev eth0 root handle 1: netem delay "$delay" limit 100000
      tc -n "$ns" qdisc replace dev eth0 parent 1: handle 2: tbf rate "$rate" burst 256kb latency 50ms
    else
      tc -n "$ns" qdisc replace dev eth0 root handle 1: tbf rate "$rate" burst 256kb latency 50ms
    fi
    # Host ingress = the bridge port's egress: the rate only, so a NIC is capped in both directions.
    tc -n "$COHORT_CLUSTER_BRIDGE_NS" qdisc replace dev "v$i" root tbf rate "$rate" burst 256kb latency 50ms
  done
}

cmd_unshape() {
  local dir=${1:?unshape DIR I|all} which=${2:?}
  load "$dir"
  local i
  for i in $(hosts_arg "$which"); do
    tc -n "$(host_ns "$i")" qdisc del dev eth0 root 2>/dev/null || true
    tc -n "$COHORT_CLUSTER_BRIDGE_NS" qdisc del dev "v$i" root 2>/dev/null || true
  done
}

cmd_cut() {
  local dir=${1:?cut DIR I} i=${2:?cut DIR I}
  load "$dir"
  host_ns "$i" >/dev/null
  ip -n "$COHORT_CLUSTER_BRIDGE_NS" link set "v$i" down
}

cmd_heal() {
  local dir=${1:?heal DIR I} i=${2:?heal DIR I}
  load "$dir"
  host_ns "$i" >/dev/null
  ip -n "$COHORT_CLUSTER_BRIDGE_NS" link set "v$i" up
}

# A cut between two hosts only: each host's route to the other is a blackhole, so what either sends
# the other vanishes in its own kernel (this kernel has no tc drop action to do it on the bridge).
# Established connections between them see silence; a new connect from one to the other fails at once
# (EINVAL), never as "refused".
pair_addrs() {  # I J -> sets PAIR_NS_I PAIR_NS_J PAIR_ADDR_I PAIR_ADDR_J
  PAIR_NS_I=$(host_ns "$1"); PAIR_NS_J=$(host_ns "$2")
  local vi="COHORT_CLUSTER_ADDR_$1" vj="COHORT_CLUSTER_ADDR_$2"
  PAIR_ADDR_I=${!vi}; PAIR_ADDR_J=${!vj}
  [[ $1 != "$2" ]] || die "cut-pair: hosts $1 and $2 are the same host"
}

cmd_cut_pair() {
  local dir=${1:?cut-pair DIR I J} i=${2:?cut-pair DIR I J} j=${3:?cut-pair DIR I J}
  load "$dir"
  pair_addrs "$i" "$j"
  ip -n "$PAIR_NS_I" route replace blackhole "$PAIR_ADDR_J/32"
  ip -n "$PAIR_NS_J" route replace blackhole "$PAIR_ADDR_I/32"
}

cmd_heal_pair() {
  local dir=${1:?heal-pair DIR I J} i=${2:?heal-pair DIR I J} j=${3:?heal-pair DIR I J}
  load "$dir"
  pair_addrs "$i" "$j"
  ip -n "$PAIR_NS_I" route del blackhole "$PAIR_ADDR_J/32" 2>/dev/null || true
  ip -n "$PAIR_NS_J" route del blackhole "$PAIR_ADDR_I/32" 2>/dev/null || true
}

cmd_pids() {
  local dir=${1:?pids DIR [I]} which=${2:-all}
  load "$dir"
  local i
  for i in $(hosts_arg "$which"); do ip netns pids "$(host_ns "$i")"; done
}

cmd_run() {
  local k=4
  while (($#)); do
    case $1 in
      -k) k=$2; shift 2 ;;
      --) shift; break ;;
      *) die "run: unknown argument '$1' (expected -k K -- CMD...)" ;;
    esac
  done
  (($#)) || die "run: no command"
  RUN_DIR=$(cmd_up -k "$k")
  local dir=$RUN_DIR
  # The teardown runs whatever happens to CMD (failure, signal), so nothing outlives the run.
  trap 'cmd_down "$RUN_DIR"' EXIT
  trap 'exit 130' INT TERM
  local rc=0
  (set -a; load "$dir"; set +a; "$@") || rc=$?
  return "$rc"
}

cmd_selftest() {
  local k=3
  [[ ${1:-} == -k ]] && k=$2
  SELFTEST_DIR=$(cmd_up -k "$k")
  local dir=$SELFTEST_DIR
  local id; read -r id _ <"$dir/owner"
  trap 'cmd_down "$SELFTEST_DIR" 2>/dev/null || true' EXIT
  load "$dir"
  local i j fails=0
  # ssh between every ordered pair, by name (the ssh config maps h<j> to its address); the far side
  # reports its hostname and address.
  for ((i = 0; i < k; i++)); do
    for ((j = 0; j < k; j++)); do
      local src="COHORT_CLUSTER_NS_$i" dst="COHORT_CLUSTER_ADDR_$j" got
      got=$(ip netns exec "${!src}" "$COHORT_CLUSTER_SSH" "h$j" "hostname; ip -4 -o addr show dev eth0" 2>&1) || true
      if [[ $got != "h$j"$'\n'*"${!dst}/24"* ]]; then
        echo "selftest: ssh from host $i to host $j (${!dst}) failed: $got" >&2
        fails=$((fails + 1))
      fi
    done
  done
  # Shaping. Delay (netem, where the kernel has it): 5 ms one-way on every host => a TCP connect takes >= 10 ms.
  cmd_shape "$dir" all 5ms 100mbit 2>/dev/null
  tc -n "$COHORT_CLUSTER_NS_0" qdisc show dev eth0 | grep -q tbf || { echo "selftest: tbf not installed on eth0" >&2; fails=$((fails + 1)); }
  tc -n "$COHORT_CLUSTER_BRIDGE_NS" qdisc show dev v0 | grep -q tbf || { echo "selftest: tbf not installed on the bridge port" >&2; fails=$((fails + 1)); }
  local rtt
  if have_netem "$COHORT_CLUSTER_NS_0"; then
    rtt=$(connect_ms "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_ADDR_1" 22) || rtt=none
    if [[ $rtt == none ]] || ((rtt < 10)); then
      echo "selftest: with 5 ms netem on both hosts a TCP connect took '$rtt' ms, expected >= 10" >&2; fails=$((fails + 1))
    fi
  else
    echo "selftest: note: no sch_netem in this kernel; delay not tested (rate is)"
  fi
  # Rate: 2 MB through a 20 Mbit/s link takes >= ~0.7 s (burst 256 KiB), unshaped it takes well under that.
  cmd_shape "$dir" 1 0ms 20mbit 2>/dev/null
  local t0 t1
  t0=$(date +%s.%N)
  ip netns exec "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_SSH" "$COHORT_CLUSTER_ADDR_1" "head -c 2000000 /dev/zero" | wc -c >/dev/null
  t1=$(date +%s.%N)
  if ! awk -v a="$t0" -v b="$t1" 'BEGIN {exit !(b - a >= 0.6)}'; then
    echo "selftest: 2 MB over a 20 Mbit/s link took $(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}') s, expected >= 0.6 s" >&2; fails=$((fails + 1))
  fi
  cmd_unshape "$dir" all
  tc -n "$COHORT_CLUSTER_NS_0" qdisc show dev eth0 | grep -q tbf && { echo "selftest: tbf still on eth0 after unshape" >&2; fails=$((fails + 1)); }
  connect_ms "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_ADDR_1" 22 >/dev/null || {
    echo "selftest: host 1 unreachable after unshape" >&2; fails=$((fails + 1)); }
  # Cut: host 1 unreachable from host 0; heal: reachable again.
  cmd_cut "$dir" 1
  if connect_ms "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_ADDR_1" 22 >/dev/null; then
    echo "selftest: host 1 still answers after its link was cut" >&2; fails=$((fails + 1))
  fi
  cmd_heal "$dir" 1
  if ! connect_ms "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_ADDR_1" 22 >/dev/null; then
    echo "selftest: host 1 does not answer after heal" >&2; fails=$((fails + 1))
  fi
  # Pair cut: hosts 0 and 1 lose each other (both ways) and nobody else; heal-pair restores them.
  if ((k >= 3)); then
    cmd_cut_pair "$dir" 0 1
    if connect_ms "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_ADDR_1" 22 >/dev/null ||
      connect_ms "$COHORT_CLUSTER_NS_1" "$COHORT_CLUSTER_ADDR_0" 22 >/dev/null; then
      echo "selftest: hosts 0 and 1 still reach each other after cut-pair" >&2; fails=$((fails + 1))
    fi
    if ! connect_ms "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_ADDR_2" 22 >/dev/null ||
      ! connect_ms "$COHORT_CLUSTER_NS_1" "$COHORT_CLUSTER_ADDR_2" 22 >/dev/null; then
      echo "selftest: cut-pair 0 1 also cut host 2 off" >&2; fails=$((fails + 1))
    fi
    cmd_heal_pair "$dir" 0 1
    if ! connect_ms "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_ADDR_1" 22 >/dev/null; then
      echo "selftest: hosts 0 and 1 do not reach each other after heal-pair" >&2; fails=$((fails + 1))
    fi
  fi
  # A process started over ssh and left running must be gone after teardown.
  ip netns exec "$COHORT_CLUSTER_NS_0" "$COHORT_CLUSTER_SSH" "$COHORT_CLUSTER_ADDR_1" \
    "nohup sleep 1000 >/dev/null 2>&1 </dev/null & echo \$!" >"$dir/../cohort-cluster-selftest-$id.pid" 2>/dev/null || true
  local orphan; orphan=$(cat "$dir/../cohort-cluster-selftest-$id.pid" 2>/dev/null || true)
  rm -f "$dir/../cohort-cluster-selftest-$id.pid"
  [[ -n $orphan ]] || { echo "selftest: could not start a background process over ssh" >&2; fails=$((fails + 1)); }
  trap - EXIT
  cmd_down "$dir"
  local left
  left=$(ip netns list | awk '{print $1}' | grep -E "^coh${id}(b|h[0-9]+)$" || true)
  [[ -z $left ]] || { echo "selftest: namespaces left after down: $left" >&2; fails=$((fails + 1)); }
  if [[ -n $orphan ]] && alive_after "$orphan" 2; then
    echo "selftest: process $orphan started over ssh survived teardown" >&2; fails=$((fails + 1))
  fi
  [[ ! -e $dir ]] || { echo "selftest: $dir left after down" >&2; fails=$((fails + 1)); }
  if ((fails)); then echo "selftest: $fails check(s) failed" >&2; return 1; fi
  echo "selftest: ok ($k hosts: ssh all pairs, netem+tbf, cut/heal, cut-pair/heal-pair, teardown clean)"
}

# 0 if pid $1 is still a live process (not a zombie waiting for init to reap it) after $2 seconds.
alive_after() {
  local pid=$1 deadline=$((SECONDS + $2)) state
  while :; do
    state=$(awk '/^State:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || state=""
    [[ -z $state || $state == Z ]] && return 1
    ((SECONDS < deadline)) || return 0
    sleep 0.1
  done
}

cmd_gc() {
  local ns id
  for ns in $(ip netns list | awk '{print $1}' | grep -E '^coh[0-9]+(b|h[0-9]+)$' || true); do
    id=${ns#coh}; id=${id%%[bh]*}
    if ! kill -0 "$id" 2>/dev/null; then kill_and_delete_ns "$ns"; log "gc: removed $ns"; fi
  done
}

cmd_check() {
  local why; why=$(why_unsupported)
  if [[ -n $why ]]; then echo "SKIP: multihost cluster unavailable: $why"; exit 77; fi
}

main() {
  local cmd=${1:-}
  (($#)) && shift
  case $cmd in
    up)
      # `up` ends before its cluster does: a keeper process stands for the cluster as its owner, so that
      # `gc` (which removes clusters whose owner is gone, e.g. from a test run beside) leaves it alone
      # until `down` stops the keeper. (Owned by the short-lived `up` itself, a cluster made by hand was
      # deleted under a running benchmark by the next multi-host test's gc.)
      # The keeper lives as long as the cluster's directory (up writes its path into the pointer file
      # within seconds): an `up` killed half-way, or a directory deleted by hand, leaves no keeper behind
      # for long, and gc then removes the namespaces as it did before.
      if [[ -z ${COHORT_CLUSTER_OWNER:-} ]]; then
        COHORT_CLUSTER_POINTER=$(mktemp "${TMPDIR:-/tmp}/cohort-cluster-keeper.XXXXXX")
        setsid bash -c 'sleep 10; while [[ -e "$(cat "$0" 2>/dev/null)/owner" ]]; do sleep 5; done; rm -f "$0"' \
          "$COHORT_CLUSTER_POINTER" </dev/null >/dev/null 2>&1 &
        export COHORT_CLUSTER_OWNER=$! COHORT_CLUSTER_KEEPER=$! COHORT_CLUSTER_POINTER
      fi
      cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    exec) cmd_exec "$@" ;;
    ssh) cmd_ssh "$@" ;;
    shape) cmd_shape "$@" ;;
    unshape) cmd_unshape "$@" ;;
    cut) cmd_cut "$@" ;;
    heal) cmd_heal "$@" ;;
    cut-pair) cmd_cut_pair "$@" ;;
    heal-pair) cmd_heal_pair "$@" ;;
    pids) cmd_pids "$@" ;;
    run) cmd_run "$@" ;;
    selftest) cmd_check; cmd_selftest "$@" ;;
    gc) cmd_gc ;;
    check) cmd_check ;;
    *) sed -n '2,/^set -euo/p' "$SELF" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
  esac
}

main "$@"
