"""sparse.py: non-negative sparse coding against exact references, and dictionary learning on a
planted problem; the CLI on a real checkpoint."""
import itertools
import os
import re
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

import lasso_exact as lasso
import sparse as S
from conftest import REPO
from machinery.plumbing import load_state


def problem(d, k, n, seed, dtype=torch.float64):
    """Random unit-norm rows H (n, d) and a dictionary D (d, k), some columns shorter than 1."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(d, k, generator=g, dtype=dtype)
    D /= D.norm(dim=0)
    D[:, : k // 5] *= 0.6
    H = torch.randn(n, d, generator=g, dtype=dtype)
    return H / H.norm(dim=1, keepdim=True), D


def brute_force(h, D, lam):
    """The minimiser of 1/2||h - Da||^2 + lam*sum(a), a >= 0, by trying every support S: on S the
    KKT equalities give a_S = (D_S^T D_S)^-1 (D_S^T h - lam); keep the S whose a_S > 0 and whose
    other atoms satisfy the KKT inequality. The problem is strictly convex here (d >= k), so
    exactly one support passes."""
    k = D.shape[1]
    found = []
    for r in range(k + 1):
        for S_ in itertools.combinations(range(k), r):
            a = np.zeros(k)
            if S_:
                Ds = D[:, S_]
                a[list(S_)] = np.linalg.solve(Ds.T @ Ds, Ds.T @ h - lam)
            c = D.T @ (h - D @ a)
            if (a[list(S_)] > 0).all() and (c <= lam + 1e-12).all():
                found.append(a)
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("lam", [0.02, 0.1, 0.3])
def test_lars_equals_brute_force_support_search(lam):
    H, D = problem(8, 6, 10, seed=1)
    for h in H.numpy():
        want = brute_force(h, D.numpy(), lam)
        np.testing.assert_allclose(lasso.lars(h, D.numpy(), lam), want, atol=1e-10)


@pytest.mark.parametrize("lam", [0.01, 0.05, 0.2])
def test_fista_matches_lars_and_both_satisfy_kkt(lam):
    """Over-complete (k > d) random problems: FISTA at its default tolerance reaches LARS's exact
    objective to 1e-4 relative, row by row; both meet the optimality conditions."""
    H, D = problem(24, 60, 30, seed=2)
    exact = lasso.encode(H, D, lam, method="lars")
    fista = lasso.encode(H, D, lam, method="fista")
    assert lasso.kkt_violation(H, D, exact, lam) < 1e-10
    assert lasso.kkt_violation(H, D, lasso.encode(H, D, lam, iters=20000, tol=1e-7), lam) < 1e-6
    f_exact, f_fista = S.objective(H, D, exact, lam), S.objective(H, D, fista, lam)
    assert ((f_fista - f_exact) / f_exact).abs().max().item() < 1e-4
    assert (exact > 0).sum(1).float().mean() > 3  # the codes are neither empty nor trivial
    # float32, as in training, against the float64 exact solution
    f32 = lasso.encode(H.float(), D.float(), lam)
    assert f32.dtype == torch.float32
    assert ((S.objective(H, D, f32.double(), lam) - f_exact) / f_exact).abs().max().item() < 1e-4


def test_working_sets_that_grow_and_rows_that_leave_early_keep_the_exact_codes():
    """sparse_code's bookkeeping against LARS, row by row: coherent atoms (a shared direction)
    whose supports outgrow a working set of 4 several times, in a batch where half the rows are
    an atom itself (done in the first check of every round, so they leave while the others go
    on), shuffled so that leaving rows are scattered through the batch."""
    g = torch.Generator().manual_seed(5)
    common = torch.randn(24, 1, generator=g, dtype=torch.float64)
    noise = torch.randn(24, 60, generator=g, dtype=torch.float64) / 24 ** 0.5
    D = common / common.norm() + 0.8 * noise
    D /= D.norm(dim=0)
    H, _ = problem(24, 60, 20, seed=6)
    H = torch.cat([H + 0.5 * (common / common.norm()).T, D[:, :20].T])
    H = (H / H.norm(dim=1, keepdim=True))[torch.randperm(40, generator=g)]
    lam = 0.02
    exact = lasso.encode(H, D, lam, method="lars")
    assert (exact > 0).sum(1).max() > 8      # m grows from 4 at least twice
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # converged: no warning
        A = S.sparse_code(H, D, lam, tol=1e-7, work=4)
    f_exact, f = S.objective(H, D, exact, lam), S.objective(H, D, A, lam)
    assert ((f - f_exact) / f_exact).abs().max().item() < 1e-9
    torch.testing.assert_close(A, exact, atol=1e-6, rtol=0)
    with pytest.warns(UserWarning, match=r"codes are not optimal after 2 rounds"):
        S.sparse_code(H, D, lam, tol=1e-7, work=4, rounds=2)   # too few rounds to grow to 9+


def test_a_start_changes_the_path_not_the_codes():
    """sparse_code from a start (the codes under another dictionary, as learn_dictionary's next
    epoch begins; or supports larger than the working set) reaches LARS's codes, as it does from
    zero, in fewer rounds when the start is close."""
    H, D = problem(24, 60, 30, seed=3)
    lam = 0.05
    exact = lasso.encode(H, D, lam, method="lars")
    g = torch.Generator().manual_seed(0)
    as_start = lambda A: tuple(reversed(A.topk(20, dim=1)))                  # (atoms, weights)
    near = as_start(S.sparse_code(H, D + 0.05 * torch.randn(D.shape, generator=g, dtype=D.dtype),
                                  lam))
    wide = torch.rand(30, 60, generator=g, dtype=D.dtype) * (torch.rand(30, 60, generator=g) < 0.2)
    assert (wide > 0).sum(1).max() > 8                                        # > work
    wide = as_start(wide)
    for start in (near, wide):
        A = S.sparse_code(H, D, lam, tol=1e-7, work=8, start=start)
        torch.testing.assert_close(A, exact, atol=1e-6, rtol=0)
    rounds = lambda start: sum(1 for _ in iter_rounds(H, D, lam, start))
    assert rounds(near) < rounds(None)


def iter_rounds(H, D, lam, start):
    """One item per working-set round sparse_code runs (counted by the Gram matrices it forms)."""
    seen = []
    original = S._fista
    S._fista = lambda G, *a, **k: (seen.append(G.shape), original(G, *a, **k))[1]
    try:
        S.sparse_code(H, D, lam, tol=1e-7, work=8, start=start)
    finally:
        S._fista = original
    return seen


def test_fista_rows_that_finish_first_leave_with_their_own_codes():
    """_fista on a batch of per-row Gram matrices, from well to badly conditioned (each row's
    atoms share a direction to a different degree), so rows finish at different checks and
    leave the batch while the rest go on: every row ends at its own exact code (LARS)."""
    g = torch.Generator().manual_seed(7)
    rows, want = [], []
    for r in range(12):
        common = torch.randn(16, 1, generator=g, dtype=torch.float64)
        D = r / 12 * common / common.norm() + torch.randn(16, 24, generator=g,
                                                         dtype=torch.float64) / 4
        D /= D.norm(dim=0)
        h = D[:, :3] @ torch.rand(3, generator=g, dtype=torch.float64) + 0.1 * torch.randn(
            16, generator=g, dtype=torch.float64)
        rows.append((D, h))
        want.append(torch.from_numpy(lasso.lars(h.numpy(), D.numpy(), 0.05)))
    G = torch.stack([D.T @ D for D, _ in rows])                                 # (12, 24, 24)
    b = torch.stack([D.T @ h for D, h in rows])                                 # (12, 24)
    L = torch.linalg.eigvalsh(G)[:, -1:]                                        # (12, 1)
    A = S._fista(G, b, torch.zeros_like(b), 0.05, L, 5000, 1e-9)
    torch.testing.assert_close(A, torch.stack(want), atol=1e-7, rtol=0)


def test_codes_are_non_negative_even_where_the_unconstrained_lasso_is_not():
    H, D = problem(16, 32, 20, seed=3)
    H = torch.cat([H, -D[:, :4].T])  # h = -d_j: the plain lasso would put a negative weight on j
    for method in ("fista", "lars"):
        A = lasso.encode(H, D, 0.05, method=method)
        assert (A >= 0).all()
        assert (A[-4:, :4] == 0).all()


def test_vectors_too_weakly_correlated_get_all_zero_codes():
    """If no atom correlates with h by more than lam, a = 0 is optimal: both solvers return it."""
    H, D = problem(16, 32, 8, seed=4)
    lam = (H @ D).max().item() + 1e-3
    for method in ("fista", "lars"):
        assert (lasso.encode(H, D, lam, method=method) == 0).all()


def planted(seed, d=20, k=24, n=3000, per=3):
    """Data made of `per` atoms of a random dictionary each, positive weights in [0.5, 1.5]."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(d, k, generator=g)
    D /= D.norm(dim=0)
    A = torch.zeros(n, k)
    for i in range(n):
        A[i, torch.randperm(k, generator=g)[:per]] = 0.5 + torch.rand(per, generator=g)
    return A @ D.T + 0.01 * torch.randn(n, d, generator=g), D


