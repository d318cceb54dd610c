#!/usr/bin/env bash
# The test suite in N processes at once, each a share of the test files (balanced by the seconds
# each took in the last recorded run, tests/file_seconds.json), as CI runs it:
#
#     NANOMLM_RAW=../shared/data bash tests/parallel.sh [PYTEST ARGS]
#
# N: $SHARDS, default the number of CPUs; $PYTHON, default python. A line a minute says they are
# running; each shard's output is printed whole once all have ended, then the counts summed; the
# run fails if one shard fails. A test file named in the arguments runs in its own shard only
# (the others may find no test: pytest's status 5). RECORD=FILE also writes the run's record
# there as JSON (its date, commit, machine, each shard's seconds, the counts), and each test
# file's seconds into tests/file_seconds.json (what balances the shards next time): docs/status.md
# quotes docs/suite.json, written so on a fresh clone.
set -uo pipefail
cd "$(dirname "$0")/.."
n=${SHARDS:-$(nproc)}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
where=(tests)  # the whole suite, unless the arguments name test files or folders
for arg in "$@"; do [ -e "${arg%%::*}" ] && where=(); done
pids=()
for ((i = 0; i < n; i++)); do
    ( began=$SECONDS
      OMP_NUM_THREADS=1 "${PYTHON:-python}" -m pytest -q "${where[@]}" --shard $i/$n \
          ${RECORD:+--record-times "$logs/$i.times"} "$@" > "$logs/$i" 2>&1
      status=$?
      echo $(( SECONDS - began )) > "$logs/$i.seconds"
      exit $status ) &
    pids+=($!)
done
# a line a minute while they run: the shards print nothing until they end
start=$SECONDS
# (its sleep is killed with it: a sleep left behind would hold a caller's pipe open a minute)
( trap 'kill $nap 2>/dev/null; exit 0' TERM
  while true; do
      sleep 60 & nap=$!
      wait $nap
      echo "tests: $n shards running, $(( (SECONDS - start) / 60 ))m so far"
  done ) &
beat=$!
rc=0 ran=0
for ((i = 0; i < n; i++)); do
    wait "${pids[$i]}"
    case $? in 0) ran=1 ;; 5) ;; *) rc=1 ;; esac  # 5: no test in this shard
done
kill $beat 2>/dev/null
for ((i = 0; i < n; i++)); do
    echo "== shard $((i + 1)) of $n"
    cat "$logs/$i"
done
# the shards' counts summed: the suite's total, as one pytest would say it
total=$(cat "$logs"/* | grep -E '^=*\s*[0-9]+ (passed|failed|skipped|errors?)' |
        grep -oE '[0-9]+ (passed|failed|skipped|errors?)' |
        awk '{n[$2] += $1} END {for (k in n) printf "%s%d %s", (s++ ? ", " : ""), n[k], k}')
echo "== all shards: ${total:-no tests} in $(( SECONDS - start ))s"
if [ -n "${RECORD:-}" ]; then
    shards=$(cat "$logs"/*.seconds | paste -sd, -)
    machine=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')
    torch=$("${PYTHON:-python}" -c "import torch; print(torch.__version__)")
    printf '{"date": "%s", "commit": "%s", "machine": "%s, %s cores", "torch": "%s", '\
'"seconds": %d, "shard_seconds": [%s], "counts": "%s", "failed": %d}\n' \
        "$(date -u +%Y-%m-%d)" "$(git rev-parse --short HEAD)" "$machine" "$(nproc)" "$torch" \
        $(( SECONDS - start )) "$shards" "$total" $rc > "$RECORD"
    # each file's seconds, which balance the shards of later runs (conftest.FILE_SECONDS)
    "${PYTHON:-python}" - "$logs" "$RECORD" tests/file_seconds.json <<'EOF'
import json, pathlib, sys
logs, record, out = sys.argv[1:]
seconds = {}
for f in sorted(pathlib.Path(logs).glob("*.times")):
    seconds.update({k: round(v, 1) for k, v in json.loads(f.read_text()).items()})
run = json.loads(pathlib.Path(record).read_text())
table = {k: run[k] for k in ("date", "commit", "machine", "torch")}
table["seconds"] = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
pathlib.Path(out).write_text(json.dumps(table, indent=1) + "\n")
EOF
fi
(( rc || ran )) && exit $rc
exit 5  # no shard ran a test, as pytest says it
