"""A study: every arm x seed trained, evaluated and compared with the baseline by the
Multi-Bootstrap, in one command that resumes where it stopped.

    python study.py studies/better_together.toml                 # its cpu scale, all of it
    python study.py studies/better_together.toml --dry-run       # the plan and its cost
    python study.py studies/better_together.toml --scale gpu --only mlm --seeds 0   # a slice
    python study.py studies/better_together.toml --report        # REPORT.md from results only

A study file (TOML; studies/*.toml, each key explained in studies/README.md) names its arms
(an objective and its flags, optionally a source corpus to pretrain on first and transfer
from), the baseline arm, and per scale (cpu, gpu) the corpus, size, seeds, budget and
evaluations: `evaluate.py mlm` (masked-token loss and accuracy on held-out text, the same hidden
tokens for every model), `evaluate.py blimp` (BLiMP folders, temperature chosen on one half of
the pairs and reported on the other) and `evaluate.py finetune` (tasks, fine-tuning seeds).

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
"""
import argparse
import contextlib
import gzip
import hashlib
import io
import json
import os
import shlex
import subprocess
import sys
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import evaluate
from data.prepare import prepare, prepared_copies, raw_root, resolve
from data.tasks import TASKS
from multibootstrap import examples_of, multibootstrap
from results import read_result
from storage import atomic_write


REPO = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------
# The study file: every key it may hold, and what it must be ("*": any name)

SCHEMA = {
    "": {"name": str, "about": str, "baseline": str, "metrics": list, "arms": dict,
         "scales": dict},
    "arms.*": {"objective": str, "flags": str, "data": str, "source": dict, "about": str},
    "arms.*.source": {"data": str, "flags": str},
    "scales.*": {"data": str, "size": str, "seeds": list, "steps": int, "epochs": (int, float),
                 "device": str, "flags": str, "arm_flags": dict, "notes": str,
                 "corpora": dict, "source": dict, "evaluate": dict},
    "scales.*.arm_flags": {"*": str},
    "scales.*.corpora": {"*": str},
    "scales.*.source": {"steps": int, "epochs": (int, float), "flags": str},
    "scales.*.evaluate": {"mlm": dict, "blimp": list, "finetune": dict},
    "scales.*.evaluate.mlm": {"segments": int, "flags": str},
    "scales.*.evaluate.finetune": {"data_dir": str, "tasks": list, "seeds": list, "flags": str},
}
BUDGETS = ("steps", "epochs")  # words seen = epochs x the corpus' words (meta.json)
# tokens/s of an MLM step when no run of the study has finished yet (--dry-run's estimate):
# tiny on the 2-core CPU at 32 x 128 (issue 16's runs: 0.45 s/step); small and base on an H100
# at 128 x 128 (issue 19's figures); two-phase objectives cost more (docs/bench.md)
RATES = {("cpu", "tiny"): 9.1e3, ("cuda", "small"): 4.1e5, ("cuda", "base"): 2.1e5}


class StudyError(SystemExit):
    pass


