#!/usr/bin/env bash
# Issue 50's speed figures: samples/s of FSDP against ZeRO stage 2 and DDP at 2 ranks, on BERT-mini and
# ResNet-18 (examples/bert, examples/resnet; BERT-base with MODELS="bert-mini resnet18 bert-base"), AdamW,
# 1 intra-op thread per rank, fresh processes every run. Rounds are interleaved (every model and mode
# once per round, in the same order) so that a change in the machine's load lands on every row alike;
# every round is printed, then per model and mode the median and the spread (slowest/fastest).
# With TRIXIE_ROOT (the Debian 13 root of scripts/test_in_trixie.sh) and root, PyTorch 2.6's FSDP on the
# CPU over gloo runs BERT-mini in each round too (bench/peers/run_torch_fsdp.sh: bench/bert_twin.py --fsdp,
# the same model, data, batch and seed), and its DDP (torch-ddp) beside it as the bar to divide it by.
#
#   bench/fsdp_speed.sh [build_dir]     ROUNDS=3 BERT_STEPS=40 RESNET_STEPS=10 MODELS="bert-mini resnet18"
#
# samples/s counts the timed steps only (after a barrier, to the barrier after the last step), in both
# programs. The load average is printed with every run: record it beside the figures.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
COHORT=$BUILD/tools/cohort
BERT=$BUILD/examples/bert/bert
RESNET=$BUILD/examples/resnet/resnet
ROUNDS=${ROUNDS:-3}
BERT_STEPS=${BERT_STEPS:-40}
RESNET_STEPS=${RESNET_STEPS:-10}
read -r -a models <<<"${MODELS:-bert-mini resnet18}"
for f in "$COHORT" "$BERT" "$RESNET"; do
  [[ -x $f ]] || { echo "fsdp_speed: $f is not built (ninja -C $BUILD tools/cohort examples/bert/bert examples/resnet/resnet)" >&2; exit 1; }
done
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo
torch_fsdp=0
[[ -n ${TRIXIE_ROOT:-} && $(id -u) -eq 0 ]] && torch_fsdp=1
# samples/s from the line's sample count and seconds, not its rounded figure (BERT-base runs below 1/s).
rate() { grep -o "samples/s: [0-9.]* ([0-9]* samples on [0-9]* ranks in [0-9.]* s" | awk '$9 > 0 {printf "%.3f\n", substr($3, 2) / $9}'; }
load() { cut -d' ' -f1 /proc/loadavg; }

# The program's command line for MODEL (without the mode's flag).
command_for() {
  case $1 in
    bert-mini) echo "$BERT --size mini --max-steps $BERT_STEPS --threads 1 --optimizer adamw --test-samples 64" ;;
    bert-base) echo "$BERT --size base --max-steps 4 --batch 4 --threads 1 --optimizer adamw --test-samples 16" ;;
    resnet18) echo "$RESNET --width 64 --batch 32 --max-steps $RESNET_STEPS --train-samples $((RESNET_STEPS * 64)) --test-samples 100 --threads 1 --optimizer adamw" ;;
    *) echo "fsdp_speed: unknown model $1 (bert-mini, bert-base, resnet18)" >&2; exit 1 ;;
  esac
}

echo "fsdp_speed: $(git rev-parse --short HEAD 2>/dev/null), $ROUNDS rounds, models ${models[*]}, $(getconf _NPROCESSORS_ONLN) CPUs, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
for m in "${models[@]}"; do c=$(command_for "$m"); echo "# $m: ${c//$PWD\//} [--zero 2 | --fsdp], 2 ranks"; done
((torch_fsdp)) && echo "# bert-mini torch-fsdp: bench/peers/run_torch_fsdp.sh 2 --size mini --max-steps $BERT_STEPS --optimizer adamw --test-samples 64 --fsdp"
# torch 2.6's DDP on the same model: the bar PyTorch's FSDP is divided by (torch 2.6's kernels are not
# Debian 12 libtorch 1.13's, so cohort's modes and PyTorch's are each compared with their own DDP).
((torch_fsdp)) && echo "# bert-mini torch-ddp: the same without --fsdp"
all=$(mktemp)
trap 'rm -f "$all"' EXIT
for round in $(seq 1 "$ROUNDS"); do
  for m in "${models[@]}"; do
    read -r -a cmd <<<"$(command_for "$m")"
    for mode in ddp zero2 fsdp torch-ddp torch-fsdp; do
      case $mode in
        ddp) flags=() ;;
        zero2) flags=(--zero 2) ;;
        fsdp) flags=(--fsdp) ;;
        torch-ddp) [[ $m == bert-mini && $torch_fsdp == 1 ]] || continue; flags=() ;;
        torch-fsdp) [[ $m == bert-mini && $torch_fsdp == 1 ]] || continue; flags=(--fsdp) ;;
      esac
      before=$(load)
      if [[ $mode == torch-* ]]; then
        r=$(timeout 600 bench/peers/run_torch_fsdp.sh 2 --size mini --max-steps "$BERT_STEPS" --optimizer adamw \
          --test-samples 64 "${flags[@]}" 2>&1 | rate)
      else
        r=$(timeout 600 "$COHORT" run --nproc-per-node 2 "${cmd[@]}" "${flags[@]}" 2>&1 | rate)
      fi
      echo "round $round: $m $mode ${r:-FAILED} samples/s (load $before)"
      echo "$m $mode ${r:-0}" >>"$all"
    done
  done
done
echo "== median (slowest-fastest) samples/s over $ROUNDS rounds"
for m in "${models[@]}"; do
  for mode in ddp zero2 fsdp torch-ddp torch-fsdp; do
    awk -v m="$m" -v mode="$mode" '$1 == m && $2 == mode {v[++n] = $3}
      END {
        if (!n) exit
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
        med = n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
        printf "%-10s %-10s %8.2f  (%.2f-%.2f)\n", m, mode, med, v[1], v[n]
      }' "$all"
  done
done
