"""Side-by-side timings, one table, measured on the machine that runs them; writes bench.json.

    python bench.py                        # everything on the CPU, tiny model (under 3 minutes on 2 cores)
    python bench.py --sizes tiny,small --sparse-all    # the README's table (18 minutes on 2 cores)
    python bench.py --device cuda          # on a GPU: adds MFU against the GPU's bf16 peak
    python bench.py --quick                # seconds: tiny shapes, few repetitions (the test suite runs this)
    python bench.py --only step,bert       # some of: step, bert, ema, pll, sparse, sampler

Every row is ours against a reference measured in the same run, so the ratio holds on a noisy
machine: rates (higher is better), median over repetitions after warm-up, with min and max.
  step     train.py itself, one short run per objective and size: tokens/s of the log intervals
           after the first (start-up, allocator warm-up); reference: mlm at the same size
  bert     our MLM training step in-process against transformers' BertForMaskedLM at the same
           shape (layers, hidden, heads, FFN width, vocabulary, sequence, batch), only if
           transformers is installed (never a requirement); flops_ratio is ours / theirs in
           matrix FLOPs per token (flops_per_token, bert_flops_per_token)
  ema      fused EMA (one torch._foreach_lerp_) against a per-tensor loop
  pll      batched pseudo-log-likelihood (every masked copy of equal-length sentences in one
           forward) against one forward per masked copy, on the same sentences
  sparse   sparse.sparse_code against scikit-learn's sparse_encode(positive=True), if installed,
           at matched objective (the gap is printed)
  sampler  synth.py's PCFG sampler, sentences/s (no reference)
"""
import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from data.prepare import raw_root
from model import PRESETS, Encoder, ModelConfig, ema_update, save_checkpoint
from sparse import sparse_code

