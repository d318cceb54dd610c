"""study.py: a two-arm, two-seed tiny study end to end, its report checked against
`evaluate.py compare` on the same result files; a study merged from two folders equals the same
study run in one; a killed training run resumed and finished runs skipped; every bad study file
one line naming the file and the key."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import evaluate as E
import study
from conftest import REPO, TINY, run_script, run_train, shared_data
from studies import plan as study_plan, report as study_report
from evaluation import multibootstrap, results
from machinery.plumbing import read_checkpoint


ARMS = """
name = "tiny"
baseline = "mlm"
[arms.mlm]
objective = "mlm"
[arms.kd]
objective = "kd+mlm"
"""


def study_file(tmp, raw, extra="", arms=ARMS, evaluations=True):
    """The tiny study: TINY's model, 12 steps, evaluated by mlm and a 2-paradigm BLiMP cut from
    the shared data into tmp (fine-tuning: the bad-file cases and evaluate.py's own tests; each
    evaluation here costs a process start per run)."""
    blimp = tmp / "blimp_mini"
    if not blimp.exists():
        blimp.mkdir()
        src = shared_data().resolve() / "babylm_eval" / "fast_eval" / "blimp_fast"
        for name in ("anaphor_gender_agreement", "regular_plural_subject_verb_agreement_1"):
            lines = (src / f"{name}.jsonl").read_text().splitlines(True)
            (blimp / f"{name}.jsonl").write_text("".join(lines[:24]))
    flags = " ".join(TINY).replace("--eval-every 1000", "--eval-every 6")
    path = tmp / "tiny.toml"
    path.write_text(arms + f"""
[scales.cpu]
data = "{raw}"
seeds = [0, 1]
steps = 12
flags = "{flags} --save-every 6 --vocab-size 2000"
""" + extra + ("" if not evaluations else f"""
[scales.cpu.evaluate]
mlm = {{ segments = 8 }}
blimp = ["{blimp}"]
"""))
    return path


def run_study(*args):
    p = run_script("study.py", *args, "--nboot", "300", "--no-figures", timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p.stdout


@pytest.fixture(scope="module")
def env(small_raw, tmp_path_factory):
    """The prepared corpus, shared by every study of this module."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOMLM_DATA", str(tmp_path_factory.mktemp("prepared")))
        mp.setenv("OMP_NUM_THREADS", "1")
        yield small_raw


@pytest.fixture(scope="module")
def whole(env, tmp_path_factory):
    """The tiny study run in one folder."""
    tmp = tmp_path_factory.mktemp("whole")
    path = study_file(tmp, env)
    out = run_study(path, "--out", tmp / "study", "--parallel", 2)  # 2 cores, 1 thread each
    return path, tmp / "study", out


def test_report_equals_compare_on_the_result_files(whole, tmp_path):
    path, folder, out = whole
    assert "wrote" in out and (folder / "REPORT.md").exists()
    report = json.loads((folder / "report.json").read_text())
    assert report["runs"] == report["planned"] == 4 and not report["failed"]
    for metric in ("loss_uniform", "acc_span", "blimp_mini"):
        E.main(["compare", str(folder / "results" / "mlm"), str(folder / "results" / "kd"),
                "--examples", metric, "--nboot", "300", "--out", str(tmp_path / "c.json")])
        direct = json.loads((tmp_path / "c.json").read_text())
        mine = report["metrics"][metric]["kd"]
        for key in ("mean_a", "mean_b", "diff", "ci95", "p", "better", "values_b", "seed_level"):
            assert mine[key] == direct[key], (metric, key)
        assert direct["seeds_a"] == direct["seeds_b"] == [0, 1] and direct["paired_seeds"]
        md = (folder / "REPORT.md").read_text()
        better = results.read_result(folder / "results" / "kd" / "s0.json.gz")[metric].get(
            "better", "higher")
        fmt = lambda x: study_report.in_units(x, better)
        t = direct["seed_level"]  # two seeds: a t-interval with 1 degree of freedom
        assert t["test"] == "paired t" and t["df"] == 1
        assert (f"| kd | 2 | {' '.join(map(fmt, direct['values_b']))} | {fmt(direct['mean_b'])} "
                f"| {study_report.signed(direct['diff'], better)} | "
                f"{study_report.signed(t['ci95'][0], better)} .. "
                f"{study_report.signed(t['ci95'][1], better)} | {t['p']:.3f} |") in md
        said = multibootstrap.verdict(t, better, 2, 2)  # the sentence a page quotes, made here
        label = "" if metric == "blimp_mini" else " (a diagnostic)"
        assert f"- `kd` against `mlm`{label}: {said}." in md
        assert report["verdicts"][metric]["kd"] == said


