"""bench.py's operation rows: the relative-attention core against other ways to compute it
(`attn`) and the fused EMA update (`ema`). (The rows of sparse.py's coder, `sparse` and
`compile`, are bench.py's own: sparse.py is a library above this folder.)

    python bench.py --only attn,ema
"""
import copy
import math

import torch
import torch.nn.functional as F

from benchmarks.timing import alternate, rates, row
from data.prepare import VOCAB_SIZE
from machinery.plumbing import use_bf16
from machinery.kernels import flex_relative, fused_relative, fused_unavailable
from model import (PRESETS, Encoder, ModelConfig, fused_plan, relative_buckets,
                   relative_scores)
from training.optim import ema_update


V = VOCAB_SIZE


def skew(a):
    """(..., T, 2T - 1) -> (..., T, T), out[i, j] = a[i, j - i + T - 1]: a row's scores by
    offset, read off by flattening and re-slicing (Dai et al. 2019's relative shift; views only)."""
    T = a.shape[-2]
    if T == 1:
        return a
    return a.flatten(-2)[..., T - 1:T - 1 + T * (2 * T - 2)].unflatten(-1, (T, 2 * T - 2))[..., :T]


def attention_variants(device, cfg: ModelConfig):
    """{name: fn(q, k, v, qp, kp, idx, keep, scale) -> (B, H, T, hd)}, dropout off: q, k, v
    (B, H, T, hd); qp, kp (H, R, hd) projected position vectors; idx (T, T) buckets of cfg's
    scheme; keep (B, T) bool, False at padding. `gather` is model.Attention's default, the gather
    in float32, `one-hot` and `fused` (CUDA, with disentangled-flash) its other forms."""
    def bias_of(keep):
        return torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, float("-inf"))

    def gather(q, k, v, qp, kp, idx, keep, scale, backend=None, pick="gather"):
        scores = relative_scores(q, k, qp, kp, idx[None, None], pick)
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

    def fused(q, k, v, qp, kp, idx, keep, scale):
        plan = fused_plan(q.shape[2], cfg.position_buckets, cfg.max_position, str(q.device))
        return fused_relative(q, k, v, qp, kp, idx[None, None], keep, scale, 0.0, plan)

    out = {"gather": gather,
           "gather in float32 (--attention gather-fp32)": lambda *a: gather(
               *a, pick="gather-fp32"),
           "one-hot pick (--attention onehot)": lambda *a: gather(*a, pick="onehot"),
           "by offset (relative shift)": by_offset,
           "flex_attention (kernels.flex_relative)": flex}
    if fused_unavailable(device, cfg.d_model // cfg.n_head) is None:  # --attention fused
        out["fused (--attention fused, disentangled-flash)"] = fused
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend
        out["gather, SDPA efficient kernel"] = lambda *a: gather(
            *a, backend=SDPBackend.EFFICIENT_ATTENTION)
    return out


def bench_attn(args, device, tmp):
    """One attention layer's core, forward and backward, dropout off, a quarter of the rows
    padded at the end (their padded query rows left out: never read): each variant against the
    gather path, with the largest difference from it in the output and in every gradient
    (max_abs_diff). A variant that fails says why."""
    B, T = args.batch_size, args.seq_len
    warmup, repeat = (1, 2) if args.quick else (3, 10)
    dtype = torch.bfloat16 if use_bf16(device, args.bf16) else torch.float32
    for size in args.sizes:
        cfg = ModelConfig(**PRESETS[size])
        variants = attention_variants(device, cfg)
        H, hd, R = cfg.n_head, cfg.d_model // cfg.n_head, 2 * cfg.position_buckets - 1
        g = torch.Generator().manual_seed(0)
        make = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()
        inputs = [make(B, H, T, hd) for _ in range(3)] + [make(H, R, hd) for _ in range(2)]
        idx = relative_buckets(T, cfg.position_buckets, cfg.max_position).to(device)
        keep = torch.ones(B, T, dtype=torch.bool, device=device)
        keep[: B // 4, T * 3 // 4:] = False
        real = keep[:, None, :, None]  # the rows compared (fused gives padded ones another rule)
        grad = torch.randn(B, H, T, hd, generator=g).to(device, dtype)
        scale = 1 / math.sqrt(3 * hd)

        def run(fn, backward=True):
            for t in inputs:
                t.grad = None
            if not backward:
                with torch.no_grad():
                    return [fn(*(t.detach() for t in inputs), idx, keep, scale) * real]
            y = fn(*inputs, idx, keep, scale) * real  # a padded query row is never read
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
