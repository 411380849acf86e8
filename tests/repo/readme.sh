#!/usr/bin/env bash
# README.md is a newcomer's first screen, so it is checked like code:
#  - it names nothing outside the repository (no ../ paths, no file that is not in the tree);
#  - every docs/, scripts/, examples/, tests/, bench/, tools/ or src/ path it names exists;
#  - the commands of "A first run" (all but the build, which the suite has done) run and succeed from
#    the repository root with the built tree.
#   tests/repo/readme.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1
build=$2
cd "$src"
fail=0
if grep -nE '(^|[^A-Za-z0-9_.])\.\./' README.md; then
  echo "README.md names paths outside the repository (above)"
  fail=1
fi
if grep -n 'ARCHITECTURE.md' README.md; then
  echo "README.md names ARCHITECTURE.md, which is not in the repository"
  fail=1
fi
while read -r path; do
  [[ -e $path ]] || { echo "README.md names $path, which does not exist"; fail=1; }
done < <(grep -oE '`(docs|scripts|examples|tests|bench|tools|src|include|integrations)/[A-Za-z0-9_./-]+`' README.md |
  tr -d '`' | sed 's/[.,:;]$//' | sort -u)

# The first run, as printed: build/ is the build tree here.
block=$(awk '/^## A first run/ {on = 1} on && /^```bash/ {inside = 1; next} inside && /^```/ {exit} inside' README.md)
[[ -n $block ]] || { echo "README.md has no 'A first run' command block"; exit 1; }
ran=0
while IFS= read -r line; do
  cmd=${line%%#*}
  cmd=${cmd%"${cmd##*[![:space:]]}"}
  [[ -z $cmd || $cmd == scripts/setup.sh* ]] && continue
  cmd=${cmd//build\//$build/}
  echo "+ $cmd"
  if ! out=$(timeout 120 bash -c "$cmd" 2>&1); then
    echo "$out" | tail -20
    echo "README.md's first-run command failed: $line"
    fail=1
  fi
  ran=$((ran + 1))
done <<<"$block"
((ran >= 2)) || { echo "README.md's first run has $ran commands besides the build; expected at least 2"; fail=1; }
((fail == 0)) && echo "README.md: no outside references, every named path exists, $ran first-run commands succeeded"
exit $fail
