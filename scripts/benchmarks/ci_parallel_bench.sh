#!/usr/bin/env bash
# Time the same test files serially and with pytest-xdist (`-n 2 --dist loadfile --basetemp`, as .ci/run runs them),
# interleaved in rounds (a shared machine is noisy: compare the min of the rounds, and the CPU seconds).
# Usage: scripts/benchmarks/ci_parallel_bench.sh ROUNDS tests/test_a.py tests/test_b.py ...
set -uo pipefail
cd "$(dirname "$0")/../.."
rounds="${1:?usage: ci_parallel_bench.sh ROUNDS FILES...}"; shift
logs="$(mktemp -d)"
for round in $(seq "$rounds"); do
  for mode in serial xdist; do
    export EMAPG_HOME="$logs/home-$mode"; rm -rf "$EMAPG_HOME"
    if [ "$mode" = serial ]; then opts=(-p no:xdist); else opts=(-n 2 --dist loadfile --basetemp "$logs/bt"); fi
    start=$(date +%s.%N); load=$(cut -d' ' -f1 /proc/loadavg)
    /usr/bin/time -f "%U %S" -o "$logs/cpu" python -m pytest -q "${opts[@]}" "$@" > "$logs/$mode-$round.log" 2>&1
    rc=$?; end=$(date +%s.%N)
    read -r user sys < "$logs/cpu"
    printf 'round %s %-6s exit %s  wall %6.1f s  cpu %6.1f s  load at start %s  %s\n' "$round" "$mode" "$rc" \
      "$(echo "$end - $start" | bc)" "$(echo "$user + $sys" | bc)" "$load" "$(tail -1 "$logs/$mode-$round.log")"
  done
done
echo "logs: $logs"