def load_study(path: Path) -> dict:
    """The study file, checked against SCHEMA: one line naming the file and key, else the dict."""
    def fail(key, why):
        raise StudyError(f"error: {path}: {key}: {why}")
    try:
        spec = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise StudyError(f"error: no study file at {path}")
    except tomllib.TOMLDecodeError as e:
        raise StudyError(f"error: {path}: not valid TOML ({e})")

    def check(node, where, pattern):
        allowed = SCHEMA[pattern]
        for key, value in node.items():
            name = f"{where}.{key}" if where else key
            kind = allowed.get(key, allowed.get("*"))
            if kind is None:
                fail(name, f"unknown key (known here: {', '.join(allowed)})")
            if not isinstance(value, kind) or isinstance(value, bool):
                fail(name, f"must be a {getattr(kind, '__name__', 'number')}")
            sub = f"{pattern}.{key}" if pattern else key
            if isinstance(value, dict) and key in ("arms", "scales"):
                for child, body in value.items():
                    if not isinstance(body, dict):
                        fail(f"{name}.{child}", "must be a table")
                    check(body, f"{name}.{child}", f"{key}.*")
            elif isinstance(value, dict):
                check(value, name, sub)
    check(spec, "", "")
    arms, scales = spec.get("arms", {}), spec.get("scales", {})
    if not arms:
        fail("arms", "a study needs at least one arm")
    if not scales:
        fail("scales", "a study needs at least one scale")
    if spec.get("baseline") not in arms:
        fail("baseline", f"{spec.get('baseline')!r} is not one of the arms ({', '.join(arms)})")
    for name, arm in arms.items():
        if "objective" not in arm:
            fail(f"arms.{name}", "has no objective")
    for name, scale in scales.items():
        given = [b for b in BUDGETS if b in scale]
        if len(given) != 1:
            fail(f"scales.{name}", f"give one budget of {', '.join(BUDGETS)} (found {given})")
        if not scale.get("seeds") or not all(isinstance(s, int) for s in scale["seeds"]):
            fail(f"scales.{name}.seeds", "a list of integer seeds")
        for arm in scale.get("arm_flags", {}):
            if arm not in arms:
                fail(f"scales.{name}.arm_flags.{arm}", "not one of the arms")
        if any("source" in a for a in arms.values()) and "source" not in scale:
            fail(f"scales.{name}", "arms have a source, so the scale needs a [source] budget")
    spec.setdefault("name", path.stem)
    spec["path"] = os.path.relpath(path.resolve(), REPO) if path.resolve().is_relative_to(
        REPO) else str(path)
    return spec


# ---------------------------------------------------------------------------------------------
# The plan: jobs of steps, each step a command whose output says it is done

@dataclass
class Step:
    label: str                 # "train", "mlm", "blimp", "rte", "corpus" ...
    argv: list                 # python ARGV, run in the repository
    done: Path                 # exists once the step has succeeded


@dataclass
class Job:
    name: str                  # "kd s1", "source 3fa2 s0", "corpus zipf"
    folder: Path
    steps: list
    arm: str | None = None
    seed: int | None = None
    result: Path | None = None  # results/ARM/sSEED.json.gz, for an arm's run
    fingerprint: str = ""
    after: list = field(default_factory=list)  # jobs (by name) that must finish first


def raw_path(p) -> Path:
    """An evaluation folder: as given if absolute, else under $NANOMLM_RAW (made absolute, as the
    commands run in the repository)."""
    return Path(p) if Path(p).is_absolute() else raw_root().resolve() / p


def fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


def shown(argv) -> str:
    """A command as the report prints it: the raw data folder as $NANOMLM_RAW."""
    raw, repo = str(raw_root().resolve()), str(REPO) + os.sep
    return "python " + " ".join(shlex.quote(str(a)).replace(raw, "$NANOMLM_RAW")
                                .replace(repo, "") for a in argv)