def test_the_report_gives_the_held_out_loss_under_each_masking_beside_its_floors(whole):
    """BLiMP's verdicts come first; the held-out loss is a diagnostics section: each arm's loss
    under both maskings, how it trained and where it is read, and the unigram and bigram counts
    on the same tokens, as evaluate.py mlm wrote them into each run's result."""
    path, folder, out = whole
    md = (folder / "REPORT.md").read_text()
    assert md.index("## blimp_mini") < md.index("## Diagnostics") < md.index("### loss_uniform")
    assert "| arm | trained on | read at | loss uniform | acc. uniform | loss span | acc. span |" \
        in md
    r = results.read_result(folder / "results" / "kd" / "s0.json.gz")
    assert r["mlm"]["read_at"] == "t" and r["trained"]["masking"] == "uniform"
    for floor in ("unigram", "bigram"):
        cells = [f"{r['mlm']['maskings'][m]['floors'][floor]:.4f}" for m in ("uniform", "span")]
        assert f"| {floor} count | | | {cells[0]} |  | {cells[1]} |  |" in md
    assert "| kd | uniform, 0.15 | t |" in md and "| mlm | span, 0.15 | t |" in md
    # a result file is small and holds what compare needs and what the report shows
    r = results.read_result(folder / "results" / "kd" / "s1.json.gz")
    assert (folder / "results" / "kd" / "s1.json.gz").stat().st_size < 100_000
    assert r["pretrain_seed"] == 1
    assert r["compute"]["steps"] == 12 and r["curve"] and "python train.py" in r["commands"][0]
    assert set(r["blimp_mini"]["phenomenon"]) <= {"anaphor_agreement", "subject_verb_agreement"}
    assert "train.py --objective kd+mlm" in md and "## blimp_mini per phenomenon" in md


def test_merged_from_two_folders_equals_one_folder(whole, tmp_path):
    """mlm's seed 1 again in a folder of its own, cut off mid-training and resumed there; its
    result file and the one-folder study's others, copied together, give that study's report.
    A finished run is skipped, and a lost evaluation is redone alone."""
    path, one, _ = whole
    b, merged = tmp_path / "b", tmp_path / "merged"
    # b: "mlm s1" was killed after its checkpoint at step 6
    jobs = study_plan.plan(study_plan.load_study(path), "cpu", b)
    job = next(j for j in jobs if j.name == "mlm s1")
    p = run_train(*job.steps[0].argv[1:], "--stop-at", "6")
    assert p.returncode == 0, p.stderr
    slice_ = ("--out", b, "--seeds", "1", "--only", "mlm")
    out = run_study(path, *slice_)
    assert "mlm s1: train (resuming)" in out and "mlm s1: blimp" in out
    (b / "mlm" / "s1" / "eval" / "blimp.json").unlink()  # a lost evaluation
    (b / "results" / "mlm" / "s1.json.gz").unlink()
    redo = run_study(path, *slice_)  # finished steps skipped, the lost one redone
    assert "mlm s1: blimp" in redo and ": train" not in redo and ": mlm\n" not in redo
    shutil.copytree(one / "results", merged / "results")
    shutil.copy(b / "results" / "mlm" / "s1.json.gz", merged / "results" / "mlm")
    run_study(path, "--out", merged, "--report")
    got = json.loads((merged / "report.json").read_text())
    want = json.loads((one / "report.json").read_text())
    assert got["runs"] == 4
    for metric, by_arm in want["metrics"].items():
        for key in ("mean_a", "mean_b", "diff", "ci95", "p", "seed_level"):
            assert got["metrics"][metric]["kd"][key] == by_arm["kd"][key], (metric, key)
    assert got["phenomena"] == want["phenomena"]