HERE = Path(__file__).resolve().parent
MASK, V = 4, 16384  # data/prepare.py's [MASK] id and default vocabulary
# dense bf16 peak FLOP/s, for MFU (vendor datasheets; SXM parts)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def rates(fn, work, device, warmup, repeat) -> list[float]:
    """work / seconds of each of `repeat` calls of fn(), after `warmup` calls."""
    out = []
    for i in range(warmup + repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            out.append(work / (time.perf_counter() - t))
    return out


def row(bench, case, unit, ours, ref_name="-", ref=None, **extra):
    """One table row: medians with min/max, and ours/reference."""
    r = {"bench": bench, "case": case, "unit": unit, "ours": statistics.median(ours), "min": min(ours), "max": max(ours),
         "reference": ref_name, "ref": statistics.median(ref) if ref else None, **extra}
    r["ratio"] = r["ours"] / r["ref"] if r["ref"] else None
    return r


# ---------------------------------------------------------------------------------------------
# Training steps: train.py for every objective; ours against BertForMaskedLM

def bench_step(args, device, tmp):
    """One train.py run per (size, objective); mlm first, whose checkpoint kd and mlsm distil from
    (mlsm: a dictionary of random unit atoms, which codes faster than a learned one, see sparse)."""
    rows = []
    k, reps = (2, 2) if args.quick else (2, 4)  # steps per log interval, intervals timed
    for size in args.sizes:
        base = None
        for objective in args.objectives:
            run = Path(tmp) / f"{objective}_{size}"
            flags = ["--objective", objective, "--data", args.data, "--size", size, "--batch-size", str(args.batch_size),
                     "--seq-len", str(args.seq_len), "--max-steps", str(k * (reps + 1)), "--log-every", str(k),
                     "--eval-every", "100000", "--save-every", "100000", "--device", device.type, "--out-dir", str(run)]
            if objective != "mlm":
                if base is None:
                    raise SystemExit("error: bench step needs mlm first in --objectives (it is the reference and the teacher)")
                flags += ["--teacher", str(Path(tmp) / f"mlm_{size}" / "ckpt.pt")] if objective in ("kd", "mlsm") else []
            if objective == "mlsm":
                d = ModelConfig(**PRESETS[size]).d_model
                D = torch.randn(d, args.mlsm_k, generator=torch.Generator().manual_seed(0))
                save_checkpoint({"D": D / D.norm(dim=0), "layer": PRESETS[size]["n_layer"]}, Path(tmp) / f"dict_{size}.pt")
                flags += ["--dict", str(Path(tmp) / f"dict_{size}.pt"), "--mlsm-k", str(args.mlsm_k)]
            for flag in ("compile", "bf16"):
                if getattr(args, flag) is not None:
                    flags.append(f"--{flag}" if getattr(args, flag) else f"--no-{flag}")
            r = subprocess.run([sys.executable, str(HERE / "train.py"), *flags], capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"error: train.py --objective {objective} --size {size} failed:\n{r.stderr[-2000:]}")
            log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
            tps = [e["tok_per_s"] for e in log if "tok_per_s" in e][1:]          # the first interval warms up
            peak = max((e.get("peak_mem_gb", 0) for e in log), default=0)
            extra = {"peak_mem_gb": peak}
            if device.type == "cuda" and objective == "mlm":
                extra["mfu"] = mfu(ModelConfig(**PRESETS[size], vocab_size=V), args.seq_len, statistics.median(tps), device)
            rows.append(row("step", f"{objective} {size} {args.batch_size}x{args.seq_len}", "tokens/s", tps,
                            *(("mlm", base) if objective != "mlm" else ("-", None)), **extra))
            if objective == "mlm":
                base = tps
    return rows


def flops_per_token(cfg: ModelConfig, seq_len: int, masked=0.15) -> float:
    """Training FLOPs per token (3x forward, 2 per multiply-add): the layers' matrices, attention
    scores and values (2 T D each), the relative-position scores (2 R D each way), and the MLM
    head on the masked share of tokens only."""
    D, L, Ff = cfg.d_model, cfg.n_layer, cfg.d_ff
    R = 2 * cfg.position_buckets - 1 if cfg.position == "relative" else 0
    layer = 2 * (3 * D * D + D * D + 2 * D * Ff + Ff * D) + 2 * 2 * seq_len * D + 2 * 2 * R * D
    head = masked * 2 * (D * D + D * cfg.vocab_size)
    return 3 * (L * layer + head)


def bert_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The same count for BertForMaskedLM at cfg's shape: a plain d_ff-wide FFN, no position
    scores, and the head on every position (it computes logits everywhere, then ignores -100)."""
    D, L, Ff = cfg.d_model, cfg.n_layer, cfg.d_ff
    layer = 2 * (4 * D * D + 2 * D * Ff) + 2 * 2 * seq_len * D
    return 3 * (L * layer + 2 * (D * D + D * cfg.vocab_size))


def mfu(cfg, seq_len, tokens_per_s, device):
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return None if peak is None else flops_per_token(cfg, seq_len) * tokens_per_s / peak


def bench_bert(args, device, tmp):
    """Our MLM step against BertForMaskedLM's at the same shape, the two timed alternately (so a
    slow spell of the machine hits both). --variants adds, per size, ours with absolute positions
    and both models without dropout: what the relative positions and dropout cost."""
    try:
        from transformers import BertConfig, BertForMaskedLM
    except ImportError:
        print("note: transformers is not installed; the BertForMaskedLM rows are skipped (it is never a requirement)")
        return []
    rows = []
    B, T = args.batch_size, args.seq_len
    warmup, repeat = (1, 3) if args.quick else (3, 10)
    bf16 = args.bf16 if args.bf16 is not None else device.type == "cuda"
    fused = {"fused": True} if device.type == "cuda" else {}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (B, T), generator=g)
    masked = torch.rand(B, T, generator=g) < 0.15
    inp, att = ids.masked_fill(masked, MASK).to(device), torch.ones(B, T, dtype=torch.long, device=device)
    masked, targets = masked.to(device), ids.to(device)[masked.to(device)]
    labels = torch.where(masked, ids.to(device), -100)
    variants = [("", {}, bf16)] + ([(", absolute positions", {"position": "absolute"}, bf16),
                                    (", dropout 0 (both)", {"dropout": 0.0}, bf16)] if args.variants else [])
    if args.variants and not bf16:
        variants.append((", bf16 autocast (both)", {}, True))
    for size in args.sizes:
        for name, change, half in variants:
            amp = torch.autocast(device.type, torch.bfloat16, enabled=half)
            cfg = ModelConfig(**{**PRESETS[size], "vocab_size": V, **change})
            ours = Encoder(cfg).to(device).train()
            p = cfg.dropout
            theirs = BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
                                                num_attention_heads=cfg.n_head, intermediate_size=cfg.d_ff,
                                                max_position_embeddings=cfg.max_position, hidden_dropout_prob=p,
                                                attention_probs_dropout_prob=p)).to(device).train()
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, **fused) for m in (ours, theirs)]
            if args.compile:  # both or neither; compiling happens in the warm-up steps
                ours.compile()
                theirs.compile()

            def step_ours():
                with amp:
                    _, logits = ours(inp, att, predict=masked)        # the MLM head on masked positions only
                F.cross_entropy(logits.float(), targets).backward()
                opts[0].step()
                opts[0].zero_grad(set_to_none=True)

            def step_theirs():
                with amp:
                    loss = theirs(input_ids=inp, attention_mask=att, labels=labels).loss
                loss.backward()
                opts[1].step()
                opts[1].zero_grad(set_to_none=True)

            a, b = [], []
            for i in range(warmup + repeat):
                a += rates(step_ours, B * T, device, int(i < warmup), int(i >= warmup))
                b += rates(step_theirs, B * T, device, int(i < warmup), int(i >= warmup))
            name += ", compiled (both)" if args.compile else ""
            rows.append(row("bert", f"mlm step {size} {B}x{T}{name} ({ours.num_params() / 1e6:.1f}M vs "
                            f"{theirs.num_parameters() / 1e6:.1f}M params)", "tokens/s", a, "BertForMaskedLM", b,
                            flops_ratio=flops_per_token(cfg, T) / bert_flops_per_token(cfg, T)))
    return rows


# ---------------------------------------------------------------------------------------------
# EMA, PLL scoring, sparse coding, the sampler

def bench_ema(args, device, tmp):
    rows = []
    for size in args.sizes:
        student = Encoder(ModelConfig(**PRESETS[size], vocab_size=V)).to(device)
        teacher = copy.deepcopy(student)
        reps = (2, 5) if args.quick else (5, 30)
        fused = rates(lambda: ema_update(teacher, student, 0.999, fused=True), 1, device, *reps)
        loop = rates(lambda: ema_update(teacher, student, 0.999, fused=False), 1, device, *reps)
        rows.append(row("ema", f"{size} ({sum(1 for _ in student.parameters())} tensors)", "updates/s", fused, "per-tensor loop", loop))
    return rows


@torch.no_grad()
def pll_batched(model, sents, device, batch_tokens=4096):
    """Log-probs of every token of every sentence, each masked in turn: the masked copies of all
    equal-length sentences go through the model together, batch_tokens tokens at a time."""
    out = {}
    for T in sorted({len(s) for s in sents}):
        idx = [i for i, s in enumerate(sents) if len(s) == T]
        ids = torch.tensor([sents[i] for i in idx], device=device)         # (n, T)
        copies = ids.repeat_interleave(T, 0)                                 # (n T, T): copy j masks position j
        target = torch.eye(T, dtype=torch.bool, device=device).repeat(len(idx), 1)
        lp = []
        for c in range(0, len(copies), max(1, batch_tokens // T)):
            sl = slice(c, c + max(1, batch_tokens // T))
            _, logits = model(copies[sl].masked_fill(target[sl], MASK), predict=target[sl])
            lp.append(logits.float().log_softmax(-1).gather(1, copies[sl][target[sl]][:, None]).squeeze(1))
        lp = torch.cat(lp).view(len(idx), T)
        out.update({i: lp[r] for r, i in enumerate(idx)})
    return [out[i] for i in range(len(sents))]


@torch.no_grad()
def pll_naive(model, sents, device):
    """The same log-probs, one forward per masked copy."""
    out = []
    for s in sents:
        ids = torch.tensor([s], device=device)
        lp = []
        for j in range(len(s)):
            target = torch.zeros_like(ids, dtype=torch.bool)
            target[0, j] = True
            _, logits = model(ids.masked_fill(target, MASK), predict=target)
            lp.append(logits.float().log_softmax(-1)[0, s[j]])
        out.append(torch.stack(lp))
    return out


def bench_pll(args, device, tmp):
    rows = []
    g = torch.Generator().manual_seed(0)
    n = 8 if args.quick else 64
    sents = [torch.randint(5, V, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    for size in args.sizes:
        model = Encoder(ModelConfig(**PRESETS[size], vocab_size=V)).to(device).eval()
        a, b = pll_batched(model, sents, device), pll_naive(model, sents, device)
        err = max((x - y).abs().max().item() for x, y in zip(a, b))
        assert err < 1e-3, f"batched and naive PLL differ by {err}"
        reps = (1, 2) if args.quick else (1, 5)
        batched = rates(lambda: pll_batched(model, sents, device), n, device, *reps)
        naive = rates(lambda: pll_naive(model, sents, device), n, device, *((0, 1) if args.quick else (1, 2)))
        rows.append(row("pll", f"{size}, {n} sentences of 8-24 tokens", "sentences/s", batched, "one forward per copy", naive,
                        max_abs_diff=err))
    return rows


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


def bench_sparse(args, device, tmp):
    """Ours codes a batch of vectors at once (as training does); scikit-learn codes the first sk
    of them in float64 (one call); the objectives are compared on those. --sparse-all adds
    scikit-learn's default algorithm (lasso_lars) and our plain FISTA over all atoms (work=0)."""
    try:
        from sklearn.decomposition import sparse_encode
    except ImportError:
        sparse_encode = None
        print("note: scikit-learn is not installed; the sparse rows have no reference (it is never a requirement)")
    lam, k = 0.05, (500 if args.quick else 2500)
    n, sk = (128, 16) if args.quick else (1024, 128)
    objective = lambda H, D, A: (0.5 * ((H - A @ D.T) ** 2).sum(1) + lam * A.sum(1)).double().mean().item()
    rows = []
    for d in ([128] if args.quick else [384, 768]):
        for kind in ("isotropic", "anisotropic"):
            H, D = sparse_problem(kind, d, k, n)
            H, D = H.to(device), D.to(device)
            refs = {}
            if sparse_encode is not None:
                Hn, Dn = H[:sk].cpu().double().numpy(), D.T.cpu().double().numpy()
                for alg in ("lasso_cd", "lasso_lars") if args.sparse_all else ("lasso_cd",):
                    t = time.perf_counter()
                    As = sparse_encode(Hn, Dn, algorithm=alg, alpha=lam, positive=True, max_iter=1000)  # = our problem
                    refs[alg] = ([sk / (time.perf_counter() - t)], objective(H[:sk].cpu().double(), D.cpu().double(), torch.tensor(As)))
            variants = [("working set", 32)] + ([("plain FISTA, all atoms", 0)] if args.sparse_all else [])
            for name, work in variants:
                A = sparse_code(H, D, lam, work=work)
                ours = rates(lambda: sparse_code(H, D, lam, work=work), n, device, 1, 1 if args.quick else 3)
                obj = objective(H[:sk], D, A[:sk])
                for alg in (list(refs) if work else list(refs)[:1]) or [None]:   # plain FISTA: against lasso_cd only
                    ref, ref_obj = refs[alg] if alg else (None, None)
                    rows.append(row("sparse", f"{kind} d={d} k={k}, {name}", "vectors/s", ours, f"sklearn {alg}" if alg else "-",
                                    ref, objective=obj, **({"ref_objective": ref_obj} if alg else {})))
    return rows


