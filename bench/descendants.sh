# Sourced by the memory benchmarks (bench_bert.sh MEMORY=1, fsdp_memory.sh):
#   descendants_matching PID REGEX   prints the pids among PID's descendants whose command line (its
#                                    arguments joined by spaces) matches the bash regex REGEX
# so that a sampler reads only its own run's workers, never another job's run of the same binary on
# the machine (`pgrep -f` would).
descendants_matching() {
  local child
  for child in $(pgrep -P "$1"); do
    [[ $(tr '\0' ' ' <"/proc/$child/cmdline" 2>/dev/null) =~ $2 ]] && echo "$child"
    descendants_matching "$child" "$2"
  done
}
