"""train.py: span masking, LAMB, schedule, data order, and the command line as a user meets it
(run folder, exact resume, DDP, and a clear one-line error for every bad input)."""
import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train as T
from conftest import TINY, run_train
from data.prepare import CLS, MASK, PAD, SEP, prepare


# --- span masking --------------------------------------------------------------------------------

def test_span_masking_statistics():
    V, B, L = 5000, 1024, 128
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (B, L), generator=gen)
    ids[:, 0], ids[:, -1] = CLS, SEP
    ids[: B // 4, 100:] = PAD  # some padding too
    inputs, labels = T.span_mask(ids, 0.15, V, gen)
    real = ids >= 5
    chosen = labels != -100
    assert not chosen[~real].any()                                  # specials are never chosen
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    assert chosen[real].float().mean().item() == pytest.approx(0.15, abs=0.01)
    masked = (inputs == MASK) & chosen
    kept = (inputs == ids) & chosen
    randomised = chosen & ~masked & ~kept
    n = chosen.sum().item()
    assert masked.sum().item() / n == pytest.approx(0.8, abs=0.01)
    assert kept.sum().item() / n == pytest.approx(0.1, abs=0.01)  # (+1/V: a random draw may hit itself)
    assert randomised.sum().item() / n == pytest.approx(0.1, abs=0.01)
    assert inputs[randomised].min() >= 5                             # random tokens are never specials
    # spans: a chosen token's right neighbour is chosen if it is in the same span (prob 2/3 for
    # geometric lengths of mean 3) or starts a new span that is chosen (1/3 * 0.15); i.i.d.
    # token masking would give 0.15
    both = chosen[:, 1:90] & chosen[:, 2:91]
    assert both.sum().item() / chosen[:, 1:90].sum().item() == pytest.approx(2 / 3 + 0.15 / 3, abs=0.02)


def test_span_masking_is_a_function_of_the_generator():
    ids = torch.randint(5, 100, (4, 32))
    a = T.span_mask(ids, 0.15, 100, torch.Generator().manual_seed(7))
    b = T.span_mask(ids, 0.15, 100, torch.Generator().manual_seed(7))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# --- optimizer and schedule ----------------------------------------------------------------------

def lamb_reference(w, grads, lr, b1, b2, eps, wd):
    """You et al. (2020), Algorithm 2, for one tensor, in float64 numpy."""
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + wd * w
        wn, rn = np.linalg.norm(w), np.linalg.norm(r)
        w = w - lr * (wn / rn if wn > 0 and rn > 0 else 1.0) * r
    return w


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_matches_reference(wd):
    rng = np.random.default_rng(0)
    inits = [rng.normal(size=(5, 3)), np.zeros(4)]  # a zero tensor takes the trust-ratio-1 branch
    grads = [[rng.normal(size=w.shape) for _ in range(4)] for w in inits]
    params = [torch.tensor(w, requires_grad=True) for w in inits]
    opt = T.Lamb([{"params": params, "weight_decay": wd}], lr=0.05, betas=(0.9, 0.98), eps=1e-6)
    for t in range(4):
        for p, g in zip(params, grads):
            p.grad = torch.tensor(g[t])
        opt.step()
    for p, w, g in zip(params, inits, grads):
        np.testing.assert_allclose(p.detach().numpy(), lamb_reference(w, g, 0.05, 0.9, 0.98, 1e-6, wd), rtol=1e-12, atol=1e-12)


def test_schedule_hand_computed():
    args = argparse.Namespace(lr=1.0, warmup=10, max_steps=110, min_lr=0.1, schedule="cosine")
    assert T.lr_at(0, args) == pytest.approx(0.1) and T.lr_at(9, args) == pytest.approx(1.0)
    assert T.lr_at(10, args) == pytest.approx(1.0)
    assert T.lr_at(35, args) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert T.lr_at(60, args) == pytest.approx(0.55) and T.lr_at(110, args) == pytest.approx(0.1)
    args.schedule = "linear"
    assert T.lr_at(35, args) == pytest.approx(0.1 + 0.9 * 0.75)
    args.warmup = 0.1  # a fraction of max_steps: 11 steps
    assert T.lr_at(10, args) == pytest.approx(1.0) and T.lr_at(9, args) == pytest.approx(10 / 11)


# --- data order ----------------------------------------------------------------------------------

def test_each_epoch_visits_every_segment_once(tmp_path):
    stream = np.arange(5, 5 + 103, dtype=np.uint16)
    stream.tofile(tmp_path / "t.bin")
    seg = T.Segments(tmp_path / "t.bin", 10, seed=3, shuffle=True)
    assert seg.n == 10
    for epoch in range(3):
        batch = seg.batch(epoch * seg.n, seg.n)
        assert (batch[:, 0] == CLS).all() and (batch[:, -1] == SEP).all()
        body = batch[:, 1:-1].numpy()
        starts = body[:, 0] - 5
        assert (np.diff(body, axis=1) == 1).all()  # each row is one contiguous window of the stream
        assert len(set((starts % 10).tolist())) == 1 and sorted(starts // 10) == list(range(10))  # all once
    again = T.Segments(tmp_path / "t.bin", 10, seed=3, shuffle=True)
    assert torch.equal(seg.batch(7, 25), again.batch(7, 25))  # a function of (seed, position) alone


# --- the command line ----------------------------------------------------------------------------

def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_run_folder_holds_everything_to_reproduce(prepared, tmp_path):
    out = tmp_path / "run"
    r = run_train("--data", prepared, "--out-dir", out, "--max-steps", 10, *TINY)
    assert r.returncode == 0, r.stderr
    assert {"args.json", "config.json", "data.json", "log.jsonl", "ckpt.pt", "code"} <= {p.name for p in out.iterdir()}
    assert {p.name for p in (out / "code").iterdir()} == {"model.py", "train.py", "prepare.py"}
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert {"model", "optimizer", "config", "args", "step", "rng", "data_pos", "ctx_state",
            "code_version", "tokenizer"} <= ckpt.keys()
    assert ckpt["step"] == 10 and ckpt["data_pos"] == 10 * 8 and ckpt["args"]["seq_len"] == 32
    assert json.loads((out / "config.json").read_text()) == ckpt["config"]
    log = read_log(out)
    assert [e["step"] for e in log if "loss" in e] == [5, 10]
    assert {"loss", "acc", "grad_norm", "lr", "tok_per_s"} <= log[0].keys()
    assert "val_loss" in log[-1] and "val_acc" in log[-1]
    assert "step 10/10 | loss" in r.stdout


def test_resume_is_exact(prepared, tmp_path):
    """40 steps in one go == 20 steps, stop, resume, 20 more: same parameters, optimizer state and
    logged losses, bit for bit (dropout is on)."""
    common = ["--data", prepared, "--max-steps", 40, *TINY]
    assert run_train(*common, "--out-dir", tmp_path / "a").returncode == 0
    first = run_train(*common, "--out-dir", tmp_path / "b", "--stop-at", 20)
    assert first.returncode == 0, first.stderr
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["step"] == 20
    second = run_train("--out-dir", tmp_path / "b", "--resume", "--device", "cpu")
    assert second.returncode == 0, second.stderr
    a, b = (torch.load(tmp_path / x / "ckpt.pt", weights_only=True) for x in "ab")
    assert a["step"] == b["step"] == 40
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa)
    drop = lambda log: [{k: v for k, v in e.items() if k != "tok_per_s"} for e in log]
    assert drop(read_log(tmp_path / "a")) == drop(read_log(tmp_path / "b"))


def test_ddp_two_gloo_processes_equal_one_process_accumulating(prepared, tmp_path):
    """2 processes x batch 8 must take the same steps as 1 process x 2 micro-batches of 8: same
    segments, same masks; DDP averages the gradients that accumulation sums /2 (dropout off)."""
    common = ["--data", prepared, "--max-steps", 6, "--dropout", 0.0, *TINY]
    single = run_train(*common, "--grad-accum", 2, "--out-dir", tmp_path / "single")
    assert single.returncode == 0, single.stderr
    ddp = run_train(*common, "--out-dir", tmp_path / "ddp",
                    launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])
    assert ddp.returncode == 0, ddp.stderr
    assert "x2 |" in ddp.stdout and "16 seqs" in ddp.stdout
    a, b = (torch.load(tmp_path / x / "ckpt.pt", weights_only=True)["model"] for x in ("single", "ddp"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    la, lb = ([e["loss"] for e in read_log(tmp_path / x) if "loss" in e] for x in ("single", "ddp"))
    np.testing.assert_allclose(la, lb, rtol=1e-5)


# --- bad input: one clear line, exit code 1, nothing already written is lost ---------------------

def assert_clean_error(r, pattern):
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and __import__("re").search(pattern, last), last


@pytest.fixture(scope="module")
def trained(prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained") / "run"
    r = run_train("--data", prepared, "--out-dir", out, "--max-steps", 5, *TINY)
    assert r.returncode == 0, r.stderr
    return out / "ckpt.pt"


def test_error_missing_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOMLM_RAW", str(tmp_path))
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    r = run_train("--data", "babylm_10m", "--out-dir", tmp_path / "run", *TINY)
    assert_clean_error(r, rf"no corpus folder at {tmp_path}/babylm_10m .*osf\.io/ad7qg")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("content", [None, "  \n\n"], ids=["empty", "no text"])
def test_error_corpus_without_text(tmp_path, monkeypatch, content):
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    (tmp_path / "corpus").mkdir()
    if content is not None:
        (tmp_path / "corpus" / "a.train").write_text(content)
    r = run_train("--data", tmp_path / "corpus", "--out-dir", tmp_path / "run", *TINY)
    assert_clean_error(r, "holds no text files|has no text")


def test_error_checkpoint_of_another_model(trained, prepared, small_raw, tmp_path, monkeypatch):
    r = run_train("--data", prepared, "--init-from", trained, "--out-dir", tmp_path / "a", *TINY, "--d-model", 96)
    assert_clean_error(r, "holds a different model: d_model=64 there but 96 here")
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    other_vocab = prepare(str(small_raw), vocab_size=1500, quiet=True)
    r = run_train("--data", other_vocab, "--init-from", trained, "--out-dir", tmp_path / "b", *TINY)
    assert_clean_error(r, "vocab_size=2000 there but 1500 here")


def test_error_corrupt_checkpoint(trained, prepared, tmp_path):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(trained.read_bytes()[:5000])
    r = run_train("--data", prepared, "--init-from", bad, "--out-dir", tmp_path / "a", *TINY)
    assert_clean_error(r, "cannot read checkpoint .*corrupt or truncated")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "ckpt.pt").write_bytes(b"not a checkpoint")
    assert_clean_error(run_train("--out-dir", tmp_path / "b", "--resume"), "cannot read checkpoint")


def test_error_impossible_model(prepared, tmp_path):
    r = run_train("--data", prepared, "--out-dir", tmp_path / "a", *TINY, "--n-head", 3)
    assert_clean_error(r, "--d-model 64 is not a multiple of --n-head 3")
    r = run_train("--data", prepared, "--out-dir", tmp_path / "b", *TINY, "--seq-len", 600)
    assert_clean_error(r, "--seq-len 600 exceeds --max-position 512")


def test_error_resume_without_checkpoint(tmp_path):
    assert_clean_error(run_train("--out-dir", tmp_path / "nothing", "--resume"), "--resume, but there is no checkpoint at")


def test_existing_run_is_never_overwritten(trained, prepared):
    before = trained.read_bytes()
    r = run_train("--data", prepared, "--out-dir", trained.parent, "--max-steps", 5, *TINY)
    assert_clean_error(r, "exists; pass --resume")
    r = run_train("--out-dir", trained.parent, "--resume", "--lr", 0.5)
    assert_clean_error(r, "keeps its settings, but --lr differ")
    assert trained.read_bytes() == before


def test_error_nan_loss_keeps_last_good_checkpoint(prepared, tmp_path):
    out = tmp_path / "run"
    r = run_train("--data", prepared, "--out-dir", out, "--max-steps", 20, *TINY,
                  "--optim", "adamw", "--lr", 1e30, "--warmup", 0, "--clip", 0, "--save-every", 1, "--log-every", 1)
    assert_clean_error(r, r"became NaN/inf at step (\d+); stopped, the last good checkpoint \(step \d+\) is kept")
    bad_step = int(__import__("re").search(r"at step (\d+)", r.stderr).group(1))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["step"] == bad_step - 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert read_log(out)[-1] == {"step": bad_step, "error": "non-finite loss or gradient"}