@pytest.mark.parametrize("seed", [0, 1])
def test_dictionary_learning_recovers_planted_atoms(seed):
    H, truth = planted(seed)
    D, history = S.learn_dictionary(H, truth.shape[1], 0.05, epochs=10, batch_size=256, seed=seed,
                                    progress=False)
    assert (D.norm(dim=0) <= 1 + 1e-6).all()
    # non-increasing, up to the jitter of mini-batch updates once converged (measured: < 1e-5)
    objectives = [h["objective"] for h in history]
    assert all(b <= a * (1 + 1e-5) for a, b in zip(objectives, objectives[1:])), objectives
    assert objectives[-1] < 0.5 * objectives[0]
    cos = ((D / D.norm(dim=0)).T @ truth).numpy()  # (learned, planted)
    rows, cols = linear_sum_assignment(-cos)        # the best one-to-one matching
    assert cos[rows, cols].min() > 0.9
    assert history[-1]["nnz"] == pytest.approx(3, abs=0.5)


def test_unused_atoms_are_resampled_from_the_data():
    """Data on two rays use at most two atoms; the others are replaced by data vectors."""
    g = torch.Generator().manual_seed(0)
    rays = torch.nn.functional.normalize(torch.randn(2, 8, generator=g), dim=1)
    H = rays[torch.randint(0, 2, (400,), generator=g)] * (0.5 + torch.rand(400, 1, generator=g))
    D, history = S.learn_dictionary(H, 6, 0.05, epochs=2, batch_size=100, progress=False)
    assert history[1]["resampled"] >= 1
    assert (D.norm(dim=0) <= 1 + 1e-6).all()


