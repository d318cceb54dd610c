#!/usr/bin/env bash
# The GPU check: what only shows at scale, bundled for the trip back. One part per device call.
#
#     bash ../shared/gpu/carry.sh          # here, first: .gpu_data/ (see ../shared/GPU.md)
#     bash gpu_check.sh tests              # there: one device call per part, in this order
#     bash gpu_check.sh objectives
#     bash gpu_check.sh mlm10
#     bash gpu_check.sh dictionary
#     bash gpu_check.sh kernels
#     bash gpu_check.sh --smoke tests objectives kernels mlm10 dictionary   # here, on the CPU
#
# Parts (default: tests):
#   tests       tests/test_cuda.py: every objective compiled in bf16 (six train.py processes side
#               by side), no host sync in a compiled step, PLL against the CPU, resume
#   objectives  bench.py's step rows at small: mlm, boot, kd+mlm, mlsm+mlm for 200 steps each,
#               tokens/s against mlm, recompilations, mlsm's coder time; and ours against BERT
#   mlm10       train.py mlm at small for 10 epochs of babylm_10m (7,246 steps of 128 x 128),
#               then evaluate.py blimp on the filtered BLiMP and its supplement
#   dictionary  train.py mlsm+mlm at small, 300 + 300 steps: the dictionary phase between them
#               at the recipe's size (3000 atoms from 100,000 states) and phase 2's speed
#   kernels     bench.py's ltg, attn and pll rows at small and base, with --profile: ours
#               against LTG-BERT's model code, the attention variants, flex scoring
# --smoke runs every part on the CPU at tiny sizes and a few steps (tests/test_gpu_check.py
# does, in the suite), so that a GPU session starts on a script that has run end to end.
#
# The corpus is the one prepared copy of babylm_10m under $NANOMLM_DATA (default
# .gpu_data/prep), found by data/prepare.py as train.py finds it; $VOCAB_SIZE (default 16384)
# is its vocabulary, $GPU_EVAL (default .gpu_data/eval) the BLiMP folders, $PYTHON (default
# python) the interpreter. Each part has its own time limit inside a budget of $BUDGET seconds
# (default 540: a device call is cut at 600); a part that no longer fits is skipped and says so.
# Every result is written as it is measured (logs, bench.json row by row, the runs' log.jsonl),
# and everything lands in $OUT/gpu_check.tgz: the logs, the bench JSON, the runs'
# args/config/log.jsonl, summary.json.
set -uo pipefail
smoke=0
if [ "${1:-}" = "--smoke" ]; then
    smoke=1
    shift
fi
export NANOMLM_DATA=${NANOMLM_DATA:-$PWD/.gpu_data/prep}
export NANOMLM_RAW=${NANOMLM_RAW:-$PWD/.gpu_data/noraw}
export PYTHONUNBUFFERED=1
E=${GPU_EVAL:-$PWD/.gpu_data/eval}
W=$(mktemp -d)/gpu_check
mkdir -p "$W"
budget=${BUDGET:-540}
python=${PYTHON:-python}
parts=${*:-tests}
left() { echo $(( budget - SECONDS - 20 )); }  # 20 s kept for the summary and the tar

data=$("$python" -c "import sys; from data.prepare import prepare; print(prepare('babylm_10m', \
int(sys.argv[1]), quiet=True))" "${VOCAB_SIZE:-16384}" 2> "$W/data.err")
if [ -z "$data" ]; then
    echo "error: no prepared babylm_10m under NANOMLM_DATA=$NANOMLM_DATA" \
         "($(tail -1 "$W/data.err")). Run bash ../shared/gpu/carry.sh in the checkout first" \
         "and carry .gpu_data" >&2
    exit 1
fi
echo "data: $data" | tee "$W/parts.txt"

if (( smoke )); then  # the tests' tiny model (tests/conftest.py TINY), a few steps, the CPU
    device=(--device cpu)
    tiny=(--size tiny --n-layer 1 --d-model 64 --n-head 2 --d-ff 128 --seq-len 32 --batch-size 8)
    objectives=(--quick --sizes tiny --objectives mlm,mlsm+mlm --steps 5)
    kernels=(--quick --sizes tiny)
    mlm10=("${tiny[@]}" --max-steps 10 --log-every 5)
    dictionary=("${tiny[@]}" --max-steps 10 --phase1-steps 5 --log-every 5 --mlsm-k 48
                --dict-vectors 300 --dict-epochs 1)
else
    device=(--device cuda)
    objectives=(--sizes small --steps 200)
    kernels=(--sizes small,base --profile)
    mlm10=(--size small --max-steps 7246)
    dictionary=(--size small --max-steps 600 --phase1-steps 300 --log-every 50)
