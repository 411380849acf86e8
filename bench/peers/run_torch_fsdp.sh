#!/usr/bin/env bash
# PyTorch's FullyShardedDataParallel on the CPU over gloo, on examples/bert's model and data:
# bench/bert_twin.py --fsdp, run with torch 2.6 in the Debian 13 root that scripts/test_in_trixie.sh makes
# (Debian 12's torch 1.13 has FSDP but not on the CPU). Needs root (chroot, bind mounts).
#
#   TRIXIE_ROOT=DIR bench/peers/run_torch_fsdp.sh NPROC [bert_twin.py flags...]
#
# The workers are started here, one per rank with RANK/WORLD_SIZE/MASTER_* set (torch 2.6's torchrun asks
# for a libuv store, which Debian's build lacks; USE_LIBUV=0 is for init_process_group's own store).
# /usr/share/wordnet (the corpus) is bound read-only into the root. Rank 0's output is printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=${TRIXIE_ROOT:?"set TRIXIE_ROOT to the Debian 13 root scripts/test_in_trixie.sh made"}
nproc=${1:?usage: TRIXIE_ROOT=DIR bench/peers/run_torch_fsdp.sh NPROC [bert_twin.py flags...]}
shift
[[ -x $root/usr/bin/python3 ]] || { echo "run_torch_fsdp: $root has no python3 (make it with scripts/test_in_trixie.sh)" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || { echo "run_torch_fsdp: needs root (chroot, bind mounts)" >&2; exit 1; }
work=$(mktemp -d "$root/tmp/cohort-fsdp.XXXXXX")
mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
bind() {  # SOURCE TARGET [ro]
  mkdir -p "$2"
  mountpoint -q "$2" && return
  mount --bind "$1" "$2"
  mounts+=("$2")
  [[ ${3:-} == ro ]] && mount -o remount,bind,ro "$2"
  return 0
}
bind /proc "$root/proc"
bind /dev "$root/dev"
bind /sys "$root/sys"
bind /usr/share/wordnet "$root/usr/share/wordnet" ro
cp bench/bert_twin.py "$work/"
inside=/tmp/$(basename "$work")
port=$((29800 + RANDOM % 1000))
pids=()
for ((r = nproc - 1; r >= 0; r--)); do
  chroot "$root" env RANK=$r LOCAL_RANK=$r WORLD_SIZE="$nproc" MASTER_ADDR=127.0.0.1 MASTER_PORT=$port USE_LIBUV=0 \
    GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
    python3 -u "$inside/bert_twin.py" "$@" >"$work/rank$r.out" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
cat "$work/rank0.out"
if ((status != 0)); then
  for ((r = 1; r < nproc; r++)); do tail -n 3 "$work/rank$r.out"; done
  exit "$status"
fi
