# shellcheck shell=bash
# Sourced by the benchmarks that compare peers in interleaved rounds (bench/rounds.sh,
# bench/coll_side_by_side.sh, bench/coll_small_side_by_side.sh; bench/side_by_side.sh for the load):
# the one round loop they share, so that every one of them interleaves, and reports the load, alike.
#
#   bench_load                        the load averages as /proc/loadavg's first three fields ("3.10 2.85 2.40")
#   bench_summary VALUES...           "min A median B max C" of the values
#   bench_ab_builds "$@"              BEFORE and AFTER: the two builds of a comparison's command line
#   bench_ab_header B_NAME B_DIR A_NAME A_DIR   the three header lines of a two-builds comparison
#   interleaved_rounds ROUNDS CASES [--start-lines]
#                                     runs `CASES r` for r = 1..ROUNDS. CASES is a function that runs
#                                     every peer's measurements of round r one after another, in fresh
#                                     processes, so that the host's load of that moment hits every peer
#                                     alike (the rounds, not a median, show how much it moved). Each round
#                                     ends with a line "# round r done, load L1 L2 L3", and with
#                                     --start-lines begins with "# round r start, load L1 L2 L3".
bench_load() { cut -d' ' -f1-3 /proc/loadavg; }

# bench_ab_builds "$@": the two builds a comparison is given first on its command line, as BEFORE and
# AFTER (their real paths); without them a usage line and exit 2.
bench_ab_builds() {
  [ $# -ge 2 ] || { echo "usage: $0 BEFORE_BUILD AFTER_BUILD [out_file]" >&2; exit 2; }
  BEFORE=$(realpath "$1") || exit 2
  AFTER=$(realpath "$2") || exit 2
}

# bench_ab_header BEFORE_NAME BEFORE_DIR AFTER_NAME AFTER_DIR: the header of a comparison of two builds:
# when, where, the CPUs (getconf: GNU nproc answers OMP_NUM_THREADS once that is exported) and the load,
# then each build as given (a full path would name this machine's folders in a results file) with the
# commit of the checkout above its folder.
bench_ab_header() {
  echo "# $(date -u +%FT%TZ) $(uname -n), $(getconf _NPROCESSORS_ONLN) CPUs, load: $(bench_load)"
  echo "# before: $1 ($(git -C "$2/.." rev-parse --short HEAD 2>/dev/null || echo 'commit unknown'))"
  echo "# after:  $3 ($(git -C "$4/.." rev-parse --short HEAD 2>/dev/null || echo 'commit unknown'))"
}

# bench_summary VALUES...: "min A median B max C" of the values (3 decimals; the median of an even
# count is the mean of the middle two), for the scripts that summarise their rounds per case.
bench_summary() {
  printf '%s\n' "$@" | sort -g | awk '{v[NR] = $1}
    END { m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
          printf "min %.3f median %.3f max %.3f", v[1], m, v[NR] }'
}

interleaved_rounds() {
  local rounds=$1 cases=$2 start_lines=${3:-} r
  for ((r = 1; r <= rounds; r++)); do
    [[ $start_lines == --start-lines ]] && echo "# round $r start, load $(bench_load)"
    "$cases" "$r"
    echo "# round $r done, load $(bench_load)"
  done
}
