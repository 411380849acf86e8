#!/usr/bin/env bash
# Issue 50's memory proof: BERT-base (109 M parameters) with AdamW under DDP, ZeRO stage 2 and FSDP at
# 2 and 4 ranks, a few steps each; per rank the peak Pss and Rss against what the ZeRO formulas predict.
#
#   bench/fsdp_memory.sh [build_dir]          RANKS="2 4" STEPS=3 BATCH=2 SIZE=base ARGS="..." (extra bert flags)
#                                             MODES="ddp zero2 fsdp" (A, the activations, comes from ddp's run)
#                                             ROUNDS=1 (every mode and world size once per round, interleaved)
#   mode fsdp-glibc: FSDP with glibc's own rising mmap threshold (bert --fsdp-mmap-threshold 0), the
#   allocator FSDP had before it fixed the threshold at 1 MiB (FSDPOptions::mmap_threshold_bytes)
#   BEFORE=other_build_dir: every mode runs with that build's bert and cohort first, then with this
#   one's, in each round (a change against the code before it, side by side)
#
# Per rank it prints the peak Rss and Pss sampled from /proc/<pid>/smaps_rollup every 0.1 s (Pss splits a
# page shared by k processes k ways: the fair figure for the DDP buckets the peer maps), the exact peak
# Rss (getrusage, the program's own last line), and the prediction
#     B + M + A
#   B  the rank's Pss before the model is built (libtorch, the corpus, the communicator): bert's
#      --trace-memory line "before the model"
#   M  the model's bytes for that mode, fp32 parameters and AdamW (two fp32 moments), Ψ parameters, N ranks:
#        DDP      16 Ψ                          parameters 4, gradients 4 (bucket views), moments 8
#        stage 2  4 Ψ + 12 Ψ/N + 2 buckets      whole parameters; gradient, moments on the shard; 2 x 25 MiB
#        FSDP     16 Ψ/N + G                    (2+2+K) Ψ/N of ZeRO-3 at cohort's precisions: the shard
#                                               (the fp32 master weights, 4), its gradient (4), AdamW's
#                                               moments (K = 8); no persistent low-precision copy. G is
#                                               what is unsharded at the peak of backward:
#                 G = 4 R + 4 R + 2 x 4 U + 4 U + 3 x 4 U
#                     the root unit gathered (R elements: embeddings tied to the decoder, the head) for the
#                     whole step; its gradient, whole from the decoder's backward (the first) to the
#                     embedding's (the last); the layer computing and the one prefetched (U elements
#                     each, 12 H^2 + 13 H); that layer's gradients as autograd makes them; its flattened
#                     gradient and the two reduce-scatters still in flight (kMaxReducesInFlight)
#   A  the activations: malloc's bytes in use after forward minus after zero_grad, step 1 of DDP, or of
#      FSDP less its root unit (4 R, gathered through forward) when MODES has no ddp (ACTIVATIONS_MB=...
#      sets it)
# and the ratio of the peak Pss to B + M + A. For FSDP, G + A is the start of backward; the end of
# backward can hold more (docs/training.md, "Fully sharded data parallel"): the embedding's backward,
# the last, with the root gathered (4 R), its other gradients (4 R - 4 V), the tied word embedding's
# three gradients (3 x 4 V, V = vocabulary x H: the decoder's, held since the start of backward, the
# embedding's, and their sum, which libtorch makes out of place because the decoder's is a transposed
# view) and the last two layers' reduce-scatters in flight (2 x (4 U + 4 U/N)), activations gone:
#                 E = 8 R + 8 V + 8 U + 8 U/N
# so FSDP's M + A is 16 Psi/N + max(G + A, E). The modes run interleaved for each world size, fresh
# processes each. Record the load (printed first) beside the figures.
# What is not in the formula, per rank, from the sample of the peak Pss (smaps_rollup's Pss_Anon,
# Pss_File, Pss_Shmem) against the same split of B: file pages (libtorch's code and data that its
# kernels touched after B was taken), and anonymous plus shared memory (the heap, the communicator's
# segments, DDP's and stage 2's buckets) above B + M + A; and, from the --trace-memory lines, the most
# anonymous memory malloc held free at a phase boundary (the heap's resident holes: anonymous minus
# malloc's bytes in use).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
builds=("$BUILD")
[[ -n ${BEFORE:-} ]] && builds=("$(realpath "$BEFORE")" "$BUILD")
source bench/rounds_loop.sh
RANKS=${RANKS:-2 4}
read -r -a extra <<<"${ARGS:-}"
args=(--size "${SIZE:-base}" --max-steps "${STEPS:-3}" --batch "${BATCH:-2}" --threads 1 --optimizer adamw
  --test-samples 16 --trace-memory "${STEPS:-3}" "${extra[@]}")
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
for b in "${builds[@]}"; do
  for f in "$b/examples/bert/bert" "$b/tools/cohort"; do
    [[ -x $f ]] || { echo "fsdp_memory: $f is not built (ninja -C $b tools/cohort examples/bert/bert)" >&2; exit 1; }
  done
