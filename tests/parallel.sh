#!/usr/bin/env bash
# The test suite in N processes at once, each a share of the test files (conftest.py's
# FILE_SECONDS balance them), as CI runs it:
#
#     NANOMLM_RAW=../shared/data bash tests/parallel.sh [PYTEST ARGS]
#
# N: $SHARDS, default the number of CPUs; $PYTHON, default python. Each shard's output is printed
# whole once all have ended; the run fails if one shard fails.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${SHARDS:-$(nproc)}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
pids=()
for ((i = 0; i < n; i++)); do
    OMP_NUM_THREADS=1 "${PYTHON:-python}" -m pytest -q tests --shard $i/$n "$@" > "$logs/$i" 2>&1 &
    pids+=($!)
done
rc=0
for ((i = 0; i < n; i++)); do
    wait "${pids[$i]}" || rc=1
    echo "== shard $((i + 1)) of $n"
    cat "$logs/$i"
done
exit $rc
