#!/usr/bin/env bash
# Fails when a file of the project names a path that exists on one machine only: the workplace's own
# top-level work and farm folders, a home directory (see `pattern`). Files of the project are named relative to
# the repository root (the peers' scripts are in bench/peers); data comes from Debian packages at their packaged paths. Raw benchmark
# output (*.txt under bench/results and docs) is a record of where a run happened and is not checked.
#   tests/repo/no_machine_paths.sh [source dir]
set -euo pipefail
src=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
cd "$src"
pattern='(^|[^.A-Za-z0-9_~-])/(work|farm|home|Users|root)/[A-Za-z0-9_.-]'
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  files=$(git ls-files --cached --others --exclude-standard | grep -vE '\.txt$' || true)
else
  files=$(find . -type f -not -path './build*' -not -path './.git/*' -not -name '*.txt' | sed 's|^\./||')
fi
hits=$(printf '%s\n' "$files" | tr '\n' '\0' | xargs -0 grep -nIE "$pattern" -- 2>/dev/null | grep -v '^tests/repo/no_machine_paths.sh:' || true)
if [[ -n $hits ]]; then
  echo "machine-specific paths in the tree (use a path relative to the repository root, or a packaged path):"
  echo "$hits"
  exit 1
fi
echo "no machine-specific paths in $(printf '%s\n' "$files" | wc -l) files"
