#!/usr/bin/env bash
# Runs every Fuzz target for a bounded time each (default 10s).
set -euo pipefail
cd "$(dirname "$0")/.."
t=${1:-10s}
grep -rl --include='*_test.go' '^func Fuzz' internal | while read -r f; do
  pkg=./$(dirname "$f")
  for fn in $(grep -o '^func Fuzz[A-Za-z0-9_]*' "$f" | sed 's/^func //'); do
    echo "fuzz: $pkg $fn ($t)"
    log=/tmp/fuzz-$fn.log
    if ! go test -run='^$' -fuzz="^${fn}\$" -fuzztime="$t" "$pkg" > "$log" 2>&1; then
      # The fuzz engine itself sometimes ends with "context deadline
      # exceeded" when a worker is slow to stop at -fuzztime; that is not a
      # finding (no failing input is reported or saved). Run it once more;
      # any real failing input fails the smoke run.
      if grep -q 'context deadline exceeded' "$log" && ! grep -q 'Failing input' "$log"; then
        echo "fuzz: $fn: engine timeout at the end of fuzzing, running it again"
        go test -run='^$' -fuzz="^${fn}\$" -fuzztime="$t" "$pkg" > "$log" 2>&1 || { cat "$log"; exit 1; }
      else
        cat "$log"; exit 1
      fi
    fi
  done
done
