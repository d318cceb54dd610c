"""A study: every arm x seed trained, evaluated and compared with the baseline over the
pretraining seeds (a Student's t interval; the Multi-Bootstrap beside it), in one command that
resumes where it stopped.

    python study.py studies/better_together.toml                 # its cpu scale, all of it
    python study.py studies/better_together.toml --dry-run       # the plan and its cost
    python study.py studies/better_together.toml --scale gpu --only mlm --seeds 0   # a slice
    python study.py studies/better_together.toml --report        # REPORT.md from results only

A study file (TOML; studies/*.toml, each key explained in studies/README.md) names its arms
(an objective and its flags, optionally a source corpus to pretrain on first and transfer
from), the baseline arm, and per scale (cpu, gpu) the corpus, size, seeds, budget and
evaluations: `evaluate.py blimp` (BLiMP folders, temperature chosen on one half of the pairs and
reported on the other) and `evaluate.py finetune` (tasks, fine-tuning seeds), the verdicts; and
`evaluate.py mlm` (masked-token loss and accuracy on held-out text under two maskings, the same
hidden tokens for every model, beside unigram and bigram counts), a diagnostic.

Every step is a command a user could type (train.py, evaluate.py, synth.py in a subprocess; the
report lists them), so one run can be re-made by hand. In runs/STUDY/SCALE/:
    ARM/sSEED/                    the run folder: ckpt.pt, log.jsonl, eval/, study.log (disposable)
    sources/KEY_sSEED/            a source pretraining run that arms transfer from
    corpora/NAME/                 a corpus the study generates (synth.py, data/breton.py)
    results/ARM/sSEED.json.gz     the run's portable result: metrics, per-example predictions,
                                  validation curve, compute, commands (about 1 MB)
    REPORT.md, report.json, *.png built from results/ alone
A result is written once all of its run's steps succeed; a run with a result is skipped, and an
interrupted one goes on from its last checkpoint and its evaluations not yet written. Results
from other machines merge by copying them into results/ and running --report.

With --train-until S (a GPU window: gpu_check.sh study), a run still training S seconds after
the study started is stopped as a preempted run is (SIGTERM: it saves the step it is in),
evaluated as it stands, and its result written as results/ARM/partial-sSEED.json.gz: the report
lists it and leaves it out of the comparisons; a later call resumes the run from its checkpoint.
Runs not started by then are left for a later call.
"""
import contextlib
import gzip
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

import evaluate
from data.prepare import prepare, prepared_copies, resolve
from data.tasks import TASKS
from evaluation.results import read_result
from machinery.plumbing import (REPO, Parser, RunFolder, above, at_least, atomic_write,
                                load_state, numbers, one_line_os_errors)
from studies.plan import (Job, StudyError, load_study, metric_names, plan, raw_path,
                          scale_arms, shown)
from studies.report import build_report


# tokens/s of an MLM step when no run of the study has finished yet (--dry-run's estimate): tiny
# at 32 x 128 on a 2-core CPU, small and base at 128 x 128 on one GPU (the figures in
# docs/bench_log.md); two-phase objectives cost more (docs/bench.md)
RATES = {("cpu", "tiny"): 9.1e3, ("cuda", "small"): 4.1e5, ("cuda", "base"): 2.1e5}

# GPU memory of one run (GB), for --parallel's check on one GPU: the largest peak measured at
# `small` (boot's, docs/bench.md) and 1 GB for the CUDA context and
# torch.compile's workspace, which torch's peak does not count. Other sizes are not measured yet.
RUN_GPU_GB = {"small": 6.6}
# seconds a run stopped by --train-until has to save its step before it is killed
STOP_GRACE = 60


# ---------------------------------------------------------------------------------------------
# Before anything trains: every flag, corpus, folder and task checked, one line if not

def quiet_exit_line(fn) -> str | None:
    """Run fn (an argparse parse); the last line it printed to stderr if it exited, else None."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            fn()
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines() or [str(e)]
        return error_of(lines[-1])
    return None


def error_of(line: str) -> str:
    """What a script's one-line error says, without its name or its pointer to --help."""
    return line.split("error: ", 1)[-1].split("; see ", 1)[0]


