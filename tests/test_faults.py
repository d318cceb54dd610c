"""Faults injected on purpose, each asserting what the user sees and what is kept: a run stopped
by SIGTERM and resumed, a second process on a run folder, a lock left by a killed process, bytes
flipped inside checkpoints, a full disk, an interrupted BLiMP evaluation, a corpus that changed
under a run. docs/robustness.md has the table these tests stand behind."""
import errno
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import evaluate as E
import warm_python
from conftest import REPO, TINY, run_train, run_trains, shared_data
from machinery.plumbing import (RunFolder, SafetyNet, load_state, read_checkpoint,
                                save_checkpoint)
from model import PRESETS, Encoder, ModelConfig, load_checkpoint


FAST = [*TINY, "--spike", "0", "--lr", "1e-3"]  # stable at any length, fast to run


def start_train(*args, **kw) -> subprocess.Popen:
    """train.py in a process of its own (a warm one: warm_python's launcher passes a signal on
    to it) whose output lines arrive as they are printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([str(warm_python.launcher()), str(REPO / "train.py"),
                             *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            **kw)


def stopped_once_it_says(proc: subprocess.Popen, prefix: str) -> str:
    """SIGTERM to `proc` as soon as it prints a line that starts with `prefix`; it must end within
    30 s with exit status 1. -> the last line of its stderr."""
    for line in proc.stdout:
        if line.startswith(prefix):
            break
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert time.time() - t0 < 30 and proc.returncode == 1, err
    return err.strip().splitlines()[-1]


def wait_for_step(proc: subprocess.Popen, step: int, timeout=120) -> None:
    """Read the process' log lines until it has logged `step` (or fail)."""
    t0 = time.time()
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= step:
            return
        assert time.time() - t0 < timeout, "the run did not get that far"
    raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()[-2000:]}")


