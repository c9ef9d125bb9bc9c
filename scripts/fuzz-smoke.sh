#!/usr/bin/env bash
# Runs every Fuzz target for a bounded time each (default 10s).
set -euo pipefail
cd "$(dirname "$0")/.."
t=${1:-10s}
grep -rl --include='*_test.go' '^func Fuzz' internal | while read -r f; do
  pkg=./$(dirname "$f")
  for fn in $(grep -o '^func Fuzz[A-Za-z0-9_]*' "$f" | sed 's/^func //'); do
    echo "fuzz: $pkg $fn ($t)"
    go test -run='^$' -fuzz="^${fn}\$" -fuzztime="$t" "$pkg" > /tmp/fuzz-$fn.log 2>&1 || { cat /tmp/fuzz-$fn.log; exit 1; }
  done
done
