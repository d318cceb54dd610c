"""gpu_check.sh --smoke: every tier of the GPU check, run on the CPU as a GPU machine would run it
(../shared/GPU.md): `carry` builds the carried folder from a raw root, and each tier, reading
only that, writes its results into $OUT as it measures them. A lent GPU is rare; the script it
runs has run here first."""
import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

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
    """{tier: (its CompletedProcess, its $OUT)}: the seven tiers with --smoke, two at a time
    (each is mostly one single-threaded process after another; the tests' machine has 2 cores).
    The study's budget is measured, not fixed: a busy machine gets a longer one (study_budget)."""
    study = Path(carried["GPU_DATA"]).parent / "tiny.toml"  # carried with its evaluation data
    tiers = {"speed": [], "study": [study], "verify": [], "rest": [], "headline": [],
             "objectives": [], "compare": []}
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


def test_verify(ran):
    r, tmp_path = ran["verify"]
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert set(back(tmp_path)) == {"env.txt", "progress.txt", "tests.log", "bench.log",
                                   "steps.json"}
    done = parts(tmp_path)
    assert all(": exit 0 in " in done[p] for p in ("tests", "steps")), done
    assert "skipped" in (tmp_path / "tests.log").read_text()  # no CUDA here: it skips
    steps = json.loads((tmp_path / "steps.json").read_text())["rows"]
    assert [r["case"].split()[0] for r in steps] == ["mlm"] and steps[0]["recompiles"] == 0
    env = (tmp_path / "env.txt").read_text()
    assert "tier: verify (smoke)" in env and "torch " in env and "commit: " in env


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


def test_objectives(ran):
    r, tmp_path = ran["objectives"]
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert set(back(tmp_path)) == {"env.txt", "progress.txt", "tests.log", "bench.log",
                                   "steps.json"}
    assert "skipped" in (tmp_path / "tests.log").read_text()  # no CUDA here: it skips
    steps = json.loads((tmp_path / "steps.json").read_text())["rows"]
    assert [r["case"].split()[0] for r in steps] == ["mlm", "gpt-bert"]
    assert steps[1]["reference"] == "mlm" and steps[1]["ours"] > 0 and "failed" not in steps[1]


def test_compare(ran):
    r, tmp_path = ran["compare"]
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert set(back(tmp_path)) == {"env.txt", "progress.txt", "bench.log", "bert.json",
                                   "bert_base.json"}
    for name in ("bert.json", "bert_base.json"):
        rows = json.loads((tmp_path / name).read_text())["rows"]
        assert rows and all(r["reference"] == "BertForMaskedLM" for r in rows)
    profiles = json.loads((tmp_path / "bert.json").read_text())["profiles"]  # the first size's
    assert [set(p) for p in profiles.values()] == [{"ours", "BertForMaskedLM"}]


def test_rest(ran):
    r, tmp_path = ran["rest"]
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert set(back(tmp_path)) == {"env.txt", "progress.txt", "bench.log", "dictionary.log",
                                   "dictionary.jsonl", "kernels.json"}
    said = (tmp_path / "dictionary.log").read_text()
    assert "dictionary: 48 atoms" in said and "done: 10 steps" in said
    assert {r["bench"] for r in json.loads((tmp_path / "kernels.json").read_text())["rows"]} == {
        "ltg", "attn", "pll"}


def test_speed(ran):
    """The CUDA check (skipped here), each form's step against BertForMaskedLM in one process
    (BERT built and compiled once: its first step on the first row alone), the top operators of
    each, then train.py in the fastest form measured, plain, with --cuda-graphs and compiled by
    layer."""
    r, tmp_path = ran["speed"]
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    assert set(back(tmp_path)) == {"env.txt", "progress.txt", "check.log", "bench.log",
                                   "forms.json", "step.json", "graphs.json", "layers.json"}
    assert "skipped" in (tmp_path / "check.log").read_text()  # no CUDA here
    done = parts(tmp_path)
    assert all(": exit 0 in " in done[p] for p in ("check", "forms", "step", "graphs", "layers"))
    forms = json.loads((tmp_path / "forms.json").read_text())
    rows = forms["rows"]
    assert [r["form"] for r in rows] == ["gather", "gather-fp32", "onehot"]
    assert all(r["reference"] == "BertForMaskedLM" and r["first_step_s"] > 0 for r in rows)
    assert rows[0]["ref_first_step_s"] > 0 and rows[1]["ref_first_step_s"] is None
    assert len(forms["profiles"]) == 3 and all(set(p) == {"ours", "BertForMaskedLM"}
                                               for p in forms["profiles"].values())
    best = max(rows, key=lambda r: r["ours"])["form"]
    assert done["fastest form"].endswith(f"fastest form: {best}")
    variant = "" if best == "gather" else f" {best}"
    for run, case in (("step", f"mlm tiny 4x32{variant}"),
                      ("graphs", f"mlm tiny 4x32 cuda-graphs{variant}"),
                      ("layers", f"mlm tiny 4x32{variant} compiled by layer")):
        [row] = json.loads((tmp_path / f"{run}.json").read_text())["rows"]
        assert row["case"] == case and row["ours"] > 0 and row["overhead_s"] > 0
    env = (tmp_path / "env.txt").read_text()
    assert re.search(r"^carried: \d+ MiB in ", env, flags=re.M), env


def test_a_failed_part_is_named_and_the_tier_exits_1(carried, tmp_path):
    """speed with a BertForMaskedLM that cannot be built (a stand-in package, first on the
    path): the forms part's row fails, every later part still runs (in the gather, no form
    having been measured), the failed part is named in one line, and the tier exits 1."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "transformers.py").write_text(
        "class BertConfig:\n    def __init__(self, **kw):\n"
        "        raise RuntimeError('broken by the test')\n\n\nBertForMaskedLM = None\n")
    env = {**carried, "OUT": str(tmp_path / "out"), "PYTHONPATH": str(broken), "FORMS": "gather"}
    r = gpu_check("--smoke", "speed", env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: speed: forms failed"), r.stderr
    done = parts(tmp_path / "out")
    assert "exit 1 in" in done["forms"] and done["fastest form"].endswith(": gather")
    assert all(": exit 0 in " in done[p] for p in ("check", "step", "graphs", "layers")), done
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