def states_equal(a: Path, b: Path) -> None:
    """The two checkpoints hold the same step, weights and optimizer state, bit for bit."""
    a, b = read_checkpoint(a), read_checkpoint(b)
    assert a["step"] == b["step"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for i, s in a["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["optimizer"]["state"][i][k]))


def test_sigterm_saves_and_resumes_bit_identically_and_one_run_per_folder(prepared, tmp_path):
    run, ref = tmp_path / "run", tmp_path / "ref"
    common = ["--data", prepared, "--max-steps", 600, "--save-every", 100000, *FAST]
    uninterrupted = start_train(*common, "--out-dir", ref)
    proc = start_train(*common, "--out-dir", run)
    wait_for_step(proc, 20)
    # a second process on the same folder, new or resuming, is refused and changes nothing
    for extra in ([], ["--resume"]):
        second = run_train(*common, "--out-dir", run, *extra)
        assert second.returncode == 1
        holder = (run / "lock").read_text().strip()  # the training process (warm: not proc)
        assert re.fullmatch(rf"process \d+ on {re.escape(os.uname().nodename)}", holder)
        os.kill(int(holder.split()[1]), 0)  # alive
        assert second.stderr.strip() == (f"error: {run} is in use by {holder}; wait for it to "
                                         f"end or choose another --out-dir")
    proc.send_signal(signal.SIGTERM)  # what a cluster sends before it preempts a job
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + signal.SIGTERM, err
    # said at once, before the step in progress ends (a slow step may take minutes)
    assert "SIGTERM: finishing the step in progress, then saving it" in err
    last = err.strip().splitlines()[-1]
    step = read_checkpoint(run / "ckpt.pt")["step"]
    assert 20 <= step < 600  # saved where it stopped: no --save-every step was reached
    assert last == (f"SIGTERM: stopped after step {step}; the last good checkpoint (step {step}) "
                    f"is kept at {run / 'ckpt.pt'}. Continue with: python train.py --out-dir "
                    f"{run} --resume")
    assert "Traceback" not in err and not list(run.glob(".*tmp"))
    # --stop-at at or before the checkpoint's step: nothing to do, nothing changed
    same = run_train("--out-dir", run, "--resume", "--stop-at", step)
    assert same.returncode == 0 and "nothing to do" in same.stdout, same.stderr
    assert read_checkpoint(run / "ckpt.pt")["step"] == step
    resumed = run_train("--out-dir", run, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {step} of 600 ({run / 'ckpt.pt'})" in resumed.stdout
    finished = run_train("--out-dir", run, "--resume")  # a finished run resumed
    assert finished.returncode == 0 and (f"nothing to do: {run / 'ckpt.pt'} is at step 600, at or "
                                         f"past --max-steps 600, the run's end"
                                         ) in finished.stdout.splitlines(), finished.stdout
    err = uninterrupted.communicate(timeout=300)[1]  # cold: it may still be running
    assert uninterrupted.returncode == 0, err
    states_equal(run / "ckpt.pt", ref / "ckpt.pt")
    # the log reads as one run's: the uninterrupted run's lines, and one more where it stopped
    steps, ref_steps = ([json.loads(line)["step"] for line in (r / "log.jsonl").open()]
                        for r in (run, ref))
    assert steps == sorted(steps) and sorted({*ref_steps, step}) == sorted(set(steps))


def test_a_killed_process_lock_is_taken_over(tmp_path):
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); "
            f"from machinery.plumbing import RunFolder; f = RunFolder({str(tmp_path)!r}); "
            f"f.lock(); print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(SystemExit, match=f"in use by process {holder.pid} "):
        RunFolder(tmp_path).lock()
    holder.kill()  # SIGKILL: no clean-up of any kind; the lock file stays behind
    holder.wait()
    holder.stdout.close()
    assert f"process {holder.pid} " in (tmp_path / "lock").read_text()
    folder = RunFolder(tmp_path)
    folder.lock()
    assert f"process {os.getpid()} " in (tmp_path / "lock").read_text()
    folder._lock.close()  # let go, as the process' end would


def flip(path: Path, tensor: torch.Tensor, n=64) -> None:
    """Invert `n` bytes in the middle of where `tensor`'s data lies in the file (torch.save
    stores tensor bytes uncompressed): what a bad disk or a broken copy does."""
    raw = bytearray(path.read_bytes())
    data = tensor.contiguous().numpy().tobytes()
    at = raw.find(data)
    assert at >= 0 and raw.find(data, at + 1) < 0
    at += len(data) // 2
    raw[at:at + n] = bytes(b ^ 0xFF for b in raw[at:at + n])
    path.write_bytes(bytes(raw))


@pytest.fixture
def trained_run(prepared, tmp_path):
    run = tmp_path / "run"
    r = run_train("--data", prepared, "--out-dir", run, "--max-steps", 20, "--stop-at", 10, *FAST)
    assert r.returncode == 0, r.stderr
    return run


def test_flipped_bytes_are_refused_wherever_a_checkpoint_is_read(trained_run, tmp_path):
    path = trained_run / "ckpt.pt"
    good = read_checkpoint(path)
    word = tmp_path / "word.pt"  # bytes flipped in the word embeddings
    word.write_bytes(path.read_bytes())
    flip(word, good["model"]["word.weight"])
    inner = io.BytesIO(torch.load(word, weights_only=True)["state"].numpy().tobytes())
    assert not torch.equal(torch.load(inner, weights_only=True)["model"]["word.weight"],
                           good["model"]["word.weight"])  # torch.load alone takes it silently
    msg = (f"error: {word} is corrupt: its content does not match the checksum it was saved with "
           f"(damaged on disk or in a copy); use another checkpoint")
    with pytest.raises(SystemExit) as e:
        load_checkpoint(word)
    assert str(e.value) == msg
    blimp = shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"
    with pytest.raises(SystemExit, match="is corrupt"):
        E.main(["blimp", "--ckpt", str(word), "--blimp-dir", str(blimp), "--device", "cpu"])
    # bytes flipped in the optimizer state: a resume refuses it
    flip(path, next(iter(good["optimizer"]["state"].values()))["m"])  # LAMB's first moment
    r = run_train("--out-dir", trained_run, "--resume")
    assert r.returncode == 1 and r.stderr.strip() == msg.replace(str(word), str(path))


def test_a_full_disk_at_save_time_keeps_the_last_checkpoint(trained_run, monkeypatch):
    path = trained_run / "ckpt.pt"
    before = path.read_bytes()
    # (1) a real OS error: a file-size limit lets this process write no file over 100 kB
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    r = subprocess.run([sys.executable, str(REPO / "train.py"), "--out-dir", str(trained_run),
                        "--resume", "--save-every", "12"], cwd=REPO, capture_output=True,
                       text=True, preexec_fn=limit, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == f"error: cannot write {path}: File too large"
    assert path.read_bytes() == before and not list(trained_run.glob(".*"))
    # (2) ENOSPC, injected where torch.save writes the file (not where it serializes the state
    # into memory first): the line says how much space is missing
    state, real_save = read_checkpoint(path), torch.save

    def full_disk(obj, f, *a, **k):
        if isinstance(f, io.BytesIO):
            return real_save(obj, f, *a, **k)
        f.write(b"\0" * 4096)  # part of the file was written when the disk filled up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(SystemExit) as e:
        save_checkpoint(state, path)
    assert str(e.value).startswith(f"error: cannot write {path}: No space left on device (about ")
    unit = r"[\d.,]+ (GiB|MiB|KiB|bytes)"
    assert re.search(rf"\(about {unit} needed, {unit} free\)$", str(e.value)), str(e.value)
    assert path.read_bytes() == before and not list(trained_run.glob(".*"))


def test_sizes_are_said_in_a_unit_that_shows_them():
    """A small checkpoint on a nearly full disk is not "0 MiB needed, 0 MiB free"."""
    from machinery.plumbing import size_text
    assert [size_text(n) for n in (0, 512, 3 * 2 ** 10, 2.5 * 2 ** 20, 50 * 2 ** 20, 2 ** 31)] == [
        "0 bytes", "512 bytes", "3.0 KiB", "2.5 MiB", "50 MiB", "2.0 GiB"]


@pytest.fixture
def ckpt(prepared, tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**PRESETS["tiny"], "vocab_size": 2000, "d_model": 64, "d_ff": 128,
                         "n_layer": 1})
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"model": Encoder(cfg).state_dict(), "config": asdict(cfg), "args": {},
                     "tokenizer": (prepared / "tokenizer.model").read_bytes()}, path)
    return path