def bench_sampler(args, device, tmp):
    ud = raw_root() / "ud"
    if not ud.is_dir():
        print(f"note: no UD treebanks at {ud}; the sampler row is skipped")
        return []
    n = 5000 if args.quick else 100000
    speeds = []
    for rep in range(1 if args.quick else 3):
        out = Path(tmp) / f"synth{rep}"
        r = subprocess.run([sys.executable, str(HERE / "synth.py"), "--ud", str(ud), "--sentences", str(n), "--seed", str(rep),
                            "--out", str(out)], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"error: synth.py failed:\n{r.stderr[-2000:]}")
        speeds.append(json.loads((out / "stats.json").read_text())["sentences_per_s"])
    return [row("sampler", f"PCFG from French UD, {n} sentences, zipf", "sentences/s", speeds)]


BENCHES = {"step": bench_step, "bert": bench_bert, "ema": bench_ema, "pll": bench_pll, "sparse": bench_sparse, "sampler": bench_sampler}


MAIN = ("bench", "case", "unit", "ours", "min", "max", "reference", "ref", "ratio")  # the table's columns


def fmt(x):
    return "-" if x is None else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--device", default=auto, choices=("cpu", "cuda"), help=f"(default {auto})")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions: seconds, for the tests")
    ap.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated benches (default all: {','.join(BENCHES)})")
    ap.add_argument("--sizes", default=None, help="model presets (default tiny on CPU, tiny,small,base on CUDA)")
    ap.add_argument("--objectives", default="mlm,boot,kd,mlsm", help="step: train.py objectives, mlm first (default mlm,boot,kd,mlsm)")
    ap.add_argument("--data", default="babylm_10m", help="step: train.py --data (default babylm_10m)")
    ap.add_argument("--batch-size", type=int, default=None, help="step, bert: sequences per step (default 32 on CPU, 128 on CUDA; --quick 4)")
    ap.add_argument("--seq-len", type=int, default=128, help="step, bert: tokens per sequence (default 128; --quick 32)")
    ap.add_argument("--mlsm-k", type=int, default=2500, help="step: mlsm dictionary atoms (default 2500)")
    ap.add_argument("--variants", action="store_true", help="bert: also ours with absolute positions, both without dropout, and both in bf16")
    ap.add_argument("--sparse-all", action="store_true", help="sparse: also scikit-learn's lasso_lars and our plain FISTA (slow)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="step: train.py --compile / --no-compile (default: train.py's own, on with CUDA); bert: --compile compiles both models")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="step, bert: bfloat16 autocast (default on with CUDA, off on the CPU; --variants adds a bf16 row on the CPU)")
    ap.add_argument("--out", default="bench.json", help="where to write the rows (default bench.json)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible")
    args.sizes = (args.sizes or ("tiny" if args.quick or device.type == "cpu" else "tiny,small,base")).split(",")
    args.objectives = args.objectives.split(",")
    args.batch_size = args.batch_size or (4 if args.quick else 32 if device.type == "cpu" else 128)
    if args.quick:
        args.seq_len = min(args.seq_len, 32)
    unknown = set(args.only.split(",")) - set(BENCHES)
    if unknown:
        raise SystemExit(f"error: --only {','.join(sorted(unknown))}: not one of {','.join(BENCHES)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            t = time.time()
            rows += BENCHES[name](args, device, tmp)
            print(f"{name}: {time.time() - t:.0f}s", file=sys.stderr)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"\nbench.py on {machine}, torch {torch.__version__}, {datetime.date.today()}; median [min, max] of repetitions")
    print("| bench | case | ours | unit | reference | reference's | ours / ref | other |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        other = ", ".join(f"{k} {fmt(v) if isinstance(v, float) else v}" for k, v in r.items() if k not in MAIN and v is not None)
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        print(f"| {r['bench']} | {r['case']} | {fmt(r['ours'])} [{fmt(r['min'])}, {fmt(r['max'])}] | {r['unit']} | "
              f"{r['reference']} | {fmt(r['ref'])} | {ratio} | {other} |")
    Path(args.out).write_text(json.dumps({"machine": machine, "device": device.type, "torch": torch.__version__,
                                          "date": str(datetime.date.today()), "args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