def test_a_report_built_elsewhere_shows_the_folders_the_runs_used(env, tmp_path):
    """The Breton study's committed results, reported into another folder (--out): the corpus
    and source runs keep no result file, yet their commands must name the folders the Breton
    runs read them from, as the recorded commands do."""
    shutil.copytree(REPO / "docs" / "studies" / "synthetic_breton_cpu" / "results",
                    tmp_path / "results")
    run_study(REPO / "studies" / "synthetic_breton.toml", "--out", tmp_path, "--report")
    md = (tmp_path / "REPORT.md").read_text()
    commands = md[md.index("## Commands"):]
    paths = re.findall(r"--(?:out|out-dir|data|init-from|ckpt) (\S*/\S*)", commands)
    assert len(paths) > 20 and str(tmp_path) not in commands
    assert all(p.startswith("runs/synthetic_breton/cpu/") for p in paths), paths
    sources = set(re.findall(r"--out-dir (\S+/sources/\S+) ", commands))
    inits = set(re.findall(r"--init-from (\S+)/ckpt.pt", commands))
    assert inits and inits <= sources  # each arm's source is a run the report shows


FINETUNE = f"""
[scales.cpu.evaluate.finetune]
data_dir = "{shared_data().resolve() / 'babylm_eval' / 'full_eval' / 'glue_filtered'}"
tasks = ["wsc"]
flags = "--epochs 1"
"""
BAD = [  # (change to the study file, what the one line must say)
    (lambda s: s.replace('objective = "kd+mlm"', 'objective = "kdd"'),
     "arms.kd: argument --objective: invalid choice: 'kdd'"),
    (lambda s: s.replace('objective = "kd+mlm"', 'objective = "kd+mlm"\nflags = "--lrr 3"'),
     "arms.kd: unrecognized arguments: --lrr 3"),
    (lambda s: s.replace('baseline = "mlm"', 'baseline = "mlm"\nmetrics = ["val_los"]'),
     "metrics[0]: unknown metric 'val_los'"),
    (lambda s: s + FINETUNE.replace('tasks = ["wsc"]', 'tasks = ["wsc", "rtee"]'),
     "scales.cpu.evaluate.finetune.tasks[1]: unknown task 'rtee'"),
    (lambda s: s + FINETUNE.replace('flags = "--epochs 1"', 'flags = "--epocs 1"'),
     "scales.cpu.evaluate.finetune.flags: unrecognized arguments: --epocs 1"),
    (lambda s: s.replace("mlm = { segments = 8 }", 'mlm = { segments = 8, flags = "--maskings '
                         'spans" }'),
     "scales.cpu.evaluate.mlm.flags: argument --maskings: spans: give distinct names among "
     "uniform, span"),
    (lambda s: re.sub(r'data = ".*babylm_small"', 'data = "/nowhere/absent"', s),
     "arms.mlm: no corpus"),
    (lambda s: s.replace('[arms.kd]', '[arms.kd]\nobjectiv = "mlm"'),
     "arms.kd.objectiv: unknown key"),
    (lambda s: s.replace('baseline = "mlm"', 'baseline = "bert"'),
     "baseline: 'bert' is not one of the arms"),
    (lambda s: s.replace("steps = 12", "steps = 12\nepochs = 1"),
     "scales.cpu: give one budget of steps, epochs"),
    (lambda s: s.replace("seeds = [0, 1]", 'seeds = "0"'), "scales.cpu.seeds: must be a list"),
    (lambda s: s.replace("blimp_mini", "blimp_none"), "evaluate.blimp[0]: no BLiMP folder"),
    (lambda s: s.replace("seeds = [0, 1]", 'seeds = [0, 1]\narms = ["mlm", "kdd"]'),
     "scales.cpu.arms[1]: 'kdd' is not one of the arms"),
    (lambda s: s.replace("[arms.kd]", "[arms.kd"), "not valid TOML"),
]


