"""Faster stand-ins for model.py's relative attention, each exact where it is used: through
flex_attention (off by default: slower on the CPU, not yet measured on a GPU; docs/bench.md), and
through the fused Triton kernels of the disentangled-flash package (CUDA only, an optional
package: requirements-kernels.txt). Tests hold each to its plain definition (tests/test_model.py).
"""
import importlib.util

import torch
import torch.nn.functional as F


_FLEX = {}  # device type -> flex_attention, compiled
_FUSED = {}  # "attention" -> disentangled_flash's training_attention, once imported
FUSED_PACKAGE = "disentangled-flash==1.1.1"  # the version whose kernel contract is read below


def flex_relative(q, k, v, qp, kp, idx, bias, scale):
    """softmax((q k^T + relative_scores) * scale + bias) v without any (B, H, T, T) tensor:
    flex_attention (Dong et al. 2024) fuses the softmax with a score_mod that adds each pair's
    position terms read from (B, H, T, R) tables, so a pair costs two lookups instead of a
    gathered score and a bias in memory. q, k, v (B, H, T, hd); qp, kp (H, R, hd); idx (B or 1,
    1, T, T) buckets; bias (B, 1, 1, T). No dropout on the probabilities: Attention uses this
    only where it drops none. Gradients reach q, k, qp, kp through the tables on CUDA; torch's
    flex has no backward on the CPU. Compiled once per device into _FLEX (tests put flex's
    uncompiled reference path there, which computes in float64)."""
    # scaled here: a Python float inside score_mod becomes a symbolic input when compiled
    # with dynamic shapes, which flex's CPU lowering refuses
    c2p, p2c = (q @ kp.transpose(-1, -2)) * scale, (k @ qp.transpose(-1, -2)) * scale  # (B,H,T,R)
    keys = bias[:, 0, 0]                                              # (B, T)
    shared = idx.shape[0] == 1
    # contiguous: inductor's CPU flex template fails to build for strided inputs or tables, such
    # as a slice of the (max_position, max_position) buckets (torch 2.13)
    rows = (idx[0, 0] if shared else idx[:, 0]).contiguous()          # (T, T) or (B, T, T)
    if q.device.type == "cpu":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()

    def score_mod(score, b, h, i, j):
        r = rows[i, j] if shared else rows[b, i, j]
        return score + keys[b, j] + c2p[b, h, i, r] + p2c[b, h, j, r]

    if q.device.type not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        # on the CPU one graph per shape: inductor's CPU template with dynamic shapes failed to
        # build on a recompile, for a new head count or length (torch 2.13)
        cpu = q.device.type == "cpu"
        _FLEX[q.device.type] = torch.compile(flex_attention, dynamic=False if cpu else None)
    return _FLEX[q.device.type](q, k, v, score_mod=score_mod, scale=scale)


def fused_unavailable(device, head_dim: int = 64) -> str | None:
    """Why fused_relative cannot run on `device` with heads of `head_dim`, or None when it can."""
    if device.type != "cuda":
        return "the fused attention kernels need CUDA"
    if head_dim not in (32, 64, 128):
        return f"the fused attention kernels take heads of 32, 64 or 128 dimensions, not {head_dim}"
    try:
        if importlib.util.find_spec("triton") is None:
            raise ImportError("no module named 'triton'")
        from disentangled_flash.training._kernels import training_attention
    except ImportError as e:
        return (f"the fused attention needs Triton and {FUSED_PACKAGE} ({e}); pip install -r "
                "requirements-kernels.txt")
    _FUSED.setdefault("attention", training_attention)
    return None


def fused_relative(q, k, v, qp, kp, idx, keep, scale, dropout_p: float):
    """softmax((q k^T + relative_scores) * scale), keys where keep is False masked, dropped
    with dropout_p, @ v, in the fused kernels of disentangled-flash (Triton; a DeBERTa-style
    flash attention: no (B, H, T, T) tensor, the dropout mask regenerated in the backward).
    Its contract (disentangled_flash/kernel.py, 1.1.1): pair (i, j) reads slot s of the
    position tables, s = slots[i - j + T - 1] for one map shared by the batch, or slots[b, i, j];
    c2p = q_i . pos_key[s], p2c = k_j . pos_query[s], the same slot for both, as ours (DeBERTa's
    p2c index is -r(j, i) = r(i, j): symmetric buckets). q, k, v (B, H, T, hd), hd 32, 64 or
    128; qp, kp (H, R, hd); idx (B or 1, 1, T, T) rows of the relative table; keep (B, T) bool.
    Returns (B, H, T, hd) as a view of its (B, T, H*hd) output. A padded query row attends to
    every key uniformly (Hugging Face's rule) where ours attends to the real keys: a padded
    position's own output differs, never a real one's."""
    B, H, T, hd = q.shape
    if idx.shape[0] == 1:  # a Toeplitz map: the row of each offset i - j = -(T-1) .. T-1
        pair = idx[0, 0]
        slots = torch.cat([pair[0].flip(0), pair[1:, 0]])                   # (2T - 1,)
    else:                  # BootBERT's MAE student: each row's tokens at their own positions
        slots = idx[:, 0].expand(B, T, T)                                  # (B, T, T)
    rows = -kp.shape[1] % 8  # Hopper's fast GEMMs want 16-byte rows: zero rows never read
    kp, qp = (F.pad(t, (0, 0, 0, rows)) for t in (kp, qp))
    y = _FUSED["attention"](q, k, v, kp, qp, slots.int().contiguous(), keep.contiguous(),
                            score_scale=scale, has_padding=True, strict_fp32=True,
                            dropout_p=dropout_p)                             # (B, T, H*hd)
    return y.view(B, T, H, hd).transpose(1, 2)
