"""bench.py's operation rows: the relative-attention core against other ways to compute it
(`attn`), the fused EMA update (`ema`), sparse coding against scikit-learn (`sparse`), and the
first compiled call of the MLSM coder (`compile`).

    python bench.py --only attn,ema,sparse,compile
"""
import copy
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import sparse
from data.masking import mask_capacity
from data.prepare import VOCAB_SIZE
from device import use_bf16
from kernels import flex_relative
from model import PRESETS, Encoder, ModelConfig, relative_buckets, relative_scores
from optim import ema_update
from timing import alternate, rates, row


V = VOCAB_SIZE


def skew(a):
    """(..., T, 2T - 1) -> (..., T, T), out[i, j] = a[i, j - i + T - 1]: a row's scores by
    offset, read off by flattening and re-slicing (Dai et al. 2019's relative shift; views only)."""
    T = a.shape[-2]
    if T == 1:
        return a
    return a.flatten(-2)[..., T - 1:T - 1 + T * (2 * T - 2)].unflatten(-1, (T, 2 * T - 2))[..., :T]


def attention_variants(device):
    """{name: fn(q, k, v, qp, kp, idx, keep, scale) -> (B, H, T, hd)}, dropout off: q, k, v
    (B, H, T, hd); qp, kp (H, R, hd) projected position vectors; idx (T, T) buckets; keep (B, T)
    bool, False at padding. `gather` is model.Attention's way."""
    def bias_of(keep):
        return torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, float("-inf"))

    def gather(q, k, v, qp, kp, idx, keep, scale, backend=None):
        scores = relative_scores(q, k, qp, kp, idx)
        bias = (bias_of(keep)[:, None, None, :] + scores * scale).to(q.dtype)
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        with torch.nn.attention.sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    def by_offset(q, k, v, qp, kp, idx, keep, scale):
        T = q.shape[2]
        off = torch.cat([idx[T - 1], idx[0, 1:]])    # bucket of offset i - j = T-1, ..., -(T-1)
        c2p = skew(q @ kp[:, off].transpose(-1, -2))
        p2c = skew(k @ qp[:, off.flip(0)].transpose(-1, -2)).transpose(-1, -2)
        bias = (bias_of(keep)[:, None, None, :] + (c2p + p2c) * scale).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    def flex(q, k, v, qp, kp, idx, keep, scale):
        bias = bias_of(keep)[:, None, None, :].to(q.dtype)
        return flex_relative(q, k, v, qp, kp, idx[None, None], bias, scale)

    out = {"gather": gather, "by offset (relative shift)": by_offset,
           "flex_attention (kernels.flex_relative)": flex}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend
        out["gather, SDPA efficient kernel"] = lambda *a: gather(
            *a, backend=SDPBackend.EFFICIENT_ATTENTION)
    return out