def test_an_interrupted_dictionary_learning_goes_on_from_its_last_epoch(tmp_path, monkeypatch):
    """Interrupted in its third epoch of four, the learner's state saved after the second lets
    the same call go on from there: the same D bit for bit and the same history as a call never
    interrupted; the state is removed at the end. Another fingerprint starts over."""
    H, truth = planted(0, n=800)
    kw = dict(epochs=4, batch_size=100, seed=3, progress=False)
    want, want_history = S.learn_dictionary(H, truth.shape[1], 0.05, **kw)
    state = tmp_path / "dict.pt.partial"
    update, calls = S.update_dictionary, []

    def interrupted(*a):
        calls.append(1)
        if len(calls) == 2 * 8 + 3:  # 8 mini-batches an epoch: the third of epoch 3
            raise KeyboardInterrupt
        return update(*a)
    monkeypatch.setattr(S, "update_dictionary", interrupted)
    with pytest.raises(KeyboardInterrupt):
        S.learn_dictionary(H, truth.shape[1], 0.05, state_path=state, fingerprint={"a": 1}, **kw)
    assert load_state(state)["epoch"] == 2
    monkeypatch.setattr(S, "update_dictionary", update)
    calls.clear()
    D, history = S.learn_dictionary(H, truth.shape[1], 0.05, state_path=state,
                                    fingerprint={"a": 1}, **kw)
    assert torch.equal(D, want) and history == want_history and not state.exists()
    with pytest.raises(KeyboardInterrupt):  # the state of another learning is not taken
        monkeypatch.setattr(S, "update_dictionary", interrupted)
        S.learn_dictionary(H, truth.shape[1], 0.05, state_path=state, fingerprint={"a": 1}, **kw)
    monkeypatch.setattr(S, "update_dictionary", update)
    D, history = S.learn_dictionary(H, truth.shape[1], 0.05, state_path=state,
                                    fingerprint={"a": 2}, **{**kw, "progress": True})
    assert torch.equal(D, want) and history == want_history


