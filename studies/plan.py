"""A study file and its plan: the file checked against SCHEMA (one line naming the key that is
wrong), and every arm x seed turned into jobs of steps, each step a command a user could type
(train.py, evaluate.py, synth.py) with the file whose existence says it is done. Run through
`python study.py STUDY.toml` (study.py's docstring has the layout of a study folder).
"""
import hashlib
import json
import os
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from data.masking import HELD_OUT_MASKINGS
from data.prepare import raw_root
from machinery.plumbing import REPO


# ---------------------------------------------------------------------------------------------
# The study file: every key it may hold, and what it must be ("*": any name)

SCHEMA = {
    "": {"name": str, "about": str, "baseline": str, "metrics": list, "arms": dict,
         "scales": dict},
    "arms.*": {"objective": str, "flags": str, "data": str, "source": dict, "about": str},
    "arms.*.source": {"data": str, "flags": str},
    "scales.*": {"data": str, "size": str, "seeds": list, "arms": list, "steps": int,
                 "epochs": (int, float),
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


class StudyError(SystemExit):
    pass


def load_study(path: Path) -> dict:
    """The study file, checked against SCHEMA: one line naming the file and key, else the dict."""
    def fail(key, why):
        raise StudyError(f"error: {path}: {key}: {why}")
    try:
        study = tomllib.loads(path.read_text())
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
    check(study, "", "")
    arms, scales = study.get("arms", {}), study.get("scales", {})
    if not arms:
        fail("arms", "a study needs at least one arm")
    if not scales:
        fail("scales", "a study needs at least one scale")
    if study.get("baseline") not in arms:
        fail("baseline", f"{study.get('baseline')!r} is not one of the arms ({', '.join(arms)})")
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
        for i, arm in enumerate(scale.get("arms", [])):
            if arm not in arms:
                fail(f"scales.{name}.arms[{i}]", f"{arm!r} is not one of the arms")
        if "arms" in scale and study["baseline"] not in scale["arms"]:
            fail(f"scales.{name}.arms", f"must hold the baseline, {study['baseline']!r}")
        if any("source" in a for a in arms.values()) and "source" not in scale:
            fail(f"scales.{name}", "arms have a source, so the scale needs a [source] budget")
    study.setdefault("name", path.stem)
    study["path"] = os.path.relpath(path.resolve(), REPO) if path.resolve().is_relative_to(
        REPO) else str(path)
    return study


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


def plan(study: dict, scale_name: str, folder: Path, only=None, seeds=None) -> list[Job]:
    scale, arms = study["scales"][scale_name], study["arms"]
    ev = scale.get("evaluate", {})
    device = ["--device", scale["device"]] if "device" in scale else []
    raw = lambda p: str(raw_path(p))
    corpora = {name: folder / "corpora" / f"{name}.{study['name']}.{scale_name}"
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
        if only and arm_name not in only or arm_name not in scale_arms(study, scale_name):
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
            # a run's fingerprint: not the keys that change no run (which arms a scale runs)
            spec_scale = {k: v for k, v in scale.items()
                          if k not in ("seeds", "device", "notes", "arms")}
            name = f"{arm_name} s{seed}"
            jobs[name] = Job(name, run, steps, arm_name, seed,
                             folder / "results" / arm_name / f"s{seed}.json.gz",
                             fingerprint(arm_name, arm, spec_scale, seed), after)
    return list(jobs.values())


def scale_arms(study: dict, scale_name: str) -> list[str]:
    """The arms a scale runs: its `arms`, else all of the study's, in the file's order."""
    chosen = study["scales"][scale_name].get("arms")
    return [a for a in study["arms"] if chosen is None or a in chosen]


def verdict_metrics(scale) -> list[str]:
    """The metrics a scale's verdicts stand on: the field's measures, BLiMP (each folder) and
    fine-tuning (each task)."""
    ev = scale.get("evaluate", {})
    return [Path(d).name for d in ev.get("blimp", [])] + list(ev.get("finetune", {}).get(
        "tasks", []))


def diagnostic_metrics(scale) -> list[str]:
    """The held-out masked-token loss and accuracy under each masking `evaluate.py mlm` scores
    (loss_uniform, acc_uniform, ...): diagnostics, never a verdict, since a masking favours the
    arms that trained on it (docs/evaluation.md)."""
    ev = scale.get("evaluate", {})
    if "mlm" not in ev:
        return []
    argv = shlex.split(ev["mlm"].get("flags", "").replace("--maskings=", "--maskings "))
    maskings = (argv[argv.index("--maskings") + 1].split(",") if "--maskings" in argv else
                HELD_OUT_MASKINGS)
    return [f"{m}_{masking}" for m in ("loss", "acc") for masking in maskings]


def metric_names(scale) -> list[str]:
    """The metrics a scale's evaluations produce, in the report's order: verdicts first."""
    return verdict_metrics(scale) + diagnostic_metrics(scale)
