#!/usr/bin/env bash
# The GPU check: what only shows at scale, bundled for the trip back.
#
#     bash ../shared/gpu/carry.sh                 # here, first: .gpu_data/ (see ../shared/GPU.md)
#     bash gpu_check.sh                           # there, one device call: tests, objectives
#     bash gpu_check.sh mlm10                     # there, a second call: the 10-epoch run
#     bash gpu_check.sh kernels                   # there: what issue 19 needs measured
#
# At today's speed (MLM at small: ~410k tokens/s, 6.5 min for 10 epochs, on an H100 with the
# code of 2026-11-22) the three parts need two 10-minute calls; a faster step brings them in one.
# Parts:
#   tests       tests/test_cuda.py: every objective compiled in bf16, PLL against the CPU, resume
#   objectives  bench.py's step rows at small: mlm, boot, kd+mlm, mlsm+mlm for 200 steps each,
#               tokens/s against mlm, recompilations, mlsm's code_share; and ours against BERT
#   kernels     bench.py's ltg, attn and pll rows at small and base, with --profile: ours
#               against LTG-BERT's model code, the attention core's gather path against SDPA's
#               efficient kernel, flex_attention (model.flex_relative) and the relative shift,
#               and BLiMP-style scoring with and without model.use_flex (issue 19)
#   mlm10       train.py mlm at small for 10 epochs of babylm_10m (7,246 steps of 128 x 128),
#               then evaluate.py blimp on the filtered BLiMP and its supplement
# Each part has its own time limit inside a budget of $BUDGET seconds (default 570: a device
# call is cut at 600); a part that no longer fits is skipped and says so. Everything lands in
# $OUT/gpu_check.tgz: the logs, bench.json, the run's args/config/log.jsonl, summary.json.
set -uo pipefail
export NANOMLM_DATA=$PWD/.gpu_data/prep NANOMLM_RAW=$PWD/.gpu_data/noraw PYTHONUNBUFFERED=1
E=$PWD/.gpu_data/eval
if [ ! -f "$NANOMLM_DATA/babylm_10m/meta.json" ]; then
    echo "error: no prepared corpus at $NANOMLM_DATA/babylm_10m; run bash ../shared/gpu/carry.sh" \
         "in the checkout first and carry .gpu_data" >&2
    exit 1
fi
W=$(mktemp -d)/gpu_check
mkdir -p "$W"
budget=${BUDGET:-570}
parts=${*:-tests objectives}
left() { echo $(( budget - SECONDS - 20 )); }  # 20 s kept for the summary and the tar

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

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$W/gpu.txt" 2>&1
python -c "import torch; print('torch', torch.__version__)" >> "$W/gpu.txt" 2>&1
git log -1 --format='%H %s' > "$W/commit.txt" 2>&1
for p in $parts; do
    case $p in
        tests) part tests 60 300 python -m pytest -q -rs tests/test_cuda.py ;;
        objectives) part objectives 120 260 python bench.py --device cuda --sizes small \
                        --only step,bert --steps 200 --out "$W/bench.json" ;;
        kernels) part kernels 60 400 python bench.py --device cuda --sizes small,base \
                     --only ltg,attn,pll --profile --out "$W/bench_kernels.json" ;;
        mlm10)
            part mlm10 300 480 python train.py --objective mlm --data babylm_10m --size small \
                --max-steps 7246 --out-dir "$W/mlm10"
            if [ -f "$W/mlm10/ckpt.pt" ]; then
                part blimp 20 90 python evaluate.py blimp --ckpt "$W/mlm10/ckpt.pt" \
                    --blimp-dir "$E/blimp_filtered" "$E/supplement_filtered"
            else
                echo "blimp: skipped, mlm10 left no checkpoint" | tee -a "$W/parts.txt"
            fi ;;
        *) echo "error: no part '$p' (tests, objectives, kernels, mlm10)" >&2; exit 2 ;;
    esac
done

# the summary: what each part measured, in one JSON
python - "$W" <<'EOF' > "$W/summary.json"
import json, pathlib, re, sys
w = pathlib.Path(sys.argv[1])
read = lambda name: (w / name).read_text() if (w / name).exists() else ""
out = {"gpu": read("gpu.txt").strip(), "commit": read("commit.txt").strip(),
       "parts": read("parts.txt").splitlines()}
tests = read("tests.log").strip().splitlines()
out["tests"] = tests[-1] if tests else None
keep = ("case", "ours", "unit", "reference", "ratio", "recompiles", "code_share", "mfu",
        "max_abs_diff", "failed")
for name in ("bench", "bench_kernels"):
    if (w / f"{name}.json").exists():
        out[name] = [{k: r.get(k) for k in keep if k in r}
                     for r in json.loads(read(f"{name}.json"))["rows"]]
if (w / "mlm10" / "log.jsonl").exists():
    log = [json.loads(line) for line in read("mlm10/log.jsonl").splitlines()]
    out["mlm10_last_val"] = next((e for e in reversed(log) if "val_loss" in e), None)
    out["mlm10_errors"] = [e for e in log if "error" in e]
    out["mlm10_done"] = re.findall(r"done: .*", read("mlm10.log"))
out["blimp"] = re.findall(r"^  \S+: over .*$", read("blimp.log"), flags=re.M)
print(json.dumps(out, indent=1))
EOF
cat "$W/summary.json"
# checkpoints (and a half-written one) do not travel, nor BLiMP's per-sentence results
tar czf "${OUT:-.}/gpu_check.tgz" --exclude='*.pt' --exclude='*.pt.tmp' --exclude='eval' \
    --exclude='code' -C "$(dirname "$W")" gpu_check &&
    echo "wrote ${OUT:-.}/gpu_check.tgz"
