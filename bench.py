"""Side-by-side timings, one table per benchmark, measured on the machine that runs them.

    python bench.py ema                                  # fused vs per-tensor EMA update, per model size
    python bench.py steps --size tiny --data babylm_10m  # each objective's training speed vs mlm
    python bench.py sparse                               # MLSM's sparse coding vs scikit-learn, if installed

`steps` runs train.py itself (short runs in a temporary folder) and reads tokens/s from its
log.jsonl, skipping the first log interval (start-up, allocator warm-up), so it times exactly
what a user runs.
"""
import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from model import PRESETS, Encoder, ModelConfig, ema_update, sparse_code

HERE = Path(__file__).resolve().parent


def timed(fn, device, repeat):
    """Median seconds of fn() over `repeat` calls, after two warm-up calls."""
    times = []
    for i in range(repeat + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_ema(args):
    device = torch.device(args.device)
    print(f"EMA update of a whole encoder (vocab {args.vocab_size}) on {device}: median of {args.repeat}")
    print(f"{'size':<6} {'params':>8} {'tensors':>8} {'loop ms':>9} {'fused ms':>9} {'speed-up':>9}")
    for size in args.sizes:
        student = Encoder(ModelConfig(**PRESETS[size], vocab_size=args.vocab_size)).to(device)
        teacher = copy.deepcopy(student)
        loop = timed(lambda: ema_update(teacher, student, 0.999, fused=False), device, args.repeat)
        fused = timed(lambda: ema_update(teacher, student, 0.999, fused=True), device, args.repeat)
        n = sum(1 for _ in student.parameters())
        print(f"{size:<6} {student.num_params() / 1e6:7.1f}M {n:>8} {1e3 * loop:9.3f} {1e3 * fused:9.3f} {loop / fused:8.2f}x")


def bench_steps(args):
    flags = ["--data", args.data, "--size", args.size, "--batch-size", str(args.batch_size), "--seq-len", "128",
             "--max-steps", str(2 * args.steps), "--log-every", str(args.steps), "--eval-every", "100000",
             "--save-every", "100000", "--device", args.device]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for objective in args.objectives:
            extra = ["--teacher", str(Path(tmp) / "mlm" / "ckpt.pt")] if objective.startswith("kd") else []
            if extra and "mlm" not in args.objectives:
                raise SystemExit("error: kd needs the mlm run's checkpoint as its teacher; keep mlm in --objectives")
            r = subprocess.run([sys.executable, str(HERE / "train.py"), "--objective", objective, *flags, *extra,
                                "--out-dir", str(Path(tmp) / objective)], capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"error: train.py --objective {objective} failed:\n{r.stderr[-2000:]}")
            log = [json.loads(line) for line in (Path(tmp) / objective / "log.jsonl").read_text().splitlines()]
            rows.append((objective, [e["tok_per_s"] for e in log if "tok_per_s" in e][-1]))
    base = dict(rows).get("mlm")
    print(f"training speed, {args.size} model, {args.batch_size} x 128 tokens per step, on {args.device} "
          f"(tokens/s over steps {args.steps + 1}-{2 * args.steps})")
    print(f"{'objective':<10} {'tokens/s':>10} {'step time vs mlm':>17}")
    for objective, tps in rows:
        print(f"{objective:<10} {tps:10.0f} {f'{base / tps:.2f}x' if base else '-':>17}")


def sparse_problem(kind, d, k, n, seed=0):
    """Unit-norm rows H (n, d) and a dictionary D (d, k), unit columns. `isotropic`: random atoms,
    each row a noisy positive mix of about 10 of them. `anisotropic`: rows share a common
    direction (mean cosine about 0.3, as the hidden states of our tiny model, measured: 0.30) and
    the atoms are k of those rows, as learn_dictionary starts; its D^T D is badly conditioned."""
    g = torch.Generator().manual_seed(seed)
    unit = lambda x, dim: x / x.norm(dim=dim, keepdim=True)
    if kind == "isotropic":
        D = unit(torch.randn(d, k, generator=g), 0)
        A = (torch.rand(n, k, generator=g) < 10 / k) * torch.rand(n, k, generator=g)
        return unit(A @ D.T + 0.1 * torch.randn(n, d, generator=g) / d ** 0.5, 1), D
    common = unit(torch.randn(d, generator=g), 0)
    X = unit(0.55 * common + unit(torch.randn(n + k, d, generator=g), 1), 1)
    return X[:n], X[n:].T.contiguous()


def bench_sparse(args):
    """vectors/s and the mean objective of each solver on the same vectors; ours on `--vectors`
    at once (training codes a whole batch of targets), scikit-learn on the first `--sk-vectors`."""
    device = torch.device(args.device)
    try:
        from sklearn.decomposition import sparse_encode
    except ImportError:
        sparse_encode = None
        print("scikit-learn is not installed: its rows are skipped (it is never a requirement)")
    lam = args.lam
    objective = lambda H, D, A: (0.5 * ((H - A @ D.T) ** 2).sum(1) + lam * A.sum(1)).double()
    print(f"non-negative sparse coding, k = {args.k} atoms, lam = {lam}, on {device}; objective = mean of "
          f"1/2||h - Da||^2 + lam*|a|_1 over the first {args.sk_vectors} vectors (gap: relative to the best)")
    print(f"{'problem':<18} {'solver':<34} {'vectors/s':>10} {'objective':>10} {'gap':>9} {'vs sklearn':>10}")
    for d in args.dims:
        for kind in ("isotropic", "anisotropic"):
            H, D = sparse_problem(kind, d, args.k, args.vectors)
            H, D = H.to(device), D.to(device)
            rows = []
            for name, work, tol in [("ours, working set (default)", 32, 1e-3), ("ours, working set, tol 1e-2 (train)", 32, 1e-2),
                                    ("ours, plain FISTA over all atoms", 0, 1e-3)]:
                sparse_code(H[:64], D, lam, tol=tol, work=work)  # warm-up
                times = []
                for _ in range(args.repeat):
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    A = sparse_code(H, D, lam, tol=tol, work=work)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                rows.append((name, len(H) / statistics.median(times), objective(H[:args.sk_vectors], D, A[:args.sk_vectors]).mean().item()))
            if sparse_encode is not None:
                Hn, Dn = H[:args.sk_vectors].cpu().double().numpy(), D.T.cpu().double().numpy()
                for alg in ("lasso_lars", "lasso_cd"):
                    # scikit-learn scales its penalty as lam / d inside; alpha = lam is the same problem (1)
                    t = time.perf_counter()
                    A = sparse_encode(Hn, Dn, algorithm=alg, alpha=lam, positive=True, max_iter=args.sk_max_iter)
                    t = time.perf_counter() - t
                    A = torch.tensor(A, dtype=torch.float64)
                    rows.append((f"sklearn sparse_encode {alg}", len(Hn) / t, objective(H[:args.sk_vectors].cpu().double(), D.cpu().double(), A).mean().item()))
            best = min(r[2] for r in rows)
            sk = max((r[1] for r in rows if r[0].startswith("sklearn")), default=None)
            for name, vps, obj in rows:
                ratio = f"{vps / sk:.1f}x" if sk and not name.startswith("sklearn") else "-"
                print(f"{f'{kind} d={d}':<18} {name:<34} {vps:10.0f} {obj:10.5f} {(obj - best) / best:9.1e} {ratio:>10}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="bench", required=True)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    e = sub.add_parser("ema", help="fused (torch._foreach_lerp_) vs per-tensor EMA update")
    e.add_argument("--sizes", nargs="+", default=list(PRESETS), choices=list(PRESETS), help="model presets (default all)")
    e.add_argument("--vocab-size", type=int, default=16384, help="(default 16384)")
    e.add_argument("--repeat", type=int, default=50, help="timed calls per variant (default 50)")
    e.add_argument("--device", default=auto, help=f"(default {auto})")
    e.set_defaults(func=bench_ema)
    s = sub.add_parser("steps", help="tokens/s of each objective, and its step time relative to mlm")
    s.add_argument("--objectives", nargs="+", default=["mlm", "boot", "kd"], help="(default mlm boot kd)")
    s.add_argument("--data", default="babylm_10m", help="as train.py --data (default babylm_10m)")
    s.add_argument("--size", default="tiny", choices=list(PRESETS), help="(default tiny)")
    s.add_argument("--batch-size", type=int, default=32, help="(default 32)")
    s.add_argument("--steps", type=int, default=30, help="steps per timed interval; each run takes twice this (default 30)")
    s.add_argument("--device", default=auto, help=f"(default {auto})")
    s.set_defaults(func=bench_steps)
    c = sub.add_parser("sparse", help="sparse coding (model.sparse_code) vs scikit-learn's sparse_encode(positive=True)")
    c.add_argument("--dims", nargs="+", type=int, default=[384, 768], help="state sizes d (default 384 768: small, base)")
    c.add_argument("--k", type=int, default=2500, help="atoms (default 2500)")
    c.add_argument("--lam", type=float, default=0.05, help="(default 0.05)")
    c.add_argument("--vectors", type=int, default=1024, help="vectors our solver codes at once (default 1024)")
    c.add_argument("--sk-vectors", type=int, default=128, help="vectors scikit-learn codes; the objective is compared on these (default 128)")
    c.add_argument("--sk-max-iter", type=int, default=1000, help="scikit-learn's max_iter (default 1000, its own)")
    c.add_argument("--repeat", type=int, default=3, help="timed calls of ours, after a warm-up; the median is shown (default 3)")
    c.add_argument("--device", default=auto, help=f"(default {auto})")
    c.set_defaults(func=bench_sparse)
    args = ap.parse_args()
    args.func(args)
