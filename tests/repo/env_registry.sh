#!/usr/bin/env bash
# Fails when the sources read (or set for workers) a COHORT_* variable that `cohort env` does not
# list: every variable must be declared in the registry of src/common/env.h, which `cohort env` prints.
#   tests/repo/env_registry.sh SOURCE_DIR COHORT_TOOL
set -euo pipefail
src=$1
tool=$2
cd "$src"
# Every "COHORT_..." string literal in the code that ships (tests and examples set their own; CMake files
# name compile definitions, not variables).
used=$(grep -rhoE --exclude=CMakeLists.txt --exclude='*.cmake' '"COHORT_[A-Z0-9_]+"' src tools integrations include | tr -d '"' | sort -u)
listed=$("$tool" env --names | sort -u)
missing=$(comm -23 <(printf '%s\n' "$used") <(printf '%s\n' "$listed"))
if [[ -n $missing ]]; then
  echo "read in the sources but not listed by 'cohort env' (declare them with env::Setting, src/common/env.h):"
  for name in $missing; do
    echo "  $name: $(grep -rlE "\"$name\"" src tools integrations include | head -3 | tr '\n' ' ')"
  done
  exit 1
fi
echo "all $(printf '%s\n' "$used" | wc -l) COHORT_* names in the sources are listed by 'cohort env'"
