"""Non-negative sparse coding and dictionary learning, written here: the targets of masked latent
semantic modeling (MLSM; Berend 2023, "Masked Latent Semantic Modeling", ACL Findings, sec. 3).

    python sparse.py --ckpt runs/mlm_babylm_10m_small/ckpt.pt --data babylm_10m --layer -1 \\
        --k 3000 --lam 0.05 --out dict.pt          # learn a dictionary from a model's hidden states

train.py calls it (dictionary_for_run) between the two phases of `--objective mlsm` and
`mlsm+mlm`, with its DictConfig.

The problem. For hidden vectors h (rows of H, n x d) and a dictionary D (d x k) whose columns
have norm <= 1, the codes a >= 0 minimise
        1/2 ||h - D a||^2 + lam * ||a||_1                                                   (1)
and learning D minimises the mean of (1) over the data under that norm constraint.

    sparse_code(H, D, lam)              batched FISTA on working sets, in torch, on any device, run
                                        to a tolerance (the exact targets; tests hold it to an
                                        exact homotopy solver, tests/lasso_exact.py)
    fista_fixed(H, D, lam, iters=100)   the MLSM code's coder (szegedai/MLSM, sparser.py): a fixed
                                        number of plain FISTA steps from zero, not run to the
                                        optimum, so its codes are denser and softer
    learn_dictionary(H, k, lam)         online dictionary learning (Mairal, Bach, Ponce & Sapiro
                                        2009/2010): code a mini-batch, accumulate its sufficient
                                        statistics, update D by block-coordinate descent

The CLI collects layer-L states of a checkpoint at random positions of the training split,
L2-normalises them (as the MLSM code does before sparse coding), optionally leaves out the most
frequent tokens (relative frequency >= --max-freq: the MLSM code's first version did, its
released version of July 2023 and later learns on all vectors, and so does the default here:
every masked token is coded in training), learns D, and reports the objective, the mean number
of non-zeros per code and the fraction of all-zero codes, and what each target coder (fista100,
exact) makes of 1000 of the vectors. As the MLSM code's July 2023 version (its first averaged
sub-word pieces into words), each piece is one vector, as each masked piece is one target.
"""
import math
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from data.prepare import CLS, SEP, check_tokenizer, prepare
from machinery.plumbing import (Parser, Range, above, add_device_flag, at_least, bar,
                                checkpoint_identity, duration, exit_on_stop_signals, file_to_write,
                                line_buffered, load_state, pick_device, read_checkpoint,
                                save_checkpoint)
from model import load_checkpoint


# ---------------------------------------------------------------------------------------------
# Sparse coding


def _fista(G, b, a, lam, L, iters, tol, check_every=10):
    """FISTA (Beck & Teboulle 2009, eq. 4.1-4.3) for min_a>=0 1/2 a^T G a - b^T a + lam sum(a), a
    batch of problems: b and the start a (n, m); G the rows' own Gram matrices (n, m, m), or a
    dictionary D (d, m) standing for G = D^T D, shared; L (n, 1) or a scalar >= the largest
    eigenvalue of G. The prox of lam sum(a) + [a >= 0] is max(0, a - lam/L). A row restarts its
    momentum when it points uphill (O'Donoghue & Candes 2015, gradient restart), which stops
    sparse rows oscillating around their support. A row is done once its gradient mapping
    L |y - a_next| is below tol * lam in every coordinate (checked every `check_every`
    iterations: one host sync each); done rows leave the batch once a fifth of it is done (each
    iteration reads every row's G once, so a finished row costs as much as a working one), the
    rest stop after `iters` iterations."""
    shared = G.dim() == 2
    out, rows = a.clone(), torch.arange(b.shape[0], device=b.device)
    y, nxt, t = a, a, torch.ones_like(b[:, :1])
    b = b - lam  # the linear term, penalty included
    for i in range(1, iters + 1):
        Gy = (y @ G.T) @ G if shared else torch.bmm(G, y[:, :, None]).squeeze(-1)
        nxt = (y - (Gy - b) / L).clamp_(min=0)
        if i % check_every == 0:
            done = (L * (y - nxt).abs()).amax(1) <= tol * lam                       # (n,)
            if done.all():
                break
            if done.float().mean() >= 0.2:
                out[rows[done]] = nxt[done]
                keep = ~done
                rows, b, a, y, t, nxt = rows[keep], b[keep], a[keep], y[keep], t[keep], nxt[keep]
                G = G if shared else G[keep]
                L = L[keep] if torch.is_tensor(L) and L.dim() == 2 else L
        moved = nxt - a
        uphill = ((y - nxt) * moved).sum(1, keepdim=True) > 0                           # (n, 1)
        t_next = torch.where(uphill, 1.0, (1 + torch.sqrt(1 + 4 * t * t)) / 2)
        y = nxt + torch.where(uphill, 0.0, (t - 1) / t_next) * moved
        a, t = nxt, t_next
    out[rows] = nxt
    return out


