"""gpu_check.sh --smoke: every tier of the GPU check, run on the CPU as a GPU machine would run it
(../shared/GPU.md): `carry` builds the carried folder from a raw root, and each tier, reading
only that, writes its results into $OUT as it measures them. A lent GPU is rare; the script it
runs has run here first."""
import contextlib
import gzip
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import objectives
import warm_python
from conftest import REPO, shared_data


def gpu_check(*args, env, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "gpu_check.sh"), *map(str, args)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


SCALE_FLAGS = ("--size tiny --n-layer 1 --d-model 64 --n-head 2 --d-ff 128 --seq-len 32 "
               "--batch-size 8 --eval-every 3 --vocab-size 2000 --device cpu")
STUDY = f"""
name = "tiny"
baseline = "mlm"
[arms.long]
objective = "mlm"
flags = "--max-steps 100000 --eval-every 100000"
[arms.mlm]
objective = "mlm"
[scales.cpu]
data = "babylm_10m"
seeds = [0]
steps = 6
flags = "{SCALE_FLAGS}"
[scales.cpu.evaluate]
mlm = {{ segments = 8 }}
blimp = ["babylm_eval/full_eval/blimp_filtered", "babylm_eval/full_eval/supplement_filtered"]
"""


@pytest.fixture(scope="module")
def carried(small_raw, tmp_path_factory) -> dict:
    """`gpu_check.sh carry STUDY` run on a raw root laid out as ../shared/data (babylm_10m: the
    tests' small corpus, under a 2000-piece tokenizer; BLiMP and its supplement: two paradigms
    each of the fast sets; the study names both, so headline finds them too). Returns the
    environment the tiers run in."""
    root = tmp_path_factory.mktemp("gpu")
    raw = root / "raw"
    (raw / "babylm_10m").mkdir(parents=True)
    for f in small_raw.iterdir():
        (raw / "babylm_10m" / f.name).symlink_to(f)
    fast = shared_data().resolve() / "babylm_eval" / "fast_eval"
    for ours, theirs in (("blimp_filtered", "blimp_fast"), ("supplement_filtered",
                                                            "supplement_fast")):
        folder = raw / "babylm_eval" / "full_eval" / ours
        folder.mkdir(parents=True)
        for f in sorted((fast / theirs).glob("*.jsonl"))[:2]:
            (folder / f.name).write_text("".join(f.read_text().splitlines(True)[:16]))
    (root / "tiny.toml").write_text(STUDY)
    env = {**os.environ, "NANOMLM_RAW": str(raw), "GPU_DATA": str(root / "carried"),
           "VOCAB_SIZE": "2000", "OMP_NUM_THREADS": "1",
           "PYTHON": str(warm_python.launcher())}  # python, warm where it runs a script
    r = gpu_check("carry", root / "tiny.toml", "cpu", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    env["NANOMLM_RAW"] = str(root / "elsewhere")  # the tiers read the carried folder alone
    return env


@pytest.fixture(scope="module")
def ran(carried, tmp_path_factory) -> dict:
    """{tier: (its CompletedProcess, its $OUT)}: the two tiers run end to end with --smoke, side
    by side (each is mostly one single-threaded process after another; the tests' machine has 2
    cores): study, the one the next GPU window runs, and headline, whose summary is the script's
    own. The other tiers are checked by their plans (`plans`). The study's budget is measured,
    not fixed: a busy machine gets a longer one (study_budget)."""
    study = Path(carried["GPU_DATA"]).parent / "tiny.toml"  # carried with its evaluation data
    tiers = {"study": [study], "headline": []}
    budget = study_budget(carried, tmp_path_factory.mktemp("yardstick"))

    def run(tier):
        out = tmp_path_factory.mktemp(tier)
        env = {**carried, "OUT": out, **(budget if tier == "study" else {})}
        return gpu_check("--smoke", tier, *tiers[tier], env=env), out
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(tiers, pool.map(run, tiers)))


