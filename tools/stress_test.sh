#!/usr/bin/env bash
# The stress check (docs/testing.md): `make test` RUNS times in a row (default 5) with a busy
# loop (`yes > /dev/null`) on every core beside it, so that every test runs on a starved
# machine. Prints each run's pytest summary and exits non-zero if any run failed.
#   tools/stress_test.sh [RUNS]
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:-5}"
cores="$(nproc)"
logs="$(mktemp -d)"
busy=()
stop_busy() { [ "${#busy[@]}" -eq 0 ] || kill "${busy[@]}" 2>/dev/null; }
trap stop_busy EXIT
for _ in $(seq "$cores"); do
    yes >/dev/null &
    busy+=("$!")
done
failed=0
for i in $(seq "$runs"); do
    echo "==> run $i of $runs, $cores busy loops beside it (log: $logs/run-$i.log)"
    if make test >"$logs/run-$i.log" 2>&1; then result=passed; else result=FAILED; failed=$((failed + 1)); fi
    # pytest's summary line (make prints its own lines after it when run from make).
    echo "    $result: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$logs/run-$i.log" | tail -n 1)"
    grep -E '^(FAILED|ERROR) ' "$logs/run-$i.log" | sed 's/^/    /'
done
echo "==> $((runs - failed)) of $runs runs passed"
[ "$failed" -eq 0 ]
