"""Side-by-side timings, one table, measured on the machine that runs them; writes bench.json.

    python bench.py                   # everything on the CPU, tiny model (~3 minutes on 2 cores)
    python bench.py --sizes tiny,small --sparse-all    # docs/bench.md's table (24 min, 2 cores)
    python bench.py --device cuda     # on a GPU: adds MFU against the GPU's bf16 peak
    python bench.py --quick           # seconds: tiny shapes, few repetitions (the tests run this)
    python bench.py --only step,bert  # some of: step, bert, ltg, attn, ema, ...
    python bench.py --table docs/bench/cpu.json   # the table of a saved run (docs/bench.md's)

Every row is ours against a reference measured in the same run, so the ratio holds on a noisy
machine: rates (higher is better), median over repetitions after warm-up, with min and max.
On a GPU, every model row (step, bert, ltg) has mfu, and ref_mfu for its reference: each
model's own matrix FLOPs per token (bench_models.flops_per_token, bert_flops_per_token) at its
rate, over the GPU's bf16 peak. A row that fails keeps the last lines of its error (`failed`),
the other rows go on, and bench.py exits 1 at the end.
  step     train.py itself, one short run per objective, size and --attention form: tokens/s of
           the log intervals after the first (start-up, allocator warm-up); reference: mlm in
           the first form at the same size
  side     --side N runs of the first objective at the first size at once on one device: their
           summed tokens/s against the first N's (one run alone), and each run's overhead_s (its
           wall time outside its steady steps: start, torch.compile, the first step)
  bert     our MLM training step in-process against transformers' BertForMaskedLM at the same
           shape (layers, hidden, heads, FFN width, vocabulary, sequence, batch), each compiled
           as train.py compiles its step (on with CUDA), ours reading the predicted positions as
           fixed slots as train.py does, a row per --attention form (BERT compiled once); only
           if transformers is installed (never a requirement); flops_ratio is ours / theirs in
           FLOPs per token, first_step_s each model's first step (its compile)
  ltg      our MLM training step against LTG-BERT's own model code, re-implemented from
           ltgoslo/ltg-bert in benchmarks/ltg_bert.py, loaded with the same weights (eager unless
           --compile); max_abs_diff is the largest difference of their logits in float32
  attn     one attention layer's relative-position core, forward and backward, dropout off:
           the model's gather path against other formulations (its other --attention forms, the
           relative shift, flex_attention as kernels.flex_relative (forward only on the CPU), on
           CUDA SDPA's efficient kernel with a bias gradient); each row's max_abs_diff is its
           largest difference from the gather path, output and gradients
  ema      fused EMA (one torch._foreach_lerp_) against a per-tensor loop
  pll      evaluate.py's batched pseudo-log-likelihood (every masked copy of equal-length
           sentences in one forward) against one forward per masked copy, on the same sentences
  sparse   sparse.sparse_code against scikit-learn's sparse_encode(positive=True), if
           installed, at matched objective (the gap is printed)
  sampler  synth.py's PCFG sampler, sentences/s (no reference)
  compile  torch.compile's first call of mlsm's target coder (sparse.fista_fixed) against the
           same steps with Python-float momentum, in compilations per minute
The step and sampler rows run train.py and synth.py as the commands users run, on purpose: what
they time is those commands.
"""
import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

import evaluate
import sparse
from benchmarks.models import bench_bert, bench_ltg, flops_per_token, mfu
from benchmarks.ops import bench_attn, bench_ema
from benchmarks.timing import (PROFILES, alternate, failed_row, fmt, print_profiles, rates, row,
                               table)
from data.masking import mask_capacity
from data.prepare import CLS, MASK, SEP, SPECIALS, VOCAB_SIZE, raw_root
from machinery.plumbing import (REPO, Parser, RunFolder, above, add_device_flag, at_least,
                                file_to_write, numbers, pick_device, use_compile, use_tf32)