def study_budget(carried, tmp) -> dict:
    """BUDGET and EVAL_S for the tiny study, from the seconds t of one run like its mlm job (6
    steps, its validations), started as the tier starts its jobs. The long run trains until
    BUDGET - EVAL_S: 25 s at the least, 8 t on a busy machine, so that mlm's run, beside it, has
    ended long before. EVAL_S, what is left for the evaluations and the report, is a ceiling and
    not a wait (the tier ends when study.py ends), so it is generous: a load that rises after t
    was measured slows the evaluations and fails nothing."""
    t0 = time.time()
    r = subprocess.run([carried["PYTHON"], "train.py", "--data", "babylm_10m", "--max-steps", "6",
                        *SCALE_FLAGS.split(), "--out-dir", str(tmp / "mlm")], cwd=REPO,
                       capture_output=True, text=True,
                       env={**carried, "NANOMLM_DATA": f"{carried['GPU_DATA']}/prep"})
    assert r.returncode == 0, r.stderr[-2000:]
    t = time.time() - t0
    print(f"study_budget: a run like the study's mlm job took {t:.1f} s")  # pytest -s shows it
    eval_s = 600
    return {"BUDGET": str(eval_s + max(25, round(8 * t))), "EVAL_S": str(eval_s)}


def test_carry_makes_one_prepared_corpus_the_evaluation_folders_and_the_commit(carried):
    g = carried["GPU_DATA"]
    prepared = os.listdir(f"{g}/prep")
    assert len(prepared) == 1 and prepared[0].startswith("babylm_10m-")
    for name in ("blimp_filtered", "supplement_filtered"):
        assert len(os.listdir(f"{g}/raw/babylm_eval/full_eval/{name}")) == 2
    commit = open(f"{g}/commit").read().split()[0]
    assert commit == subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True).stdout.strip()


def back(out) -> dict:
    """What $OUT holds: {name: text} of its files, as the device tool returns them."""
    files = {p.relative_to(out).as_posix(): p for p in out.rglob("*") if p.is_file()}
    assert len(files) <= 8 and all(name.count("/") <= 2 for name in files), sorted(files)
    return files


def parts(out) -> dict:
    """{part: its progress line} from progress.txt."""
    lines = (out / "progress.txt").read_text().splitlines()
    return {line.split("] ")[1].split(":")[0]: line for line in lines}



def test_headline(ran):
    """The smoke run is stopped at step 10 of 1000, as a run too long for the command is
    stopped at its limit: BLiMP scores the checkpoint it saved, and the summary projects the
    whole run from the measured step time."""
    r, tmp_path = ran["headline"]
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert set(back(tmp_path)) == {"env.txt", "progress.txt", "train.log", "log.jsonl",
                                   "blimp.log", "blimp.json.gz", "summary.json"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["max_steps"] == 1000 and not summary["finished"]
    assert summary["projected_train_s"] == summary["train_wall_s"] + 990 * summary["step_s"]
    assert summary["val"]["val_loss"] > 0 and summary["blimp_sentences_per_s"] > 0
    assert set(summary["blimp"]) == {"blimp_filtered", "supplement_filtered"}
    blimp = json.loads(gzip.decompress((tmp_path / "blimp.json.gz").read_bytes()))
    assert len(blimp["pairs"]) == 2 * 2 * 16 and blimp["ckpt"].endswith("ckpt.pt")






# the parts each tier plans, in order, with --smoke and on the GPU; and the study a GPU window
# runs next (issue order, ../shared/GPU.md), planned as its window would run it
PARTS = {"speed": ["check", "forms", "step", "graphs", "layers"], "verify": ["tests", "steps"],
         "objectives": ["tests", "steps"], "compare": ["bert", "bert_base"],
         "rest": ["dictionary", "kernels"], "headline": ["train"], "study": ["study"]}
GPU_STUDY = ["studies/gpt_bert.toml", "window", "mlm,gpt-bert", "0,1,2"]


@pytest.fixture(scope="module")
def plans(carried, tmp_path_factory) -> dict:
    """{(tier, smoke): (its CompletedProcess, its $OUT)}: every tier with PLAN=all, with --smoke
    and without (the commands a GPU runs), two at a time: each part's command is written to
    plan.txt, none runs."""
    smoke_study = [Path(carried["GPU_DATA"]).parent / "tiny.toml"]

    def run(key):
        tier, smoke = key
        out = tmp_path_factory.mktemp(f"plan-{tier}")
        args = (smoke_study if smoke else GPU_STUDY) if tier == "study" else []
        return gpu_check(*["--smoke"][:smoke], tier, *args,
                         env={**carried, "OUT": out, "PLAN": "all"}), out
    keys = [(tier, smoke) for tier in PARTS for smoke in (True, False)]
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(keys, pool.map(run, keys)))