def preflight(study, scale_name, jobs, path) -> dict:
    """{job name: the settings train.py resolved for its first step}; raises StudyError."""
    scale = study["scales"][scale_name]
    where = lambda job: (f"arms.{job.arm}" if job.arm else
                         f"arms (source) / scales.{scale_name}.source" if job.name.startswith(
                             "source") else f"scales.{scale_name}.corpora")
    fail = lambda key, why: StudyError(f"error: {path}: {key}: {why}")
    for i, m in enumerate(study.get("metrics", [])):
        known = metric_names(scale)
        if m not in known:
            raise fail(f"metrics[{i}]", f"unknown metric {m!r} (this study's: {', '.join(known)})")
    for i, d in enumerate(scale.get("evaluate", {}).get("blimp", [])):
        if not raw_path(d).is_dir():
            raise fail(f"scales.{scale_name}.evaluate.blimp[{i}]", f"no BLiMP folder at "
                       f"{raw_path(d)}")
    mlm = scale.get("evaluate", {}).get("mlm")
    if mlm and (line := quiet_exit_line(lambda: evaluate.build_parser().parse_args(
            ["mlm", "--ckpt", "x", *shlex.split(mlm.get("flags", ""))]))):
        raise fail(f"scales.{scale_name}.evaluate.mlm.flags", line)
    ft = scale.get("evaluate", {}).get("finetune")
    if ft:
        key = f"scales.{scale_name}.evaluate.finetune"
        if "data_dir" not in ft:
            raise fail(key, "needs data_dir")
        folder = raw_path(ft["data_dir"])
        if not folder.is_dir():
            raise fail(f"{key}.data_dir", f"no task folder at {folder}")
        for i, task in enumerate(ft.get("tasks", [])):
            if task not in TASKS and not (folder / f"{task}.train.jsonl").exists():
                raise fail(f"{key}.tasks[{i}]", f"unknown task {task!r} (known: "
                           f"{', '.join(TASKS)}, or MSGS-style files in {folder})")
            if not (folder / f"{task}.train.jsonl").exists():
                raise fail(f"{key}.tasks[{i}]", f"{task} has no training file in {folder}")
        line = quiet_exit_line(lambda: evaluate.build_parser().parse_args(
            ["finetune", "--ckpt", "x", "--task", "rte", "--data-dir", "x",
             *shlex.split(ft.get("flags", ""))]))
        if line:
            raise fail(f"{key}.flags", line)
    for name, command in scale.get("corpora", {}).items():
        script = shlex.split(command)[0] if command.strip() else ""
        if not (REPO / script).is_file():
            raise fail(f"scales.{scale_name}.corpora.{name}", f"no script {script!r} here")
    # train.py --check resolves each distinct command's flags; run them side by side
    trains = {j.name: j.steps[0].argv for j in jobs if j.steps[0].label == "train"}
    # seeds differ in --seed and --out-dir alone: check one command per arm
    same = lambda argv: tuple(a for i, a in enumerate(argv)
                              if i == 0 or argv[i - 1] not in ("--seed", "--out-dir"))
    distinct = {same(argv): argv for argv in trains.values()}

    def check(argv):
        p = subprocess.run([sys.executable, *argv, "--check"], cwd=REPO, capture_output=True,
                           text=True)
        return p.returncode, p.stdout, (p.stderr.strip().splitlines() or ["?"])[-1]
    with ThreadPoolExecutor(4) as pool:
        once = dict(zip(distinct, pool.map(check, distinct.values())))
    checked = {name: once[same(argv)] for name, argv in trains.items()}
    resolved = {}
    generated = {str(j.steps[0].done.parent) for j in jobs if j.name.startswith("corpus")}
    for job in jobs:
        if job.name not in checked:
            continue
        rc, out, err = checked[job.name]
        if rc != 0:
            raise fail(where(job), error_of(err))
        settings = json.loads(out)
        rawdir, prepared = resolve(settings["data"])
        if (settings["data"] not in generated and not rawdir.is_dir()
                and not prepared_copies(prepared) and not (prepared / "meta.json").exists()):
            raise fail(where(job), f"no corpus {settings['data']!r} at {rawdir} "
                       f"(set by scales.{scale_name}.data, the arm's data or its flags)")
        resolved[job.name] = settings
    return resolved


