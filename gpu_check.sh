#!/usr/bin/env bash
# The GPU check in tiers, each one device command of at most 8 minutes on an H100, every result
# written into $OUT the moment it exists: a command cut at any moment returns what it measured.
#
#     bash gpu_check.sh carry [FILE [SCALE]]   # here, first: .gpu_data/ (the prepared corpus,
#                                              # the fused kernels' wheel, the commit; without a
#                                              # study BLiMP for headline, with one the study's
#                                              # evaluation data alone)
#     bash gpu_check.sh speed                  # there, one device command each, .gpu_data carried
#     bash gpu_check.sh verify
#     bash gpu_check.sh headline
#     bash gpu_check.sh objectives
#     bash gpu_check.sh compare
#     bash gpu_check.sh rest
#     bash gpu_check.sh study FILE [SCALE [ARMS [SEEDS]]]  # every job of a study's scale
#                                              # (default gpu), or a slice: mlm,boot 0,1
#     bash gpu_check.sh --smoke TIER [ARGS]    # here, the same on the CPU at tiny sizes
#
# Run the tier the open "Needs a GPU" issue names next, then study jobs. Times are from the H200
# runs of 2026-11-26..28 (docs/bench.md): a compiled train.py run at small takes 70 to 100 s
# whatever its steps (start and torch.compile; 100 steps are 4 s of it), ours against
# BertForMaskedLM at small 104 s, the CUDA tests of verify 55 s; the rest are estimates:
#   speed       ~8 min: which attention form and which compile options make the `small` MLM
#               step fastest. A CUDA check of every form (FORMS, default gather, fused,
#               gather-fp32, onehot), compiled, at a tiny size (tests/test_cuda.py, ~1 min):
#               a form that cannot run is named and left out (the tier then exits 1), and the
#               tier stops at once if the gather cannot. Then in one process our step in each
#               form against BertForMaskedLM, compiled once (bench.py --only bert: tokens/s,
#               MFU, each model's first step, the top kernels of 10 steps of each), ~4.5 min; then
#               train.py at small for 100 steps in the fastest form, with --cuda-graphs, and
#               with --compile-scope layers (bench.py --only step: tokens/s, seconds outside
#               the steady steps), ~1.2 min each
#   verify      ~7.5 min: the CUDA sync and PLL tests (~1.5 min); bench.py's step rows at
#               small, mlm, mlsm+mlm, boot, kd+mlm compiled for 100 steps each, 240 s a row at
#               most (mlsm+mlm compiles for over 2 min; kd+mlm runs if time is left; tokens/s
#               against mlm, recompilations, mfu, wall_s)
#   headline    ~7 min: train.py mlm with the defaults (small, 10 epochs of babylm_10m, 7,246
#               steps: ~5.5 min at 456k tokens/s), then BLiMP filtered and supplement (~0.5
#               min). Training that cannot end in time is stopped (SIGTERM: it saves its step),
#               BLiMP scores that checkpoint, and summary.json gives the step time and the
#               projected total (with BUDGET=540 the run has a minute more, where the window
#               allows it)
#   objectives  ~7.5 min: every objective (seven) compiled side by side at a tiny size and
#               resume on CUDA (~1.5 min); the step rows of the objectives verify leaves out,
#               mlm (their reference and teacher), kd, mlsm, gpt-bert (~6 min)
#   compare     ~5 min: ours against BertForMaskedLM at small and base, both compiled as
#               train.py compiles its step (tokens/s, mfu), and at small the top operators of
#               one step of each (torch.profiler, in bert.json): where ours loses its time
#   rest        ~5.5 min: mlsm+mlm at small, 300 + 100 steps, the recipe's dictionary (3000
#               atoms from 100,000 states) learned between its phases, and phase 2's speed
#               (~4 min); bench.py's ltg, attn and pll rows at small (~1.5 min)
#   study       every job of a study's scale (FILE SCALE; ARMS and SEEDS, comma lists, take a
#               slice), PARALLEL at a time (default 2: four side by side on an H200 trained at
#               0.93x one run's tokens/s, docs/bench.md; two overlap starts with steps),
#               study.py --train-until the budget less EVAL_S (default 150) for the
#               evaluations: a run still training then is stopped, saves, is evaluated and
#               kept as a partial result (results/ARM/partial-sSEED.json.gz), left out of the
#               comparisons. Each result is appended to results.tar the moment it is written;
#               then REPORT.md and report.json of what this command ran, and the jobs' own logs
#               (logs.tar). Here: tar -xf results.tar -C runs/STUDY/SCALE, then study.py --report
# Each tier's parts work within $BUDGET seconds (default 460) from the end of its set-up (a few
# seconds); each part within its own limit and what is left of the budget, under `timeout -k
# 20`: 8 minutes at most. A part that no longer fits
# is skipped and says so; a part that fails (exits non-zero, or is cut at its limit where that
# is not its planned stop) is named at the end, and the tier exits 1. Back in $OUT (at most 8
# files, two folders deep): env.txt (with the size carried), progress.txt (each part: exit
# status, seconds), and each tier's logs and JSON.
#
# Environment: OUT (default gpu_out/), GPU_DATA (default .gpu_data/), BUDGET, PYTHON (default
# python3, else python), VOCAB_SIZE (the corpus' vocabulary, default 16384), SCALE, FORMS
# (speed), PLAN (`all`, or a comma list of parts: write those parts' commands to plan.txt, a
# line each, "NAME<tab>LIMIT<tab>COMMAND", instead of running them); carry reads the raw data
# under NANOMLM_RAW. tests/test_gpu_check.py runs the study and headline tiers with --smoke and
# checks every tier's plan, with and without it.
set -uo pipefail
here=$PWD
abs() { case $1 in /*) echo "$1" ;; *) echo "$here/$1" ;; esac; }  # a path typed from here
cd "$(dirname "$0")"  # the repository root, where the scripts are
smoke=0
if [ "${1:-}" = "--smoke" ]; then
    smoke=1
    shift
fi
tier=${1:-}
shift
case $tier in
    carry|speed|verify|headline|objectives|compare|rest|study) ;;
    *) echo "error: no tier '${tier}' (carry, speed, verify, headline, objectives, compare," \
            "rest, study FILE [SCALE [ARMS [SEEDS]]]); see the top of gpu_check.sh" >&2
       exit 2 ;;
esac
G=$(abs "${GPU_DATA:-.gpu_data}")
mkdir -p "$G"
py=${PYTHON:-$(command -v python3 || command -v python)}
vocab=${VOCAB_SIZE:-16384}
export PYTHONUNBUFFERED=1

# carry: what the GPU machine needs, made here (it has no network and no ../shared): babylm_10m
# prepared, the commit id, the wheel of the fused kernels' package (--attention fused; Triton
# comes with torch there), and either BLiMP filtered and its supplement (no study: headline's)
# or a study's evaluation data alone (a window carries what its tier reads)
if [ "$tier" = carry ]; then
    raw=$(abs "${NANOMLM_RAW:-data/raw}")
    eval_dir=$raw/babylm_eval/full_eval
    [ -d "$eval_dir" ] || { echo "error: no $eval_dir (set NANOMLM_RAW to the folder that" \
                                 "holds babylm_10m/ and babylm_eval/)" >&2; exit 1; }
    data=$(NANOMLM_RAW=$raw NANOMLM_DATA=$G/prep "$py" -c "import sys
from data.prepare import prepare
print(prepare('babylm_10m', int(sys.argv[1])))" "$vocab" | tee /dev/stderr | tail -1) || exit 1
    for old in "$G"/prep/babylm_10m-*; do  # one prepared copy, so that it is found by name
        [ "$old" = "$data" ] || rm -rf "$old"
    done
    # the evaluation folders, at their paths under NANOMLM_RAW: blimp, supplement, a study's
    study=${1:+$(abs "$1")}  # empty: no study
    "$py" - "$raw" "$G/raw" "$study" "${2:-${SCALE:-gpu}}" <<'EOF' || exit 1
import shutil, sys
from pathlib import Path
from studies.plan import StudyError, load_study
raw, to, study, scale = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
shutil.rmtree(to, ignore_errors=True)
need = {} if study else {"babylm_eval/full_eval/blimp_filtered": None,
                        "babylm_eval/full_eval/supplement_filtered": None}
if study:
    try:
        spec = load_study(Path(study))
    except StudyError as e:
        raise SystemExit(str(e))
    if scale not in spec["scales"]:
        raise SystemExit(f"error: {study} has no scale {scale!r}")
    ev = spec["scales"][scale].get("evaluate", {})
    need.update({d: None for d in ev.get("blimp", [])})
    if "finetune" in ev:  # only the files of the tasks it names
        need[ev["finetune"]["data_dir"]] = ev["finetune"]["tasks"]
for d, tasks in need.items():
    if Path(d).is_absolute():
        raise SystemExit(f"error: {d}: a study carried to a GPU names folders under NANOMLM_RAW")
    if not (raw / d).is_dir():
        raise SystemExit(f"error: no folder {raw / d}")
    files = [f for f in sorted((raw / d).iterdir()) if f.is_file() and (
        tasks is None or any(f.name.startswith((t + ".", t + "-")) for t in tasks))]
    (to / d).mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, to / d / f.name)
EOF
    # the fused attention's package (pure Python): its wheel, installed there from the file
    rm -rf "$G/wheels"
    package=$("$py" -c "from machinery.kernels import FUSED_PACKAGE; print(FUSED_PACKAGE)")
    "$py" -m pip download --quiet --no-deps -d "$G/wheels" "$package" ||
        echo "note: no wheel of $package (offline?): --attention fused will refuse to run" \
             "there" >&2
    commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
    [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] &&
        commit="$commit with uncommitted changes"
    echo "$commit" > "$G/commit"
    mib=$(( $(du -sk "$G" | cut -f1) / 1024 ))
    tree=$(git ls-files -z 2>/dev/null | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
    tree=$(( ${tree:-0} / 1024 ))
    echo "carry: $G, $mib MiB, and the checkout's $tree MiB (commit $commit)"
    (( mib + tree < 64 )) || { echo "error: a device call carries 64 MiB in all, with the" \
                                    "checkout; carry a study whose scale needs less" >&2; exit 1; }
    exit 0
fi

# on the GPU machine (or here with --smoke): the carried data, found as train.py finds it
export NANOMLM_DATA=$G/prep NANOMLM_RAW=$G/raw
W=$(mktemp -d)  # run folders (checkpoints never travel back), the carried wheels installed
trap 'rm -rf "$W"' EXIT
# the carried wheels where the python lacks them (the GPU machine has no registry)
if compgen -G "$G/wheels/*.whl" > /dev/null &&
        ! "$py" -c "import importlib.util as u, sys
sys.exit(u.find_spec('disentangled_flash') is None)" 2> /dev/null; then  # found, not imported
    "$py" -m pip install --quiet --no-deps --no-index --target "$W/site" "$G"/wheels/*.whl &&
        export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
fi
E=$G/raw/babylm_eval/full_eval
say() { echo "[${SECONDS}s] $*" | tee -a "$O/progress.txt"; }
failed=()  # the parts that failed: named at the end, and the tier exits 1
# part [--stop] NAME LOG LIMIT CMD...: CMD, its output appended to LOG, stopped after LIMIT
# seconds or at the end of the budget, whichever comes first (SIGTERM, then SIGKILL 20 s later).
# A non-zero exit is a failure, but with --stop a stop at the limit (timeout's 124): the part's
# planned end (headline's training, which saves where it is stopped)
part() {
    local stop=0 name log limit left=$(( END - SECONDS )) t0=$SECONDS rc
    [ "$1" = --stop ] && { stop=1; shift; }
    name=$1 log=$2 limit=$3
    shift 3
    (( limit > left )) && limit=$left
    if (( limit < (smoke ? 1 : 30) )); then
        say "$name: skipped, ${left}s of the budget left"
        return 99
    fi
    if [[ ${PLAN:-} == all || ",${PLAN:-}," == *",$name,"* ]]; then
        printf '%s\t%s\t%s\n' "$name" "$limit" "$(printf '%q ' "$@")" >> "$O/plan.txt"
        say "$name: planned (limit ${limit}s)"
        return 0
    fi
    timeout -k 20 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    say "$name: exit $rc in $(( SECONDS - t0 ))s (limit ${limit}s)"
    (( rc != 0 && !(stop && rc == 124) )) && failed+=("$name")
    return $rc
}

O=$(abs "${OUT:-gpu_out}")
mkdir -p "$O"
data=$("$py" -c "import sys; from data.prepare import prepare
print(prepare('babylm_10m', int(sys.argv[1]), quiet=True))" "$vocab" 2> "$W/data.err")
if [ -z "$data" ]; then
    echo "error: no prepared babylm_10m under $G/prep ($(tail -1 "$W/data.err")); run bash" \
         "gpu_check.sh carry here first and carry .gpu_data" >&2
    exit 1
fi
{ echo "tier: $tier${*:+ $*}$( ((smoke)) && echo ' (smoke)')"
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(cat "$G/commit" 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 ||
      echo "no nvidia-smi"
  "$py" -c "import importlib.metadata as m, torch
print('torch', torch.__version__, 'cuda', torch.version.cuda)
for name in ('transformers', 'triton', 'disentangled-flash'):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print('no', name)"
  echo "data: $data"
  echo "carried: $(( $(du -sk "$G" | cut -f1) / 1024 )) MiB in $G ($(ls "$G" | tr '\n' ' '))"
} > "$O/env.txt" 2>&1
# the budget counts from here, the set-up above done (two cold Python starts: seconds on a GPU
# machine, a minute on a loaded 2-core one)
END=$(( SECONDS + ${BUDGET:-460} ))
say "$tier: budget ${BUDGET:-460}s"

if (( smoke )); then  # the tests' tiny model (tests/conftest.py TINY), a few steps, the CPU
    dev=(--device cpu)
    tiny=(--size tiny --n-layer 1 --d-model 64 --n-head 2 --d-ff 128 --seq-len 32 --batch-size 8)
    steps=(--quick --sizes tiny --objectives mlm --steps 5)
    more_steps=(--quick --sizes tiny --objectives mlm,gpt-bert --steps 5)
    bert=(--quick --sizes tiny --profile) bert_base=(--quick --sizes tiny)
    kernels=(--quick --sizes tiny)
    forms=${FORMS:-gather,gather-fp32,onehot}  # fused needs CUDA: refused in test_train
    speed_bert=(--quick --sizes tiny --profile 2)
    speed_step=(--quick --sizes tiny --objectives mlm --steps 5)
    # stopped at step 10 of 1000, as a run too long for the budget is stopped by SIGTERM
    headline=("${tiny[@]}" --max-steps 1000 --stop-at 10 --log-every 5 --eval-every 10)
    dictionary=("${tiny[@]}" --max-steps 10 --phase1-steps 5 --log-every 5 --mlsm-k 48
                --dict-vectors 300 --dict-epochs 1)
    scale=${SCALE:-cpu}
else
    dev=(--device cuda)
    steps=(--sizes small --objectives mlm,mlsm+mlm,boot,kd+mlm --steps 100 --row-timeout 240)
    more_steps=(--sizes small --objectives mlm,kd,mlsm,gpt-bert --steps 100 --row-timeout 150)
    bert=(--sizes small --profile) bert_base=(--sizes base)  # profile: where ours loses
    kernels=(--sizes small --profile)
    forms=${FORMS:-gather,fused,gather-fp32,onehot}  # gather first: the others' baseline
    speed_bert=(--sizes small --profile 10)
    speed_step=(--sizes small --objectives mlm --steps 100 --row-timeout 150)
    headline=()
    dictionary=(--size small --max-steps 400 --phase1-steps 300 --log-every 20)
    scale=${SCALE:-gpu}
fi
tests=("$py" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py)

case $tier in
    speed)  # the attention form and compile options that make the small MLM step fastest
        part check "$O/check.log" 120 "${tests[@]}" -k "attention_form"
        if [[ " ${failed[*]} " == *" check "* ]]; then  # a form that cannot run: no time on it
            bad=$(grep -oE '^FAILED [^ ]+\[[^]]+\]' "$O/check.log" | sed -E 's/.*\[(.+)\]/\1/' |
                  sort -u | paste -sd, -)
            forms=$(tr , '\n' <<< "$forms" | grep -vxF -f <(tr , '\n' <<< "$bad") | paste -sd, -)
            if [ -z "$bad" ] || [[ ",$forms," != *,gather,* ]]; then  # no baseline left
                say "check: ${bad:-the check itself} failed; stopped"
                echo "error: speed: the CUDA check failed for ${bad:-every form} (check.log)" >&2
                exit 1
            fi
            say "check: $bad cannot run on CUDA (check.log); measuring $forms"
        fi
        part forms "$O/bench.log" 300 "$py" bench.py "${dev[@]}" --only bert --attention \
            "$forms" "${speed_bert[@]}" --out "$O/forms.json"
        best=$("$py" - "$O/forms.json" <<'EOF'
import json, sys
try:  # the fastest form measured; gather where none was
    rows = [r for r in json.load(open(sys.argv[1]))["rows"] if not r.get("failed")]
except (OSError, ValueError):
    rows = []
print(max(rows, key=lambda r: r["ours"])["form"] if rows else "gather")
EOF
)
        say "fastest form: $best"
        for run in step graphs layers; do  # train.py itself: its start and the loop's speed
            case $run in
                step) variant=() ;;
                graphs) variant=(--cuda-graphs) ;;
                layers) variant=(--compile-scope layers) ;;
            esac
            part "$run" "$O/bench.log" 150 "$py" bench.py "${dev[@]}" --only step --attention \
                "$best" "${variant[@]}" "${speed_step[@]}" --data "$data" --out "$O/$run.json"
        done ;;
    verify)
        part tests "$O/tests.log" 150 "${tests[@]}" -k "never_waits or pll"
        part steps "$O/bench.log" 420 "$py" bench.py "${dev[@]}" \
            --only step "${steps[@]}" --data "$data" --out "$O/steps.json" ;;
    headline)  # what is left of the budget, less BLiMP's share
        part --stop train "$O/train.log" $(( END - SECONDS - (smoke ? 5 : 75) )) "$py" train.py \
            --objective mlm --data "$data" "${dev[@]}" "${headline[@]}" --out-dir "$W/headline"
        cp "$W/headline/log.jsonl" "$O/log.jsonl" 2>/dev/null
        if [ -f "$W/headline/ckpt.pt" ]; then
            part blimp "$O/blimp.log" 120 "$py" evaluate.py blimp --ckpt "$W/headline/ckpt.pt" \
                "${dev[@]}" --blimp-dir "$E/blimp_filtered" "$E/supplement_filtered"
            gzip -c "$W/headline/eval/blimp.json" > "$O/blimp.json.gz" 2>/dev/null ||
                rm -f "$O/blimp.json.gz"
        else
            say "blimp: skipped, training left no checkpoint"
        fi
        "$py" - "$W/headline" "$O/progress.txt" > "$O/summary.json" <<'EOF'
import json, re, statistics, sys, traceback
from pathlib import Path
from machinery.plumbing import RunFolder
run, progress = Path(sys.argv[1]), Path(sys.argv[2]).read_text()
wall = lambda part: float(re.findall(rf"^\[\d+s\] {part}: exit \d+ in (\d+)s", progress,
                                     flags=re.M)[-1]) if f"] {part}: exit" in progress else None
out = {"train_wall_s": wall("train"), "blimp_wall_s": wall("blimp")}
try:  # whatever the run left: a log torn by a kill, or no log at all
    log = RunFolder(run, master=False).records()
    args = json.loads((run / "args.json").read_text())
    train = [r for r in log if "tok_per_s" in r]
    steps = train[-1]["step"] if train else 0
    out.update(steps=steps, max_steps=args["max_steps"], finished=steps == args["max_steps"],
               val=next((r for r in reversed(log) if "val_loss" in r), None))
    if train:  # the first interval holds torch.compile's warm-up: the others' median
        tokens = args["batch_size"] * args["seq_len"] * args["grad_accum"]
        out["step_s"] = tokens / statistics.median([r["tok_per_s"] for r in train[1:] or train])
        # training steps only: the evaluations and saves still to come are not counted
        out["projected_train_s"] = ((out["train_wall_s"] or 0)
                                    + (args["max_steps"] - steps) * out["step_s"])
    if (run / "eval" / "blimp.json").exists():
        b = json.loads((run / "eval" / "blimp.json").read_text())
        out.update(blimp_sentences_per_s=b["sentences_per_s"],
                   blimp={g: {"over_paradigms": 100 * s["macro_paradigms"][0],
                              "pipeline_average": 100 * s["pipeline_average"]}
                          for g, s in b["summary"].items()})
except Exception:
    out["error"] = traceback.format_exc()
print(json.dumps(out, indent=1))
EOF
        say "summary: exit $?" ;;
    objectives)
        part tests "$O/tests.log" 150 "${tests[@]}" -k "compiled_in_bf16 or resume"
        part steps "$O/bench.log" 420 "$py" bench.py "${dev[@]}" \
            --only step "${more_steps[@]}" --data "$data" --out "$O/steps.json" ;;
    compare)  # one size per command: each writes its row as it is measured
        part bert "$O/bench.log" 180 "$py" bench.py "${dev[@]}" --only bert "${bert[@]}" \
            --out "$O/bert.json"
        part bert_base "$O/bench.log" 240 "$py" bench.py "${dev[@]}" --only bert \
            "${bert_base[@]}" --out "$O/bert_base.json" ;;
    rest)
        part dictionary "$O/dictionary.log" 240 "$py" train.py --objective mlsm+mlm \
            --data "$data" "${dev[@]}" "${dictionary[@]}" --out-dir "$W/dictionary"
        cp "$W/dictionary/log.jsonl" "$O/dictionary.jsonl" 2>/dev/null
        part kernels "$O/bench.log" 90 "$py" bench.py "${dev[@]}" --only ltg,attn,pll \
            "${kernels[@]}" --out "$O/kernels.json" ;;
    study)
        [ $# -ge 1 ] || { echo "error: study needs FILE [SCALE [ARMS [SEEDS]]]" >&2; exit 2; }
        file=$(abs "$1") scale=${2:-$scale}
        slice=(${3:+--only "$3"} ${4:+--seeds "$4"})
        S=$W/study
        # results/ARM/*.json.gz (complete or partial) and *.failed into results.tar, each once,
        # as soon as study.py has written it (whole: it renames a finished file into place)
        collect() {
            local f
            for f in "$S"/results/*/*.json.gz "$S"/results/*/*.failed; do
                [ -f "$f" ] || continue
                f=${f#"$S"/}
                grep -qxF "$f" "$W/collected" 2>/dev/null && continue
                tar -rf "$O/results.tar" -C "$S" "$f" && echo "$f" >> "$W/collected"
            done
        }
        (while sleep 2; do collect; done) &
        collector=$!
        until=$(( END - SECONDS - ${EVAL_S:-$((smoke ? 15 : 150))} ))
        part study "$O/study.log" $(( END - SECONDS )) "$py" study.py "$file" --scale "$scale" \
            "${slice[@]}" --out "$S" --no-figures --parallel "${PARALLEL:-2}" \
            --train-until $(( until > 1 ? until : 1 ))
        kill "$collector" 2>/dev/null
        wait "$collector" 2>/dev/null
        collect
        cp "$S/REPORT.md" "$S/report.json" "$O/" 2>/dev/null
        (cd "$S" && tar -cf "$O/logs.tar" */s*/study.log sources/*/study.log 2>/dev/null)
        say "results: $(tar -tf "$O/results.tar" 2>/dev/null | tr '\n' ' ')" ;;
esac
if (( ${#failed[@]} )); then
    say "failed: ${failed[*]}"
    echo "error: $tier: ${failed[*]} failed (progress.txt, and each part's log in $O)" >&2
    exit 1
fi
say "done"