def planned(out) -> list:
    """plan.txt's lines: [(part, limit, argv)]."""
    lines = (out / "plan.txt").read_text().splitlines()
    return [(name, int(limit), shlex.split(cmd)) for name, limit, cmd in
            (line.split("\t") for line in lines)]


def accepts(argv, tmp):
    """Check the flags of a planned command as the tool it runs checks them, nothing run:
    train.py's get_args; bench.py's, and train.py's for each timed run of its step rows;
    evaluate.py's parser; study.py's, its file, scale and arms, and every job's train.py flags;
    pytest on tests/test_cuda.py (its selections: test_every_cuda_test_runs_in_a_tier)."""
    import bench
    import evaluate
    import study
    import train
    from studies.plan import load_study, plan
    tool, flags = argv[1], argv[2:]
    if tool == "train.py":
        train.get_args(flags)
    elif tool == "bench.py":
        args = bench.get_args(flags)
        if "step" in args.only.split(","):
            for objective in args.objectives:
                train.get_args(bench.train_flags(args, torch.device(args.device), objective,
                                                 args.sizes[0], tmp / objective))
    elif tool == "evaluate.py":
        evaluate.build_parser().parse_args(flags)
    elif tool == "study.py":
        args = study.build_parser().parse_args(flags)
        spec = load_study(Path(args.study))
        jobs = plan(spec, args.scale, tmp, args.only.split(",") if args.only else None,
                    args.seeds)
        steps = [s.argv for j in jobs for s in j.steps if s.argv[0] == "train.py"]
        assert steps, jobs
        for step in steps:
            train.get_args(step[1:])
    else:
        assert argv[1:3] == ["-m", "pytest"] and "tests/test_cuda.py" in argv, argv


@pytest.mark.parametrize("smoke", [True, False], ids=["smoke", "gpu"])
@pytest.mark.parametrize("tier", PARTS)
def test_every_tier_plans_commands_its_tools_accept(plans, tier, smoke, tmp_path):
    """Each tier's parts, in order, each within the budget, each command one its tool accepts;
    the GPU's on the GPU (--device cuda, the small model), the smoke's on the CPU."""
    r, out = plans[tier, smoke]
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    steps = planned(out)
    assert [name for name, _, _ in steps] == PARTS[tier]
    assert all(0 < limit <= 460 for _, limit, _ in steps)
    for _, _, argv in steps:
        if argv[1] not in ("-m", "study.py"):  # (a study's scale names its device)
            assert argv[argv.index("--device") + 1] == ("cpu" if smoke else "cuda"), argv
        accepts(argv, tmp_path)
    env = (out / "env.txt").read_text()
    assert f"tier: {tier}" in env and "torch " in env and "commit: " in env
    assert ("(smoke)" in env) == smoke


def test_the_plans_measure_what_each_tier_says(plans):
    """What the GPU's commands measure: verify and objectives between them the step rows of
    every objective, compare ours against BERT at small and base, rest the mlsm+mlm dictionary
    at small and the kernels, speed each attention form against BERT (profiled) and then the
    fastest in train.py three ways, headline mlm at its defaults."""
    gpu = {tier: {name: argv for name, _, argv in planned(plans[tier, False][1])}
           for tier in PARTS}
    flag = lambda argv, name: argv[argv.index(name) + 1]
    timed = [flag(gpu[t]["steps"], "--objectives").split(",") for t in ("verify", "objectives")]
    assert timed[0][0] == timed[1][0] == "mlm"
    assert set(timed[0] + timed[1]) == set(objectives.OBJECTIVES)
    assert flag(gpu["compare"]["bert"], "--sizes") == "small"
    assert flag(gpu["compare"]["bert_base"], "--sizes") == "base"
    assert flag(gpu["rest"]["dictionary"], "--objective") == "mlsm+mlm"
    assert flag(gpu["rest"]["kernels"], "--only") == "ltg,attn,pll"
    assert flag(gpu["speed"]["forms"], "--attention") == "gather,fused,gather-fp32,onehot"
    assert "--profile" in gpu["speed"]["forms"]
    assert [flag(gpu["speed"][run], "--attention") for run in ("step", "graphs", "layers")] == [
        "gather"] * 3  # no forms.json: the gather, the others' baseline
    assert "--cuda-graphs" in gpu["speed"]["graphs"]
    assert flag(gpu["speed"]["layers"], "--compile-scope") == "layers"
    headline = gpu["headline"]["train"]
    assert flag(headline, "--objective") == "mlm" and "--size" not in headline  # its defaults


