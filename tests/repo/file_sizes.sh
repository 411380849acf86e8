#!/usr/bin/env bash
# No source file is too big to hold in mind (issue 49): a file of code over 800 lines is split by idea,
# or its opening comment says why its cohesion makes it one file, with those words ("one file") in its
# first 15 lines, as src/transport/tcp/tcp_transport.cc does. Prose and data (docs, bench/results) are
# not code and are not checked.
#   tests/repo/file_sizes.sh [source dir]
set -euo pipefail
src=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
cd "$src"
limit=800
patterns=('*.cc' '*.h' '*.c' '*.cpp' '*.py' '*.sh' '*.cmake' 'CMakeLists.txt' '*/CMakeLists.txt')
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  files=$(git ls-files --cached --others --exclude-standard -- "${patterns[@]}")
else
  names=()
  for p in "${patterns[@]}"; do names+=(-o -name "${p##*/}"); done
  files=$(find . -type f -not -path './build*' -not -path './.git/*' \( -false "${names[@]}" \) | sed 's|^\./||')
fi
checked=$(printf '%s\n' "$files" | grep -c . || true)
big=0
fail=0
# One wc over every file (its last line, "total", is skipped: no file is named so).
while read -r lines f; do
  [[ $f == total && ! -f total ]] && continue
  ((lines > limit)) || continue
  big=$((big + 1))
  head -15 "$f" | grep -qi 'one file' && continue
  echo "$f:1: $lines lines (over $limit), and its opening comment does not say why it is one file: split it by" \
       "idea, or say in its first 15 lines why its cohesion makes it \"one file\""
  fail=1
done < <(printf '%s\n' "$files" | tr '\n' '\0' | xargs -0 wc -l 2>/dev/null)
((fail == 0)) || exit 1
echo "$checked files of code: $big over $limit lines, each saying in its opening comment why it is one file"