from model import PRESETS, TRAINING_ATTENTION, Encoder, ModelConfig, use_attention
from objectives import BASELINE, OBJECTIVES
from train import COMPILE_SCOPES


V = VOCAB_SIZE


# ---------------------------------------------------------------------------------------------
# Training steps: train.py for every objective, as users run it

def bench_step(args, device, tmp):
    """One train.py run per (size, objective, attention form); mlm first, whose checkpoint the
    two-phase objectives (kd, mlsm) distil from (mlsm: a dictionary of random unit atoms;
    fista100 takes 100 steps whatever the atoms). Beside tokens/s: the recompilations
    torch.compile logged (dynamo's TORCH_LOGS=recompiles), mfu (the encoder's own MLM training
    FLOPs per token: a teacher's forward, mlsm's coder or the head on gpt-bert's causal rows is
    work it does not count), wall_s (the whole run: start, compile, steps, the validation and
    save at its end), overhead_s (the run's seconds outside its steady steps: start,
    torch.compile, the first step) and, for mlsm, a batch's coding time alone (coder_ms) and its
    share of a step's time (code_share; coder_seconds). The reference: mlm in the first form at
    the same size. A run that fails, or outlasts --row-timeout, is a row with its error's last
    lines, and the next goes on."""
    B, T = args.batch_size, args.seq_len
    reference = {}  # size -> mlm's tokens/s in the first form: the other rows' reference
    first = BASELINE + run_variant(args, args.attention[0])
    for size in args.sizes:
        cfg = ModelConfig(**PRESETS[size], vocab_size=V)
        for objective in args.objectives:
            entry = OBJECTIVES.get(objective)  # unknown: train.py refuses it, a failed row
            two_phase = bool(entry and entry.two_phase)
            coded = bool(entry and entry.declares("dict"))  # mlsm's targets: sparse codes
            for form in args.attention:
                run = timed_run_dir(tmp, objective, size, form)
                case = f"{objective} {size} {B}x{T}{run_variant(args, form)}"
                flags = train_flags(args, device, objective, size, run, form=form)
                if two_phase:  # phase 2 alone, taught by the baseline's run (in the first form)
                    teacher = timed_run_dir(tmp, BASELINE, size, args.attention[0]) / "ckpt.pt"
                    flags += ["--teacher", str(teacher)]
                if coded:
                    g = torch.Generator().manual_seed(0)
                    D = torch.randn(cfg.d_model, args.mlsm_k, generator=g)
                    path = Path(tmp) / f"dict_{size}.pt"
                    sparse.save_dictionary(path, D / D.norm(dim=0), layer=cfg.n_layer)
                    flags += ["--dict", str(path), "--mlsm-k", str(args.mlsm_k)]
                [r] = train_runs([flags], args.row_timeout)
                if r["failed"]:
                    yield failed_row("step", case, r["failed"])
                    continue
                tps = r["tps"]
                # the head reads C slots: the two-phase objectives' uniform masking, else spans
                slots = mask_capacity(B, T, 0.15, None if two_phase else 3.0)
                flops = flops_per_token(cfg, T, slots / (B * T), B * T)
                extra = {k: r[k] for k in ("wall_s", "overhead_s", "peak_mem_gb", "recompiles")}
                extra["mfu"] = mfu(flops, statistics.median(tps), device)
                if coded:  # the coder timed alone, not inside the step
                    try:
                        coder = coder_seconds(args, device, D)
                        step_s = B * T / statistics.median(tps)
                        extra.update(coder_ms=1e3 * coder, code_share=coder / step_s)
                    except Exception as e:  # the step's row stands; the next goes on
                        extra["coder_failed"] = f"{type(e).__name__}: {e}"
                is_first = objective == BASELINE and form == args.attention[0]
                base = reference.get(size) if not is_first else None
                yield row("step", case, "tokens/s", tps, *((first, base) if base else ("-", None)),
                          **extra)
                if is_first:
                    reference[size] = tps


