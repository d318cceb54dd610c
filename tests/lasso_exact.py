"""The exact non-negative lasso, the reference the tests hold sparse.py's coders to: the LARS-lasso
homotopy in float64 numpy, one vector at a time, and the KKT conditions that certify an optimum.

    encode(H, D, lam, method="lars")    exact codes for every row of H
    encode(H, D, lam, method="fista")   sparse.sparse_code's, for comparison
"""
import numpy as np
import torch

import sparse


def kkt_violation(H, D, A, lam) -> float:
    """How far A is from optimal for sparse.py's (1): with c = D^T (h - D a), the optimum has
    c_j = lam where a_j > 0 and c_j <= lam where a_j = 0 (and a >= 0). The largest violation."""
    c = (H - A @ D.T) @ D
    on = A > 0
    return max((c - lam).abs()[on].max().item() if on.any() else 0.0,
               (c - lam).clamp(min=0)[~on].max().item() if (~on).any() else 0.0,
               (-A).clamp(min=0).max().item())


def lars(h: np.ndarray, D: np.ndarray, lam: float) -> np.ndarray:
    """The exact minimiser of (1) for one vector h (d,), by the non-negative LARS-lasso homotopy
    (Efron et al. 2004, "Least Angle Regression", sec. 3.1 with the lasso modification of sec.
    3.1 and the positive constraint of sec. 3.4), in float64.

    Follow the solution a(mu) as the penalty mu falls from max_j c_j (where a = 0) to lam. On the
    active set S the KKT conditions hold with equality, D_S^T (h - D_S a_S) = mu, so
    a_S(mu) = G^-1 (D_S^T h - mu 1) with G = D_S^T D_S: a_S grows along w = G^-1 1 as mu falls,
    and the correlation of an inactive atom j falls at rate D_j^T D_S w (active ones at rate 1).
    The path is linear until an inactive atom's correlation reaches mu (it joins) or an active
    coefficient reaches 0 (it leaves); each such event is a breakpoint."""
    D = np.asarray(D, np.float64)
    h = np.asarray(h, np.float64)
    k = D.shape[1]
    a = np.zeros(k)
    c = D.T @ h
    mu = c.max()
    if mu <= lam:
        return a
    active, left = [int(c.argmax())], None
    for _ in range(10 * k):  # each breakpoint adds or drops one atom; the path has few of them
        S = np.array(active)
        w = np.linalg.solve(D[:, S].T @ D[:, S], np.ones(len(S)))
        c = D.T @ (h - D @ a)                 # recomputed at every breakpoint: no drift
        rate = D.T @ (D[:, S] @ w)            # how fast each correlation falls per unit of mu
        inactive = np.ones(k, bool)
        inactive[S] = False
        if left is not None:
            inactive[left] = False            # the atom that just left is at its breakpoint
        with np.errstate(divide="ignore", invalid="ignore"):
            join = np.where(inactive & (rate < 1 - 1e-12), (mu - c) / (1 - rate), np.inf)
            drop = np.where(w < 0, -a[S] / w, np.inf)
        join[join < 0] = 0.0                  # round-off at a breakpoint
        step = min(mu - lam, join.min(), drop.min())
        a[S] += step * w
        if step == mu - lam:                  # reached lam before the next breakpoint
            break
        mu -= step
        if drop.min() <= join.min():
            j = int(S[drop.argmin()])
            a[j], left = 0.0, j
            active.remove(j)                  # never empties: at a = 0 some c_j = max c > mu
        else:
            active.append(int(join.argmin()))
            left = None
    return np.maximum(a, 0.0)


def encode(H, D, lam: float, method: str = "fista", iters: int = 1000, tol: float = 1e-3,
           work: int = 32):
    """Codes (n, k) >= 0 minimising sparse.py's (1) for every row of H (n, d), dictionary D (d, k).
    fista: batched, in H's dtype and device; tol and work (working-set size, 0 = all atoms): see
    sparse_code. lars: exact, float64, one row at a time."""
    if method == "fista":
        return sparse.sparse_code(H, D, lam, iters=iters, tol=tol, work=work)
    if method == "lars":
        Dn = D.detach().cpu().double().numpy()
        rows = [lars(h, Dn, lam) for h in H.detach().cpu().double().numpy()]
        return torch.tensor(np.stack(rows), dtype=H.dtype, device=H.device)
    raise ValueError(f"unknown method {method!r} (fista or lars)")