def plan(spec: dict, scale_name: str, folder: Path, only=None, seeds=None) -> list[Job]:
    scale, arms = spec["scales"][scale_name], spec["arms"]
    ev = scale.get("evaluate", {})
    device = ["--device", scale["device"]] if "device" in scale else []
    raw = lambda p: str(raw_path(p))
    corpora = {name: folder / "corpora" / f"{name}.{spec['name']}.{scale_name}"
               for name in scale.get("corpora", {})}
    data = lambda name: str(corpora.get(name, name))
    jobs = {}
    for name, command in scale.get("corpora", {}).items():
        argv = [*shlex.split(command), "--out", str(corpora[name])]
        jobs[f"corpus {name}"] = Job(f"corpus {name}", folder / "corpora" / "logs" / name,
                                     [Step("corpus", argv, corpora[name] / ".study_done")])

    def budget(b):
        if "steps" in b:
            return ["--max-steps", str(b["steps"])]
        return ["--epochs", str(b["epochs"])]

    def train(objective, corpus, flags, seed, out, init=None, stage=scale):
        """stage: the scale, or its [source] table for a source run (budget, common flags)."""
        argv = ["train.py", "--objective", objective, "--data", data(corpus), "--seed", str(seed),
                "--out-dir", str(out), *budget(stage), *device,
                *(["--size", scale["size"]] if "size" in scale else []),
                *shlex.split(stage.get("flags", "")), *shlex.split(flags)]
        return argv + (["--init-from", str(init)] if init else [])

    for arm_name, arm in arms.items():
        if only and arm_name not in only:
            continue
        corpus = arm.get("data", scale.get("data", "babylm_10m"))
        flags = arm.get("flags", "") + " " + scale.get("arm_flags", {}).get(arm_name, "")
        for seed in seeds or scale["seeds"]:
            run = folder / arm_name / f"s{seed}"
            after, init = [], None
            if "source" in arm:
                src = arm["source"]
                key = fingerprint(src, scale["source"])[:8]
                sfolder = folder / "sources" / f"{key}_s{seed}"
                argv = train("mlm", src["data"], src.get("flags", ""), seed, sfolder,
                             stage=scale["source"])
                sname = f"source {key} s{seed}"
                needs = [f"corpus {src['data']}"] if src["data"] in corpora else []
                jobs.setdefault(sname, Job(sname, sfolder, [Step("train", argv,
                                sfolder / "study_train.json")], after=needs))
                after, init = [sname], sfolder / "ckpt.pt"
            if corpus in corpora:
                after.append(f"corpus {corpus}")
            ckpt = run / "ckpt.pt"
            steps = [Step("train", train(arm["objective"], corpus, flags, seed, run, init),
                          run / "study_train.json")]
            if "mlm" in ev:
                steps.append(Step("mlm", ["evaluate.py", "mlm", "--ckpt", str(ckpt), "--out",
                                          str(run / "eval/mlm.json"), *device,
                                          "--segments", str(ev["mlm"].get("segments", 1024)),
                                          *shlex.split(ev["mlm"].get("flags", ""))],
                                  run / "eval/mlm.json"))
            if "blimp" in ev:
                steps.append(Step("blimp", ["evaluate.py", "blimp", "--ckpt", str(ckpt), "--out",
                                            str(run / "eval/blimp.json"), *device, "--blimp-dir",
                                            *map(raw, ev["blimp"])], run / "eval/blimp.json"))
            ft = ev.get("finetune", {})
            for task in ft.get("tasks", []):
                steps.append(Step(task, [
                    "evaluate.py", "finetune", "--ckpt", str(ckpt), "--task", task,
                    "--data-dir", raw(ft["data_dir"]), "--out", str(run / f"eval/{task}.json"),
                    "--seeds", ",".join(map(str, ft.get("seeds", [1]))), *device,
                    *shlex.split(ft.get("flags", ""))], run / f"eval/{task}.json"))
            spec_scale = {k: v for k, v in scale.items() if k not in ("seeds", "device", "notes")}
            name = f"{arm_name} s{seed}"
            jobs[name] = Job(name, run, steps, arm_name, seed,
                             folder / "results" / arm_name / f"s{seed}.json.gz",
                             fingerprint(arm_name, arm, spec_scale, seed), after)
    return list(jobs.values())


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
        return lines[-1].split("error: ", 1)[-1]
    return None


def preflight(spec, scale_name, jobs, path) -> dict:
    """{job name: the settings train.py resolved for its first step}; raises StudyError."""
    scale = spec["scales"][scale_name]
    where = lambda job: (f"arms.{job.arm}" if job.arm else
                         f"arms (source) / scales.{scale_name}.source" if job.name.startswith(
                             "source") else f"scales.{scale_name}.corpora")
    fail = lambda key, why: StudyError(f"error: {path}: {key}: {why}")
    for i, m in enumerate(spec.get("metrics", [])):
        known = metric_names(scale)
        if m not in known:
            raise fail(f"metrics[{i}]", f"unknown metric {m!r} (this study's: {', '.join(known)})")
    for i, d in enumerate(scale.get("evaluate", {}).get("blimp", [])):
        if not raw_path(d).is_dir():
            raise fail(f"scales.{scale_name}.evaluate.blimp[{i}]", f"no BLiMP folder at "
                       f"{raw_path(d)}")
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
            raise fail(where(job), err.split("error: ", 1)[-1])
        settings = json.loads(out)
        rawdir, prepared = resolve(settings["data"])
        if (settings["data"] not in generated and not rawdir.is_dir()
                and not prepared_copies(prepared) and not (prepared / "meta.json").exists()):
            raise fail(where(job), f"no corpus {settings['data']!r} at {rawdir} "
                       f"(set by scales.{scale_name}.data, the arm's data or its flags)")
        resolved[job.name] = settings
    return resolved