# ---------------------------------------------------------------------------------------------
# Running: each step a subprocess, its output in the run folder's study.log

lock = threading.Lock()
stopping = threading.Event()  # a stop signal came: no step starts, the running ones stop
running, running_lock = set(), threading.RLock()  # the steps' processes now running
STOPPED = "stopped by a signal"  # run_job's answer for a job a stop signal interrupted


def say(text):
    with lock:
        print(text, flush=True)


def forward_stop_signals() -> dict:
    """Ctrl-C or SIGTERM: each running step gets one SIGTERM (each runs in a session of its own,
    so a terminal's Ctrl-C reaches study.py alone: a second signal would make train.py exit
    without saving); training saves the step it is in, an evaluation stops at once, and no step
    starts after. A second signal kills them. -> {"signal": its name}, once one came."""
    got = {}

    def handler(signum, frame):  # the main thread (a second signal may come inside: RLock)
        name = signal.Signals(signum).name
        with running_lock:
            if stopping.is_set():
                for p in running:
                    p.kill()
                raise SystemExit(f"{name}: stopped at once; the steps that were running lose "
                                 f"what they had not saved")
            got["signal"] = name
            stopping.set()
            for p in running:
                p.send_signal(signal.SIGTERM)
        print(f"{name}: stopping: the running training saves the step it is in (a second {name} "
              f"stops at once)", file=sys.stderr, flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return got


def run_job(job: Job, env: dict, counter, deadline: float | None = None) -> str | None:
    """The job's steps not yet done, in order; its result file at the end. None, or the error.
    Training still running at `deadline` (time.time()) is stopped; the rest is evaluated as it
    stands and its result is partial (partial_result)."""
    job.folder.mkdir(parents=True, exist_ok=True)
    log = job.folder / "study.log"
    cut = False  # training stopped by the deadline: the result is partial
    if job.steps[0].label == "train" and not job.steps[0].done.exists():
        for step in job.steps[1:]:  # evaluations of a stopped run's checkpoint, not the last one
            step.done.unlink(missing_ok=True)
    for step in job.steps:
        if step.done.exists() and step.label in ("train", "corpus"):
            if json.loads(step.done.read_text()).get("argv", step.argv) != step.argv:
                error = (f"{job.folder} was made by another command than the study file's "
                         f"now; move it away to run it again")
                say(f"    {job.name}: FAILED ({error})")
                return error
        if step.done.exists():
            continue
        if stopping.is_set():
            return STOPPED
        argv = list(step.argv)
        # (a run stopped before its first save has args.json alone: --resume begins it again)
        resuming = step.label == "train" and any(
            (job.folder / f).exists() for f in ("ckpt.pt", "args.json"))
        if resuming:
            argv.append("--resume")
        elif step.label == "train":  # its folder holds study.log, the study's own
            argv.append("--force")
        say(f"[{counter()}] {job.name}: {step.label}" + (" (resuming)" if resuming else ""))
        t0 = time.time()
        with open(log, "a") as f:
            f.write(f"\n$ {shown(argv)}\n")
            f.flush()
            p = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=f,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
            with running_lock:
                running.add(p)
                if stopping.is_set():  # the signal came while it started
                    p.send_signal(signal.SIGTERM)
            try:
                rc, stopped = wait_until(p, deadline if step.label == "train" else None)
            finally:
                with running_lock:
                    running.discard(p)
        seconds = time.time() - t0
        if rc != 0 and stopping.is_set():  # stopped by the signal: not a failure
            saved = step.label == "train" and (job.folder / "ckpt.pt").exists()
            say(f"    {job.name}: {step.label} stopped" + (", its step saved" if saved else ""))
            return STOPPED
        if stopped and (job.folder / "ckpt.pt").exists() and job.result:
            cut = True
            say(f"    {job.name}: training stopped by --train-until after {seconds / 60:.1f} min"
                f"; evaluated as it stands (a partial result)")
            with open(job.folder / "study_times.jsonl", "a") as f:
                f.write(json.dumps({"step": "train", "seconds": seconds}) + "\n")
            continue  # its done file is not written: a later call resumes the training
        if stopped:
            rc = rc or 1
            with open(log, "a") as f:
                f.write("stopped by --train-until before its first checkpoint\n")
        if rc != 0:
            tail = [x for x in log.read_text().splitlines() if x.strip()][-1:] or ["?"]
            error = f"{step.label} exited with {rc}: {tail[0][:300]}"
            say(f"    {job.name}: FAILED ({error}); log {log}")
            if job.result:
                job.result.parent.mkdir(parents=True, exist_ok=True)
                failed = job.result.with_name(job.result.name.replace(".json.gz", ".failed"))
                failed.write_text(json.dumps({"arm": job.arm, "seed": job.seed, "error": error,
                                              "log": str(log)}))
            return error
        if step.label in ("train", "corpus"):  # the others' outputs are their done files
            step.done.write_text(json.dumps({"seconds": seconds, "argv": step.argv}))
        with open(job.folder / "study_times.jsonl", "a") as f:
            f.write(json.dumps({"step": step.label, "seconds": seconds}) + "\n")
        say(f"    {job.name}: {step.label} done in {seconds / 60:.1f} min")
    if job.result and (cut or not job.result.exists()):
        write_job_result(job, partial=cut)
    return None


def wait_until(p: subprocess.Popen, deadline: float | None) -> tuple[int, bool]:
    """(p's exit status, whether the deadline stopped it). At the deadline p gets SIGTERM, on
    which train.py saves the step it is in and exits; SIGKILL STOP_GRACE s later if it has not."""
    try:
        return p.wait(None if deadline is None else max(0.0, deadline - time.time())), False
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGTERM)
    try:
        return p.wait(STOP_GRACE), True
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait(), True