@pytest.mark.parametrize("change,says", BAD, ids=[b[1][:30] for b in BAD])
def test_bad_study_files_fail_in_one_line(env, tmp_path, change, says, warm_executable):
    path = study_file(tmp_path, env)
    path.write_text(change(path.read_text()))
    with pytest.raises(SystemExit) as e:
        study.main([str(path), "--dry-run"])
    line = str(e.value)
    assert line.startswith(f"error: {path}: ") and says in line and "\n" not in line, line


def test_a_report_without_results_and_an_unwritable_out_are_one_line(env, tmp_path,
                                                                     warm_executable):
    """Issue 83: --report of a folder with no results says so and what to run (it drew a
    figure into a folder that was not there: a traceback); an --out where no folder can be made
    stops before any corpus is prepared. Neither writes anything."""
    path = study_file(tmp_path, env)
    with pytest.raises(SystemExit) as stopped:
        study.main([str(path), "--report", "--out", str(tmp_path / "none")])
    assert str(stopped.value) == (f"error: {tmp_path / 'none' / 'results'} holds no results to "
                                  f"report; run the study first (python study.py {path} --scale "
                                  f"cpu --out {tmp_path / 'none'})")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stopped:
        study.main([str(path), "--out", str(tmp_path / "file" / "s")])
    assert str(stopped.value) == f"error: cannot write {tmp_path / 'file' / 's'}: Not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blimp_mini", "file", "tiny.toml"]


def test_a_failed_run_is_reported_and_the_others_go_on(env, tmp_path):
    """A run that crashes (here: kd told to start from a checkpoint that is not there, which
    only training finds out) is listed in REPORT.md; the baseline's run still finishes."""
    extra = '[scales.cpu.arm_flags]\nkd = "--init-from /nowhere/ckpt.pt"\n'
    path = study_file(tmp_path, env, extra=extra, evaluations=False)
    p = run_script("study.py", path, "--out", tmp_path / "s", "--seeds", "0", "--no-figures",
                   "--nboot", "50", "--parallel", "2")
    assert p.returncode == 1 and "1 jobs failed: kd s0" in p.stdout, p.stdout[-3000:]
    md = (tmp_path / "s" / "REPORT.md").read_text()
    assert "`kd` seed 0 failed: train exited with 1: error:" in md
    assert (tmp_path / "s" / "results" / "mlm" / "s0.json.gz").exists()