fi

# part NAME MIN MAX CMD...: run CMD with a limit of MAX seconds (less if the budget is short),
# or skip it when fewer than MIN seconds are left; its output goes to $W/NAME.log
part() {
    local name=$1 min=$2 max=$3 limit
    shift 3
    limit=$(( $(left) < max ? $(left) : max ))
    if (( limit < min )); then
        echo "$name: skipped, ${limit}s left of the budget" | tee -a "$W/parts.txt"
        return
    fi
    local t0=$SECONDS
    timeout "$limit" "$@" > "$W/$name.log" 2>&1
    echo "$name: exit $?, $(( SECONDS - t0 ))s (limit ${limit}s)" | tee -a "$W/parts.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"
  "$python" -c "import torch; print('torch', torch.__version__)"; } > "$W/gpu.txt" 2>&1
git log -1 --format='%H %s' > "$W/commit.txt" 2>&1
for p in $parts; do
    case $p in
        tests) part tests 60 500 "$python" -m pytest -q -rs tests/test_cuda.py ;;
        objectives) part objectives 120 500 "$python" bench.py "${device[@]}" "${objectives[@]}" \
                        --only step,bert --data "$data" --out "$W/bench.json" ;;
        kernels) part kernels 60 500 "$python" bench.py "${device[@]}" "${kernels[@]}" \
                     --only ltg,attn,pll --out "$W/bench_kernels.json" ;;
        mlm10)  # SIGTERM at the limit: train.py saves the step it is at, which BLiMP then reads
            part mlm10 120 $(( $(left) - 60 )) "$python" train.py --objective mlm --data "$data" \
                "${device[@]}" "${mlm10[@]}" --out-dir "$W/mlm10"
            if [ -f "$W/mlm10/ckpt.pt" ]; then
                part blimp 20 90 "$python" evaluate.py blimp --ckpt "$W/mlm10/ckpt.pt" \
                    "${device[@]}" --blimp-dir "$E/blimp_filtered" "$E/supplement_filtered"
            else
                echo "blimp: skipped, mlm10 left no checkpoint" | tee -a "$W/parts.txt"
            fi ;;
        dictionary) part dictionary 120 500 "$python" train.py --objective mlsm+mlm --data "$data" \
                        "${device[@]}" "${dictionary[@]}" --out-dir "$W/dictionary" ;;
        *) echo "error: no part '$p' (tests, objectives, mlm10, dictionary, kernels)" >&2; exit 2 ;;
    esac
done

# the summary: what each part measured, in one JSON
"$python" - "$W" <<'EOF' > "$W/summary.json"
import json, pathlib, re, sys
w = pathlib.Path(sys.argv[1])
read = lambda name: (w / name).read_text() if (w / name).exists() else ""
out = {"gpu": read("gpu.txt").strip(), "commit": read("commit.txt").strip(),
       "parts": read("parts.txt").splitlines()}
tests = read("tests.log").strip().splitlines()
out["tests"] = tests[-1] if tests else None
keep = ("case", "ours", "unit", "reference", "ratio", "recompiles", "coder_ms", "code_share",
        "mfu", "max_abs_diff", "failed")
for name in ("bench", "bench_kernels"):
    if (w / f"{name}.json").exists():
        out[name] = [{k: r.get(k) for k in keep if k in r}
                     for r in json.loads(read(f"{name}.json"))["rows"]]
for run in ("mlm10", "dictionary"):
    if (w / run / "log.jsonl").exists():
        log = [json.loads(line) for line in read(f"{run}/log.jsonl").splitlines()]
        out[f"{run}_last_train"] = next((e for e in reversed(log) if "tok_per_s" in e), None)
        out[f"{run}_last_val"] = next((e for e in reversed(log) if "val_loss" in e), None)
        out[f"{run}_errors"] = [e for e in log if "error" in e]
        out[f"{run}_said"] = re.findall(r"^(?:done|dictionary|step \d+: phase 2)[^\n]*",
                                        read(f"{run}.log"), flags=re.M)
out["blimp"] = re.findall(r"^  \S+: over .*$", read("blimp.log"), flags=re.M)
print(json.dumps(out, indent=1))
EOF
cat "$W/summary.json"
# checkpoints (and a half-written one) do not travel, nor BLiMP's per-sentence results
tar czf "${OUT:-.}/gpu_check.tgz" --exclude='*.pt' --exclude='*.pt.tmp' --exclude='eval' \
    --exclude='code' -C "$(dirname "$W")" gpu_check &&
    echo "wrote ${OUT:-.}/gpu_check.tgz"