def metric_names(scale) -> list[str]:
    """The metrics a scale's evaluations produce, in the report's order."""
    ev = scale.get("evaluate", {})
    names = ["val_loss", "val_acc"] if "mlm" in ev else []
    names += [Path(d).name for d in ev.get("blimp", [])]
    return names + list(ev.get("finetune", {}).get("tasks", []))



# ---------------------------------------------------------------------------------------------
# Running: each step a subprocess, its output in the run folder's study.log

lock = threading.Lock()


def say(text):
    with lock:
        print(text, flush=True)


def run_job(job: Job, env: dict, counter) -> str | None:
    """The job's steps not yet done, in order; its result file at the end. None, or the error."""
    job.folder.mkdir(parents=True, exist_ok=True)
    log = job.folder / "study.log"
    for step in job.steps:
        if step.done.exists() and step.label in ("train", "corpus"):
            if json.loads(step.done.read_text()).get("argv", step.argv) != step.argv:
                error = (f"{job.folder} was made by another command than the study file's "
                         f"now; move it away to run it again")
                say(f"    {job.name}: FAILED ({error})")
                return error
        if step.done.exists():
            continue
        argv = list(step.argv)
        resuming = step.label == "train" and (job.folder / "ckpt.pt").exists()
        if resuming:
            argv.append("--resume")
        say(f"[{counter()}] {job.name}: {step.label}" + (" (resuming)" if resuming else ""))
        t0 = time.time()
        with open(log, "a") as f:
            f.write(f"\n$ {shown(argv)}\n")
            f.flush()
            rc = subprocess.run([sys.executable, *argv], cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT, env=env).returncode
        seconds = time.time() - t0
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
    if job.result and not job.result.exists():
        write_job_result(job)
    return None


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

def write_job_result(job: Job):
    run, out = job.folder, {}
    records = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
    args = json.loads((run / "args.json").read_text())
    train_log = [r for r in records if "tok_per_s" in r]
    times = [json.loads(x) for x in (run / "study_times.jsonl").read_text().splitlines()]
    tokens = args["max_steps"] * args["batch_size"] * args["grad_accum"] * args["seq_len"]
    out["compute"] = {
        "device": device_name(args["device"]), "steps": args["max_steps"], "tokens": tokens,
        "tok_per_s": float(np.median([r["tok_per_s"] for r in train_log])) if train_log else None,
        "train_s": sum(t["seconds"] for t in times if t["step"] == "train"),
        "eval_s": sum(t["seconds"] for t in times if t["step"] != "train"),
        "date": time.strftime("%Y-%m-%d")}
    out["curve"] = [r for r in records if any(k.startswith("val_") for k in r)]
    out["commands"] = [shown(s.argv) for s in job.steps]
    eval_dir = run / "eval"
    if (eval_dir / "mlm.json").exists():
        r = read_result(eval_dir / "mlm.json")
        out["val_loss"], out["val_acc"] = r["examples_loss"], r["examples"]
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
    job.result.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(job.result) as tmp, gzip.open(tmp, "wt", encoding="utf-8") as f:
        json.dump(result, f)
    job.result.with_name(job.result.name.replace(".json.gz", ".failed")).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The report: from results/ alone