def test_a_stop_signal_saves_the_training_and_the_same_command_goes_on(env, tmp_path):
    """SIGTERM to study.py while a job trains: the training (in a session of its own, so that it
    gets the signal once, from study.py) saves the step it is in; study.py ends within 30 s with
    status 1, nothing reported failed, its last line the command that goes on. That command then
    resumes the run and ends with the weights and validation of the same train.py command never
    interrupted."""
    path = study_file(tmp_path, env, evaluations=False)
    path.write_text(path.read_text().replace("steps = 12", "steps = 300"))  # seconds, not one
    out = tmp_path / "s"
    cmd = [sys.executable, "study.py", path, "--out", out, "--only", "mlm", "--seeds", "0",
           "--no-figures", "--nboot", "50"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    t0 = time.time()
    while not any("loss" in line for f in out.rglob("log.jsonl")
                  for line in f.read_text().splitlines()):
        assert proc.poll() is None and time.time() - t0 < 300, proc.communicate()
        time.sleep(0.05)
    stopped_at = time.time()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert time.time() - stopped_at < 30 and proc.returncode == 1, stdout + stderr
    assert stderr.strip().splitlines()[-1].startswith("SIGTERM: stopped; the same command goes "
                                                      "on: python study.py ")
    assert "FAILED" not in stdout and "its step saved" in stdout, stdout
    [run] = [f.parent for f in out.rglob("ckpt.pt")]
    assert read_checkpoint(run / "ckpt.pt")["step"] < 300 and not list(out.rglob("*.failed"))
    p = run_script("study.py", *cmd[2:], timeout=900)
    assert p.returncode == 0 and "(resuming)" in p.stdout, p.stdout + p.stderr
    [job] = study_plan.plan(study_plan.load_study(path), "cpu", out, only=["mlm"], seeds=[0])
    argv = [str(a) for a in job.steps[0].argv]
    argv[argv.index("--out-dir") + 1] = str(tmp_path / "whole")
    assert run_script(*argv, timeout=900).returncode == 0
    got, want = (read_checkpoint(folder / "ckpt.pt") for folder in (run, tmp_path / "whole"))
    assert got["step"] == want["step"] == 300
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    val = lambda folder: [e for e in map(json.loads, (folder / "log.jsonl").open())
                          if "val_loss" in e][-1]
    assert val(run) == val(tmp_path / "whole")


def test_a_run_past_the_deadline_is_stopped_and_killed_if_it_does_not_stop(monkeypatch):
    """study.wait_until: SIGTERM at the deadline (a run that obeys exits with its code), then
    SIGKILL after the grace for one that ignores it."""
    obeys = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); "
             "print(flush=True); time.sleep(60)")
    ignores = obeys.replace("lambda *a: sys.exit(143)", "signal.SIG_IGN")
    monkeypatch.setattr(study, "STOP_GRACE", 1.0)
    for code, want in ((obeys, 143), (ignores, -9)):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        p.stdout.readline()  # its handler is set
        t0 = time.time()
        assert study.wait_until(p, time.time() + 0.5) == (want, True)
        assert time.time() - t0 < 20
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    assert study.wait_until(p, time.time() + 60) == (0, False)


def test_evaluations_of_an_unfinished_run_are_redone_after_its_training(tmp_path):
    """A run stopped by --train-until was evaluated at the step it stopped at: once its
    training goes on, those evaluations are stale and are removed before it resumes."""
    run = tmp_path / "mlm" / "s0"
    (run / "eval").mkdir(parents=True)
    train = study_plan.Step("train", ["-c", "raise SystemExit(3)"], run / "study_train.json")
    evals = [study_plan.Step(n, ["-c", "pass"], run / "eval" / f"{n}.json") for n in ("mlm", "b")]
    for step in evals:
        step.done.write_text("{}")
    job = study_plan.Job("mlm s0", run, [train, *evals], "mlm", 0, tmp_path / "r.json.gz")
    assert study.run_job(job, dict(os.environ), lambda: 1).startswith("train exited with 3")
    assert not any(step.done.exists() for step in evals)


def test_runs_side_by_side_on_one_gpu_are_checked_against_its_free_memory(monkeypatch):
    """--parallel on one GPU: refused in one line when the runs cannot fit (RUN_GPU_GB each in
    the GPU's free memory), with the count that fits; a size with no figure is a note."""
    monkeypatch.setattr(study, "has_cuda", lambda: True)
    monkeypatch.setattr(study.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(study.torch.cuda, "mem_get_info", lambda i=0: (20e9, 80e9))
    jobs = [study_plan.Job(f"mlm s{i}", None, []) for i in range(4)]
    small = {j.name: {"device": "auto", "size": "small"} for j in jobs}
    assert study.check_gpu_memory(2, jobs, small) is None          # 13.2 GB in 18 usable
    with pytest.raises(SystemExit) as e:
        study.check_gpu_memory(4, jobs, small)                     # 26.4 GB
    assert str(e.value).startswith("error: --parallel 4:") and "use --parallel 2 or" in str(e.value)
    assert study.check_gpu_memory(4, jobs[:1], small) is None      # one run: nothing to share
    base = {j.name: {"device": "cuda", "size": "base"} for j in jobs}
    assert "no GPU memory figure for base" in study.check_gpu_memory(4, jobs, base)
    cpu = {j.name: {"device": "cpu", "size": "small"} for j in jobs}
    assert study.check_gpu_memory(4, jobs, cpu) is None