def test_speed_measures_train_py_in_the_fastest_form_the_forms_part_found(carried, tmp_path):
    """The forms part's rows (here written beforehand, the part planned) choose the form the
    step, graphs and layers runs use: the fastest that did not fail."""
    rows = [{"form": "gather", "ours": 1.0}, {"form": "onehot", "ours": 3.0},
            {"form": "gather-fp32", "ours": 9.0, "failed": "no"}]
    (tmp_path / "forms.json").write_text(json.dumps({"rows": rows}))
    r = gpu_check("--smoke", "speed", env={**carried, "OUT": str(tmp_path), "PLAN": "all"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert parts(tmp_path)["fastest form"].endswith("fastest form: onehot")
    runs = {name: argv for name, _, argv in planned(tmp_path)}
    assert all(runs[run][runs[run].index("--attention") + 1] == "onehot"
               for run in ("step", "graphs", "layers"))


def test_a_failed_part_is_named_and_the_tier_exits_1(carried, tmp_path):
    """speed with a BertForMaskedLM that cannot be built (a stand-in package, first on the
    path): the forms part's row fails, every later part is still reached (in the gather, no form
    having been measured; planned here, not run), the failed part is named in one line, and the
    tier exits 1."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "transformers.py").write_text(
        "class BertConfig:\n    def __init__(self, **kw):\n"
        "        raise RuntimeError('broken by the test')\n\n\nBertForMaskedLM = None\n")
    env = {**carried, "OUT": str(tmp_path / "out"), "PYTHONPATH": str(broken), "FORMS": "gather",
           "PLAN": "check,step,graphs,layers"}
    r = gpu_check("--smoke", "speed", env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: speed: forms failed"), r.stderr
    done = parts(tmp_path / "out")
    assert "exit 1 in" in done["forms"] and done["fastest form"].endswith(": gather")
    assert all(": planned " in done[p] for p in ("check", "step", "graphs", "layers")), done
    assert done["failed"].endswith("failed: forms")
    [row] = json.loads((tmp_path / "out" / "forms.json").read_text())["rows"]
    assert "broken by the test" in row["failed"]


def test_a_study_window_carries_its_evaluation_data_alone(carried, tmp_path):
    """carry with a study: the corpus, the commit, and the folders the study's scale names, not
    the full BLiMP that headline reads (here the study names the supplement alone)."""
    g = Path(carried["GPU_DATA"])
    shutil.copytree(g / "prep", tmp_path / "carried" / "prep")  # prepared once already
    study = tmp_path / "supplement.toml"
    study.write_text(STUDY.replace('"babylm_eval/full_eval/blimp_filtered", ', ""))
    env = {**carried, "NANOMLM_RAW": str(g.parent / "raw"), "GPU_DATA": str(tmp_path / "carried")}
    r = gpu_check("carry", study, "cpu", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    full = tmp_path / "carried" / "raw" / "babylm_eval" / "full_eval"
    assert sorted(os.listdir(full)) == ["supplement_filtered"]
    assert (tmp_path / "carried" / "commit").exists()
    assert re.search(r"^carry: .*, \d+ MiB, and the checkout's \d+ MiB", r.stdout, flags=re.M)


def tar_members(path) -> dict:
    """{name: bytes} of a tar file's members."""
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_study_runs_every_job_side_by_side_and_stops_the_one_that_cannot_end(ran):
    """Both jobs of the tiny study at once: mlm's 6 steps end and are evaluated; `long`, 100,000
    steps, is stopped by --train-until, saves, is evaluated there and comes back as a partial
    result, which the report lists and leaves out of its comparisons."""
    r, tmp_path = ran["study"]
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert set(back(tmp_path)) == {"env.txt", "progress.txt", "study.log", "results.tar",
                                   "REPORT.md", "report.json", "logs.tar"}
    results = tar_members(tmp_path / "results.tar")
    assert set(results) == {"results/mlm/s0.json.gz", "results/long/partial-s0.json.gz"}
    done = json.loads(gzip.decompress(results["results/mlm/s0.json.gz"]))
    assert done["arm"] == "mlm" and done["compute"]["steps"] == 6 and "stopped" not in done
    assert "blimp_filtered" in done and done["loss_uniform"] and done["loss_span"]
    cut = json.loads(gzip.decompress(results["results/long/partial-s0.json.gz"]))
    assert 0 < cut["stopped"]["step"] == cut["compute"]["steps"] < 100000
    assert cut["stopped"]["max_steps"] == 100000 and cut["loss_uniform"] and "blimp_filtered" in cut
    said = (tmp_path / "study.log").read_text()
    assert "long s0: training stopped by --train-until" in said, said
    assert "partial results: long s0" in said
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["runs"] == 1 and report["partial"][0]["file"] == "results/long/partial-s0.json.gz"
    assert "training stopped at step" in (tmp_path / "REPORT.md").read_text()
    assert set(tar_members(tmp_path / "logs.tar")) == {"mlm/s0/study.log", "long/s0/study.log"}


def test_a_study_killed_midway_has_brought_back_the_jobs_that_ended(carried, tmp_path):
    """The study tier killed outright (a device call past its limit) while its long run still
    trains: the run that ended is in results.tar, whole."""
    study = Path(carried["GPU_DATA"]).parent / "tiny.toml"
    p = subprocess.Popen(["bash", str(REPO / "gpu_check.sh"), "--smoke", "study", study],
                         cwd=REPO, env={**carried, "OUT": str(tmp_path), "BUDGET": "300"},
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    tar, t0 = tmp_path / "results.tar", time.time()

    def has_mlm():  # (a member being appended is not read yet)
        with contextlib.suppress(tarfile.ReadError, FileNotFoundError, EOFError):
            return "results/mlm/s0.json.gz" in tar_members(tar)
    while not has_mlm():
        assert p.poll() is None and time.time() - t0 < 240, "the study ended before mlm's result"
        time.sleep(0.5)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    result = json.loads(gzip.decompress(tar_members(tar)["results/mlm/s0.json.gz"]))
    assert result["arm"] == "mlm" and result["compute"]["steps"] == 6


def test_a_cut_tier_leaves_what_it_measured_before_the_cut(carried, tmp_path):
    """verify killed outright (as a device call past its limit is) once its first bench row is
    written: the tests' log, the row and the progress lines are in $OUT."""
    p = subprocess.Popen(["bash", str(REPO / "gpu_check.sh"), "--smoke", "verify"], cwd=REPO,
                         env={**carried, "OUT": str(tmp_path)}, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    steps = tmp_path / "steps.json"
    t0 = time.time()
    while not (steps.exists() and json.loads(steps.read_text())["rows"]):
        assert p.poll() is None and time.time() - t0 < 300, "verify ended before its first row"
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert json.loads(steps.read_text())["rows"][0]["case"].startswith("mlm")
    assert "skipped" in (tmp_path / "tests.log").read_text()
    assert "tests: exit 0" in (tmp_path / "progress.txt").read_text()


def test_without_the_carried_corpus_a_tier_stops_at_once_with_one_line(carried, tmp_path):
    env = {**carried, "GPU_DATA": str(tmp_path / "empty"), "OUT": str(tmp_path / "out")}
    r = gpu_check("--smoke", "verify", env=env, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: no prepared babylm_10m") and "gpu_check.sh carry" in r.stderr
    r = gpu_check("tests", env=env, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: no tier 'tests'")


def test_every_cuda_test_runs_in_a_tier():
    """The tiers' `-k` selections of tests/test_cuda.py (words joined by "or": pytest selects a
    test whose name holds one of them) together cover every test in it: a new CUDA test is not
    left out of the GPU check."""
    script = (REPO / "gpu_check.sh").read_text()
    selections = re.findall(r'"\$\{tests\[@\]\}" -k "([^"]+)"', script)
    words = [w for k in selections for w in k.split(" or ")]
    assert len(selections) == 3 and all(re.fullmatch(r"\w+", w) for w in words), selections
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                                "no:cacheprovider", "tests/test_cuda.py"], cwd=REPO,
                               capture_output=True, text=True, timeout=120).stdout
    tests = collected.split("\n\n")[0].splitlines()
    assert len(tests) >= 9 and all("test_cuda.py::test_" in t for t in tests), collected
    assert all(any(w in t.split("::")[1] for w in words) for t in tests), (tests, words)
