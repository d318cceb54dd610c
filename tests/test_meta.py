"""meta.py: the soft-label unroll against finite differences, the hard-label h against a hand
computation, the student keeping only its own step, the Two Moons data, and the CLI."""
import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import meta as M
from conftest import REPO, shared_data
from metalearning import examples as EX
from data.prepare import MASK, PAD, SEP
from metalearning import moons as MM
from evaluation.multibootstrap import load_examples, multibootstrap
from machinery.plumbing import read_checkpoint
from model import Encoder, ModelConfig, load_checkpoint


V = 24  # 5 specials, ids 5..19 "words", 20 = [MLM], 21 = [TASK], 22-23 labels
CFG = ModelConfig(vocab_size=V, n_layer=2, n_head=2, d_model=8, d_ff=16, dropout=0.0,
                  max_position=16)


def batch(seed=0, B=3, T=6):
    """Unlabelled sequences (one padded) and a support and a query batch of a two-class task."""
    g = torch.Generator().manual_seed(seed)
    x_u = torch.randint(5, 20, (B, T), generator=g)
    x_u[:, 0] = 20
    x_u[1, -2:] = PAD
    m_u = (x_u != PAD).long()
    x_m, y_m = EX.mask_tokens(x_u, g, 5, 20, 20, p=0.5)
    b = {"x_u": x_u, "m_u": m_u, "x_m": x_m, "y_m": y_m}
    for s in "sq":
        x = torch.randint(5, 20, (4, 4), generator=g)
        x[:, 0] = 21
        x, y = EX.task_batch(x, torch.tensor([0, 1, 1, 0]), torch.arange(4), torch.tensor([22, 23]))
        b.update({f"x_{s}": x, f"y_{s}": y, f"m_{s}": torch.ones_like(x)})
    return b


def models(seed=0):
    torch.manual_seed(seed)
    return Encoder(CFG).double().train(), M.Teacher(CFG).double().train()


def args(**kw):
    base = argparse.Namespace(labels="soft", inner_lr=0.3, clip=1e9, meta_weight=1.0,
                                unroll="sgd")
    return M.replace_args(base, **kw)


# ---------------------------------------------------------------------------------------------
# Soft labels: the exact meta-gradient

def stepped_adamw(student, b, steps=3, lr=1e-2, weight_decay=0.01):
    """An AdamW on the student that holds moments: `steps` steps taken on copies of the student
    (so the student itself stays where it is), the state then moved over to its parameters."""
    copy = Encoder(CFG).double().train()
    copy.load_state_dict(student.state_dict())
    warm = torch.optim.AdamW(copy.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        M.seq_loss(copy, M.params_of(copy), b["x_m"], b["y_m"], b["m_u"]).backward()
        warm.step()
        warm.zero_grad()
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=weight_decay)
    opt.load_state_dict(warm.state_dict())
    return opt


@pytest.mark.parametrize("unroll", ["sgd", "adamw"])
def test_soft_teacher_gradient_matches_finite_differences(unroll):
    """d L_query(theta2(teacher)) / d teacher, by autograd through the functional unroll, against
    central differences in float64, on entries of three different teacher tensors; step (1) as
    SGD or as the student's AdamW step with its moments."""
    student, teacher = models()
    b = batch()
    opt = stepped_adamw(student, b) if unroll == "adamw" else None

    def query_loss():
        lx, ly = teacher(b["x_u"], b["m_u"])
        return M.soft_unroll(student, opt, lx.softmax(-1), ly.softmax(-1), b,
                             args(unroll=unroll))[0]

    query_loss().backward()
    checked = 0
    for name in ("y_head.4.weight", "encoder.layers.0.ffn.up.weight", "encoder.word.weight"):
        p = dict(teacher.named_parameters())[name]
        picks = torch.randperm(p.numel(), generator=torch.Generator().manual_seed(1))[:4]
        for flat in picks.tolist():
            idx = np.unravel_index(flat, p.shape)
            keep = p[idx].item()
            p.data[idx] = keep + 1e-6
            up = query_loss().item()
            p.data[idx] = keep - 1e-6
            down = query_loss().item()
            p.data[idx] = keep
            fd = (up - down) / 2e-6
            assert p.grad[idx].item() == pytest.approx(fd, rel=1e-5, abs=1e-9), (name, idx)
            checked += abs(fd) > 1e-7
    assert checked >= 6  # most checked entries have a real gradient, not a trivial 0 = 0