def read_results(folder: Path, jobs_by_arm: dict) -> tuple[dict, list, list]:
    """({arm: [result, ...] by seed}, stale files, failures). A result whose fingerprint is not
    the plan's (the study file changed since) is stale: listed, never compared."""
    results, stale, failed = {}, [], []
    for path in sorted((folder / "results").glob("*/s*.json.gz")):
        r = read_result(path)
        if r.get("fingerprint") != jobs_by_arm.get((r.get("arm"), r.get("seed"))):
            stale.append(str(path.relative_to(folder)))
            continue
        results.setdefault(r["arm"], []).append(r)
    for path in sorted((folder / "results").glob("*/s*.failed")):
        failed.append(json.loads(path.read_text()))
    return {a: sorted(rs, key=lambda r: r["seed"]) for a, rs in results.items()}, stale, failed


def subset(ex: dict, keep: np.ndarray) -> dict:
    return {**ex, "id": [ex["id"][i] for i in keep], "label": ex["label"][keep],
            "pred": ex["pred"][:, keep]}


def compare_arms(spec, scale_name, results, nboot) -> dict:
    """{metric: {arm: multibootstrap(baseline, arm)}} and per BLiMP phenomenon."""
    base = spec["baseline"]
    out, phen = {}, {}
    if base not in results:
        return {"metrics": out, "phenomena": phen}
    names = spec.get("metrics") or metric_names(spec["scales"][scale_name])
    for m in names:
        A = [examples_of(r, m, f"{base} s{r['seed']}") for r in results[base] if m in r]
        for arm, rs in results.items():
            B = [examples_of(r, m, f"{arm} s{r['seed']}") for r in rs if m in r]
            if A and B:
                out.setdefault(m, {})[arm] = multibootstrap(A, B, nboot)
            if A and B and "phenomenon" in results[base][0].get(m, {}):
                labels = np.array(results[base][0][m]["phenomenon"])
                for p in np.unique(labels):
                    keep = np.flatnonzero(labels == p)
                    phen.setdefault(m, {}).setdefault(str(p), {})[arm] = multibootstrap(
                        [subset(a, keep) for a in A], [subset(b, keep) for b in B], nboot)
    return {"metrics": out, "phenomena": phen}


def fmt(x, better) -> str:
    return f"{100 * x:.2f}" if better == "higher" else f"{x:.4f}"


def signed(x, better) -> str:
    return ("+" if x >= 0 else "-") + fmt(abs(x), better)


def ran_in(results: dict) -> Path | None:
    """The study folder the runs were made in, read from an arm's recorded train command (its
    --out-dir is FOLDER/ARM/sSEED): a report may be built in another (--report --out)."""
    for r in (r for rs in results.values() for r in rs):
        argv = shlex.split(r["commands"][0])
        if "--out-dir" in argv:
            return Path(argv[argv.index("--out-dir") + 1]).parent.parent
    return None


