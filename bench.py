"""Side-by-side timings, one table, measured on the machine that runs them; writes bench.json.

    python bench.py                   # everything on the CPU, tiny model (~3 minutes on 2 cores)
    python bench.py --sizes tiny,small --sparse-all    # docs/bench.md's table (37 min, 2 cores)
    python bench.py --device cuda     # on a GPU: adds MFU against the GPU's bf16 peak
    python bench.py --quick           # seconds: tiny shapes, few repetitions (the tests run this)
    python bench.py --only step,bert  # some of: step, bert, ltg, attn, ema, ...
    python bench.py --table docs/bench/cpu.json   # the table of a saved run (docs/bench.md's)

Every row is ours against a reference measured in the same run, so the ratio holds on a noisy
machine: rates (higher is better), median over repetitions after warm-up, with min and max.
  step     train.py itself, one short run per objective and size: tokens/s of the log intervals
           after the first (start-up, allocator warm-up); reference: mlm at the same size
  bert     our MLM training step in-process against transformers' BertForMaskedLM at the same
           shape (layers, hidden, heads, FFN width, vocabulary, sequence, batch), only if
           transformers is installed (never a requirement); flops_ratio is ours / theirs in
           matrix FLOPs per token (flops_per_token, bert_flops_per_token)
  ltg      our MLM training step against LTG-BERT's own model code, re-implemented from
           ltgoslo/ltg-bert in tests/ltg_bert.py, loaded with the same weights; max_abs_diff is
           the largest difference of their logits in float32
  attn     one attention layer's relative-position core, forward and backward, dropout off:
           the model's gather path against other formulations (the relative shift, flex_attention
           as kernels.flex_relative (forward only on the CPU), on CUDA SDPA's efficient kernel with
           a bias gradient); each row's max_abs_diff is its largest difference from the gather
           path, output and gradients
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
import copy
import datetime
import json
import math
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

import evaluate
import sparse
from data.masking import mask_capacity
from data.prepare import CLS, MASK, SEP, SPECIALS, VOCAB_SIZE, raw_root
from device import autocast, pick_device, use_bf16, use_compile
from kernels import flex_relative
from model import PRESETS, Encoder, ModelConfig, relative_buckets, relative_scores, use_flex
from optim import ema_update
from run_folder import REPO
from tests.ltg_bert import LtgBert


V = VOCAB_SIZE
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
    r = {"bench": bench, "case": case, "unit": unit, "ours": statistics.median(ours),
         "min": min(ours), "max": max(ours), "reference": ref_name,
         "ref": statistics.median(ref) if ref else None, **extra}
    r["ratio"] = r["ours"] / r["ref"] if r["ref"] else None
    return r


# ---------------------------------------------------------------------------------------------
# Training steps: train.py for every objective; ours against BertForMaskedLM

def bench_step(args, device, tmp):
    """One train.py run per (size, objective); mlm first, whose checkpoint the two-phase
    objectives distil from (mlsm: a dictionary of random unit atoms; fista100 takes 100 steps
    whatever the atoms). Beside tokens/s: the recompilations torch.compile logged (dynamo's
    TORCH_LOGS=recompiles) and, for mlsm, a batch's coding time alone (coder_ms) and its share
    of a step's time (code_share; coder_seconds)."""
    k = max(1, args.steps // 5)  # steps per log interval: 5 intervals, the first not timed
    for size in args.sizes:
        base = None
        for objective in args.objectives:
            run = Path(tmp) / f"{objective}_{size}"
            flags = ["--objective", objective, "--data", args.data, "--size", size,
                     "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
                     "--max-steps", str(5 * k), "--log-every", str(k),
                     "--eval-every", "100000", "--save-every", "100000",
                     "--device", device.type, "--out-dir", str(run)]
            if objective != "mlm":
                if base is None:
                    raise SystemExit("error: bench step needs mlm first in --objectives (it is "
                                     "the reference and the teacher)")
                if objective not in ("mlm", "boot"):  # a two-phase objective: phase 2 alone
                    flags += ["--teacher", str(Path(tmp) / f"mlm_{size}" / "ckpt.pt")]
            if objective.startswith("mlsm"):
                cfg = ModelConfig(**PRESETS[size])
                g = torch.Generator().manual_seed(0)
                D = torch.randn(cfg.d_model, args.mlsm_k, generator=g)
                path = Path(tmp) / f"dict_{size}.pt"
                sparse.save_dictionary(path, D / D.norm(dim=0), layer=cfg.n_layer)
                flags += ["--dict", str(path), "--mlsm-k", str(args.mlsm_k)]
            for flag in ("compile", "bf16"):
                if getattr(args, flag) is not None:
                    flags.append(f"--{flag}" if getattr(args, flag) else f"--no-{flag}")
            r = subprocess.run([sys.executable, str(REPO / "train.py"), *flags],
                               capture_output=True, text=True,
                               env={**os.environ, "TORCH_LOGS": ",".join(filter(None, (
                                   os.environ.get("TORCH_LOGS"), "recompiles")))})
            if r.returncode:
                raise SystemExit(f"error: train.py --objective {objective} --size {size} "
                                 f"failed:\n{r.stderr[-2000:]}")
            log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
            tps = [e["tok_per_s"] for e in log if "tok_per_s" in e][1:]  # the first warms up
            extra = {"peak_mem_gb": max((e.get("peak_mem_gb", 0) for e in log), default=0),
                     "recompiles": r.stderr.count("Recompiling function")}
            if objective.startswith("mlsm"):  # the coder timed alone, not inside the step
                coder = coder_seconds(args, device, D)
                step_s = args.batch_size * args.seq_len / statistics.median(tps)
                extra.update(coder_ms=1e3 * coder, code_share=coder / step_s)
            if device.type == "cuda" and objective == "mlm":
                cfg = ModelConfig(**PRESETS[size], vocab_size=V)
                extra["mfu"] = mfu(cfg, args.seq_len, statistics.median(tps), device)
            reference = ("mlm", base) if objective != "mlm" else ("-", None)
            case = f"{objective} {size} {args.batch_size}x{args.seq_len}"
            yield row("step", case, "tokens/s", tps, *reference, **extra)
            if objective == "mlm":
                base = tps


def coder_seconds(args, device, D) -> float:
    """Seconds of one batch's fista100 targets, timed alone: mask_capacity's B int(p T) unit
    vectors (mlsm's uniform masking) against D, compiled where train.py compiles the step.
    Timing it inside the step would split the step's compiled graph."""
    C = mask_capacity(args.batch_size, args.seq_len, 0.15)
    g = torch.Generator().manual_seed(0)
    H = F.normalize(torch.randn(C, D.shape[0], generator=g), dim=-1).to(device)
    D = D.to(device)
    L = torch.linalg.matrix_norm(D, ord=2) ** 2
    momentum = sparse.fista_momentum(100, device)  # as train.py passes them: graph inputs
    code = lambda: sparse.fista_fixed(H, D, sparse.DictConfig().lam, 100, L, momentum)
    if use_compile(device, args.compile):
        code = torch.compile(code)
    return 1 / statistics.median(rates(code, 1, device, 2, 5))


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


def mlm_batch(B, T, device):
    """A fixed random MLM batch on device: ids (B, T), masked (B, T) bool (15%), the inputs
    with [MASK] there, and an all-ones attention mask."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(len(SPECIALS), V, (B, T), generator=g)
    masked = torch.rand(B, T, generator=g) < 0.15
    inp = ids.masked_fill(masked, MASK)
    att = torch.ones(B, T, dtype=torch.long)
    return ids.to(device), masked.to(device), inp.to(device), att.to(device)


def bench_bert(args, device, tmp):
    """Our MLM step against BertForMaskedLM's at the same shape, the two timed alternately (so a
    slow spell of the machine hits both). --variants adds, per size, ours with absolute positions
    and both models without dropout: what the relative positions and dropout cost."""
    try:
        from transformers import BertConfig, BertForMaskedLM
    except ImportError:
        print("note: transformers is not installed; the BertForMaskedLM rows are skipped (it is "
              "never a requirement)")
        return
    B, T = args.batch_size, args.seq_len
    warmup, repeat = (1, 3) if args.quick else (3, 10)
    bf16 = use_bf16(device, args.bf16)
    fused = {"fused": True} if device.type == "cuda" else {}
    ids, masked, inp, att = mlm_batch(B, T, device)
    targets, labels = ids[masked], torch.where(masked, ids, -100)
    variants = [("", {}, bf16)]
    if args.variants:
        variants += [(", absolute positions", {"position": "absolute"}, bf16),
                     (", dropout 0 (both)", {"dropout": 0.0}, bf16)]
        if not bf16:
            variants.append((", bf16 autocast (both)", {}, True))
    for size in args.sizes:
        for name, change, half in variants:
            amp = autocast(device, half)
            cfg = ModelConfig(**{**PRESETS[size], "vocab_size": V, **change})
            ours = Encoder(cfg).to(device).train()
            p = cfg.dropout
            bert = BertConfig(vocab_size=V, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
                              num_attention_heads=cfg.n_head, intermediate_size=cfg.d_ff,
                              max_position_embeddings=cfg.max_position, hidden_dropout_prob=p,
                              attention_probs_dropout_prob=p)
            theirs = BertForMaskedLM(bert).to(device).train()
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, **fused) for m in (ours, theirs)]
            if args.compile:  # both or neither; compiling happens in the warm-up steps
                ours.compile()
                theirs.compile()

            def step_ours():
                with amp:
                    _, logits = ours(inp, att, predict=masked)  # the MLM head on masked positions
                F.cross_entropy(logits.float(), targets).backward()
                opts[0].step()
                opts[0].zero_grad(set_to_none=True)

            def step_theirs():
                with amp:
                    loss = theirs(input_ids=inp, attention_mask=att, labels=labels).loss
                loss.backward()
                opts[1].step()
                opts[1].zero_grad(set_to_none=True)

            a, b = alternate(step_ours, step_theirs, B * T, device, warmup, repeat)
            name += ", compiled (both)" if args.compile else ""
            params = f"{ours.num_params() / 1e6:.1f}M vs {theirs.num_parameters() / 1e6:.1f}M"
            case = f"mlm step {size} {B}x{T}{name} ({params} params)"
            yield row("bert", case, "tokens/s", a, "BertForMaskedLM", b,
                      flops_ratio=flops_per_token(cfg, T) / bert_flops_per_token(cfg, T))
            if args.profile:
                PROFILES[f"bert: {case}"] = {"ours": profile_ops(step_ours, device),
                                             "BertForMaskedLM": profile_ops(step_theirs, device)}


def alternate(fn_a, fn_b, work, device, warmup, repeat):
    """rates() of two functions called in turn, so that a slow spell of the machine hits both."""
    a, b = [], []
    for i in range(warmup + repeat):
        a += rates(fn_a, work, device, int(i < warmup), int(i >= warmup))
        b += rates(fn_b, work, device, int(i < warmup), int(i >= warmup))
    return a, b


PROFILES = {}  # case -> {model: top operators of one step}, with --profile; saved in bench.json


def profile_ops(fn, device, top=15) -> list[dict]:
    """The operators of one call of fn, by self time (torch.profiler; device time on a GPU):
    op, ms, calls, share of the call's total."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = sorted(prof.key_averages(), key=lambda e: -getattr(e, attr))
    total = sum(getattr(e, attr) for e in ops)
    return [{"op": e.key, "ms": getattr(e, attr) / 1e3, "calls": e.count,
             "share": getattr(e, attr) / total} for e in ops[:top]]