def test_soft_unroll_is_sgd_then_sgd():
    """The unrolled query loss equals one computed by two explicit SGD steps on a model copy."""
    student, teacher = models(1)
    b = batch(1)
    with torch.no_grad():
        lx, ly = teacher(b["x_u"], b["m_u"])
    px, py = lx.softmax(-1), ly.softmax(-1)
    lq = M.soft_unroll(student, None, px, py, b, args(unroll="sgd"))[0]
    copy = Encoder(CFG).double()
    copy.load_state_dict(student.state_dict())
    sgd = torch.optim.SGD(copy.parameters(), lr=0.3)
    for x, y, m in ((px, py, b["m_u"]), (b["x_s"], b["y_s"], b["m_s"])):
        M.seq_loss(copy, M.params_of(copy), x, y, m).backward()
        sgd.step()
        sgd.zero_grad()
    want = M.seq_loss(copy, M.params_of(copy), b["x_q"], b["y_q"], b["m_q"]).item()
    assert lq.item() == pytest.approx(want, rel=1e-10)


@pytest.mark.parametrize("clip", [1e9, 0.05])
def test_adamw_unroll_is_the_optimisers_own_step(clip):
    """theta1 of the unroll equals what torch.optim.AdamW.step does with the same (clipped)
    gradients and state, in float64: the first step and one with moments."""
    student, teacher = models(3)
    b = batch(3)
    for warm in (0, 3):
        opt = stepped_adamw(student, b, steps=warm)
        theta0 = M.params_of(student, detach=True)
        loss = M.seq_loss(student, theta0, b["x_s"], b["y_s"], b["m_s"])
        grads = torch.autograd.grad(loss, list(theta0.values()))
        theta1 = M.adamw_unroll(theta0, grads, opt, list(student.parameters()), clip)
        copy = Encoder(CFG).double().train()
        copy.load_state_dict(student.state_dict())
        ref = torch.optim.AdamW(copy.parameters(), lr=1e-2, weight_decay=0.01)
        ref.load_state_dict(opt.state_dict())
        for p, g in zip(copy.parameters(), grads):
            p.grad = g.clone()
        nn.utils.clip_grad_norm_(copy.parameters(), clip)
        ref.step()
        for (name, want) in copy.named_parameters():
            torch.testing.assert_close(theta1[name], want.detach(), rtol=1e-12, atol=1e-14)


def test_support_and_query_never_share_an_example():
    g = torch.Generator().manual_seed(0)
    for n, k in ((160, 8), (10, 8), (3, 8)):
        for _ in range(20):
            s, q = EX.support_and_query(n, k, g)
            assert len(s) == len(q) == min(k, n // 2)
            assert not set(s.tolist()) & set(q.tolist()) and max(s.max(), q.max()) < n
    with pytest.raises(SystemExit, match="cannot make a support and a query"):
        EX.support_and_query(1, 8, g)


def test_soft_defaults_are_metalmos_and_mlm_takes_turns_as_the_task():
    a = M.label_defaults(argparse.Namespace(labels="soft", meta_weight=None, mlm_task_p=None))
    assert (a.meta_weight, a.mlm_task_p) == (100.0, 0.5)
    a = M.label_defaults(argparse.Namespace(labels="hard", meta_weight=None, mlm_task_p=None))
    assert (a.meta_weight, a.mlm_task_p) == (1.0, 0.0)
    a = M.label_defaults(argparse.Namespace(labels="soft", meta_weight=3.0, mlm_task_p=0.0))
    assert (a.meta_weight, a.mlm_task_p) == (3.0, 0.0)  # typed values stay


# ---------------------------------------------------------------------------------------------
# Hard labels: h by hand

class TwoParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))


def two_param_h(opt_class, lr):
    """L_pseudo = (w1-3)^2/2 + (w2-1)^2/4, L_support = |w|^2/2,
    L_query = (w1-1)^2/2 + (w2-3)^2/2."""
    model = TwoParams()
    opt = opt_class(model.parameters(), lr=lr)
    pseudo = lambda p: 0.5 * (p["w"][0] - 3) ** 2 + 0.25 * (p["w"][1] - 1) ** 2
    support = lambda p: 0.5 * (p["w"] ** 2).sum()
    query = lambda p: 0.5 * (p["w"][0] - 1) ** 2 + 0.5 * (p["w"][1] - 3) ** 2
    h = M.hard_label_signal(model, opt, pseudo, support, query, inner_lr=0.1, clip=1e9)[0]
    return h.item(), model.w.detach().tolist()