def build_report(spec, scale_name, folder, jobs, nboot, figures=True) -> str:
    scale = spec["scales"][scale_name]
    arms = list(spec["arms"])
    planned = {(j.arm, j.seed): j.fingerprint for j in jobs if j.arm}
    results, stale, failed = read_results(folder, planned)
    comp = compare_arms(spec, scale_name, results, nboot)
    base = spec["baseline"]
    held = sum(len(v) for v in results.values())
    lines = [f"# Study `{spec['name']}`, scale `{scale_name}`", ""]
    if spec.get("about"):
        lines += [spec["about"].strip(), ""]
    devices = sorted({r["compute"]["device"] for rs in results.values() for r in rs})
    dates = sorted({r["compute"]["date"] for rs in results.values() for r in rs})
    lines += [f"Holds {held} of the {len(planned)} runs planned ({len(arms)} arms x "
              f"{len(scale['seeds'])} seeds {scale['seeds']}); made on {', '.join(devices) or '-'}"
              f", {', '.join(dates) or '-'}. Baseline: `{base}`. Built by `python study.py "
              f"{spec['path']} --scale {scale_name} --report"
              + ("" if folder == REPO / "runs" / spec["name"] / scale_name else
                 f" --out {os.path.relpath(folder.resolve(), REPO)}") + "` from "
              "`results/` alone.", ""]
    if scale.get("notes"):
        lines += [scale["notes"].strip(), ""]
    lines += ["B - A is each arm minus the baseline, with its 95% Multi-Bootstrap interval "
              "(pretraining seeds and examples resampled jointly, `evaluate.py compare`) and p = "
              "P(B is not better than A). val_loss is lower-better (nats); the other metrics are "
              "percentages. One seed is a demo, not a verdict.", ""]
    for m, by_arm in comp["metrics"].items():
        better = next(iter(by_arm.values()))["better"]
        lines += [f"## {m}" + (" (lower is better)" if better == "lower" else ""), "",
                  "| arm | seeds | mean | B - A | 95% interval | p |", "|---|---|---|---|---|---|"]
        for arm in arms:
            if arm not in by_arm:
                continue
            r = by_arm[arm]
            if arm == base:
                lines.append(f"| **{arm}** (baseline) | {len(r['seeds_b'])} | "
                             f"{fmt(r['mean_b'], better)} | | | |")
            else:
                lo, hi = r["ci95"]
                p = f"{'< ' if r.get('p_floored') else ''}{r['p']:.3f}"  # below 1/nboot: floored
                lines.append(f"| {arm} | {len(r['seeds_b'])} | {fmt(r['mean_b'], better)} | "
                             f"{signed(r['diff'], better)} | {signed(lo, better)} .. "
                             f"{signed(hi, better)} | {p} |")
        lines.append("")
    for m, by_phen in comp["phenomena"].items():
        shown_arms = [a for a in arms if a in next(iter(by_phen.values()))]
        lines += [f"## {m} per phenomenon", "",
                  f"Accuracy (%) on the reporting half; for each arm B - A [95% interval] "
                  f"against `{base}`.", "",
                  "| phenomenon | pairs | " + " | ".join(shown_arms) + " |",
                  "|---|---|" + "---|" * len(shown_arms)]
        for p, by_arm in by_phen.items():
            n = sum(x == p for x in results[base][0][m]["phenomenon"])
            cells = []
            for a in shown_arms:
                r = by_arm[a]
                cells.append(f"{100 * r['mean_b']:.1f}" if a == base else
                             f"{100 * r['mean_b']:.1f} ({100 * r['diff']:+.1f} "
                             f"[{100 * r['ci95'][0]:+.1f}, {100 * r['ci95'][1]:+.1f}])")
            lines.append(f"| {p} | {n} | " + " | ".join(cells) + " |")
        lines.append("")
    tasks = {t for rs in results.values() for r in rs for t in r.get("finetune", {})}
    if tasks:
        lines += ["## Fine-tuning, per task (mean +- std over pretraining x fine-tuning seeds)",
                  "", "| arm | " + " | ".join(sorted(tasks)) + " |",
                  "|---|" + "---|" * len(tasks)]
        for arm in arms:
            cells = []
            for t in sorted(tasks):
                v = [x for r in results.get(arm, []) for m in list(r.get("finetune", {}).get(
                    t, {}).values())[:1] for x in m["values"]]
                cells.append(f"{100 * np.mean(v):.2f} +- {100 * np.std(v):.2f}" if v else "-")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Compute", "", "| arm | runs | steps | tokens | train min (mean) | "
              "eval min (mean) | tokens/s (median) | device |", "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        rs = results.get(arm, [])
        if rs:
            c = [r["compute"] for r in rs]
            rate = [x["tok_per_s"] for x in c if x["tok_per_s"]]
            lines.append(f"| {arm} | {len(rs)} | {c[0]['steps']} | {c[0]['tokens']:,} | "
                         f"{np.mean([x['train_s'] for x in c]) / 60:.1f} | "
                         f"{np.mean([x['eval_s'] for x in c]) / 60:.1f} | "
                         f"{np.median(rate):,.0f} | {c[0]['device']} |")
    lines.append("")
    lines += ["Train time is study.py's clock around train.py (set-up, phase-1 teacher, "
              "dictionary and validation included); tokens/s is the training loop's own figure.",
              ""]
    if failed or stale:
        lines += ["## Not in the comparison", ""]
        lines += [f"- `{f['arm']}` seed {f['seed']} failed: {f['error']} (log: {f['log']})"
                  for f in failed]
        lines += [f"- `{s}`: made with other settings than the study file's now (stale)"
                  for s in stale]
        lines.append("")
    lines += ["## Commands", "", "Each run, as study.py ran it (seed "
              f"{scale['seeds'][0]}; the other seeds change `--seed` and the folders):", ""]
    # corpus and source runs keep no result file: plan them again where the arms ran
    root = ran_in(results)
    as_ran = {j.name: j for j in plan(spec, scale_name, root)} if root else {}
    for j in jobs:
        if j.seed == scale["seeds"][0] or (j.arm is None and j.name.endswith(
                f"s{scale['seeds'][0]}")) or j.name.startswith("corpus"):
            ran = [r for r in results.get(j.arm, []) if r["seed"] == j.seed]  # as it was run
            commands = ran[0]["commands"] if ran else [
                shown(s.argv) for s in as_ran.get(j.name, j).steps]
            lines += [f"`{j.name}`:", "```bash", *commands, "```"]
    if figures:
        lines += ["", *draw_figures(folder, spec, results, comp)]
    (folder / "report.json").write_text(json.dumps(
        {"study": spec["name"], "scale": scale_name, "runs": held, "planned": len(planned),
         "stale": stale, "failed": failed, **comp}, indent=1, default=float))
    text = "\n".join(lines) + "\n"
    (folder / "REPORT.md").write_text(text)
    return text