def print_profiles():
    for case, models in PROFILES.items():
        for name, ops in models.items():
            print(f"\n{case}, {name}: one step's top operators by self time")
            for o in ops:
                print(f"  {o['op'][:44]:44s} {o['ms']:9.1f} ms {o['share']:6.1%} "
                      f"{o['calls']:5d} calls")


# ---------------------------------------------------------------------------------------------
def bench_ltg(args, device, tmp):
    """Our MLM step against LTG-BERT's model code (tests/ltg_bert.py) with the same weights, the
    two timed alternately; max_abs_diff: their logits against ours in float32, dropout off."""
    B, T = args.batch_size, args.seq_len
    warmup, repeat = (1, 3) if args.quick else (3, 10)
    amp = autocast(device, args.bf16)
    fused = {"fused": True} if device.type == "cuda" else {}
    ids, masked, inp, att = mlm_batch(B, T, device)
    # theirs predicts in (T, B) order, ours in (B, T): `back` puts their rows in our order
    back = torch.arange(B * T, device=device).view(B, T).t()[masked.t()].argsort()
    for size in args.sizes:
        cfg = ModelConfig(**PRESETS[size], vocab_size=V)
        ours = Encoder(cfg).to(device).eval()
        theirs = LtgBert(cfg).to(device).eval()
        theirs.load_state_dict(ours.state_dict())
        with torch.no_grad():
            diff = (ours(inp, att, predict=masked)[1] - theirs(inp, att, masked)[back]).abs()
        opts = [torch.optim.AdamW(m.train().parameters(), lr=1e-4, **fused)
                for m in (ours, theirs)]
        if args.compile:
            ours.compile()
            theirs.compile()

        def step(model, opt, logits, targets):
            with amp:
                out = logits(model)
            F.cross_entropy(out.float(), targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step_ours = lambda: step(ours, opts[0], lambda m: m(inp, att, predict=masked)[1],
                                 ids[masked])
        step_ltg = lambda: step(theirs, opts[1], lambda m: m(inp, att, masked),
                                ids.t()[masked.t()])
        a, b = alternate(step_ours, step_ltg, B * T, device, warmup, repeat)
        case = f"mlm step {size} {B}x{T}" + (", compiled (both)" if args.compile else "")
        yield row("ltg", case, "tokens/s", a, "LTG-BERT model code", b,
                  max_abs_diff=diff.max().item())
        if args.profile:
            PROFILES[f"ltg: {case}"] = {name: profile_ops(fn, device) for name, fn in
                                        (("ours", step_ours), ("LTG-BERT model code", step_ltg))}



# ---------------------------------------------------------------------------------------------
# Relative attention: the model's gather path against other ways to compute the same thing

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

# ---------------------------------------------------------------------------------------------
# EMA, PLL scoring, sparse coding, the sampler

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
    batched = lambda: evaluate.pll(model, seqs, [1.0], False, evaluate.BATCH_TOKENS[device.type],
                                   device, starts, progress=False)
    for size in args.sizes:
        model = Encoder(ModelConfig(**PRESETS[size], vocab_size=V)).to(device).eval()
        _, _, lp = evaluate.token_logprobs(model, seqs, [1.0], False,
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
        # the same scorer with relative attention through flex (model.use_flex)
        toggled = lambda on: lambda: (use_flex(model, on), batched())[1]
        diff = float(abs(toggled(True)() - toggled(False)()).max())
        a, b = alternate(toggled(True), toggled(False), n, device, *reps)
        yield row("pll", f"{size}, {n} sentences of 8-24 tokens, flex_attention",
                  "sentences/s", a, "gather path", b, max_abs_diff=diff)


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
            raise SystemExit(f"error: synth.py failed:\n{r.stderr[-2000:]}")
        speeds.append(json.loads((out / "stats.json").read_text())["sentences_per_s"])
    yield row("sampler", f"PCFG from French UD, {n} sentences, zipf", "sentences/s", speeds)


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


BENCHES = {"step": bench_step, "bert": bench_bert, "ltg": bench_ltg, "attn": bench_attn,
           "ema": bench_ema, "pll": bench_pll, "sparse": bench_sparse, "sampler": bench_sampler,
           "compile": bench_compile}


# ---------------------------------------------------------------------------------------------
# The table

MAIN = ("bench", "case", "unit", "ours", "min", "max", "reference", "ref", "ratio")  # columns


def fmt(x):
    return "-" if x is None else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table(saved: dict) -> str:
    """The markdown table of a bench.json: a heading line and one row per measurement."""
    lines = [f"bench.py on {saved['machine']}, torch {saved['torch']}, {saved['date']}; "
             f"median [min, max] of repetitions", "",
             "| bench | case | ours | unit | reference | reference's | ours / ref | other |",
             "|---|---|---|---|---|---|---|---|"]
    for r in saved["rows"]:
        other = ", ".join(f"{k} {fmt(v) if isinstance(v, float) else v}" for k, v in r.items()
                          if k not in MAIN and v is not None)
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {r['bench']} | {r['case']} | {fmt(r['ours'])} [{fmt(r['min'])}, "
                     f"{fmt(r['max'])}] | {r['unit']} | {r['reference']} | {fmt(r['ref'])} | "
                     f"{ratio} | {other} |")
    return "\n".join(lines)


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add = ap.add_argument
    add("--device", default="auto", choices=("auto", "cpu", "cuda"),
        help="auto = cuda if available (default auto)")
    add("--quick", action="store_true",
        help="tiny shapes and few repetitions: seconds, for the tests")
    add("--only", default=",".join(BENCHES),
        help=f"comma-separated benches (default all: {','.join(BENCHES)})")
    add("--sizes", default=None,
        help="model presets (default tiny on CPU, tiny,small,base on CUDA)")
    add("--objectives", default="mlm,boot,kd+mlm,mlsm+mlm",
        help="step: train.py objectives, mlm first; the two-phase ones run phase 2 alone, "
        "taught by mlm's run (default mlm,boot,kd+mlm,mlsm+mlm)")
    add("--steps", type=int, default=10,
        help="step: optimizer steps per train.py run, in 5 log intervals (rounded down to a "
        "multiple of 5, at least 5); the first warms up, 4 are timed (default 10; a few hundred "
        "on a GPU, past torch.compile's warm-up)")
    add("--data", default="babylm_10m", help="step: train.py --data (default babylm_10m)")
    add("--batch-size", type=int, default=None,
        help="step, bert: sequences per step (default 32 on CPU, 128 on CUDA; --quick 4)")
    add("--seq-len", type=int, default=128,
        help="step, bert: tokens per sequence (default 128; --quick 32)")
    add("--mlsm-k", type=int, default=sparse.DictConfig().k,
        help=f"step: mlsm dictionary atoms (default {sparse.DictConfig().k}, train.py's)")
    add("--variants", action="store_true", help="bert: also ours with absolute positions, both "
        "without dropout, and both in bf16")
    add("--profile", action="store_true", help="bert, ltg: also profile one step of each model "
        "and print its top operators by self time (saved in bench.json)")
    add("--sparse-all", action="store_true",
        help="sparse: also scikit-learn's lasso_lars and our plain FISTA (slow)")
    add("--compile", action=argparse.BooleanOptionalAction, default=None,
        help="step: train.py --compile / --no-compile (default: train.py's own, on with CUDA); "
        "bert: --compile compiles both models")
    add("--bf16", action=argparse.BooleanOptionalAction, default=None,
        help="step, bert: bfloat16 autocast (default on with CUDA, off on the CPU; --variants "
        "adds a bf16 row on the CPU)")
    add("--out", default="bench.json", help="where to write the rows (default bench.json)")
    add("--table", default=None, help="print the table of this bench.json and stop")
    args = ap.parse_args(argv)
    if args.table:
        if not Path(args.table).is_file():
            raise SystemExit(f"error: --table {args.table}: no such file")
        saved = json.loads(Path(args.table).read_text())
        print(table(saved))
        return saved["rows"]
    device = pick_device(args.device)
    cpu = device.type == "cpu"
    args.sizes = (args.sizes or ("tiny" if args.quick or cpu else "tiny,small,base")).split(",")
    args.objectives = args.objectives.split(",")
    args.batch_size = args.batch_size or (4 if args.quick else 32 if cpu else 128)
    if args.quick:
        args.seq_len, args.steps = min(args.seq_len, 32), min(args.steps, 5)
    unknown = set(args.only.split(",")) - set(BENCHES)
    if unknown:
        raise SystemExit(f"error: --only {','.join(sorted(unknown))}: not one of "
                         f"{','.join(BENCHES)}")
    rows = []
    machine = torch.cuda.get_device_name(device) if not cpu else cpu_name()
    saved = {"machine": machine, "device": device.type, "torch": torch.__version__,
             "date": str(datetime.date.today()), "args": vars(args), "rows": rows}

    def write():  # after every row: a run cut off by a time limit keeps what it measured
        saved.update({"profiles": PROFILES} if PROFILES else {})
        tmp_out = Path(f"{args.out}.tmp")
        tmp_out.write_text(json.dumps(saved, indent=1))
        tmp_out.replace(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            t = time.time()
            for r in BENCHES[name](args, device, tmp):
                rows.append(r)
                write()
                print(f"{name}: {r['case']}: {fmt(r['ours'])} {r['unit']}"
                      + (f", {r['ratio']:.2f}x {r['reference']}" if r["ratio"] else ""),
                      file=sys.stderr)
            print(f"{name}: {time.time() - t:.0f}s", file=sys.stderr)
    write()
    if PROFILES:
        print_profiles()
    print("\n" + table(saved))
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