def test_hard_label_signal_equals_hand_computed_cosine_sgd():
    # grad L_pseudo(1, 2) = (-2, 0.5); SGD lr 0.5: theta1 = (2, 1.75), theta0 - theta1 = (-1, 0.25)
    # support: theta2 = 0.9 theta1 = (1.8, 1.575); grad L_query(theta2) = (0.8, -1.425)
    h, w = two_param_h(torch.optim.SGD, 0.5)
    want = (0.8 * -1 + -1.425 * 0.25) / (math.hypot(0.8, 1.425) * math.hypot(1, 0.25))
    assert w == pytest.approx([2.0, 1.75])              # the student keeps theta1, not theta2
    assert h == pytest.approx(want, rel=1e-12)


def test_hard_label_signal_uses_the_adaptive_step_not_the_gradient():
    # Adam's first step is lr * sign(g) (to eps): theta1 = (1.5, 1.5), theta0 - theta1 =
    # (-0.5, 0.5);
    # theta2 = (1.35, 1.35); grad L_query(theta2) = (0.35, -1.65)
    h, w = two_param_h(torch.optim.Adam, 0.5)
    want = (0.35 * -0.5 + -1.65 * 0.5) / (math.hypot(0.35, 1.65) * math.hypot(0.5, 0.5))
    with_gradient = (0.35 * -2 + -1.65 * 0.5) / (math.hypot(0.35, 1.65) * math.hypot(2, 0.5))
    assert w == pytest.approx([1.5, 1.5], rel=1e-6)
    assert h == pytest.approx(want, rel=1e-6)
    assert abs(h - with_gradient) > 0.05


# ---------------------------------------------------------------------------------------------
# The student keeps its own outer step only

@pytest.mark.parametrize("labels", ["hard", "soft", "denoise", "mlm"])
def test_meta_step_leaves_the_student_with_its_outer_step_only(labels):
    student, teacher = models(2)
    b = batch(2)
    reference = Encoder(CFG).double().train()
    reference.load_state_dict(student.state_dict())
    before = {k: v.clone() for k, v in student.state_dict().items()}
    opt_s = torch.optim.AdamW(student.parameters(), lr=1e-2)
    opt_t = torch.optim.AdamW(teacher.parameters(), lr=1e-2)
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    info = M.meta_step(student, teacher, opt_s, opt_t, b, args(labels=labels), gen)
    # the same AdamW step on the same pseudo example, taken alone
    x, y = info["example"] if labels != "mlm" else (b["x_m"], b["y_m"])
    opt_r = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    loss = M.seq_loss(reference, M.params_of(reference), x, y, b["m_u"])
    M.outer_step(reference, opt_r, loss, 1e9)
    for k, v in student.state_dict().items():
        torch.testing.assert_close(v, reference.state_dict()[k], rtol=1e-9, atol=1e-12)
    assert any(not torch.equal(v, before[k]) for k, v in student.state_dict().items())
    moved = any(not torch.equal(v, teacher_before[k]) for k, v in teacher.state_dict().items())
    assert moved == (labels != "mlm")


def test_denoise_writes_x_only_and_restores_the_text_read():
    """--labels denoise: the pseudo example's target is x_u itself, one-hot (MetaLMO's
    --fixed_y); the teacher's y head gets no meta gradient."""
    student, teacher = models(5)
    b = batch(5)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    lx, ly = teacher(b["x_u"], b["m_u"])
    meta, info = M.soft_step(student, opt, b, lx, ly, args(labels="denoise"), None)
    px, py = info["example"]
    assert torch.equal(py.argmax(-1), b["x_u"]) and (py.sum(-1) == 1).all()
    g_y = torch.autograd.grad(meta, ly, allow_unused=True)[0]
    assert g_y is None or not g_y.any()


def test_the_teacher_reads_unlabelled_text_under_its_own_token():
    """The meta loss's x^, y^ come from x_u under [U]; the auxiliary losses read x_u relabelled
    [MLM] (to write an MLM task) and x_m (to do one), as MetaLMO's mlm_step."""
    student, teacher = models(4)
    b = batch(4)
    b["x_u"][:, 0] = 19  # [U] here; 20 is [MLM], x_m's first token
    read = []
    forward = teacher.forward
    teacher.forward = lambda x, m: (read.append(x.clone()), forward(x, m))[1]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (student, teacher)]
    M.meta_step(student, teacher, *opts, b, args(labels="hard"), torch.Generator().manual_seed(0))
    assert [int(x[0, 0]) for x in read] == [19, 20, 20]
    assert torch.equal(read[1][:, 1:], b["x_u"][:, 1:]) and torch.equal(read[2], b["x_m"])


# ---------------------------------------------------------------------------------------------
# Pieces

