#!/usr/bin/env bash
# Fails when a file of the project refers to a folder beside the checkout: `../shared`, or the same folder
# by its absolute path on the machine where the project began (`shared` in the top-level work folder). A
# clone has neither: what the project runs or cites must be in the repository (the peers' programs are in
# bench/peers). Every file is checked, raw benchmark output included; files git ignores are skipped.
#   tests/repo/no_outside_refs.sh [source dir]
set -euo pipefail
src=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
cd "$src"
# ([w] keeps this line itself out of no_machine_paths.sh's reach; it matches the same text)
pattern='\.\./shared([^A-Za-z0-9_.-]|$)|/[w]ork/shared'
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  files=$(git ls-files --cached --others --exclude-standard)
else
  files=$(find . -type f -not -path './build*' -not -path './.git/*' | sed 's|^\./||')
fi
hits=$(printf '%s\n' "$files" | tr '\n' '\0' | xargs -0 grep -nIE "$pattern" -- 2>/dev/null |
  grep -v '^tests/repo/no_outside_refs.sh:' || true)
if [[ -n $hits ]]; then
  echo "files that refer outside the repository (a clone has no ../shared; put what is needed in the tree):"
  echo "$hits"
  exit 1
fi
echo "no references outside the repository in $(printf '%s\n' "$files" | wc -l) files"
