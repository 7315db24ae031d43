#!/usr/bin/env bash
# `make test-loaded`: the same suite as `make test`, with two CPU-bound processes running beside it, the
# way a user's busy 2-core machine looks (stalls appeared at load 8-16 from other programs).
#
# The burners are this script's own children, ended by PID on every exit path (suite passed, failed, or
# the script interrupted), never by name. Arguments replace `tests` as pytest's (e.g. one test file). The
# suite runs as `make test` runs it: TEST_WORKERS pytest workers (3; 0 for one process).
set -u
PY="${PY:-.venv/bin/python}"
BURNERS="${BURNERS:-2}"

pids=()
stop_burners() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    pids=()
}
trap stop_burners EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$BURNERS"); do
    # A pure CPU loop in a shell: no I/O, no memory, one core each.
    sh -c 'while :; do :; done' &
    pids+=("$!")
done
echo "test-loaded: $BURNERS CPU burners running (pids ${pids[*]}); load $(cut -d' ' -f1-3 /proc/loadavg)"

start=$(date +%s)
"$PY" -m pytest -q -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder -m "not real" "${@:-tests}"
rc=$?
took=$(( $(date +%s) - start ))
echo "test-loaded: pytest exited $rc after ${took}s beside $BURNERS burners; load $(cut -d' ' -f1-3 /proc/loadavg)"
stop_burners
exit "$rc"
