#!/usr/bin/env bash
# Conventions enforced by grep (in the spirit of grpc-go's vet.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
fail=0
files=$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')
nontest=$(printf '%s\n' $files | grep -v '_test.go$' | grep -v '^test/' || true)
if [ -n "$nontest" ] && grep -n 'time\.After(' $nontest; then
  echo "grep-bans: time.After( outside tests leaks timers; use time.NewTimer"; fail=1
fi
if grep -n 'interface{}' $files | grep -v '^.*//.*interface{}'; then
  echo "grep-bans: use any instead of interface{}"; fail=1
fi
exit $fail