def timed_run_dir(tmp, objective: str, size: str, form: str) -> Path:
    """Where a timed train.py run of `objective` at `size` in attention `form` writes."""
    return Path(tmp) / (f"{objective}_{size}" + (f"_{form}" if form != "gather" else ""))


def train_flags(args, device, objective: str, size: str, out_dir, seed: int = 0,
                form: str | None = None) -> list[str]:
    """train.py's flags for a timed run: --steps in 5 log intervals, no validation or save but
    at its end, --compile and --bf16 as given, relative attention as `form` (default the first
    of --attention)."""
    k = max(1, args.steps // 5)  # steps per log interval: 5 intervals, the first not timed
    flags = ["--objective", objective, "--data", args.data, "--size", size, "--seed", str(seed),
             "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--max-steps", str(5 * k), "--log-every", str(k), "--eval-every", "100000",
             "--save-every", "100000", "--device", device.type, "--out-dir", str(out_dir),
             "--attention", form or args.attention[0], "--compile-scope", args.compile_scope]
    for flag in ("compile", "bf16", "cuda_graphs"):
        if getattr(args, flag) is not None:
            name = flag.replace("_", "-")
            flags.append(f"--{name}" if getattr(args, flag) else f"--no-{name}")
    return flags


def run_variant(args, form: str) -> str:
    """What a timed run's flags change from train.py's defaults, for its row's name."""
    return (" cuda-graphs" if args.cuda_graphs else "") + (
        f" {form}" if form != "gather" else "") + (
        " compiled by layer" if args.compile_scope == "layers" else "")


def bench_side(args, device, tmp):
    """Runs side by side on one device: --side N runs of the first objective at the first size
    and the first --attention form (seeds 0..N-1), started together. tokens/s is their sum (each
    run's median over its log intervals after the first); reference: the first count's sum (1
    run alone by default); overhead_s, each run's time outside its steady steps (train_runs),
    their median."""
    size, objective = args.sizes[0], args.objectives[0]
    alone = None
    for n in args.side:
        case = (f"{n} x {objective} {size} {args.batch_size}x{args.seq_len}"
                f"{run_variant(args, args.attention[0])}")
        runs = train_runs([train_flags(args, device, objective, size, Path(tmp) / f"side{n}_{i}",
                                       seed=i) for i in range(n)], args.row_timeout,
                          # the cores shared as study.py --parallel shares them
                          threads=max(1, (os.cpu_count() or 1) // n) if n > 1 else None)
        bad = next((r["failed"] for r in runs if r["failed"]), None)
        if bad:
            yield failed_row("side", case, bad)
            continue
        total = [sum(statistics.median(r["tps"]) for r in runs)]
        yield row("side", case, "tokens/s", total, *(("alone", alone) if alone else ("-", None)),
                  per_run=statistics.median(statistics.median(r["tps"]) for r in runs),
                  overhead_s=statistics.median(r["overhead_s"] for r in runs),
                  wall_s=max(r["wall_s"] for r in runs),
                  peak_mem_gb=max(r["peak_mem_gb"] for r in runs),
                  recompiles=sum(r["recompiles"] for r in runs))
        alone = alone or total


def train_runs(commands: list[list[str]], timeout: float | None, threads: int | None = None
               ) -> list[dict]:
    """train.py once per flag list, all started at once, each in its own process group (its
    compile workers with it). Per run: failed (its error's last lines, or None); tps, the tokens/s
    of its log intervals after the first (start-up, allocator warm-up); wall_s (start to exit);
    overhead_s (wall_s less all but one of its steps at their median rate: the start,
    torch.compile, the first step, the closing validation and save); peak_mem_gb; recompiles
    (dynamo's TORCH_LOGS=recompiles). Runs still going after `timeout` s are killed; `threads`:
    each run's OMP_NUM_THREADS."""
    env = {**os.environ, "TORCH_LOGS": ",".join(filter(None, (os.environ.get("TORCH_LOGS"),
                                                              "recompiles"))),
           **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, str(REPO / "train.py"), *argv], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for argv in commands]

    def finish(p):  # (what it said on stderr, its wall time or None if it timed out)
        try:
            return p.communicate(timeout=timeout)[1], time.time() - t0
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            return p.communicate()[1], None
    pool = ThreadPoolExecutor(len(procs))
    try:
        ended = list(pool.map(finish, procs))
    finally:  # bench.py stopped (SIGTERM is a SystemExit, main): its runs go too
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pool.shutdown()
    out = []
    for p, argv, (said, wall) in zip(procs, commands, ended):
        if wall is None or p.returncode:
            out.append({"failed": f"timed out after {timeout:g} s (--row-timeout)\n{tail(said)}"
                        if wall is None else f"train.py exited with {p.returncode}\n{tail(said)}"})
            continue
        value = lambda flag: argv[argv.index(flag) + 1]
        timed = [e for e in RunFolder(value("--out-dir"), master=False).records()
                 if "tok_per_s" in e]
        tps = [e["tok_per_s"] for e in timed][1:]  # the first interval warms up
        step_s = int(value("--batch-size")) * int(value("--seq-len")) / statistics.median(tps)
        out.append({"failed": None, "tps": tps, "wall_s": wall,
                    "overhead_s": wall - (timed[-1]["step"] - 1) * step_s,
                    "peak_mem_gb": max(e.get("peak_mem_gb", 0) for e in timed),
                    "recompiles": said.count("Recompiling function")})
    return out


def tail(text: str, lines=25) -> str:
    """The last lines of a failed command's output: what a failed row keeps of it."""
    return "\n".join(text.strip().splitlines()[-lines:])


def coder_seconds(args, device, D) -> float:
    """Seconds of one batch's fista100 targets, timed alone: mask_capacity's B int(p T) unit
    vectors (mlsm's uniform masking) against D, compiled where train.py compiles the step, with
    TF32 on a GPU as train.py codes them (and off again after: the rows that follow time
    float32 code, evaluate.py's PLL say, as it runs). Timing it inside the step would split the
    step's compiled graph."""
    C = mask_capacity(args.batch_size, args.seq_len, 0.15)
    g = torch.Generator().manual_seed(0)
    H = F.normalize(torch.randn(C, D.shape[0], generator=g), dim=-1).to(device)
    D = D.to(device)
    L = torch.linalg.matrix_norm(D, ord=2) ** 2
    momentum = sparse.fista_momentum(100, device)  # as train.py passes them: graph inputs
    code = lambda: sparse.fista_fixed(H, D, sparse.DictConfig().lam, 100, L, momentum)
    if use_compile(device, args.compile):
        code = torch.compile(code)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    use_tf32(device)
    try:
        return 1 / statistics.median(rates(code, 1, device, 2, 5))
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


# ---------------------------------------------------------------------------------------------
# sparse.py's coder: against scikit-learn, and its first compiled call

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
    """sparse.fista_fixed with its momentum weights as Python floats, as it was first written."""
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


# ---------------------------------------------------------------------------------------------
# PLL scoring, the sampler


@torch.no_grad()
def pll_naive(model, seqs, device):
    """Log-probabilities of every token but [CLS] and [SEP], each masked in turn: one forward
    per masked copy, in sentence and position order (evaluate.token_logprobs' order)."""
    out = []
    for s in seqs:
        ids = torch.tensor([s], device=device)
        for j in range(1, len(s) - 1):
            target = torch.zeros_like(ids, dtype=torch.bool)
            target[0, j] = True
            _, logits = model(ids.masked_fill(target, MASK), predict=target)  # float32, as
            out.append(logits.float().log_softmax(-1)[0, s[j]].item())        # evaluate.py
    return out


def bench_pll(args, device, tmp):
    """evaluate.py's scorer as `evaluate.py blimp` runs it (its batch size for the device,
    temperature 1), against one forward per masked copy."""
    g = torch.Generator().manual_seed(0)
    n = 8 if args.quick else 64
    lengths = torch.randint(8, 25, (n,), generator=g).tolist()
    seqs = [[CLS, *torch.randint(len(SPECIALS), V, (L,), generator=g).tolist(), SEP]
            for L in lengths]
    starts = torch.ones(V, dtype=torch.bool)  # word starts: unused by the plain PLL scorer
    batched = lambda: evaluate.pll(model, seqs, [1.0], "pll", evaluate.BATCH_TOKENS[device.type],
                                   device, starts, progress=False)
    for size in args.sizes:
        model = Encoder(ModelConfig(**PRESETS[size], vocab_size=V)).to(device).eval()
        _, _, lp = evaluate.token_logprobs(model, seqs, [1.0], "pll",
                                           evaluate.BATCH_TOKENS[device.type], device, starts,
                                           progress=False)
        err = float(abs(lp[:, 0] - pll_naive(model, seqs, device)).max())
        assert err < 1e-3, f"batched and naive PLL differ by {err}"  # both float32
        reps = (1, 2) if args.quick else (1, 5)
        ours = rates(batched, n, device, *reps)
        naive = rates(lambda: pll_naive(model, seqs, device), n, device,
                      *((0, 1) if args.quick else (1, 2)))
        yield row("pll", f"{size}, {n} sentences of 8-24 tokens", "sentences/s", ours,
                  "one forward per copy", naive, max_abs_diff=err)
        if device.type != "cuda":  # on the CPU flex compiles once per shape (model.py), and it
            continue               # scored at 0.93x (tiny) and 0.95x (small): docs/bench.md
        # the same scorer with relative attention through flex (model.use_attention)
        toggled = lambda on: lambda: (use_attention(model, "flex" if on else "gather"),
                                      batched())[1]
        diff = float(abs(toggled(True)() - toggled(False)()).max())
        a, b = alternate(toggled(True), toggled(False), n, device, *reps)
        yield row("pll", f"{size}, {n} sentences of 8-24 tokens, flex_attention",
                  "sentences/s", a, "gather path", b, max_abs_diff=diff)


def bench_sampler(args, device, tmp):
    ud = raw_root() / "ud"
    if not ud.is_dir():
        print(f"note: no UD treebanks at {ud}; the sampler row is skipped")
        return
    n = 5000 if args.quick else 100000
    speeds = []
    for rep in range(1 if args.quick else 3):
        out = Path(tmp) / f"synth{rep}"
        r = subprocess.run([sys.executable, str(REPO / "synth.py"), "--ud", str(ud), "--sentences",
                            str(n), "--seed", str(rep), "--out", str(out)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"synth.py exited with {r.returncode}\n{tail(r.stderr)}")
        speeds.append(json.loads((out / "stats.json").read_text())["sentences_per_s"])
    yield row("sampler", f"PCFG from French UD, {n} sentences, zipf", "sentences/s", speeds)


BENCHES = {"step": bench_step, "side": bench_side, "bert": bench_bert, "ltg": bench_ltg,
           "attn": bench_attn, "ema": bench_ema, "pll": bench_pll, "sparse": bench_sparse,
           "sampler": bench_sampler, "compile": bench_compile}


# ---------------------------------------------------------------------------------------------
# The table

def cpu_name() -> str:
    """The CPU's model, cores and the vector extensions that decide bf16 speed (AMX, AVX-512)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines()
                      if line.startswith("flags")), []))
    have = [name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"),
                                    ("avx2", "AVX2")) if flag in flags]
    return f"{model}, {os.cpu_count()} cores" + (f" ({', '.join(have)})" if have else "")


def attention_forms(text: str) -> list[str]:
    """--attention's type: a comma list of train.py's attention forms."""
    forms = text.split(",")
    if unknown := [f for f in forms if f not in TRAINING_ATTENTION]:
        raise argparse.ArgumentTypeError(f"{','.join(unknown)}: not one of "
                                         f"{','.join(TRAINING_ATTENTION)}")
    return forms


def build_parser() -> Parser:
    ap = Parser(prog="bench.py", description=__doc__)
    add = ap.add_argument
    add_device_flag(add)
    add("--quick", action="store_true",
        help="tiny shapes and few repetitions: seconds, for the tests")
    add("--only", default=",".join(BENCHES),
        help=f"comma-separated benches (default all: {','.join(BENCHES)})")
    add("--sizes", default=None,
        help="model presets (default tiny on CPU, tiny,small,base on CUDA)")
    add("--objectives", default="mlm,boot,kd+mlm,mlsm+mlm",
        help="step: train.py objectives, mlm first; the two-phase ones run phase 2 alone, "
        "taught by mlm's run")
    add("--steps", type=at_least(int, 1), default=10,
        help="step: optimizer steps per train.py run, in 5 log intervals (rounded down to a "
        "multiple of 5, at least 5); the first warms up, 4 are timed (default 10; a few hundred "
        "on a GPU, past torch.compile's warm-up)")
    add("--side", type=numbers(at_least(int, 1)), default=None,
        help="side: how many runs side by side, a comma list (default 1,2,4,8 on CUDA, 1,2 on "
        "the CPU); the first is the reference")
    add("--data", default="babylm_10m", help="step, side: train.py --data")
    add("--row-timeout", type=above(float, 0), default=None,
        help="step: seconds each train.py run may take; one that takes longer is a failed row and "
        "the next objective goes on (default: no limit)")
    add("--batch-size", type=at_least(int, 1), default=None,
        help="step, bert: sequences per step (default 32 on CPU, 128 on CUDA; --quick 4)")
    add("--seq-len", type=at_least(int, 3), default=128,
        help="step, bert: tokens per sequence (default 128; --quick 32)")
    add("--mlsm-k", type=at_least(int, 1), default=sparse.DictConfig().k,
        help=f"step: mlsm dictionary atoms (default {sparse.DictConfig().k}, train.py's)")
    add("--variants", action="store_true", help="bert: also ours with absolute positions, both "
        "without dropout, and both in bf16")
    add("--profile", type=at_least(int, 0), nargs="?", const=1, default=0,
        help="bert, ltg: also profile N steps of each model (N: 1 when not given) and print its "
        "top operators by self time, per step (saved in bench.json)")
    add("--sparse-all", action="store_true",
        help="sparse: also scikit-learn's lasso_lars and our plain FISTA (slow)")
    add("--compile", action=argparse.BooleanOptionalAction, default=None,
        help="step: train.py --compile / --no-compile; bert: both models' steps as train.py "
        "compiles its own (default for both: on with CUDA, off on the CPU); ltg: --compile "
        "compiles both models")
    add("--attention", type=attention_forms, default="gather",
        help="step, bert: how our relative attention is computed (train.py --attention), a "
        f"comma list of {', '.join(TRAINING_ATTENTION)}: a row for each, the first the other "
        "forms' reference in step (bert: BertForMaskedLM compiled once, for all); side: the "
        "first")
    add("--compile-scope", default="model", choices=COMPILE_SCOPES,
        help="step, side: train.py --compile-scope (one graph for the model, or one per layer, "
        "reused)")
    add("--cuda-graphs", action="store_true", default=None,
        help="step, side: train.py --cuda-graphs (the compiled step replayed as CUDA graphs)")
    add("--bf16", action=argparse.BooleanOptionalAction, default=None,
        help="step, bert: bfloat16 autocast (default on with CUDA, off on the CPU; --variants "
        "adds a bf16 row on the CPU)")
    add("--out", default="bench.json", help="where to write the rows")
    add("--table", default=None, help="print the table of this bench.json and stop")
    return ap


def get_args(argv=None):
    """The flags, checked, with the defaults that depend on the device filled in (sizes,
    batch size, side counts; --quick's shapes): what every bench reads."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.table:
        return args
    file_to_write(args.out, ap.error, "the rows' file path")
    # (not pick_device: a GPU's flags are checked on a machine without one too, as its plans)
    cpu = args.device == "cpu" or args.device == "auto" and not torch.cuda.is_available()
    args.sizes = (args.sizes or ("tiny" if args.quick or cpu else "tiny,small,base")).split(",")
    args.objectives = args.objectives.split(",")
    if "step" in args.only.split(",") and args.objectives[0] != BASELINE:
        raise SystemExit("error: --objectives must start with mlm: it is the step rows' "
                         "reference and the two-phase objectives' teacher")
    args.batch_size = args.batch_size or (4 if args.quick else 32 if cpu else 128)
    args.side = args.side or ([1, 2] if cpu else [1, 2, 4, 8])
    if args.quick:
        args.seq_len, args.steps = min(args.seq_len, 32), min(args.steps, 5)
    unknown = set(args.only.split(",")) - set(BENCHES)
    if unknown:
        raise SystemExit(f"error: --only {','.join(sorted(unknown))}: not one of "
                         f"{','.join(BENCHES)}")
    return args


def main(argv=None):
    args = get_args(argv)
    if args.table:
        try:
            saved = json.loads(Path(args.table).read_text())
            print(table(saved))
        except OSError as e:
            raise SystemExit(f"error: --table {args.table}: {e.strerror}")
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"error: --table {args.table}: not a bench.py result (the JSON "
                             f"file its --out writes)")
        return saved["rows"]
    device = pick_device(args.device)
    cpu = device.type == "cpu"
    rows = []
    PROFILES.clear()  # this call's alone (the tests call main more than once in a process)
    machine = torch.cuda.get_device_name(device) if not cpu else cpu_name()
    saved = {"machine": machine, "device": device.type, "torch": torch.__version__,
             "date": str(datetime.date.today()), "args": vars(args), "rows": rows}

    def write():  # after every row: a run cut off by a time limit keeps what it measured
        saved.update({"profiles": PROFILES} if PROFILES else {})
        tmp_out = Path(f"{args.out}.tmp")
        tmp_out.write_text(json.dumps(saved, indent=1))
        tmp_out.replace(args.out)
    # stopped by a time limit's SIGTERM: unwind (a step row kills its train.py), rows are written
    before = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.only.split(","):
                t = time.time()
                rows_before = len(rows)
                try:
                    for r in BENCHES[name](args, device, tmp):
                        rows.append(r)
                        write()
                        said(r)
                except Exception as e:  # a failing bench is a row; the next bench goes on
                    rows.append(failed_row(name, f"after {len(rows) - rows_before} rows",
                                           f"{type(e).__name__}: {e}\n"
                                           + tail(traceback.format_exc())))
                    write()
                    said(rows[-1])
                print(f"{name}: {time.time() - t:.0f}s", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, before)
    write()
    if PROFILES:
        print_profiles()
    print("\n" + table(saved))
    print(f"wrote {args.out}")
    failed = [r for r in rows if r.get("failed")]
    if failed:
        raise SystemExit(f"error: {len(failed)} of {len(rows)} rows failed: "
                         + "; ".join(f"{r['bench']} {r['case']}" for r in failed))
    return rows


def said(r):
    """A row as it is measured, on stderr."""
    if r.get("failed"):
        print(f"{r['bench']}: {r['case']}: FAILED: {r['failed'].splitlines()[0]}", file=sys.stderr)
    else:
        print(f"{r['bench']}: {r['case']}: {fmt(r['ours'])} {r['unit']}"
              + (f", {r['ratio']:.2f}x {r['reference']}" if r["ratio"] else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