def partial_result(job: Job) -> Path:
    """Where a run stopped by --train-until keeps its result: beside the complete ones, under a
    name that the report's comparisons never read (study_report.read_results lists it)."""
    return job.result.with_name("partial-" + job.result.name)


def device_name(settings_device: str) -> str:
    if settings_device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                  .splitlines() if line.startswith("model name")), "CPU") if Path(
        "/proc/cpuinfo").exists() else "CPU"
    return f"{model}, {os.cpu_count()} cores"


# ---------------------------------------------------------------------------------------------
# A run's portable result: what the report and `evaluate.py compare` need, and nothing that can
# be recomputed from it (BLiMP's per-temperature log-probabilities are left out: 1.7 -> 0.3 MB)

def write_job_result(job: Job, partial: bool = False):
    """results/ARM/sSEED.json.gz, or with `partial` (training stopped before its last step)
    partial-sSEED.json.gz, which says the step it stopped at; a complete result replaces it."""
    run, out = job.folder, {}
    records = RunFolder(run, master=False).records()
    args = json.loads((run / "args.json").read_text())
    train_log = [r for r in records if "tok_per_s" in r]
    times = [json.loads(x) for x in (run / "study_times.jsonl").read_text().splitlines()]
    steps = (load_state(run / "ckpt.pt")["step"]
             if partial else args["max_steps"])  # the step its evaluations read
    if partial:
        out["stopped"] = {"step": steps, "max_steps": args["max_steps"]}
    tokens = steps * args["batch_size"] * args["grad_accum"] * args["seq_len"]
    out["compute"] = {
        "device": device_name(args["device"]), "steps": steps, "tokens": tokens,
        "tok_per_s": float(np.median([r["tok_per_s"] for r in train_log])) if train_log else None,
        "train_s": sum(t["seconds"] for t in times if t["step"] == "train"),
        "eval_s": sum(t["seconds"] for t in times if t["step"] != "train"),
        "date": time.strftime("%Y-%m-%d")}
    out["curve"] = [r for r in records if any(k.startswith("val_") for k in r)]
    out["commands"] = [shown(s.argv) for s in job.steps]
    eval_dir = run / "eval"
    # how the run trained and is read: what a masking or a reading position may favour
    out["trained"] = {k: args.get(k) for k in ("objective", "masking", "mask_p", "mask_p_end")}
    if (eval_dir / "mlm.json").exists():
        r = read_result(eval_dir / "mlm.json")
        out.update((f"{m}_{masking}", r[f"{m}_{masking}"]) for masking in r["maskings"]
                   for m in ("loss", "acc"))
        out["mlm"] = {k: r[k] for k in ("read_at", "mask_p", "segments", "maskings")}
    if (eval_dir / "blimp.json").exists():
        r = read_result(eval_dir / "blimp.json")
        pairs = {p["id"]: p for p in r["pairs"]}
        ex = r["examples_best_t"]  # the reporting half, at the temperature the other half chose
        for group in r["summary"]:
            keep = [i for i, e in enumerate(ex["id"]) if pairs[e]["group"] == group]
            out[group] = {"id": [ex["id"][i] for i in keep], "label": [1] * len(keep),
                          "pred": [[ex["pred"][0][i] for i in keep]], "metric": "accuracy",
                          "k": 2, "phenomenon": [pairs[ex["id"][i]]["phenomenon"] for i in keep]}
        out["blimp"] = {k: r[k] for k in ("best_temperature", "summary", "phenomena",
                                          "sentences_per_s")}
    for step in [s for s in job.steps if s.argv[1:2] == ["finetune"]]:
        r = read_result(step.done)
        out[step.label] = r["examples"]
        out.setdefault("finetune", {})[step.label] = r["aggregate"]
    result = {"kind": "study-run", "arm": job.arm, "seed": job.seed, "pretrain_seed": job.seed,
              "fingerprint": job.fingerprint, **out}
    path = partial_result(job) if partial else job.result
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as tmp, gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump(result, f)
    job.result.with_name(job.result.name.replace(".json.gz", ".failed")).unlink(missing_ok=True)
    if not partial:
        partial_result(job).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Command line