def test_seq_loss_matches_a_per_position_loop():
    student, teacher = models(3)
    b = batch(3)
    with torch.no_grad():
        lx, ly = teacher(b["x_u"], b["m_u"])
    for x, y in ((b["x_m"], b["y_m"]), (lx.softmax(-1), ly.softmax(-1))):
        got = M.seq_loss(student, M.params_of(student), x, y, b["m_u"]).item()
        with torch.no_grad():
            logp = student.logits(x, b["m_u"]).log_softmax(-1)
        terms = []
        for i in range(x.shape[0]):
            for t in range(x.shape[1]):
                if b["m_u"][i, t] == 0:
                    continue
                if y.dim() == 2:
                    if y[i, t] != PAD:
                        terms.append(-logp[i, t, y[i, t]].item())
                else:
                    terms.append(-(y[i, t] * logp[i, t]).sum().item())
        assert got == pytest.approx(sum(terms) / len(terms), rel=1e-10)


def test_mask_tokens_rates_and_never_the_task_token_or_padding():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(5, 69, (400, 33), generator=g)
    x[:, 0] = 69
    x[:50, -5:] = PAD
    x_m, y_m = EX.mask_tokens(x, g, 5, 69, 70)
    chosen = y_m != PAD
    assert not chosen[:, 0].any() and not chosen[x == PAD].any() and (x_m[:, 0] == 70).all()
    assert torch.equal(y_m[chosen], x[chosen])
    assert torch.equal(x_m[:, 1:][~chosen[:, 1:]], x[:, 1:][~chosen[:, 1:]])
    eligible = (x != PAD).sum() - 400
    assert chosen.sum() / eligible == pytest.approx(0.15, abs=0.01)
    assert (x_m[chosen] == MASK).float().mean() == pytest.approx(0.8, abs=0.03)
    assert (x_m[chosen] == x[chosen]).float().mean() == pytest.approx(0.1 + 0.9 / 64, abs=0.03)