def bench_attn(args, device, tmp):
    """One attention layer's core, forward and backward, dropout off, a quarter of the rows
    padded at the end: each variant against the gather path, with the largest difference from
    it in the output and in every gradient (max_abs_diff). A variant that fails says why."""
    B, T = args.batch_size, args.seq_len
    warmup, repeat = (1, 2) if args.quick else (3, 10)
    dtype = torch.bfloat16 if use_bf16(device, args.bf16) else torch.float32
    variants = attention_variants(device)
    for size in args.sizes:
        cfg = ModelConfig(**PRESETS[size])
        H, hd, R = cfg.n_head, cfg.d_model // cfg.n_head, 2 * cfg.position_buckets - 1
        g = torch.Generator().manual_seed(0)
        make = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()
        inputs = [make(B, H, T, hd) for _ in range(3)] + [make(H, R, hd) for _ in range(2)]
        idx = relative_buckets(T, cfg.position_buckets, cfg.max_position).to(device)
        keep = torch.ones(B, T, dtype=torch.bool, device=device)
        keep[: B // 4, T * 3 // 4:] = False
        grad = torch.randn(B, H, T, hd, generator=g).to(device, dtype)
        scale = 1 / math.sqrt(3 * hd)

        def run(fn, backward=True):
            for t in inputs:
                t.grad = None
            if not backward:
                with torch.no_grad():
                    return [fn(*(t.detach() for t in inputs), idx, keep, scale)]
            y = fn(*inputs, idx, keep, scale)
            y.backward(grad)
            return [y.detach()] + [t.grad for t in inputs]

        ref = rates(lambda: run(variants["gather"]), B * T, device, warmup, repeat)
        for name, fn in variants.items():
            if name == "gather":
                continue
            bw = not (name.startswith("flex") and device.type == "cpu")  # no CPU backward
            if not bw and args.quick:  # a compilation per shape; tests/test_model.py covers it
                continue
            if not bw:
                name += ", forward only (no backward on the CPU)"
            try:
                got, want = run(fn, bw), run(variants["gather"], bw)
                diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
                a, b = alternate(lambda: run(fn, bw), lambda: run(variants["gather"], bw), B * T,
                                 device, warmup, repeat)
                yield row("attn", f"{size} {B}x{T}, {name}", "tokens/s", a, "gather", b,
                          max_abs_diff=diff)
            except Exception as e:  # a kernel that refuses these inputs: the row says so
                yield row("attn", f"{size} {B}x{T}, {name}", "tokens/s", [0.0], "gather",
                          ref, failed=f"{type(e).__name__}: {str(e)[:120]}")


def bench_ema(args, device, tmp):
    for size in args.sizes:
        student = Encoder(ModelConfig(**PRESETS[size], vocab_size=V)).to(device)
        teacher = copy.deepcopy(student)
        reps = (2, 5) if args.quick else (5, 30)
        fused = rates(lambda: ema_update(teacher, student, 0.999, fused=True), 1, device, *reps)
        loop = rates(lambda: ema_update(teacher, student, 0.999, fused=False), 1, device, *reps)
        tensors = sum(1 for _ in student.parameters())
        yield row("ema", f"{size} ({tensors} tensors)", "updates/s", fused,
                  "per-tensor loop", loop)


def sparse_problem(kind, d, k, n, seed=0):
    """Unit-norm rows H (n, d) and a dictionary D (d, k), unit columns. `isotropic`: random atoms,
    each row a noisy positive mix of about 10 of them. `anisotropic`: rows share a common
    direction (mean cosine about 0.3, as the hidden states of our tiny model, measured: 0.30) and
    the atoms are k of those rows, as learn_dictionary starts; its D^T D is badly conditioned.
    `learned`: the same rows, D learned from 2k others by learn_dictionary (one epoch), as MLSM
    codes against: coherent, but less so than its starting point."""
    g = torch.Generator().manual_seed(seed)
    unit = lambda x, dim: x / x.norm(dim=dim, keepdim=True)
    if kind == "isotropic":
        D = unit(torch.randn(d, k, generator=g), 0)
        A = (torch.rand(n, k, generator=g) < 10 / k) * torch.rand(n, k, generator=g)
        return unit(A @ D.T + 0.1 * torch.randn(n, d, generator=g) / d ** 0.5, 1), D
    common = unit(torch.randn(d, generator=g), 0)
    X = unit(0.55 * common + unit(torch.randn(n + 2 * k, d, generator=g), 1), 1)
    if kind == "anisotropic":
        return X[:n], X[n:n + k].T.contiguous()
    D, _ = sparse.learn_dictionary(X[n:], k, 0.05, epochs=1, seed=seed, eval_vectors=256,
                                   progress=False)
    return X[:n], D


def bench_sparse(args, device, tmp):
    """Ours codes a batch of vectors at once (as training does); scikit-learn codes the first sk
    of them in float64 (one call, timed as often as ours); the objectives are compared on those.
    --sparse-all adds scikit-learn's default algorithm (lasso_lars) and our plain FISTA over all
    atoms (work=0)."""
    try:
        from sklearn.decomposition import sparse_encode
    except ImportError:
        sparse_encode = None
        print("note: scikit-learn is not installed; the sparse rows have no reference (it is "
              "never a requirement)")
    lam, k = 0.05, (500 if args.quick else 2500)
    n, sk = (128, 16) if args.quick else (1024, 128)
    objective = lambda H, D, A: sparse.objective(H, D, A, lam).double().mean().item()
    for d in ([128] if args.quick else [384, 768]):
        for kind in ("isotropic", "anisotropic", "learned"):
            H, D = sparse_problem(kind, d, k, n)
            H, D = H.to(device), D.to(device)
            refs = {}
            if sparse_encode is not None:
                Hn, Dn = H[:sk].cpu().double().numpy(), D.T.cpu().double().numpy()
                for alg in ("lasso_cd", "lasso_lars") if args.sparse_all else ("lasso_cd",):
                    speeds = []
                    for _ in range(1 if args.quick else 3):
                        t = time.perf_counter()  # positive=True: our problem
                        As = sparse_encode(Hn, Dn, algorithm=alg, alpha=lam, positive=True,
                                           max_iter=1000)
                        speeds.append(sk / (time.perf_counter() - t))
                    refs[alg] = (speeds, objective(H[:sk].cpu().double(), D.cpu().double(),
                                                   torch.tensor(As)))
            variants = [("working set", 32)] + ([("plain FISTA, all atoms", 0)]
                                                if args.sparse_all else [])
            for name, work in variants:
                A = sparse.sparse_code(H, D, lam, work=work)
                code = lambda: sparse.sparse_code(H, D, lam, work=work)
                ours = rates(code, n, device, 1, 1 if args.quick else 3)
                obj = objective(H[:sk], D, A[:sk])
                algs = list(refs) if work else list(refs)[:1]  # plain FISTA: against lasso_cd
                for alg in algs or [None]:
                    ref, ref_obj = refs[alg] if alg else (None, None)
                    yield row("sparse", f"{kind} d={d} k={k}, {name}", "vectors/s", ours,
                              f"sklearn {alg}" if alg else "-", ref, objective=obj,
                              **({"ref_objective": ref_obj} if alg else {}))


def fista_float_momentum(H, D, lam, L, iters):
    """sparse.fista_fixed as written before issue 41: the momentum weights as Python floats."""
    HD = H @ D
    a = y = torch.zeros_like(HD)
    t = 1.0
    for _ in range(iters):
        nxt = (y + (HD - (y @ D.T) @ D) / L - lam / L).clamp(min=0)
        t_next = (1 + (1 + 4 * t * t) ** 0.5) / 2
        y = nxt + (t - 1) / t_next * (nxt - a)
        a, t = nxt, t_next
    return a


def bench_compile(args, device, tmp):
    """torch.compile's time to a first call, inductor with an empty cache, as compilations per
    minute: sparse.fista_fixed as train.py's mlsm calls it (momentum weights as tensor inputs)
    against the same steps with float momentum (the MLSM targets of a tiny 32 x 128 batch:
    608 states of 128 dimensions, 3000 atoms); max_abs_diff between their codes."""
    steps = 10 if args.quick else 100
    g = torch.Generator().manual_seed(0)
    H = F.normalize(torch.randn(mask_capacity(32, 128, 0.15), 128, generator=g), dim=-1)
    D = F.normalize(torch.randn(128, sparse.DictConfig().k, generator=g), dim=0)
    H, D = H.to(device), D.to(device)
    L, lam = torch.linalg.matrix_norm(D, ord=2) ** 2, sparse.DictConfig().lam
    momentum = sparse.fista_momentum(steps, device)
    calls = {"ours": lambda f: f(H, D, lam, steps, L, momentum),
             "float momentum": lambda f: f(H, D, lam, L, steps)}
    per_minute, codes = {}, {}
    warm = torch.compile(lambda x: (x * 2).clamp(min=0))  # inductor's one-time start-up
    warm(H)
    for name, fn in (("ours", sparse.fista_fixed), ("float momentum", fista_float_momentum)):
        torch._dynamo.reset()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / f"inductor_{len(per_minute)}")
        compiled = torch.compile(fn, fullgraph=True)
        per_minute[name] = rates(lambda: codes.setdefault(name, calls[name](compiled)), 60,
                                 device, 0, 1)
    diff = (codes["ours"] - codes["float momentum"]).abs().max().item()
    yield row("compile", f"fista100 targets, {steps} steps, {H.shape[0]}x{H.shape[1]} -> "
              f"{D.shape[1]}", "compiles/min", per_minute["ours"], "float momentum",
              per_minute["float momentum"], max_abs_diff=diff)