@torch.no_grad()
def sparse_code(H, D, lam: float, iters: int = 1000, tol: float = 1e-3, work: int = 32,
                rounds: int = 30, start=None):
    """Codes A (n, k) >= 0 minimising, row by row, 1/2 ||h - D a||^2 + lam * sum(a), for
    H (n, d) and a dictionary D (d, k) whose columns have norm <= 1. Computed in H's dtype.

    work = 0: FISTA over all k atoms with step 1/L, L = ||D||_2^2 the largest eigenvalue of D^T D.
    Exact, but slow on the dictionaries MLSM learns: hidden states share a common direction, so
    their atoms do too, L is large (measured on our tiny model: 740 with 2500 of its 128-d states
    as atoms, 335 for the dictionary learned from them, 29 for random unit atoms) and FISTA needs
    thousands of steps.

    work = m > 0 (default): the same FISTA on a working set per row (the active-set strategy of
    e.g. Johnson & Guestrin 2015, "Blitz"), exact in the same sense. Each round solves every
    unfinished row restricted to m atoms (its current support, then the atoms whose optimality
    condition c_j = d_j^T (h - D a) <= lam is most violated) with that row's own L, the largest
    eigenvalue of its m x m Gram matrix; then checks the condition on all k atoms. Rows with no
    violation above tol * lam are done. When a support fills 3/4 of m, m grows to 1.5 times the
    largest support (doubling it instead ran 1.8x slower on a learned dictionary: bench.py's
    `learned` case). One round costs n m^2 per iteration instead of 2 n d k, and the small Gram
    matrices are far better conditioned.

    start: (atoms (n, s) long, weights (n, s)), codes to begin from, s entries a row (the same
    vectors' codes under an earlier dictionary, as learn_dictionary's later epochs have): the
    first working sets hold their supports, and the optimum found is the same, in fewer rounds.
    """
    n, k = H.shape[0], D.shape[1]
    if work <= 0 or work >= k:
        HD = H @ D                                               # (n, k): correlations at a = 0
        L = torch.linalg.matrix_norm(D, ord=2) ** 2
        # G y = D^T (D y): two thin matmuls, 2 n d k, instead of n k^2 with G = D^T D
        return _fista(D, HD, torch.zeros_like(HD), lam, L, iters, tol)
    A = torch.zeros(n, k, dtype=H.dtype, device=H.device)
    todo = torch.arange(n, device=H.device)
    Dt = D.T.contiguous()                  # (k, d): the atoms as rows, gathered by index below
    if start is None:
        c, m = H @ D, work                                       # correlations at a = 0
        score = c
    else:
        atoms, weights = start[0], start[1].clamp(min=0)
        A.scatter_(1, atoms, weights)
        resid = H - (weights[:, None, :] @ Dt[atoms]).squeeze(1)               # (n, d)
        c = resid @ D                                            # the residual's correlations
        score = c.scatter(1, atoms, torch.where(weights > 0, torch.inf, c.gather(1, atoms)))
        m = max(work, int((weights > 0).sum(1).max()))
    for _ in range(rounds):
        W = score.topk(min(m, k), dim=1).indices     # support first (score inf), then violators
        DW = Dt[W]                                                        # (r, m, d)
        G = DW @ DW.transpose(1, 2)                                       # (r, m, m)
        # a cheap upper bound on G's largest eigenvalue (eigvalsh would take half the time):
        # the smaller of the Frobenius norm and the largest absolute row sum (Gershgorin); with
        # coherent atoms one eigenvalue dominates and both are close to it
        L = torch.minimum(torch.linalg.matrix_norm(G), G.abs().sum(2).amax(1))[:, None]    # (r, 1)
        rows = todo[:, None]
        b = (DW @ H[todo, :, None]).squeeze(-1)                           # (r, m): D_W^T h
        x = _fista(G, b, A[rows, W], lam, L, iters, tol)                  # (r, m)
        A[rows, W] = x  # a row's earlier support lies inside W: no other entry of it changes
        resid = H[todo] - (x[:, None, :] @ DW).squeeze(1)                # (r, d)
        c = resid @ D                                                     # (r, k)
        # KKT on all k atoms: c_j <= lam off the support, c_j = lam on it
        on_support = torch.where(x > 0, (c.gather(1, W) - lam).abs(), 0.0)
        viol = torch.maximum(c.amax(1) - lam, on_support.amax(1))        # (r,)
        left = viol > tol * lam
        if not left.any():
            break
        most = int((x > 0).sum(1).max())      # the largest support (one host sync)
        if 4 * most > 3 * m:  # it nearly fills its working set: make m 1.5x it
            m = -(-3 * most // 2)
        todo, c, W, x = todo[left], c[left], W[left], x[left]
        score = c.scatter(1, W, torch.where(x > 0, torch.inf, c.gather(1, W)))
    if rounds and left.any():
        warnings.warn(f"sparse_code: {len(todo)} of {n} codes are not optimal after {rounds} "
                      f"rounds (KKT violated by up to {viol.max().item() / lam:.2g} lam, tol "
                      f"{tol:g}); raise rounds or iters")
    return A


def fista_momentum(iters: int, device=None, dtype=torch.float32) -> list[torch.Tensor]:
    """FISTA's momentum weights (t_k - 1) / t_{k+1}, k = 1..iters, with t_1 = 1 and
    t_{k+1} = (1 + sqrt(1 + 4 t_k^2)) / 2 (Beck & Teboulle 2009, eq. 4.2), each a 0-d tensor of
    its own (see fista_fixed)."""
    out, t = [], 1.0
    for _ in range(iters):
        t_next = (1 + math.sqrt(1 + 4 * t * t)) / 2
        out.append(torch.tensor((t - 1) / t_next, device=device, dtype=dtype))
        t = t_next
    return out


@torch.no_grad()
def fista_fixed(H, D, lam: float, iters: int = 100, L=None, momentum=None):
    """Codes as the MLSM code computes its targets (szegedai/MLSM, sparser.py FISTA, 100 steps):
    `iters` FISTA steps (Beck & Teboulle 2009) from a = 0 over all k atoms, step 1/L with L the
    largest eigenvalue of D D^T, no restart and no stopping test. H (n, d), D (d, k) -> (n, k) >= 0.
    On coherent dictionaries 100 steps are far from the optimum of (1): the codes keep more,
    smaller non-zeros than sparse_code's. L and momentum (fista_momentum(iters), on H's device
    and in its dtype) may be passed in, computed once by a caller that codes many batches
    against a frozen D.

    Each momentum weight is a tensor, not a Python float: torch.compile then traces the unrolled
    steps into identical code that reads a different input, which inductor generates once. As
    floats they were a new constant in each step, so a new kernel, and a compiled call of 100
    steps took twice as long to compile (bench.py's `compile` row); the codes are the same."""
    if L is None:
        L = torch.linalg.matrix_norm(D, ord=2) ** 2              # = the top eigenvalue of D D^T
    if momentum is None:
        momentum = fista_momentum(iters, H.device, H.dtype)
    if len(momentum) != iters:
        raise ValueError(f"fista_fixed: {len(momentum)} momentum weights for {iters} steps")
    HD = H @ D                                                   # (n, k)
    a = y = torch.zeros_like(HD)
    for m in momentum:
        nxt = (y + (HD - (y @ D.T) @ D) / L - lam / L).clamp(min=0)  # a gradient step, then prox
        y = nxt + m * (nxt - a)
        a = nxt
    return a


@torch.no_grad()
def compare_coders(H, D, lam: float) -> dict:
    """The MLSM targets each coder gives on the rows of H (unit vectors): non-zeros per code and
    all-zero codes for fista_fixed (100 steps) and sparse_code (exact, tol 1e-3), and the mean
    total-variation distance between the two target distributions (codes / their sum) over the
    rows both code to non-zero."""
    codes = {"fista100": fista_fixed(H, D, lam, 100), "exact": sparse_code(H, D, lam)}
    out = {}
    for name, A in codes.items():
        out[f"{name}_nnz"] = (A > 0).sum(1).float().mean().item()
        out[f"{name}_zero_rate"] = (A.sum(1) == 0).float().mean().item()
    a, b = codes["fista100"], codes["exact"]
    both = (a.sum(1) > 0) & (b.sum(1) > 0)
    p, q = a[both] / a[both].sum(1, keepdim=True), b[both] / b[both].sum(1, keepdim=True)
    out["tv"] = (0.5 * (p - q).abs().sum(1)).mean().item() if both.any() else float("nan")
    return out


def objective(H, D, A, lam) -> torch.Tensor:
    """(1) for every row: (n,) from H (n, d), D (d, k), A (n, k)."""
    return 0.5 * ((H - A @ D.T) ** 2).sum(1) + lam * A.abs().sum(1)


# ---------------------------------------------------------------------------------------------
# Dictionary learning

@torch.no_grad()
def update_dictionary(D, P, Q, blocks: int = 32):
    """One sweep of block-coordinate descent on the surrogate 1/2 tr(D^T D P) - tr(D^T Q) of
    dictionary learning, D (d, k) in place, its columns kept in the unit ball. Mairal's
    Algorithm 2 takes the columns one at a time, each seeing the ones before it updated: k
    dependent steps, a Python loop of k matrix-vector products. Here the columns go in
    `blocks` blocks of about k / blocks, one after another; within a block every column takes
    its step at once, a projected gradient step: column j's is 1/P_jj (the exact step on that
    column alone, as Algorithm 2's) divided by L_b, the largest row sum of S_b P_bb S_b with
    S = diag(P_jj^-1/2). P >= 0 entrywise (a sum of outer products of non-negative codes), so
    L_b bounds the largest eigenvalue of S_b P_bb S_b (Gershgorin) and each block's step
    decreases the surrogate. With one column a block this is Algorithm 2. Columns no code has
    used yet (P_jj = 0) stay as they are."""
    k = D.shape[1]
    diag = P.diagonal()
    used = diag > 1e-12
    s = torch.where(used, diag, 1.0).rsqrt() * used                      # (k,): 0 if unused
    size = -(-k // blocks)
    for first in range(0, k, size):
        b = slice(first, first + size)
        L = (s[b] * (P[b, b] @ s[b])).max().clamp(min=1e-12)
        step = D @ P[b].T - Q[:, b]                  # (d, |b|): the gradient; P is symmetric
        D[:, b] -= step * (s[b] * s[b] / L)
        D[:, b] /= D[:, b].norm(dim=0).clamp(min=1.0)
    return D


def add_gram(P, A, weights, atoms):
    """P (k, k) += A^T A, for codes A (b, k) whose non-zeros all lie among (weights, atoms)
    (b, w), each row's w largest entries: as the b w^2 products of those entries, added at
    their flat positions in P, where a code has a few tens of non-zeros among thousands of
    atoms (the dense product's b k^2 multiply-adds would dominate a mini-batch); as the dense
    product when that is the smaller. On a GPU index_add_ adds in no
    fixed order, so the last bits of P vary from run to run."""
    (b, w), k = weights.shape, P.shape[0]
    if b * w * w >= k * k:
        return P.addmm_(A.T, A)
    pairs = (atoms[:, :, None] * k + atoms[:, None, :]).flatten()               # (b w^2,)
    products = (weights[:, :, None] * weights[:, None, :]).flatten()
    P.view(-1).index_add_(0, pairs, products)
    return P


@torch.no_grad()
def learn_dictionary(H, k: int, lam: float, epochs: int = 4, batch_size: int = 1024,
                     seed: int = 0, forget: float = 50.0, iters: int = 1000, tol: float = 1e-2,
                     eval_vectors: int = 8192, progress: bool = True, state_path=None,
                     fingerprint: dict | None = None):
    """D (d, k) with columns of norm <= 1 minimising the mean of (1) over the rows of H (n, d),
    and the history [{epoch, objective, nnz, zero_rate, resampled}], epoch 0 being the start.

    Online dictionary learning (Mairal et al. 2010, JMLR 11, "Online Learning for Matrix
    Factorization and Sparse Coding", Algorithm 1 with the refinements of sec. 3.4):
      - D starts as k distinct data vectors;
      - each mini-batch X (b, d) is coded with the current D, A = its codes (b, k), and the
        sufficient statistics become  P <- beta_t P + A^T A,  Q <- beta_t Q + X^T A  (k x k, d x k)
        with beta_t = (1 - 1/t)^forget, t = 1, 2, ... the mini-batch count (sec. 3.4.2, "scaling
        the past data"): forget = 0 weighs every past code equally, larger values forget the
        codes made with the early, poor dictionaries faster (on the planted problems of
        tests/test_sparse.py, 50 recovered the atoms in 10 epochs; the mini-batch weighting of
        sec. 3.4.3, close to plain sums, had not in 30);
      - one sweep of block-coordinate descent then lowers the surrogate
        1/2 tr(D^T D P) - tr(D^T Q), each column kept in the unit ball (update_dictionary:
        Algorithm 2 by blocks of columns rather than column by column);
      - an atom no vector of the epoch used is replaced by a random data vector (sec. 3.4.4,
        "purging the dictionary from unused atoms"), and its statistics are reset.
    From the second epoch on, a vector's coding starts from its code of the epoch before
    (its `work` largest entries): the codes are the same optimum, found in fewer rounds.
    The objective is measured after every epoch on a fixed sample of `eval_vectors` rows, coded
    afresh with the current D, so epochs compare with each other.

    state_path: where the learner's whole state is saved after every epoch (D, the statistics,
    the last codes, the batch order's generator), and where a call with the same `fingerprint`
    (what H and the settings depend on) goes on from it: the same D, bit for bit, as a call never
    interrupted. Removed once the last epoch is done.
    """
    n, d = H.shape
    if k > n:
        raise SystemExit(f"error: {k} atoms need at least {k} vectors to start from; there are {n}")
    gen = torch.Generator().manual_seed(seed)
    pick = lambda m: torch.randperm(n, generator=gen)[:m].to(H.device)
    D = H[pick(k)].T.clone()
    D /= D.norm(dim=0).clamp(min=1.0)
    P = torch.zeros(k, k, dtype=H.dtype, device=H.device)
    Q = torch.zeros(d, k, dtype=H.dtype, device=H.device)
    sample = H[pick(min(n, eval_vectors))]
    keep = min(32, k)  # entries of each vector's last code kept as its next start
    last_atoms = torch.zeros(n, keep, dtype=torch.long, device=H.device)
    last_weights = torch.zeros(n, keep, dtype=H.dtype, device=H.device)
    sample_codes = []  # the sample's codes at the last measurement, where the next one starts

    def measure(epoch, resampled):
        starts = sample_codes or [None] * len(sample.split(batch_size))
        A = torch.cat([sparse_code(x, D, lam, iters, tol, start=a)
                       for x, a in zip(sample.split(batch_size), starts)])
        values, atoms = A.topk(keep, dim=1)
        sample_codes[:] = zip(atoms.split(batch_size), values.split(batch_size))
        nnz = (A > 0).sum(1)
        row = dict(epoch=epoch, objective=objective(sample, D, A, lam).mean().item(),
                   nnz=nnz.float().mean().item(), zero_rate=(nnz == 0).float().mean().item(),
                   resampled=resampled)
        if progress:  # numbered as the bar numbers them: the start, then epoch 1/4 ... 4/4
            show = lambda k, v: f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
            when = f"epoch {epoch}/{epochs}" if epoch else "at the start"
            tqdm.write(f"dictionary: {when} | " + " | ".join(show(k, v) for k, v in row.items()
                                                           if k != "epoch"))
        return row

    fingerprint = {**(fingerprint or {}), "shape": list(H.shape), "k": k, "lam": lam,
                   "epochs": epochs, "batch_size": batch_size, "seed": seed, "forget": forget,
                   "iters": iters, "tol": tol, "eval_vectors": eval_vectors}
    saved = learner_state(state_path, fingerprint)
    if saved:  # where the interrupted call left off, after its epoch saved["epoch"]
        for mine, theirs in ((D, "D"), (P, "P"), (Q, "Q"), (last_atoms, "last_atoms"),
                             (last_weights, "last_weights")):
            mine.copy_(saved[theirs])
        gen.set_state(saved["generator"])
        sample_codes[:] = [(a.to(H.device), w.to(H.device)) for a, w in saved["sample_codes"]]
        history, t, done = saved["history"], saved["t"], saved["epoch"]
        if progress:
            tqdm.write(f"dictionary: going on after epoch {done}/{epochs} from {state_path}")
    else:
        history, t, done = [measure(0, 0)], 0, 0
    t0 = time.time()
    for epoch in range(done + 1, epochs + 1):
        used = torch.zeros(k, dtype=torch.bool, device=H.device)
        batches = pick(n).split(batch_size)
        for idx in bar(batches, desc=f"dictionary epoch {epoch}/{epochs}", unit="batch",
                        disable=None if progress else True):
            X = H[idx]
            start = (last_atoms[idx], last_weights[idx]) if epoch > 1 else None  # last codes
            A = sparse_code(X, D, lam, iters, tol, start=start)           # (b, k)
            # each code's non-zeros (a few tens of k): the longest code's count of them, read
            # once per mini-batch, bounds them all
            w = max(keep, int((A > 0).sum(1).max()))
            weights, atoms = A.topk(w, dim=1)                               # (b, w)
            last_weights[idx], last_atoms[idx] = weights[:, :keep], atoms[:, :keep]
            used |= (A > 0).any(0)
            t += 1
            beta = (1 - 1 / t) ** forget
            add_gram(P.mul_(beta), A, weights, atoms)
            Q.mul_(beta).addmm_(X.T, A)
            # the decay sinks the statistics of atoms long unused below float32's normal
            # range, where a CPU computes many times slower (a dictionary update on two
            # threads: 2.2 s against 18 ms, measured); they are flushed to zero (P >= 0)
            torch.nn.functional.threshold_(P, 1e-30, 0.0)
            Q.masked_fill_(Q.abs() < 1e-30, 0.0)
            update_dictionary(D, P, Q)
            if t == 1 and progress:  # its cost, said at its start (later epochs start warm)
                spent = time.time() - t0
                tqdm.write(f"dictionary: about {duration(spent * len(batches) * epochs)} for "
                           f"{epochs} epochs of {len(batches)} batches (from the first batch)")
        dead = torch.nonzero(~used).flatten()
        if len(dead):
            D[:, dead] = H[pick(len(dead))].T
            D[:, dead] /= D[:, dead].norm(dim=0).clamp(min=1.0)
            P[dead], P[:, dead], Q[:, dead] = 0, 0, 0
        history.append(measure(epoch, len(dead)))
        if state_path is not None and epoch < epochs:
            save_checkpoint({"fingerprint": fingerprint, "epoch": epoch, "t": t, "D": D, "P": P,
                             "Q": Q, "last_atoms": last_atoms, "last_weights": last_weights,
                             "generator": gen.get_state(), "sample_codes": sample_codes,
                             "history": history}, state_path)
    if state_path is not None:
        Path(state_path).unlink(missing_ok=True)
    return D, history


def learner_state(path, fingerprint: dict) -> dict | None:
    """learn_dictionary's state saved at `path` after an epoch, if it was made with the same
    fingerprint; a note and None for one that was not, or cannot be read."""
    if path is None or not Path(path).exists():
        return None
    try:
        saved = load_state(path)
    except SystemExit as e:
        print(f"note: {e}; the dictionary is learned from the start")
        return None
    if saved.get("fingerprint") != fingerprint:
        print(f"note: {path} was saved by another dictionary learning; starting over")
        return None
    return saved


# ---------------------------------------------------------------------------------------------
# Hidden states of a checkpoint

@torch.no_grad()
def collect(model, tokens: np.ndarray, layer: int, n: int, seq_len: int, max_freq: float,
            batch_size: int, seed: int, device) -> torch.Tensor:
    """(n, d) float32: L2-normalised layer-`layer` states at random positions of random windows of
    the token stream, [CLS]/[SEP] and tokens of relative frequency >= max_freq left out."""
    freq = np.bincount(tokens, minlength=model.config.vocab_size) / len(tokens)
    keep = torch.from_numpy(freq < max_freq).to(device)
    if freq[freq < max_freq].sum() < 0.01:
        left_out = 100 * freq[freq >= max_freq].sum()
        raise SystemExit(f"error: --max-freq {max_freq} leaves out {left_out:.1f}% of the "
                         f"tokens; raise it (1 keeps every token)")
    rng = np.random.default_rng(seed)
    L = seq_len - 2
    if len(tokens) < L:
        raise SystemExit(f"error: the corpus holds {len(tokens)} tokens, fewer than one window "
                         f"of {L}")
    out, have = [], 0
    progress = bar(total=n, desc=f"layer {layer} states", unit="vec", disable=None)
    for _ in range(100000):
        starts = rng.integers(0, len(tokens) - L + 1, batch_size)
        ids = np.full((batch_size, seq_len), SEP, np.int64)
        ids[:, 0] = CLS
        ids[:, 1:-1] = np.stack([tokens[s:s + L] for s in starts])
        ids = torch.from_numpy(ids).to(device)
        h = model(ids, all_layers=True)[layer].float()            # (B, T, d)
        take = keep[ids]
        take[:, 0] = take[:, -1] = False
        v = h[take]
        out.append(torch.nn.functional.normalize(v, dim=1)[: n - have].cpu())
        have += len(out[-1])
        progress.update(len(out[-1]))
        if have >= n:
            break
    progress.close()
    if have < n:
        raise SystemExit(f"error: found only {have} of {n} vectors below --max-freq {max_freq}")
    return torch.cat(out)


# ---------------------------------------------------------------------------------------------
# A dictionary from a checkpoint: what the CLI and train.py's mlsm (between its phases) run

@dataclass
class DictConfig:
    """How a dictionary is learned; each field's meaning, range and flag: DICT_FIELDS."""
    layer: int = -1
    k: int = 3000
    lam: float = 0.05
    vectors: int = 100000
    epochs: int = 4
    batch_size: int = 1024
    max_freq: float = 1.0
    seq_len: int = 128
    forget: float = 50.0
    iters: int = 1000
    tol: float = 1e-2
    seed: int = 0

    def check(self, n_layer: int | None = None, names: dict | None = None, where="the model"):
        """One line for the first setting that cannot work, named by the caller's flags (`names`
        maps a field to its flag; default --field-name): a field outside its range, fewer
        vectors than atoms, and, given the model's n_layer, a layer it does not have."""
        flag = lambda f: (names or {}).get(f, "--" + f.replace("_", "-"))
        for name, (allowed, _) in DICT_FIELDS.items():
            if isinstance(allowed, Range) and getattr(self, name) not in allowed:
                raise SystemExit(f"error: {allowed.refusal(flag(name), getattr(self, name))}")
        for broken, why in (
                (self.vectors < self.k, f"{flag('vectors')} {self.vectors}: fewer vectors than "
                                        f"the {self.k} atoms they start from ({flag('k')})"),
                (n_layer is not None and not -n_layer - 1 <= self.layer <= n_layer,
                 f"{flag('layer')} {self.layer}: {where} has layers 0..{n_layer}")):
            if broken:
                raise SystemExit(f"error: {why}")


# Each DictConfig field's flag: its type (with its range) and its help. sparse.py has a flag for
# each, train.py's mlsm flags six (objectives.DICT_FLAGS); the layer is checked against the
# model, whose depth the flags do not know (DictConfig.check).
DICT_FIELDS = {
    "layer": (int, "hidden layer: 0 = embeddings, 1..n_layer, negative from the end"),
    "k": (at_least(int, 1), "dictionary atoms: the size of the distribution MLSM predicts"),
    "lam": (above(float, 0), "l1 penalty lambda of the codes, eq. (1) of sparse.py"),
    "vectors": (at_least(int, 1), "hidden states the dictionary is learned from"),
    "epochs": (at_least(int, 0), "passes of dictionary learning over them"),
    "batch_size": (at_least(int, 1), "vectors per mini-batch"),
    "max_freq": (Range(float, 0, 1, low_open=True),
                 "leave out tokens at least this frequent (1: keep every token)"),
    "seq_len": (at_least(int, 3), "window length the model reads"),
    "forget": (at_least(float, 0),
               "past mini-batches weigh (1-1/t)^forget at mini-batch t; 0: equally"),
    "iters": (at_least(int, 1), "FISTA iteration cap per mini-batch"),
    "tol": (at_least(float, 0),
            "FISTA stops when its gradient mapping is below tol*lam everywhere"),
    "seed": (at_least(int, 0), "seed of the windows, the initial atoms and the batch order"),
}


def dict_flag(field: str) -> dict:
    """add_argument's keywords for the flag of a DictConfig field (sparse.py's, and train.py's
    mlsm flags under their own names): its type and range, default and help."""
    kind, about = DICT_FIELDS[field]
    return dict(type=kind, default=getattr(DictConfig, field), help=about)


def learn_from_checkpoint(ckpt_path, data, cfg: DictConfig, device, out) -> dict:
    """Learn a dictionary of layer cfg.layer of a checkpoint's states on the corpus `data` (None:
    the one it was trained on), write it to `out` (save_dictionary) and return what was written.

    Everything random is drawn from generators seeded by cfg.seed, and the global torch RNG is
    left as it was (loading the model would draw from it), so a training run that calls this
    between its phases goes on exactly as one that was given the same dictionary with --dict."""
    with torch.random.fork_rng(devices=[]):
        ckpt = read_checkpoint(ckpt_path)
        model, _ = load_checkpoint(ckpt_path, device, encoder_only=True)
        n_layer = model.config.n_layer
        cfg.check(n_layer, where=ckpt_path)
        layer = cfg.layer % (n_layer + 1)
        trained = ckpt.get("args", {})
        data_dir = prepare(data or trained.get("data", "babylm_10m"),
                           trained.get("vocab_size", model.config.vocab_size), quiet=True)
        check_tokenizer(data_dir, ckpt["tokenizer"], ckpt_path)
        tokens = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r")

        t0 = time.time()
        H = collect(model, tokens, layer, cfg.vectors, cfg.seq_len, cfg.max_freq, 64, cfg.seed,
                    device).to(device)
        t1 = time.time()
        # the learner's state after each epoch beside `out`: an interrupted call goes on from
        # it (a checkpoint's size and time stand for its weights, and so for H)
        D, history = learn_dictionary(
            H, cfg.k, cfg.lam, cfg.epochs, cfg.batch_size, cfg.seed, cfg.forget, cfg.iters,
            cfg.tol, state_path=Path(str(out) + ".partial"),
            fingerprint={**checkpoint_identity(ckpt_path), "data": str(data_dir), **asdict(cfg)})
        t2 = time.time()
        coders = compare_coders(H[:1000], D, cfg.lam)  # what the two target coders make of D
        last = history[-1]
        print(f"dictionary: {cfg.k} atoms of layer {layer} from {cfg.vectors} vectors "
              f"(d {H.shape[1]}) | objective {history[0]['objective']:.4f} -> "
              f"{last['objective']:.4f} | {last['nnz']:.1f} non-zeros per code | "
              f"{100 * last['zero_rate']:.2f}% all-zero codes | states {t1 - t0:.0f} s, "
              f"learning {t2 - t1:.0f} s\n"
              f"targets on 1000 of those vectors: {coders['fista100_nnz']:.1f} non-zeros with "
              f"fista100 (the MLSM code's), {coders['exact_nnz']:.1f} exact; total variation "
              f"between the two {coders['tv']:.3f}")
        about = dict(lam=cfg.lam, ckpt=str(ckpt_path), ckpt_step=ckpt.get("step"), history=history,
                     args={**asdict(cfg), "ckpt": str(ckpt_path), "data": data,
                           "device": str(device)},
                     seconds={"states": t1 - t0, "learning": t2 - t1}, coders=coders)
        return save_dictionary(out, D, layer, **about)


def dictionary_for_run(path, given, teacher_path, n_layer: int, data, cfg: DictConfig, device,
                       flag_names: dict) -> None:
    """A training run's dictionary at `path` (RUN/dict.pt, so that a resumed run and its code/
    folder keep the very dictionary it trained on): a copy of `given` (--dict), or without one
    learned from the teacher checkpoint, whose n_layer layers cfg is checked against (its
    messages name the flags, flag_names). Under DDP rank 0 makes it; the others wait."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and not Path(path).exists():
        if given:
            if not Path(given).is_file():
                raise SystemExit(f"error: --dict {given}: no such file")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(given, path)
        else:
            tqdm.write(f"learning the MLSM dictionary from layer {cfg.layer} of {teacher_path} "
                       f"(sparse.py): {cfg.k:,} atoms from {cfg.vectors:,} states, {cfg.epochs} "
                       f"epochs")
            cfg.check(n_layer, flag_names, f"the teacher {teacher_path}")
            learn_from_checkpoint(teacher_path, data, cfg, device, path)
    if dist.is_initialized():
        dist.barrier()


def save_dictionary(path, D, layer: int, **about) -> dict:
    """A dictionary file: D (d, k), the layer it codes, and whatever else says how it was made."""
    state = {"D": D.cpu(), "layer": layer, "k": D.shape[1], "d_model": D.shape[0], **about}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(state, path)
    return state


def load_dictionary(path, d_model: int, n_layer: int) -> tuple[torch.Tensor, int]:
    """(D (d, k) float32, the layer it codes) of a dictionary file, for a model of d_model
    dimensions and n_layer layers."""
    saved = load_state(path)  # a missing, unreadable or corrupt file: one line
    D = saved.get("D") if isinstance(saved, dict) else None
    if not isinstance(D, torch.Tensor):
        raise SystemExit(f"error: {path} is not a dictionary file (no tensor D)")
    if D.ndim != 2 or D.shape[0] != d_model:
        raise SystemExit(f"error: the dictionary {path} has shape {tuple(D.shape)}, but the "
                         f"model's states have {d_model} dimensions")
    return D.float(), saved["layer"]


def build_parser() -> Parser:
    p = Parser(prog="sparse.py", description=__doc__)
    p.add_argument("--ckpt", required=True, help="checkpoint whose hidden states are coded (a "
                   "train.py ckpt.pt or phase1.pt)")
    p.add_argument("--data", default=None,
                   help="corpus it was trained on (default: the checkpoint's --data)")
    for name in DICT_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), **dict_flag(name))
    add_device_flag(p.add_argument)
    p.add_argument("--out", required=True, help="where to write the dictionary (a torch file: "
                   "D (d, k) and how it was made)")
    return p


def main(argv=None):
    line_buffered()
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = DictConfig(**{f.name: getattr(args, f.name) for f in fields(DictConfig)})
    cfg.check()
    out = file_to_write(args.out, parser.error, "the dictionary file's path")
    with exit_on_stop_signals("`sparse.py`; the epochs learned so far are kept: the same command "
                              "goes on from them"):  # one line, at once
        learn_from_checkpoint(args.ckpt, args.data, cfg, pick_device(args.device), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