def test_sampler_follows_the_distribution_and_never_draws_zero_probability():
    logits = torch.log(torch.tensor([0.0, 0.1, 0.2, 0.0, 0.7])).expand(4, 50_000, 5)
    s = M.sample(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(s.flatten(), minlength=5) / s.numel()
    assert freq[0] == 0 and freq[3] == 0
    assert freq[1:3].tolist() == pytest.approx([0.1, 0.2], abs=0.005)


def test_two_moons_is_deterministic_by_seed_and_shaped_as_described():
    a, b, c = (MM.two_moons(seed, n_unlabeled=300) for seed in (5, 5, 6))
    assert np.array_equal(a["unlabeled"], b["unlabeled"])
    for k in ("labeled", "test"):
        assert all(np.array_equal(x, y) for x, y in zip(a[k], b[k]))
    assert not np.array_equal(a["unlabeled"], c["unlabeled"])
    assert not np.array_equal(a["test"][0], c["test"][0])
    tok = a["tokens"]
    assert tok["vocab"] == 512
    u = a["unlabeled"]
    assert u.shape == (300, 34) and (u[:, 0] == tok["unl"]).all() and (u[:, -1] == SEP).all()
    pts = (u[:, 1:-1] - MM.COORD).reshape(300, 16, 2)
    assert pts.min() >= 0 and pts.max() < 64
    key = pts[..., 0] * 64 + pts[..., 1]
    assert (np.diff(key, axis=1) >= 0).all()                            # sorted by x, then y
    x, y = a["labeled"]
    assert x.shape == (160, 4) and (x[:, 0] == tok["task"]["moon"]).all()
    assert (x[:, 3] == SEP).all()
    # MetaLMO's labels (data/config/two_moons.py): class 0 is [SEP], class 1 the task token
    assert tok["label"] == [SEP, tok["task"]["moon"]]
    assert EX.label_tokens(9, 3) == [SEP, 9, MASK]        # as MetaLMO's CB: a third class [MASK]
    with pytest.raises(SystemExit, match="4 classes"):
        EX.label_tokens(9, 4)
    assert all(y[:n].sum() == n // 2 for n in (10, 20, 40, 80, 160))   # every prefix balanced
    assert a["test"][0].shape == (1000, 4)


def test_moons_lie_on_their_half_circles():
    xy, label = MM.make_moons(20000, np.random.default_rng(0), noise=0.0)
    upper, lower = xy[label == 0], xy[label == 1]
    assert np.allclose(np.hypot(*upper.T), 1) and (upper[:, 1] >= 0).all()
    assert np.allclose(np.hypot(lower[:, 0] - 1, lower[:, 1] - 0.5), 1)
    assert (lower[:, 1] <= 0.5).all()
    xy, _ = MM.make_moons(20000, np.random.default_rng(0), noise=0.1)
    grid = MM.to_grid(xy)
    assert grid.min() >= 0 and grid.max() <= 63
    assert np.unique(grid[:, 0]).size > 50  # the grid is used, not collapsed


def test_even_labelled_points_are_scikit_learns_make_moons():
    """--labeled-points even: MetaLMO's make_moons(n) (scikit-learn's: n/2 points per moon at t =
    linspace(0, pi, n/2), then noise); without noise, n = 10 by hand: t = 0, pi/4, ..., pi."""
    xy, label = MM.even_moons(10, np.random.default_rng(0), noise=0.0)
    r = math.sqrt(0.5)
    upper = [(1, 0), (r, r), (0, 1), (-r, r), (-1, 0)]                  # (cos t, sin t)
    lower = [(0, 0.5), (1 - r, 0.5 - r), (1, -0.5), (1 + r, 0.5 - r), (2, 0.5)]
    assert label.tolist() == [0, 1] * 5
    assert np.allclose(xy[0::2], upper) and np.allclose(xy[1::2], lower)
    noisy, _ = MM.even_moons(10, np.random.default_rng(0))
    assert 0.03 < np.std(noisy - xy) < 0.2                              # N(0, 0.1^2) added
    # the sets: one draw per size (not nested), validation apart from training, by data seed
    data = MM.two_moons(0, n_unlabeled=16)
    (tr, va), (tr2, _) = (MM.labeled_sets(data, n, "even", 0) for n in (10, 20))
    assert tr.x.shape == (10, 4) and va.x.shape == (10, 4) and tr2.x.shape == (20, 4)
    assert (tr.x[:, 0] == data["tokens"]["task"]["moon"]).all() and (tr.x[:, 3] == SEP).all()
    assert not np.array_equal(tr.x, va.x) and not np.array_equal(tr.x, tr2.x[:10])
    assert np.array_equal(MM.labeled_sets(data, 10, "even", 0)[0].x, tr.x)
    assert not np.array_equal(MM.labeled_sets(data, 10, "even", 1)[0].x, tr.x)
    assert MM.labeled_sets(data, 160, "even", 0)[1].x.shape == (128, 4)  # at most 128
    # random: the first n of the data's own draws, as before the flag
    rt, rv = MM.labeled_sets(data, 10, "random", 0)
    assert np.array_equal(rt.x, data["labeled"].x[:10])
    assert np.array_equal(rv.y, data["valid"].y[:10])


# ---------------------------------------------------------------------------------------------
# Command line

def test_two_moons_cli_prints_the_table_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--sizes", "2,4", "--seeds", "0,1", "--steps", "3", "--ft-steps", "2",
              "--workers", "1", "--device", "cpu", "--out-dir", str(out)]
    M.main(["--labels", "hard,soft,mlm,none", *common])
    text = capsys.readouterr().out
    assert "| pretraining | n=2 | n=4 |" in text
    for labels in ("hard", "soft", "mlm", "none"):
        assert f"| {labels} |" in text
    results = json.loads((out / "results.json").read_text())
    assert len(results) == 16 and all(0 <= v <= 1 for v in results.values())
    # every entry's test predictions, which evaluate.py compare reads
    assert len(list((out / "cells").glob("*.json"))) == 16
    cell = json.loads((out / "cells" / "soft_n4_s1.json").read_text())
    ex = cell["examples"]
    assert np.mean(np.array(ex["pred"][0]) == np.array(ex["label"])) == results["soft/4/1"]
    A, B = ([load_examples(out / "cells" / f"{lab}_n4_s{s}.json", "examples") for s in (0, 1)]
            for lab in ("mlm", "soft"))
    r = multibootstrap(A, B, nboot=50)
    assert r["seeds_a"] == r["seeds_b"] == [0, 1] and r["mean_b"] == pytest.approx(
        (results["soft/4/0"] + results["soft/4/1"]) / 2)
    assert (out / "args.json").exists() and (out / "code" / "meta.py").exists()
    with pytest.raises(SystemExit, match="exists"):
        M.main(["--labels", "mlm", *common])
    M.main(["--labels", "hard,soft,mlm,none", *common, "--resume"])
    assert ": test accuracy" not in capsys.readouterr().out             # no entry recomputed
    with pytest.raises(SystemExit):
        M.main(["--labels", "hrad", *common])
    assert "hard, soft, denoise, mlm or none" in capsys.readouterr().err


def test_glue_cli_writes_a_student_evaluate_can_load(prepared, tmp_path, capsys):
    glue = shared_data() / "babylm_eval" / "full_eval" / "glue_filtered"
    out = tmp_path / "glue"
    common = ["--task", "glue", "--data", str(prepared), "--glue-dir", str(glue), "--glue-tasks",
              "rte,cola", "--labels", "hard", "--log-every", "2", "--seq-len", "24",
              "--batch-size", "2", "--task-batch", "2", "--n-layer", "1", "--d-model", "16",
              "--n-head", "2", "--d-ff", "32", "--device", "cpu", "--out-dir", str(out)]
    M.main([*common, "--steps", "4", "--save-every", "2"])
    samples = (out / "samples.txt").read_text()
    assert "read    [U]" in samples and "x^" in samples and "y^" in samples
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4] and all(-1 <= r["h"] <= 1 for r in log)
    model, tok = load_checkpoint(out / "ckpt.pt")
    assert model.config.vocab_size == tok.get_piece_size()
    M.main([*common, "--steps", "6", "--resume"])
    assert "resuming at step 4" in capsys.readouterr().out