done
out=$(mktemp)
trap 'rm -f "$out"' EXIT

echo "fsdp_memory: $(git rev-parse --short HEAD 2>/dev/null), $(getconf _NPROCESSORS_ONLN) CPUs, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
# The two builds as given (a full path would name this machine's folders in a results file).
[[ -n ${BEFORE:-} ]] && bench_ab_header "$BEFORE" "${builds[0]}" "${1:-build}" "$BUILD"
echo "# bert ${args[*]}"

# The bert processes among PID's descendants: this run's workers only (another job's bert on the
# machine is not sampled).
source bench/descendants.sh
workers() { descendants_matching "$1" "^$BERT "; }

# Runs "$@" in the background, samples every worker's smaps_rollup every 0.1 s, and prints
# "peak <pid> <peak Rss kB> <peak Pss kB> <Pss_Anon kB> <Pss_File kB> <Pss_Shmem kB>" lines into $out
# after the run's own output (the last three from the sample of the peak Pss).
sample() {
  local job pid rss pss anon file shmem
  "$@" >"$out" 2>&1 &
  job=$!
  declare -A peak_rss=() peak_pss=() split=()
  while kill -0 "$job" 2>/dev/null; do
    for pid in $(workers "$job"); do
      read -r rss pss anon file shmem < <(awk '/^Rss:/ {r = $2} /^Pss:/ {p = $2} /^Pss_Anon:/ {a = $2}
          /^Pss_File:/ {f = $2} /^Pss_Shmem:/ {s = $2} END {print r + 0, p + 0, a + 0, f + 0, s + 0}' \
        "/proc/$pid/smaps_rollup" 2>/dev/null) || continue
      ((rss > ${peak_rss[$pid]:-0})) && peak_rss[$pid]=$rss
      ((pss > ${peak_pss[$pid]:-0})) && peak_pss[$pid]=$pss split[$pid]="$anon $file $shmem"
    done
    sleep 0.1
  done
  wait "$job" || { echo "fsdp_memory: the run failed:"; tail -n 5 "$out"; return 1; }
  for pid in "${!peak_rss[@]}"; do echo "peak $pid ${peak_rss[$pid]} ${peak_pss[$pid]} ${split[$pid]}"; done >>"$out"
}

# The activations A (MB), from the run's trace: in use after forward minus after zero_grad, step 1, rank 0;
# $1 = fsdp: less the root unit, gathered from the start of forward to its backward.
activations() {
  awk -v mode="$1" '
       /^\[.*\] bert: / || /^bert: / {
         for (i = 1; i <= NF; i++) {
           if ($i == "layers,") L = $(i - 1); if ($i == "hidden") H = $(i + 1) + 0; if ($i == "parameters;") P = $(i - 1)
         }
       }
       /rank 0 step 1 after zero_grad:/ {match($0, /in use by malloc [0-9]+/); z = substr($0, RSTART + 17, RLENGTH - 17)}
       /rank 0 step 1 after forward:/ {match($0, /in use by malloc [0-9]+/); f = substr($0, RSTART + 17, RLENGTH - 17)}
       END {root = mode == "fsdp" ? 4 * (P - L * (12 * H * H + 13 * H)) / (1024 * 1024) : 0; printf "%.0f\n", f - z - root}' "$out"
}

# Prints each rank's figures and the prediction. $1: mode, $2: N, $3: A (MB).
report() {
  local mode=$1 n=$2 act=$3
  awk -v mode="$mode" -v n="$n" -v act="$act" '
    /^\[.*\] bert: / || /^bert: / {
      for (i = 1; i <= NF; i++) {
        if ($i == "layers,") L = $(i - 1); if ($i == "hidden") H = $(i + 1) + 0; if ($i == "parameters;") P = $(i - 1)
        if ($i == "vocabulary") V = $(i + 1) + 0
      }
    }
    /before the model:/ { match($0, /rank [0-9]+/); r = substr($0, RSTART + 5, RLENGTH - 5) + 0
                          match($0, /Pss [0-9]+/); B[r] = substr($0, RSTART + 4, RLENGTH - 4) + 0
                          match($0, /Pss of files [0-9]+/); Bfile[r] = substr($0, RSTART + 13, RLENGTH - 13) + 0
                          match($0, /of shared memory [0-9]+/); Bshm[r] = substr($0, RSTART + 17, RLENGTH - 17) + 0 }
    # The resident holes of the heap at a phase boundary: anonymous memory minus what malloc has in use.
    / step [0-9]+ .*anonymous [0-9]+ MB, in use by malloc/ {
                          match($0, /rank [0-9]+/); r = substr($0, RSTART + 5, RLENGTH - 5) + 0
                          match($0, /anonymous [0-9]+/); an = substr($0, RSTART + 10, RLENGTH - 10) + 0
                          match($0, /in use by malloc [0-9]+/); iu = substr($0, RSTART + 17, RLENGTH - 17) + 0
                          if (an - iu > holes[r]) holes[r] = an - iu }
    /: optimizer state .* peak RSS/ { match($0, /rank [0-9]+/); r = substr($0, RSTART + 5, RLENGTH - 5) + 0
                          match($0, /peak RSS [0-9.]+/); hwm[r] = substr($0, RSTART + 9, RLENGTH - 9) + 0 }
    /^peak / { npk++; pid[npk] = $2; prss[$2] = $3 / 1024; ppss[$2] = $4 / 1024
               panon[$2] = $5 / 1024; pfile[$2] = $6 / 1024; pshm[$2] = $7 / 1024 }
    END {
      MB = 1024 * 1024; U = 12 * H * H + 13 * H; R = P - L * U
      if (mode == "ddp") { M = 16 * P; what = "16 Psi" }
      else if (mode == "zero2") { M = 4 * P + 12 * P / n + 2 * 25 * MB; what = "4 Psi + 12 Psi/N + 2 buckets" }
      else {
        # FSDP: the start of backward (G + A) or its end (E, activations gone), whichever holds more.
        G = 8 * R + 24 * U; E = 8 * R + 8 * V * H + 8 * U + 8 * U / n
        if (E > G + act * MB) { M = 16 * P / n + E - act * MB; what = "16 Psi/N + E - A" } else { M = 16 * P / n + G; what = "16 Psi/N + G" }
        printf "  FSDP: G + A = %.0f MB (start of backward), E = %.0f MB (end of backward; the tied word embedding V = %d elements)\n", G / MB + act, E / MB, V * H
      }
      printf "  Psi %d, layer unit U %d, root unit R %d; M = %s = %.0f MB (G = %.0f MB), A = %.0f MB\n", P, U, R, what, M / MB, (8 * R + 24 * U) / MB, act
      # pids in increasing order are ranks 0..N-1 (the launcher forks them in rank order)
      for (i = 1; i <= npk; i++) for (j = i + 1; j <= npk; j++) if (pid[j] + 0 < pid[i] + 0) { t = pid[i]; pid[i] = pid[j]; pid[j] = t }
      for (r = 0; r < npk; r++) {
        p = pid[r + 1]; pred = B[r] + M / MB + act
        printf "  rank %d: peak Pss %.0f MB, peak Rss %.0f MB (sampled), %.0f MB (getrusage); B %.0f + M %.0f + A %.0f = %.0f MB; peak Pss / prediction %.3f\n",
               r, ppss[p], prss[p], hwm[r], B[r], M / MB, act, pred, ppss[p] / pred
        # Not in the formula: the peak minus the prediction, split as smaps_rollup splits Pss. M lives
        # in anonymous memory and, for the buckets of DDP and stage 2, in shared memory: the two together.
        Bmem = B[r] - Bfile[r]
        printf "    not in the formula %+.0f MB: files %+.0f (Pss %.0f at the peak, %.0f in B); anonymous and shared memory %+.0f (%.0f + %.0f at the peak against B %.0f + M + A); heap holes at a phase boundary, at most %.0f MB\n",
               ppss[p] - pred, pfile[p] - Bfile[r], pfile[p], Bfile[r], panon[p] + pshm[p] - (Bmem + M / MB + act),
               panon[p], pshm[p], Bmem, holes[r]
      }
    }' "$out"
  grep -h "samples/s:" "$out" | sed 's/^/  /'
}

# Every world size, mode and build of round $1, fresh processes each.
cases() {
  local round=$1 n mode b act
  for n in $RANKS; do
    act=
    for mode in ${MODES:-ddp zero2 fsdp}; do
      case $mode in
        ddp) flags=() ;;
        zero2) flags=(--zero 2) ;;
        fsdp) flags=(--fsdp) ;;
        fsdp-glibc) flags=(--fsdp --fsdp-mmap-threshold 0) ;;
        *) echo "fsdp_memory: unknown mode $mode (ddp, zero2, fsdp, fsdp-glibc)" >&2; exit 1 ;;
      esac
      for b in "${builds[@]}"; do
        BERT=$b/examples/bert/bert COHORT=$b/tools/cohort
        which=
        [[ -n ${BEFORE:-} ]] && which=$([[ $b == "${builds[0]}" ]] && echo ", before" || echo ", after")
        echo "== round $round, $n ranks, $mode$which (load $(bench_load))"
        sample "$COHORT" run --nproc-per-node "$n" "$BERT" "${args[@]}" "${flags[@]}" || continue
        [[ $mode == ddp ]] && act=$(activations ddp)
        # No ddp run to take A from: FSDP's own (the first FSDP mode of this world size).
        [[ -z $act && -z ${ACTIVATIONS_MB:-} && $mode == fsdp* ]] && act=$(activations fsdp)
        report "${mode%-glibc}" "$n" "${act:-${ACTIVATIONS_MB:-0}}"
      done
    done
  done
}
interleaved_rounds "${ROUNDS:-1}" cases
