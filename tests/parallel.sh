#!/usr/bin/env bash
# The test suite in N processes at once, each a share of the test files (conftest.py's
# FILE_SECONDS balance them), as CI runs it:
#
#     NANOMLM_RAW=../shared/data bash tests/parallel.sh [PYTEST ARGS]
#
# N: $SHARDS, default the number of CPUs; $PYTHON, default python. Each shard's output is printed
# whole once all have ended; the run fails if one shard fails. A test file named in the
# arguments runs in its own shard only (the others may find no test: pytest's status 5).
set -uo pipefail
cd "$(dirname "$0")/.."
n=${SHARDS:-$(nproc)}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
where=(tests)  # the whole suite, unless the arguments name test files or folders
for arg in "$@"; do [ -e "${arg%%::*}" ] && where=(); done
pids=()
for ((i = 0; i < n; i++)); do
    OMP_NUM_THREADS=1 "${PYTHON:-python}" -m pytest -q "${where[@]}" --shard $i/$n "$@" \
        > "$logs/$i" 2>&1 &
    pids+=($!)
done
rc=0 ran=0
for ((i = 0; i < n; i++)); do
    wait "${pids[$i]}"
    case $? in 0) ran=1 ;; 5) ;; *) rc=1 ;; esac  # 5: no test in this shard
    echo "== shard $((i + 1)) of $n"
    cat "$logs/$i"
done
(( rc || ran )) && exit $rc
exit 5  # no shard ran a test, as pytest says it