def test_sigterm_while_sparse_py_learns_keeps_its_epochs_and_the_same_command_goes_on(
        prepared, tmp_path):
    """sparse.py stopped by SIGTERM in its second epoch: it ends at once with one line saying how
    to go on; the same command goes on after the first epoch and writes the dictionary a command
    never interrupted writes."""
    from conftest import TINY, run_script, run_train
    run = tmp_path / "run"
    assert run_train("--data", prepared, "--out-dir", run, "--max-steps", 3, *TINY).returncode == 0
    cli = lambda out: [sys.executable, str(REPO / "sparse.py"), "--ckpt", str(run / "ckpt.pt"),
                       "--data", str(prepared), "--layer", "1", "--k", "40", "--vectors", "3000",
                       "--epochs", "3", "--batch-size", "10", "--seq-len", "32", "--device",
                       "cpu", "--out", str(tmp_path / out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ref = subprocess.Popen(cli("whole.pt"), cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    proc = subprocess.Popen(cli("stopped.pt"), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    state, t0 = tmp_path / "stopped.pt.partial", time.time()
    while not state.exists():  # its first epoch saved
        assert proc.poll() is None and time.time() - t0 < 300, proc.communicate()
        time.sleep(0.05)
    stopped = time.time()
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1]
    assert time.time() - stopped < 30 and proc.returncode == 1, err
    assert err.strip().splitlines()[-1] == ("SIGTERM: stopped `sparse.py`; the epochs learned so "
                                            "far are kept: the same command goes on from them")
    again = run_script(*cli("stopped.pt")[1:], timeout=300)
    assert again.returncode == 0, again.stderr
    assert re.search(r"going on after epoch [12]/3", again.stdout + again.stderr), again.stdout
    assert ref.wait(timeout=300) == 0, ref.stderr.read()
    got, want = (load_state(tmp_path / f) for f in ("stopped.pt", "whole.pt"))
    assert torch.equal(got["D"], want["D"]) and got["history"] == want["history"]


def test_cli_learns_a_dictionary_from_a_checkpoint(prepared, tmp_path):
    from conftest import TINY, run_script, run_train
    run = tmp_path / "run"
    assert run_train("--data", prepared, "--out-dir", run, "--max-steps", 3, *TINY).returncode == 0
    out = tmp_path / "dict.pt"
    cli = ["sparse.py", "--ckpt", run / "ckpt.pt", "--data", prepared]
    r = run_script(*cli, "--layer", "1", "--k", "40", "--vectors", "400", "--epochs", "2",
                   "--batch-size", "100", "--seq-len", "32", "--max-freq", "0.05", "--device",
                   "cpu", "--out", out, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "non-zeros per code" in r.stdout and "all-zero codes" in r.stdout
    saved = load_state(out)
    assert saved["D"].shape == (64, 40) and saved["layer"] == 1 and len(saved["history"]) == 3
    assert (saved["D"].norm(dim=0) <= 1 + 1e-6).all()
    bad = run_script(*cli, "--layer", "5", "--out", out, timeout=300)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("error: --layer 5")


def mlsm_code_fista(I, basis, lambd, num_iter):
    """The MLSM code's target coder (szegedai/MLSM, sparser.py, FISTA) transcribed to float64
    numpy, column-major as there: I (d, n) signals, basis (d, k) -> codes (k, n) >= 0."""
    eta = 1.0 / np.linalg.eigvalsh(basis @ basis.T)[-1]
    tk_n = 1.0
    ahat = np.zeros((basis.shape[1], I.shape[1]))
    ahat_y = np.zeros_like(ahat)
    for _ in range(num_iter):
        tk = tk_n
        tk_n = (1 + np.sqrt(1 + 4 * tk ** 2)) / 2
        ahat_pre = ahat
        res = I - basis @ ahat_y
        ahat_y = ahat_y + eta * basis.T @ res
        ahat = np.maximum(ahat_y - eta * lambd, 0.0)
        ahat_y = ahat + (ahat - ahat_pre) * ((tk - 1) / tk_n)
    return ahat


@pytest.mark.parametrize("coherent", [False, True])
def test_fista_fixed_is_the_mlsm_codes_rule(coherent):
    """sparse.fista_fixed against the transcription, on random and on coherent atoms (a shared
    direction, as hidden states have), where 100 steps stop short of the optimum: its codes are
    denser than the exact solver's and its objective higher."""
    rng = np.random.default_rng(0)
    d, k, n = 24, 60, 30
    D = rng.normal(size=(d, k)) + (3.0 * rng.normal(size=(d, 1)) if coherent else 0.0)
    D /= np.linalg.norm(D, axis=0)
    H = rng.normal(size=(n, d)) + (D[:, :1].T * 3 if coherent else 0.0)
    H /= np.linalg.norm(H, axis=1, keepdims=True)
    lam = 0.05
    got = S.fista_fixed(torch.tensor(H), torch.tensor(D), lam, 100).numpy()
    want = mlsm_code_fista(H.T, D, lam, 100).T
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    if coherent:
        exact = lasso.encode(torch.tensor(H), torch.tensor(D), lam, method="lars")
        obj = lambda A: S.objective(torch.tensor(H), torch.tensor(D), torch.as_tensor(A), lam)
        assert (got > 0).sum() > (exact.numpy() > 0).sum()
        assert obj(got).mean().item() > obj(exact).mean().item()


def algorithm_2(D, P, Q):
    """Mairal et al. 2010, Algorithm 2, transcribed: one sweep over the columns in order, each
    u_j = d_j + (q_j - D p_j) / P_jj, then d_j = u_j / max(1, ||u_j||), skipping unused ones."""
    D = D.clone()
    for j in range(D.shape[1]):
        if P[j, j] > 1e-12:
            u = D[:, j] + (Q[:, j] - D @ P[:, j]) / P[j, j]
            D[:, j] = u / max(1.0, u.norm().item())
    return D


def surrogate_problem(seed, d=16, k=40, n=400):
    """Statistics P = A^T A, Q = X^T A of sparse non-negative codes A (n, k), a start D."""
    g = torch.Generator().manual_seed(seed)
    A = torch.rand(n, k, generator=g, dtype=torch.float64) * (torch.rand(n, k, generator=g) < 0.1)
    A[:, -3:] = 0                                            # atoms no code uses
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    D = torch.nn.functional.normalize(torch.randn(d, k, generator=g, dtype=torch.float64), dim=0)
    return D, A.T @ A, X.T @ A


@pytest.mark.parametrize("seed", [0, 1])
def test_dictionary_update_is_algorithm_2_by_blocks(seed):
    """One column a block: exactly Algorithm 2. Blocks of 5 or all 40 at once: every sweep keeps
    the columns in the unit ball, leaves unused columns alone and lowers the surrogate, and
    repeated sweeps reach Algorithm 2's minimiser of it (P is positive definite on the used
    columns here, so the minimiser is unique)."""
    D, P, Q = surrogate_problem(seed)
    k = D.shape[1]
    surrogate = lambda D: (0.5 * (D.T @ D * P).sum() - (D * Q).sum()).item()
    torch.testing.assert_close(S.update_dictionary(D.clone(), P, Q, blocks=k), algorithm_2(D, P, Q))
    want = D.clone()
    for _ in range(500):
        want = algorithm_2(want, P, Q)
    for blocks in (8, 1):
        got, before = D.clone(), surrogate(D)
        for _ in range(3000):
            S.update_dictionary(got, P, Q, blocks=blocks)
            assert (got.norm(dim=0) <= 1 + 1e-12).all() and torch.equal(got[:, -3:], D[:, -3:])
            after = surrogate(got)
            assert after <= before + 1e-12
            before = after
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("b", [16, 4000])  # the scattered products; the dense product
def test_gram_of_sparse_codes(b):
    """add_gram from each code's w largest entries equals A^T A (every non-zero among them)."""
    g = torch.Generator().manual_seed(b)
    k = 300
    A = torch.rand(b, k, generator=g, dtype=torch.float64)
    A *= torch.rand(b, k, generator=g) < 0.03
    w = int((A > 0).sum(1).max())
    weights, atoms = A.topk(w, dim=1)
    P = torch.rand(k, k, generator=g, dtype=torch.float64)
    torch.testing.assert_close(S.add_gram(P.clone(), A, weights, atoms), P + A.T @ A)
    assert (b * w * w < k * k) == (b == 16)


def test_dictionary_lines_are_numbered_as_the_bar(capsys):
    """Issue 43: the log counted epochs 0-4 while its bar said 1/4; now the start, then 1/2, 2/2,
    and each line's objective is the history's."""
    gen = torch.Generator().manual_seed(0)
    H = torch.nn.functional.normalize(torch.randn(300, 8, generator=gen), dim=1)
    _, history = S.learn_dictionary(H, 6, 0.05, epochs=2, batch_size=100)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dictionary:")]
    cost = said.pop(1)  # after the first mini-batch: what the whole will take (issue 68)
    assert cost.startswith("dictionary: about ")
    assert cost.endswith(" for 2 epochs of 3 batches (from the first batch)")
    assert [line.split(" | ")[0] for line in said] == [
        "dictionary: at the start", "dictionary: epoch 1/2", "dictionary: epoch 2/2"]
    for h, line in zip(history, said, strict=True):
        assert f"objective {h['objective']:.4g}" in line


def test_an_out_that_cannot_be_written_is_one_line_before_the_checkpoint_is_read(tmp_path,
                                                                                 capsys):
    """Issue 83: --out under a file, or naming a folder, stops in one line before anything is
    read (the checkpoint named does not exist: reading it first would say so instead)."""
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as stopped:
        S.main(["--ckpt", str(tmp_path / "none.pt"), "--out", str(tmp_path / "file" / "d.pt")])
    bad = tmp_path / "file" / "d.pt"
    assert str(stopped.value).startswith(f"error: cannot write {bad}: ")  # the OS's reason
    with pytest.raises(SystemExit) as stopped:
        S.main(["--ckpt", str(tmp_path / "none.pt"), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1
    assert f"--out {tmp_path} is a folder; give the dictionary file's path" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("cfg, n_layer, says", [
    (dict(batch_size=0), None, "error: --batch-size: must be >= 1, not 0"),
    (dict(tol=-1.0), None, "error: --tol: must be >= 0, not -1"),
    (dict(lam=0.0), None, "error: --dict-lam: must be > 0, not 0"),
    (dict(k=10, vectors=5), None, "error: --vectors 5: fewer vectors than the 10 atoms"),
    (dict(layer=3), 2, "error: --layer 3: the model has layers 0..2"),
    (dict(layer=-4), 2, "error: --layer -4: the model has layers 0..2"),
])
def test_a_dictionary_setting_that_cannot_work_is_one_line(cfg, n_layer, says):
    """DictConfig.check, which train.py's mlsm and the CLI run before any state is read, names
    the caller's flag; -3 is layer 0 of a 2-layer model, -4 is none."""
    with pytest.raises(SystemExit) as stopped:
        S.DictConfig(**cfg).check(n_layer, names={"lam": "--dict-lam"})
    assert str(stopped.value).startswith(says), stopped.value
    S.DictConfig(layer=-3).check(2)  # the lowest layer a negative index reaches