def estimate(jobs, resolved, folder) -> list[str]:
    """--dry-run: each job's tokens and a time from the study's finished runs (their median
    tokens/s per arm), else from RATES."""
    done_rates = {}
    for path in (folder / "results").glob("*/s*.json.gz"):
        r = read_result(path)
        if r["compute"]["tok_per_s"]:
            done_rates.setdefault(r["arm"], []).append(r["compute"]["tok_per_s"])
    lines, total = [], 0.0
    for j in jobs:
        todo = [] if done(j) else [s.label for s in j.steps if not s.done.exists()]
        a = resolved.get(j.name)
        cost = "-"
        if a and "train" in todo and a.get("max_steps"):
            tokens = a["max_steps"] * a["batch_size"] * a["grad_accum"] * a["seq_len"]
            dev = "cuda" if a["device"] in ("cuda", "auto") and has_cuda() else "cpu"
            rate = (np.median(done_rates[j.arm]) if j.arm in done_rates
                    else RATES.get((dev, a["size"])))
            cost = f"{tokens / 1e6:.1f}M tokens" + (f", ~{tokens / rate / 60:.0f} min train"
                                                     if rate else "")
            total += tokens / rate / 60 if rate else 0
        elif a and "train" in todo:
            cost = f"{a['epochs']:g} epochs (steps known once the corpus is prepared)"
        lines.append(f"  {j.name:<24} {'done' if not todo else 'to do: ' + ', '.join(todo):<40}"
                     f" {cost}")
    lines.append(f"  about {total:.0f} min of training in all, plus evaluation"
                 + ("" if total else " (no rate known for this device and size)"))
    return lines


def done(job: Job) -> bool:
    """A run is done once its result is written (a stale one too: the report lists it, and
    main() says how to redo it); a source or corpus once its step is."""
    return job.result.exists() if job.result else all(s.done.exists() for s in job.steps)