def test_an_interrupted_blimp_evaluation_resumes_to_the_same_result(ckpt, tmp_path,
                                                                    monkeypatch, capsys):
    src = shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"
    folder = tmp_path / "blimp"
    folder.mkdir()
    for i, f in enumerate(sorted(src.glob("*.jsonl"))[:5]):
        rows = [json.loads(line) for line in f.read_text().splitlines()[:12]]
        for r in rows if i == 0 else []:  # a paradigm name longer than the table's old column
            r["UID"] = "a_paradigm_whose_name_is_longer_than_forty_two_characters"
        (folder / f.name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(E, "CHUNK_PAIRS", 20)  # 5 paradigms x 12 pairs: chunks of 2, 2 and 1
    flags = ["blimp", "--ckpt", str(ckpt), "--blimp-dir", str(folder), "--device", "cpu"]
    E.main(flags + ["--out", str(tmp_path / "whole.json")])
    rows = [line for line in capsys.readouterr().out.splitlines()
            if len(line.split()) == 5 and line.split()[-1].isdigit()]  # name, 3 accuracies, pairs
    assert len(rows) == 8 and len({len(line) for line in rows}) == 1  # 5 paradigms, 3 phenomena
    calls, pll = [], E.pll

    def interrupted(*a, **k):  # Ctrl-C while the second chunk is being scored
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return pll(*a, **k)
    monkeypatch.setattr(E, "pll", interrupted)
    out = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt):
        E.main(flags + ["--out", str(out)])
    partial = out.with_name(out.name + ".partial")
    assert not out.exists() and len(partial.read_text().splitlines()) == 2  # header + chunk 0
    capsys.readouterr()
    E.main(flags + ["--out", str(out)])
    assert "resuming: 1 of 3 chunks already scored" in capsys.readouterr().out
    assert len(calls) == 4 and not partial.exists()  # chunks 1 and 2 only were scored again
    whole, cut = (json.loads((tmp_path / n).read_text()) for n in ("whole.json", "cut.json"))
    for key in whole:
        if key not in ("sentences_per_s",):
            assert cut[key] == whole[key], key
    # another checkpoint's leftovers are not mixed in: the fingerprint differs, it starts over
    partial.write_text(json.dumps({"ckpt": "elsewhere"}) + "\n")
    E.main(flags + ["--out", str(out)])
    assert "starting over" in capsys.readouterr().out
    assert json.loads(out.read_text())["pairs"] == whole["pairs"]