def mlm_curve(records) -> tuple[list, list]:
    """(steps, validation MLM losses) of a run's log: val_mlm where the objective logs it (boot,
    kd, kd+mlm, mlsm+mlm), val_loss where the loss is MLM itself (records with no other figure:
    mlm, and every phase 1); mlsm's phase 2 logs no MLM loss and is left out."""
    xs, ys = [], []
    for r in records:
        y = r.get("val_mlm", r.get("val_loss") if set(r) <= {"step", "val_loss", "val_acc"}
                  else None)
        if y is not None:
            xs.append(r["step"])
            ys.append(y)
    return xs, ys


def draw_figures(folder, spec, results, comp) -> list[str]:
    """curves.png and blimp.png when matplotlib is there; the report's lines about them."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["Figures: `pip install matplotlib`, then run study.py again with `--report`."]
    out = ["## Figures", ""]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in spec["arms"]:
        curves = [mlm_curve(r["curve"]) for r in results.get(arm, [])]
        curves = [c for c in curves if len(c[0]) > 1]  # mlsm: phase 1's last point alone
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c[0]) for c in curves)))
        ys = np.array([[dict(zip(*c))[s] for s in steps] for c in curves])   # (seeds, steps)
        line, = ax.plot(steps, ys.mean(0), label=f"{arm} ({len(curves)} seeds)")
        ax.fill_between(steps, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
    ax.set(xlabel="step", ylabel="validation MLM loss (nats)",
           title="Validation MLM loss as each run logged it (band: min-max over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=110)
    plt.close(fig)
    out += ["![validation curves](curves.png)", "", "The curves are train.py's own validation "
            "(each arm's masking); the table's val_loss is `evaluate.py mlm`'s, the same hidden "
            "tokens for every arm.", ""]
    for m, by_phen in comp["phenomena"].items():
        phens = list(by_phen)
        arms = [a for a in spec["arms"] if a != spec["baseline"] and a in by_phen[phens[0]]]
        if not arms:
            continue
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(phens) * max(1, len(arms)) / 2 + 1.5))
        height = 0.8 / len(arms)
        for i, a in enumerate(arms):
            d = np.array([100 * by_phen[p][a]["diff"] for p in phens])
            lo = np.array([100 * by_phen[p][a]["ci95"][0] for p in phens])
            hi = np.array([100 * by_phen[p][a]["ci95"][1] for p in phens])
            y = np.arange(len(phens)) + i * height
            ax.errorbar(d, y, xerr=[d - lo, hi - d], fmt="o", ms=3, capsize=2, label=a)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_yticks(np.arange(len(phens)) + 0.4 - height / 2, phens, fontsize=7)
        ax.set(xlabel=f"accuracy B - {spec['baseline']} (points), 95% interval",
               title=f"{m} per phenomenon")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / f"{m}.png", dpi=110)
        plt.close(fig)
        out += [f"![{m} per phenomenon]({m}.png)", ""]
    return out


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("study", help="the study file, e.g. studies/better_together.toml")
    add("--scale", default="cpu", help="which of the file's scales (default cpu)")
    add("--only", default=None, help="comma-separated arms to run (default all)")
    add("--seeds", default=None, help="comma-separated seeds to run (default the scale's)")
    add("--dry-run", action="store_true", help="print the plan and its estimated cost, run nothing")
    add("--report", action="store_true", help="only rebuild REPORT.md from results/")
    add("--parallel", type=int, default=1, help="runs at once (several GPUs: one each; on one "
        "GPU four small runs together were no faster than one after another) (default 1)")
    add("--out", default=None, help="the study folder (default runs/STUDY/SCALE)")
    add("--nboot", type=int, default=1000, help="bootstrap resamples per comparison "
        "(default 1000)")
    add("--no-figures", action="store_true", help="no PNGs even when matplotlib is installed")
    args = ap.parse_args(argv)
    path = Path(args.study)
    spec = load_study(path)
    if args.scale not in spec["scales"]:
        raise StudyError(f"error: {path}: scales: no scale {args.scale!r} (the file has "
                         f"{', '.join(spec['scales'])})")
    only = args.only.split(",") if args.only else None
    for a in only or []:
        if a not in spec["arms"]:
            raise StudyError(f"error: --only {a}: {path} has no such arm "
                             f"({', '.join(spec['arms'])})")
    try:
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else None
    except ValueError:
        raise StudyError(f"error: --seeds {args.seeds}: give comma-separated integers")
    folder = Path(args.out) if args.out else REPO / "runs" / spec["name"] / args.scale
    jobs = plan(spec, args.scale, folder, only, seeds)
    if args.report:
        print(build_report(spec, args.scale, folder, plan(spec, args.scale, folder), args.nboot,
                           not args.no_figures))
        return
    resolved = preflight(spec, args.scale, jobs, path)
    if args.dry_run:
        print(f"{spec['name']}, scale {args.scale}: {len(jobs)} jobs into {folder}")
        print("\n".join(estimate(jobs, resolved, folder)))
        for j in jobs:
            print(f"\n{j.name}:\n" + "\n".join("  " + shown(s.argv) for s in j.steps))
        return
    todo = [j for j in jobs if not done(j)]
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
    print(f"{spec['name']}, scale {args.scale}: {len(todo)} of {len(jobs)} jobs to run into "
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
            error = run_job(job, e, counter)
            if error:
                failed[job.name] = error
        finally:
            with lock:
                slots.append(slot)
                finished.add(job.name)
    # waves: a job runs once the jobs it needs (its corpus, its source run) have finished
    with ThreadPoolExecutor(args.parallel) as pool:
        pending = list(todo)
        while pending:
            wave = [j for j in pending if all(a in finished for a in j.after)]
            if not wave:  # what they need is not in this slice: run it first
                wave = pending
            list(pool.map(work, wave))
            pending = [j for j in pending if j not in wave]
    text = build_report(spec, args.scale, folder, plan(spec, args.scale, folder), args.nboot,
                        not args.no_figures)
    print(f"\nwrote {folder / 'REPORT.md'} ({len(text.splitlines())} lines)"
          + (f"; {len(failed)} jobs failed: " + ", ".join(failed) if failed else ""))
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