def has_cuda() -> bool:
    return torch.cuda.is_available()


def check_gpu_memory(parallel: int, jobs: list, resolved: dict) -> str | None:
    """With several runs at once on each GPU: an error line if the GPU's free memory cannot hold
    them (RUN_GPU_GB), a note if a size has no measured figure, else None."""
    on_gpu = [resolved[j.name] for j in jobs if j.name in resolved
              and resolved[j.name]["device"] in ("cuda", "auto")]
    gpus = torch.cuda.device_count() if on_gpu and has_cuda() else 0
    at_once = min(parallel, len(on_gpu)) // max(gpus, 1)  # runs per GPU
    if not gpus or at_once < 2:
        return None
    sizes = sorted({a["size"] for a in on_gpu})
    unknown = [size for size in sizes if size not in RUN_GPU_GB]
    if unknown:
        return (f"note: no GPU memory figure for {', '.join(unknown)} runs yet: --parallel "
                f"{parallel} on one GPU is not checked against its memory")
    need = max(RUN_GPU_GB[size] for size in sizes)
    free = min(torch.cuda.mem_get_info(i)[0] for i in range(gpus)) / 1e9
    if at_once * need > 0.9 * free:
        fits = max(1, int(0.9 * free / need)) * gpus
        raise SystemExit(f"error: --parallel {parallel}: {at_once} {sizes[-1]} runs on one GPU "
                         f"need about {at_once * need:.0f} GB ({need:g} GB each), but "
                         f"{free:.0f} GB are free; use --parallel {fits} or fewer")
    return None


def build_parser() -> Parser:
    ap = Parser(prog="study.py", description=__doc__)
    add = ap.add_argument
    add("study", help="the study file, e.g. studies/better_together.toml")
    add("--scale", default="cpu", help="which of the file's scales")
    add("--only", default=None, help="comma-separated arms to run (default all)")
    add("--seeds", type=numbers(at_least(int, 0)), default=None,
        help="comma-separated seeds to run (default the scale's)")
    add("--dry-run", action="store_true", help="print the plan and its estimated cost, run nothing")
    add("--report", action="store_true", help="only rebuild REPORT.md from results/")
    add("--parallel", type=at_least(int, 1), default=1,
        help="runs at once: on several GPUs spread over them; on one GPU side by side, checked "
        "against its free memory first; on a CPU the cores shared")
    add("--train-until", type=above(float, 0), default=None,
        help="seconds after the start: a run still training then is stopped (it saves), "
        "evaluated as it stands and kept apart as a partial result; runs not started by then "
        "wait for a later call (a GPU window: gpu_check.sh study)")
    add("--out", default=None, help="the study folder (default runs/STUDY/SCALE)")
    add("--nboot", type=at_least(int, 1), default=1000,
        help="bootstrap resamples per comparison")
    add("--no-figures", action="store_true", help="no PNGs even when matplotlib is installed")
    return ap