def family(pid: int) -> set[int]:
    """The PIDs of a process's descendants, from /proc."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    kids, todo = set(), [pid]
    while todo:
        p = todo.pop()
        new = {c for c, pp in parent.items() if pp == p} - kids
        kids |= new
        todo += new
    return kids


def alive(pid: int) -> bool:
    """Running (a zombie, which the container's init may never reap, counts as ended)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def ignores_ctrl_c(pid: int) -> bool:
    """Its SIGINT disposition is 'ignore' (/proc/PID/status SigIgn, bit SIGINT - 1)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("SigIgn:")), 16)
    return bool(mask >> (signal.SIGINT - 1) & 1)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_stop_signal_ends_two_moons_at_once_and_no_worker_outlives_it(tmp_path, how):
    """Issue 84: Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM
    (to meta.py alone, as a scheduler sends it) while two worker processes pretrain: meta.py
    ends within seconds, in one line giving the command that goes on, no traceback, and none of
    its child processes is left running."""
    out = tmp_path / "run"
    cmd = [sys.executable, "meta.py", "--labels", "hard", "--sizes", "2,4", "--seeds", "0",
           "--steps", "100000", "--ft-steps", "2", "--workers", "2", "--device", "cpu",
           "--out-dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    t0 = time.time()
    while not (out / "cells").exists():  # made once the workers have been started
        assert proc.poll() is None and time.time() - t0 < 300, proc.communicate()
        time.sleep(0.05)
    children = family(proc.pid)
    workers = {k for k in children if ignores_ctrl_c(k)}  # from their start: none can trace back
    os.killpg(proc.pid, signal.SIGINT) if how == "ctrl-c" else proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    name = "SIGINT" if how == "ctrl-c" else "SIGTERM"
    go_on = shlex.join(["python", *cmd[1:], "--resume"])
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"{name}: stopped `meta.py`; the entries finished "
                                            f"are kept, the same run goes on: {go_on}"), err
    t0 = time.time()
    while any(alive(k) for k in children) and time.time() - t0 < 30:
        time.sleep(0.1)
    assert len(workers) >= 2 and not [k for k in children if alive(k)]


def test_a_stop_signal_saves_the_glue_step_and_the_run_goes_on_to_the_same_weights(prepared,
                                                                                  tmp_path):
    """Issue 84: SIGTERM while the glue student pretrains: the step in progress ends and is
    saved, meta.py exits 1 with one line giving the command that goes on; that command ends
    with the weights of the same run never stopped. --resume of a folder that holds no run is
    refused in one line and makes no folder."""
    glue = shared_data() / "babylm_eval" / "full_eval" / "glue_filtered"
    flags = ["--task", "glue", "--data", str(prepared), "--glue-dir", str(glue), "--glue-tasks",
             "rte,cola", "--labels", "hard", "--log-every", "1", "--seq-len", "24",
             "--batch-size", "2", "--task-batch", "2", "--n-layer", "1", "--d-model", "16",
             "--n-head", "2", "--d-ff", "32", "--device", "cpu", "--steps", "300"]
    whole = subprocess.run([sys.executable, "meta.py", *flags, "--out-dir", tmp_path / "whole"],
                           cwd=REPO, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "stopped"
    cmd = [sys.executable, "meta.py", *flags, "--out-dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    t0 = time.time()
    logged = lambda: len((out / "log.jsonl").read_text().splitlines()) if out.exists() else 0
    while not (out / "log.jsonl").exists() or logged() < 3:
        assert proc.poll() is None and time.time() - t0 < 300, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    go_on = shlex.join(["python", *cmd[1:], "--resume"])
    assert proc.returncode == 1 and "Traceback" not in err, err
    step = int(last.split("stopped at step ")[1].split(",")[0])
    assert 3 <= step < 300 and last == (f"SIGTERM: stopped at step {step}, saved in "
                                        f"{out / 'meta.pt'}; the same run goes on: {go_on}")
    resumed = subprocess.run([sys.executable, *shlex.split(go_on)[1:]], cwd=REPO,
                             capture_output=True, text=True)
    assert resumed.returncode == 0 and f"resuming at step {step}" in resumed.stdout, resumed.stderr
    a, b = (read_checkpoint(d / "ckpt.pt")["model"] for d in (tmp_path / "whole", out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(SystemExit) as stopped:
        M.main([*flags, "--out-dir", str(tmp_path / "none"), "--resume"])
    assert str(stopped.value) == (f"error: --resume, but {tmp_path / 'none'} holds no meta.py run "
                                  f"to go on from")
    assert not (tmp_path / "none").exists()


def test_shens_schedule_is_metalmos_rule():
    """Transcribed from MetaLMO's trainers/schedulers.py with power -0.5 and decay forever: a
    linear rise to warmup^-1/2 at optimizer step n = warmup, then n^-1/2."""
    assert M.inverse_sqrt(0, 10) == pytest.approx(0.1 * 10 ** -0.5)
    assert M.inverse_sqrt(9, 10) == pytest.approx(10 ** -0.5)   # the peak: 0.04 -> 1.26e-2
    assert M.inverse_sqrt(39, 10) == pytest.approx(40 ** -0.5)   # half the peak at 4 x warmup
    assert M.inverse_sqrt(999, 1000) * 0.08 == pytest.approx(2.53e-3, abs=1e-5)  # his Table 5


@pytest.mark.parametrize("typed, want", [
    ([], dict(steps=40000, batch_size=16, task_batch=4, lr=0.08, teacher_lr=0.08, clip=5.0,
              dropout=0.1, ft_epochs=100, ft_lr=0.04, ft_warmup=10, warmup=1000,
              betas=(0.9, 0.98), eps=1e-6, labeled_points="even")),
    (["--labeled-points", "random"], dict(labeled_points="random", steps=40000)),
    (["--steps", "7", "--lr", "0.01"], dict(steps=7, lr=0.01, teacher_lr=0.01, batch_size=16)),
])
def test_shen_protocol_fills_what_is_not_typed(typed, want, monkeypatch):
    seen = {}
    monkeypatch.setattr(M, "run_two_moons", lambda args, device, folder: seen.update(vars(args)))
    monkeypatch.setattr(M.RunFolder, "lock", lambda self: None)
    monkeypatch.setattr(M.RunFolder, "start", lambda self, *a, **k: None)
    M.main(["--protocol", "shen", "--out-dir", "/nonexistent/x", *typed])
    assert {k: seen[k] for k in want} == want
    assert [MM.ft_batch(l, n) for l in ("mlm", "soft") for n in (10, 160)] == [1, 16, 1, 16]
    assert MM.ft_batch("soft", 20) == 2 and MM.ft_batch("mlm", 20) == 1


def test_shen_fine_tuning_steps_follow_his_schedule(monkeypatch):
    """Every fine-tuning step's lr, by hand: 10 warm-up steps rising linearly to 0.04 / sqrt(10)
    (his 1.2e-2 peak), then 0.04 / sqrt(n) at step n; batches of 2 for n = 20 (his Table 6)."""
    lrs = []
    monkeypatch.setattr(M, "outer_step", lambda model, opt, loss, clip: (
        lrs.append(opt.param_groups[0]["lr"]), opt.zero_grad()))
    data = MM.two_moons(0, n_unlabeled=16, n_labeled=20, n_test=8)
    a = argparse.Namespace(labels="soft", ft_epochs=3, ft_lr=0.04, ft_warmup=10,
                             betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, clip=5.0)
    student = Encoder(ModelConfig(vocab_size=data["tokens"]["vocab"], n_layer=1, n_head=2,
                                  d_model=8, d_ff=16, dropout=0.0, max_position=40))
    split = lambda part: MM.Labeled(*map(torch.as_tensor, part))
    M.finetune_predict(student, split(data["labeled"]), split(data["valid"]), split(data["test"]),
                       torch.tensor(data["tokens"]["label"]), a, seed=0)
    want = [0.04 * (n / 10) / math.sqrt(10) if n < 10 else 0.04 / math.sqrt(n)
            for n in range(1, 3 * 10 + 1)]  # 3 epochs of 20 / 2 steps
    assert lrs == pytest.approx(want, rel=1e-12)
    assert max(lrs) == pytest.approx(1.26e-2, abs=1e-4)


def test_mlm_takes_turns_as_the_labelled_task(monkeypatch):
    """--labels soft (--mlm-task-p 0.5): about half of the steps replace the support and query
    batches with MLM on other unlabelled text (x = the masked text under [MLM], y = the hidden
    tokens); the other steps keep the labelled task."""
    seen = []
    monkeypatch.setattr(M, "meta_step", lambda student, teacher, opt_s, opt_t, b, args, gen: (
        seen.append({k: v.clone() for k, v in b.items()}), {})[1])
    U = torch.arange(5, 5 + 64 * 6).view(64, 6)  # distinct tokens: every row traceable
    MLM_ID = 1000

    def unlabeled(step, gen):
        x = U[torch.randint(64, (8,), generator=gen)]
        x_m, y_m = EX.mask_tokens(x, gen, 5, 5 + 64 * 6, MLM_ID, p=0.5)
        return {"x_u": x, "m_u": torch.ones_like(x), "x_m": x_m, "y_m": y_m}

    task = torch.full((4, 6), 2000)
    labeled = lambda step, gen: {f"{v}_{s}": task for v in "xym" for s in "sq"}
    a = argparse.Namespace(labels="soft", steps=400, warmup=10, lr=1e-3, teacher_lr=1e-3,
                             betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, seed=0,
                             task_batch=3, log_every=1000, save_every=1000, meta_weight=None,
                             mlm_task_p=None)
    M.pretrain(Encoder(CFG), M.Teacher(CFG), unlabeled, labeled, a, torch.device("cpu"))
    assert len(seen) == 400
    mlm = [b for b in seen if (b["x_s"][:, 0] == MLM_ID).all()]
    assert all(torch.equal(b["x_s"], task) and torch.equal(b["x_q"], task)
               for b in seen if not (b["x_s"][:, 0] == MLM_ID).all())
    assert abs(len(mlm) - 200) < 3 * 10  # Binomial(400, 1/2): sd 10
    masked, in_x_u = [], []
    for b in mlm:
        for s in "sq":
            x, y = b[f"x_{s}"], b[f"y_{s}"]
            assert x.shape == y.shape == (3, 6) and (x[:, 0] == MLM_ID).all()
            hidden = y != PAD
            text = torch.where(hidden, y, x)[:, 1:]  # the text the example was made from
            assert all((t == U[:, 1:]).all(1).any() for t in text)
            in_x_u += [(t == b["x_u"][:, 1:]).all(1).any().item() for t in text]
            masked.append((x[hidden] == MASK).float())
    assert 0.75 < torch.cat(masked).mean() < 0.85  # BERT's 80% [MASK]
    # other text than the step's own x_u: a row is in it by chance only (8 draws of 64: < 12%)
    assert np.mean(in_x_u) < 0.25


def test_shen_fine_tuning_keeps_the_best_validation_epoch(tmp_path, monkeypatch):
    """Two Moons under --protocol shen end to end (a few steps). The fine-tuning's choice: the
    test predictions kept are those made after the first epoch with the best accuracy on the
    10 validation examples."""
    calls, predict_labels, sets, finetune = [], M.predict_labels, [], M.finetune_predict
    monkeypatch.setattr(M, "predict_labels", lambda model, x, ids: (
        calls.append((len(x), predict_labels(model, x, ids))), calls[-1][1])[1])
    monkeypatch.setattr(M, "finetune_predict", lambda student, train, valid, *a: (
        sets.append((train, valid)), finetune(student, train, valid, *a))[1])
    out = tmp_path / "run"
    M.main(["--protocol", "shen", "--labels", "soft", "--sizes", "10", "--seeds", "0",
            "--steps", "3", "--ft-epochs", "6", "--ft-lr", "0.3", "--workers", "1",
            "--device", "cpu", "--out-dir", str(out)])
    train, valid = MM.labeled_sets(MM.two_moons(0), 10, "even", 0)  # shen: MetaLMO's points
    assert [torch.equal(got.x, torch.as_tensor(want.x)) for got, want in
            zip(sets[0], (train, valid))] == [True, True]
    valid_y = torch.as_tensor(valid.y)
    accs, tests, kept = [], [], None
    for n, preds in calls:
        if n == 10:
            accs.append((preds == valid_y).float().mean().item())
        else:
            tests.append((len(accs), preds.tolist()))
    assert len(accs) == 6 and [i for i, _ in tests] == sorted({i for i, _ in tests})
    best = accs.index(max(accs)) + 1
    kept = [p for i, p in tests if i == best][0]
    cell = json.loads((out / "cells" / "soft_n10_s0.json").read_text())
    assert cell["examples"]["pred"][0] == kept