def test_a_resume_refuses_data_other_than_its_own(small_raw, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    raw = tmp_path / "corpus"
    raw.mkdir()
    text = (small_raw / "childes.train").read_text()
    (raw / "text.txt").write_text(text)
    run = tmp_path / "run"
    r = run_train("--data", raw, "--vocab-size", 500, "--out-dir", run, "--max-steps", 5, *FAST)
    assert r.returncode == 0, r.stderr
    (raw / "text.txt").write_text(text[len(text) // 2:])  # the corpus changed under the run
    r = run_train("--out-dir", run, "--resume")
    assert r.returncode == 1
    first = json.loads((run / "data.json").read_text())["folder"]  # NAME-KEY it trained on
    now = next(p for p in (tmp_path / "prep").iterdir() if p.name != first)
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: {run / 'ckpt.pt'} was trained on other data than the prepared {now} (the "
        f"corpus at {raw}, or its tokenizer, changed since the run began); it cannot be resumed "
        f"on it")
    assert len(list((tmp_path / "prep").iterdir())) == 2  # the first corpus' folder is intact
    assert read_checkpoint(run / "ckpt.pt")["step"] == 5


def test_a_kill_mid_write_leaves_nothing_a_resume_trips_on(trained_run):
    """What SIGKILL leaves at the worst moment: a half-written log line and a temp checkpoint of
    the dead process. A resume drops the one and removes the other."""
    with open(trained_run / "log.jsonl", "a") as f:
        f.write('{"step": 11, "loss": 4.')
    (trained_run / ".ckpt.pt.999999999.tmp").write_bytes(b"\0" * 1000)
    r = run_train("--out-dir", trained_run, "--resume", "--stop-at", 15)
    assert r.returncode == 0, r.stderr
    log = [json.loads(line) for line in (trained_run / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [5, 10, 15]
    assert not list(trained_run.glob(".*"))


def test_a_signal_while_the_data_is_prepared_leaves_nothing(small_raw, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    raw = tmp_path / "corpus"
    raw.mkdir()
    (raw / "text.txt").write_text((small_raw / "childes.train").read_text() * 20)
    proc = start_train("--data", raw, "--vocab-size", 1000, "--out-dir", tmp_path / "run", *FAST)
    assert proc.stdout.readline().startswith("data: preparing ")
    t0 = time.time()
    while not list((tmp_path / "prep").glob(".*.tmp")):  # mid-preparation (the tokenizer)
        assert time.time() - t0 < 60 and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err.strip().splitlines()[-1] == (
        "SIGTERM: stopped; nothing more was saved"), err
    assert not list((tmp_path / "prep").iterdir())  # not even the temporary folder
    assert not (tmp_path / "run").exists()


def test_a_file_without_a_checksum_is_refused_in_one_line(tmp_path):
    """Every file nanoMLM writes carries a checksum; a torch file without one (another program's,
    or a state dict saved by hand) is refused rather than loaded unverified, and one an older
    nanoMLM wrote is refused by name."""
    state = {"model": {"w": torch.ones(2)}, "config": {}, "tokenizer": b"spm"}
    torch.save(state, tmp_path / "plain.pt")
    with pytest.raises(SystemExit, match="has no checksum: it was not written by nanoMLM"):
        read_checkpoint(tmp_path / "plain.pt")
    save_checkpoint(state, tmp_path / "ours.pt")
    assert torch.equal(read_checkpoint(tmp_path / "ours.pt")["model"]["w"], torch.ones(2))
    # an older nanoMLM's file (its checksum a key of the state): named as such, not as foreign
    torch.save({**state, "checksum": "0" * 64}, tmp_path / "old.pt")
    with pytest.raises(SystemExit, match="was written by an older nanoMLM, which checked its"):
        read_checkpoint(tmp_path / "old.pt")


# --- the divergence guard on real runs -----------------------------------------------------------

def stopped_by_the_old_rule(losses) -> bool:
    """The guard's earlier rule (its diverging(), the loss half): a log
    line's loss 1 nat above the lowest of the phase's earlier lines, in it and the line before,
    judged from the sixth line on."""
    for i in range(5, len(losses)):
        if min(losses[i], losses[i - 1]) > min(losses[:i - 1]) + 1.0:
            return True
    return False


def judged_at(records, log_every: int, folder) -> None:
    """The loop's guard replayed on a run's per-step log (--log-every 1: each step's loss and
    gradient norm, the numbers its guard was handed) as a run logging every `log_every` steps
    would ask it: raises SystemExit where that run would have been stopped. The training is the
    same at any --log-every (batches, masks and dropout are functions of seed and step)."""
    folder.mkdir(parents=True, exist_ok=True)  # where a stopped run logs why
    guard = SafetyNet(RunFolder(folder), torch.device("cpu"), False, 10.0, None)
    try:
        for r in records:
            guard.recent.append((torch.tensor(r["loss"]), torch.tensor(r["grad_norm"])))
            if r["step"] % log_every == 0 or r is records[-1]:
                guard.check(r["step"], 0)
                guard.judge(r["step"], r["lr"])
    finally:
        guard.release()


def test_healthy_small_batch_runs_are_never_stopped_at_any_log_interval(prepared, tmp_path):
    """Issue 69's case: tiny gpt-bert runs at 4 x 64 tokens a batch (200 steps, two seeds) and
    32 x 128 (100 steps, one seed: 8x the tokens of a small run), all with the default --spike,
    trained logging every step: none is stopped, and the guard replayed on their per-step logs
    as a run logging every 50 steps would ask it (judged_at) stops none either. The rule the
    guard replaced, read on the per-step logs, would have stopped one or more of them (it
    stopped such a run at step 40). (The runs logging every 50 steps that this test once
    trained as well are the same training, judged less often: the replay asks what they did.)"""
    common = [*TINY, "--data", prepared, "--objective", "gpt-bert", "--log-every", 1]
    shapes = {(4, 64): (0, 1), (32, 128): (0,)}  # batch, length: seeds
    runs = {(shape, seed): [*common, "--batch-size", shape[0], "--seq-len", shape[1],
                            "--max-steps", 200 if shape[0] == 4 else 100, "--seed", seed,
                            "--out-dir", tmp_path / f"{shape[0]}_{seed}"]
            for shape, seeds in shapes.items() for seed in seeds}
    for key, done in zip(runs, run_trains(*runs.values())):
        assert done.returncode == 0, (key, done.stderr[-500:])
    logs = [[r for r in RunFolder(tmp_path / f"{b}_{s}").records() if "loss" in r]
            for (b, _), seeds in shapes.items() for s in seeds]
    assert [len(x) for x in logs] == [200, 200, 100]
    for i, log in enumerate(logs):
        for every in (1, 50):
            judged_at(log, every, tmp_path / f"replay{i}_{every}")
    assert any(stopped_by_the_old_rule([r["loss"] for r in log]) for log in logs)


def test_the_replayed_guard_stops_what_the_loop_stops(tmp_path):
    """judged_at is the loop's guard: on a per-step log that diverges (a healthy loss, then
    +4 nats from step 120) it stops the run, at any interval, within the window it promises."""
    healthy = [{"step": i, "loss": 6.0 - i / 100 + (0.3 if i % 2 else -0.3), "grad_norm": 1.0,
                "lr": 0.01} for i in range(1, 121)]
    jumped = [{**r, "step": r["step"] + 120, "loss": r["loss"] + 4.0} for r in healthy[:100]]
    for every in (1, 50):
        with pytest.raises(SystemExit, match="the run is diverging at step"):
            judged_at(healthy + jumped, every, tmp_path / f"jumped{every}")
        judged_at(healthy, every, tmp_path / f"healthy{every}")  # the healthy part goes on


def test_a_run_stopped_for_diverging_resumes_from_its_last_good_checkpoint(prepared, tmp_path):
    """LAMB at --lr 0.5 with a 500-step warm-up: healthy while the rate is low, diverging as it
    grows (past step 100). Saved every 25 steps but not once suspect, it names its last
    checkpoint, from before, and the command to go on at half the rate; that command resumes
    from it and trains on."""
    out = tmp_path / "run"
    r = run_train(*TINY, "--data", prepared, "--lr", 0.5, "--warmup", 500, "--max-steps", 600,
                  "--save-every", 25, "--out-dir", out)
    assert r.returncode == 1 and "the run is diverging at step" in r.stderr, r.stderr
    stop = int(re.search(r"at step (\d+)", r.stderr).group(1))
    kept = int(re.search(r"the last good checkpoint \(step (\d+)\) is kept", r.stderr).group(1))
    assert load_state(out / "ckpt.pt")["step"] == kept < stop and kept % 25 == 0
    cure = re.search(r"python train.py (--out-dir \S+ --resume --lr \S+);", r.stderr).group(1)
    assert cure.endswith("--lr 0.25")
    r = run_train(*cure.split(), "--spike", 0, "--stop-at", kept + 20)
    assert r.returncode == 0, r.stderr
    log = [x for x in RunFolder(out).records() if "lr" in x]
    assert log[-1]["step"] == kept + 20 and log[-1]["lr"] <= 0.25


def test_a_run_at_a_rate_that_blows_up_is_stopped_early(prepared, tmp_path):
    """AdamW at --lr 1 (100x the tiny default): its 20-step loss climbs away from its first
    level within tens of steps and stays up; the guard stops it within the first 100 steps of
    400, at the default --spike (seeds 0, 1, 2: at steps 35, 40, 45). At --lr 0.3 the loss
    climbs as far but may come back down: a change in the gradient norm's order of summation
    made one such run recover to 10 nats by step 80, where it had been stopped at step 40.
    Stopped before its first save, it says that no checkpoint was kept, and the command it
    prints, run as printed (but for --stop-at, to keep the test short), begins the run again
    from step 0 at half the rate, in the same folder, with its other settings."""
    out = tmp_path / "run"
    r = run_train(*TINY, "--data", prepared, "--optim", "adamw", "--lr", 1.0, "--max-steps",
                  400, "--out-dir", out)
    assert r.returncode == 1 and "the run is diverging at step" in r.stderr, r.stderr[-500:]
    assert int(re.search(r"at step (\d+)", r.stderr).group(1)) <= 100
    assert "stopped, no checkpoint had been saved yet. Begin it again" in r.stderr
    cure = re.search(r"python train.py (--out-dir \S+ --resume --lr \S+);", r.stderr).group(1)
    assert cure == f"--out-dir {out} --resume --lr 0.5" and not (out / "ckpt.pt").exists()
    r = run_train(*cure.split(), "--stop-at", 10)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the run begins again from step 0" in r.stdout + r.stderr
    log = [x for x in RunFolder(out).records() if "lr" in x]
    assert log[0]["step"] < log[-1]["step"] == 10 and log[-1]["lr"] <= 0.5
    saved = json.loads((out / "args.json").read_text())
    assert (saved["lr"], saved["optim"], saved["max_steps"]) == (0.5, "adamw", 400)
    assert read_checkpoint(out / "ckpt.pt")["step"] == 10


def test_sigterm_while_the_dictionary_is_learned_ends_the_run_at_once_and_it_resumes(prepared,
                                                                                     tmp_path):
    """Issue 68's case: a stop signal while mlsm+mlm learns its dictionary between the phases
    (a set-up that takes minutes at the recipe's size) ends the process at once, in one line
    that says how to go on; phase 1's checkpoint is kept, and the resumed run (which learns the
    dictionary again) ends with the same weights as an uninterrupted run's."""
    common = [*TINY, "--data", prepared, "--objective", "mlsm+mlm", "--max-steps", 20,
              "--phase1-steps", 10, "--mlsm-k", 200, "--dict-vectors", 8000, "--dict-epochs", 2]
    ref = start_train(*common, "--out-dir", tmp_path / "ref")
    run = tmp_path / "run"
    proc = start_train(*common, "--out-dir", run)
    assert stopped_once_it_says(proc, "learning the MLSM dictionary") == (
        f"SIGTERM: stopped while phase 2 was being set up; continue with: python train.py "
        f"--out-dir {run} --resume")
    assert read_checkpoint(run / "ckpt.pt")["step"] == 10 and not (run / "dict.pt").exists()
    r = run_train("--out-dir", run, "--resume")
    assert r.returncode == 0, r.stderr
    assert ref.wait(timeout=300) == 0, ref.stderr.read()
    states_equal(run / "ckpt.pt", tmp_path / "ref" / "ckpt.pt")


def test_sigterm_during_a_blimp_scoring_ends_it_at_once_and_the_same_command_goes_on(ckpt,
                                                                                      tmp_path):
    """`evaluate.py blimp` on 20 of the fast BLiMP's paradigms (4,000 pairs: two chunks of
    2,000), SIGTERM once its first chunk is scored: the process ends at once with one line
    saying how to go on; the same command then scores only the chunk that was left."""
    src = tmp_path / "blimp"
    src.mkdir()
    fast = shared_data() / "babylm_eval" / "fast_eval" / "blimp_fast"
    for f in sorted(fast.glob("*.jsonl"))[:20]:
        (src / f.name).symlink_to(f.resolve())  # (CI's NANOMLM_RAW is a relative path)
    cmd = [str(warm_python.launcher()), str(REPO / "evaluate.py"), "blimp", "--ckpt", str(ckpt),
           "--blimp-dir", str(src), "--device", "cpu", "--out", str(tmp_path / "blimp.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    assert stopped_once_it_says(proc, "blimp: 1/") == (
        "SIGTERM: stopped `evaluate.py blimp`; the chunks scored so far are kept: the same "
        "command goes on from them")
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "resuming: 1 of 2 chunks already scored" in again.stdout, again.stdout


def test_sigterm_during_fine_tuning_keeps_the_seeds_done_and_the_same_command_goes_on(ckpt,
                                                                                       tmp_path):
    """`evaluate.py finetune` over three seeds, SIGTERM once the first seed's run is kept: the
    process ends at once with one line saying how to go on; the same command fine-tunes only
    the seeds left and writes what a command never interrupted writes (each seed's metrics,
    epochs and predictions)."""
    from test_evaluate import keyword_task
    keyword_task(tmp_path, 400, 0)
    keyword_task(tmp_path, 100, 1)
    cmd = lambda out: [sys.executable, str(REPO / "evaluate.py"), "finetune", "--ckpt", str(ckpt),
                       "--task", "keyword", "--data-dir", str(tmp_path), "--seeds", "1,2,3",
                       "--lr", "1e-3", "--epochs", "3", "--batch-size", "16", "--device", "cpu",
                       "--out", str(tmp_path / out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # The run to stop is niced, so that a loaded machine delays it rather than this test's poll:
    # the signal must arrive while seeds are left.
    proc = subprocess.Popen(cmd("stopped.json"), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: os.nice(15))
    ref = subprocess.Popen(cmd("whole.json"), cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    partial = tmp_path / "stopped.json.partial"
    t0 = time.time()
    while not (partial.exists() and '"seed": 1' in partial.read_text()):
        assert proc.poll() is None and time.time() - t0 < 300, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1] == (
        "SIGTERM: stopped `evaluate.py finetune`; the seeds fine-tuned so far are kept: the "
        "same command goes on from them")
    again = subprocess.run(cmd("stopped.json"), cwd=REPO, capture_output=True, text=True,
                           env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert re.search(r"resuming: seeds \[1(, 2)?\] already fine-tuned", again.stdout), again.stdout
    assert ref.wait(timeout=600) == 0, ref.stderr.read()
    got, want = (json.loads((tmp_path / f).read_text()) for f in ("stopped.json", "whole.json"))
    drop = lambda runs: {s: {k: v for k, v in r.items() if k != "seconds"} for s, r in runs.items()}
    assert drop(got["runs"]) == drop(want["runs"]) and got["aggregate"] == want["aggregate"]
    assert not partial.exists()


# A user's mistakes, by kind, across the tools: each one line, naming the cause, before any work

@pytest.mark.parametrize("tool", ["train", "synth", "study", "export"])
def test_a_file_where_a_folder_is_written_is_one_line(tool, prepared, tmp_path, capsys):
    """Every flag that names a folder to write (train.py --out-dir, synth.py, study.py and
    export.py --out) says that a file given there is a file, before anything is read."""
    import export
    import study
    import synth
    import train
    f = tmp_path / "a_file"
    f.write_text("mine")
    main, argv, flag = {
        "train": (train.main, ["--data", str(prepared), "--out-dir", str(f), *TINY], "--out-dir"),
        "synth": (synth.main, ["--out", str(f)], "--out"),
        "study": (study.main, [str(REPO / "studies" / "gpt_bert.toml"), "--dry-run", "--out",
                               str(f)], "--out"),
        "export": (export.main, ["--ckpt", str(tmp_path / "none"), "--out", str(f)], "--out")}[tool]
    with pytest.raises(SystemExit) as e:
        main(argv)
    # a parser's error is printed (exit 2); the others are the exit's own line
    said = str(e.value.code) if isinstance(e.value.code, str) else capsys.readouterr().err
    assert said.count("\n") <= 1 and f"{flag} {f} is a file, not a folder" in said, said
    assert f.read_text() == "mine"


def test_a_new_run_is_refused_a_folder_of_other_files_unless_forced(prepared, tmp_path, capsys):
    """train.py into a folder that holds a user's files (no run): refused in one line naming
    them and --force, nothing written; with --force it trains beside them. A run folder is
    taken wherever a checkpoint is (--init-from here), as evaluate.py and export.py take it."""
    import train
    (tmp_path / "notes.txt").write_text("mine")
    argv = ["--data", str(prepared), "--out-dir", str(tmp_path), "--max-steps", "1", *TINY]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert str(e.value) == (f"error: --out-dir {tmp_path} holds other files (notes.txt) and no "
                            f"run; choose an empty or new folder, or pass --force to write "
                            f"beside them")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    train.main(argv + ["--force"])
    assert (tmp_path / "ckpt.pt").exists() and (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit) as e:  # a run there now: --resume, even with --force
        train.main(argv + ["--force"])
    assert "pass --resume to continue that run" in str(e.value)
    assert read_checkpoint(tmp_path)["model"].keys() == read_checkpoint(
        tmp_path / "ckpt.pt")["model"].keys()
    train.main(["--data", str(prepared), "--out-dir", str(tmp_path / "next"), "--max-steps", "1",
                "--init-from", str(tmp_path), *TINY])
    capsys.readouterr()


def test_the_same_input_twice_is_one_line(tmp_path, capsys):
    """evaluate.py compare with a result on both sides, plot.py with a run twice: refused, where
    they said "not distinguishable, p = 1.000" and drew one curve over the other."""
    import plot
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "blimp.json").write_text(json.dumps({"kind": "blimp", "pretrain_seed": 0,
        "examples": {"id": [0, 1], "label": [1, 0], "pred": [[1, 0]], "metric": "accuracy",
                     "k": 2}}))
    with pytest.raises(SystemExit) as e:
        E.main(["compare", str(tmp_path / "r"), str(tmp_path / "r" / "blimp.json")])
    assert str(e.value).startswith("error: 1 result file(s) in both groups")
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path / "r"), str(tmp_path / "r") + "/", "--out",
                   str(tmp_path / "c.png")])
    assert "a run folder is given twice" in capsys.readouterr().err