def main(argv=None):
    started = time.time()  # --train-until counts from here
    ap = build_parser()
    args = ap.parse_args(argv)
    path = Path(args.study)
    study = load_study(path)
    if args.scale not in study["scales"]:
        raise StudyError(f"error: {path}: scales: no scale {args.scale!r} (the file has "
                         f"{', '.join(study['scales'])})")
    only = args.only.split(",") if args.only else None
    for a in only or []:
        if a not in scale_arms(study, args.scale):
            raise StudyError(f"error: --only {a}: {path} has no such arm at scale {args.scale} "
                             f"({', '.join(scale_arms(study, args.scale))})")
    folder = Path(args.out) if args.out else REPO / "runs" / study["name"] / args.scale
    if folder.exists() and not folder.is_dir():  # (made below, once the plan is checked)
        ap.error(f"--out {folder} is a file, not a folder")
    jobs = plan(study, args.scale, folder, only, args.seeds)
    if args.report:
        if not any((folder / "results").glob("*/*")):
            raise StudyError(f"error: {folder / 'results'} holds no results to report; run the "
                             f"study first (python study.py {path} --scale {args.scale}"
                             + (f" --out {folder}" if args.out else "") + ")")
        print(build_report(study, args.scale, folder, plan(study, args.scale, folder), args.nboot,
                           not args.no_figures))
        return
    resolved = preflight(study, args.scale, jobs, path)
    if not args.dry_run:
        with one_line_os_errors(folder):  # an unwritable --out: one line, before the corpora
            folder.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        print(f"{study['name']}, scale {args.scale}: {len(jobs)} jobs into {folder}")
        print("\n".join(estimate(jobs, resolved, folder)))
        for j in jobs:
            print(f"\n{j.name}:\n" + "\n".join("  " + shown(s.argv) for s in j.steps))
        return
    todo = [j for j in jobs if not done(j)]
    deadline = started + args.train_until if args.train_until else None
    if note := check_gpu_memory(args.parallel, todo, resolved):
        print(note)
    for j in jobs:
        if j.result and j.result.exists() and read_result(j.result).get(
                "fingerprint") != j.fingerprint:
            print(f"warning: {j.result} was made with other settings than the study file's "
                  f"now (stale, left out of the report); move it and {j.folder} away to redo it")
    # the corpora there already are prepared here, once, not by runs racing side by side
    generated = {str(j.steps[0].done.parent) for j in jobs if j.name.startswith("corpus")}
    for data, vocab in sorted({(a["data"], a["vocab_size"]) for a in resolved.values()}):
        if data not in generated:
            prepare(data, vocab)
    print(f"{study['name']}, scale {args.scale}: {len(todo)} of {len(jobs)} jobs to run into "
          f"{folder}" + (f", {args.parallel} at a time" if args.parallel > 1 else ""))
    count = iter(range(1, 10 ** 6))
    counter = lambda: next(count)
    env = dict(os.environ)
    if args.parallel > 1:  # share the cores; one GPU each where there are several
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.parallel))
    slots = list(range(args.parallel))
    gpus = torch.cuda.device_count()
    failed, finished = {}, set(j.name for j in jobs if j not in todo)

    def work(job):
        with lock:
            slot = slots.pop()
        e = dict(env, **({"CUDA_VISIBLE_DEVICES": str(slot % gpus)} if gpus > 1 else {}))
        try:
            blocked = [a for a in job.after if a in failed]
            if blocked:
                failed[job.name] = f"needs {blocked[0]}, which failed"
                say(f"    {job.name}: skipped ({failed[job.name]})")
                return
            if stopping.is_set():
                return
            if deadline and time.time() >= deadline:
                say(f"    {job.name}: not started (--train-until has passed); left for a later "
                    f"call")
                return
            error = run_job(job, e, counter, deadline)
            if error and error != STOPPED:
                failed[job.name] = error
        finally:
            with lock:
                slots.append(slot)
                finished.add(job.name)
    got = forward_stop_signals()
    # waves: a job runs once the jobs it needs (its corpus, its source run) have finished
    with ThreadPoolExecutor(args.parallel) as pool:
        pending = list(todo)
        while pending:
            wave = [j for j in pending if all(a in finished for a in j.after)]
            if not wave:  # what they need is not in this slice: run it first
                wave = pending
            list(pool.map(work, wave))
            pending = [j for j in pending if j not in wave]
    if got.get("signal"):
        raise SystemExit(f"{got['signal']}: stopped; the same command goes on: "
                         f"{shown(sys.argv)}")
    text = build_report(study, args.scale, folder, plan(study, args.scale, folder), args.nboot,
                        not args.no_figures)
    unfinished = [j for j in todo if not done(j) and j.name not in failed]
    partial = [j.name for j in unfinished if j.result and partial_result(j).exists()]
    print(f"\nwrote {folder / 'REPORT.md'} ({len(text.splitlines())} lines)"
          + (f"; {len(failed)} jobs failed: " + ", ".join(failed) if failed else "")
          + (f"; stopped by --train-until, partial results: {', '.join(partial)}" if partial
             else "")
          + (f"; not run yet: {len(unfinished) - len(partial)}"
             if len(unfinished) > len(partial) else ""))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
