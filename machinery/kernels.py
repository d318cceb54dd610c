"""Faster stand-ins for model.py's relative attention, each exact where it is used: through
flex_attention (off by default; its timings: docs/bench.md), and
through the fused Triton kernels of the disentangled-flash package (CUDA only, an optional
package: requirements-kernels.txt). Tests hold each to its plain definition (tests/test_model.py).
"""
import importlib.util

import torch
import torch.nn.functional as F


_FLEX = {}  # device type -> flex_attention, compiled
_FUSED = {}  # "attention" -> disentangled_flash's training op, once imported (fused_kernels)
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


def fused_kernels():
    """disentangled-flash's differentiable training attention op, once imported (ImportError if
    Triton or the package is missing): torch.ops.disentangled_flash.training_attention_forward,
    a torch.library.triton_op whose backward (two Triton kernels and the position tables' GEMMs)
    the package registers as its autograd formula."""
    if "attention" not in _FUSED:
        if importlib.util.find_spec("triton") is None:
            raise ImportError("no module named 'triton'")
        import disentangled_flash.training._kernels  # noqa: F401  (registers the op)
        _FUSED["attention"] = torch.ops.disentangled_flash.training_attention_forward
    return _FUSED["attention"]


def fused_unavailable(device, head_dim: int = 64) -> str | None:
    """Why fused_relative cannot run on `device` with heads of `head_dim`, or None when it can."""
    if device.type != "cuda":
        return "the fused attention kernels need CUDA"
    if head_dim not in (32, 64, 128):
        return f"the fused attention kernels take heads of 32, 64 or 128 dimensions, not {head_dim}"
    try:
        fused_kernels()
    except ImportError as e:
        return (f"the fused attention needs Triton and {FUSED_PACKAGE} ({e}); pip install -r "
                "requirements-kernels.txt")
    return None


def toeplitz_plan(slots: list[int], device: str) -> tuple:
    """What the fused kernels read for a bucket map shared by the batch, made on the host from the
    bucket of each offset i - j = -(T-1) .. T-1 (slots, monotone in the offset): (slots (2T - 1,)
    int32 on `device`, low, high, columns (C,) int64 on `device`), the last three the package's
    GradientBand (disentangled_flash/position.py): every offset strictly inside (low, high) gets
    its own column of the position gradient, the offsets at or beyond either end share the end
    slots' two columns, so the backward kernels write each (row, offset) gradient once, without
    atomics, and a (C, R) one-hot GEMM folds the columns into the table's slots."""
    from disentangled_flash.position import gradient_band
    s = torch.tensor(slots, dtype=torch.int32)
    low, high, columns = gradient_band(s, torch.device(device))
    return s.to(device), int(low), int(high), columns


@torch.compiler.assume_constant_result
def launch_configs(T: int, head_dim: int, dtype: str, device: str) -> tuple:
    """The fused kernels' tiles, explicit: (block_m, block_n, warps, stages) for the forward, the
    dQ and the dK/dV kernels, from the package's heuristic (tuning.heuristic_config: the workload
    and the GPU's limits, no benchmarking). The package's default autotunes its backward kernels
    with configs whose pre_hook zeroes the atomic outputs, which torch.compile refuses to trace
    ("pre_hook and post_hook are not supported in triton.Autotune or triton.Config"); with every
    config given, the plain kernels run. assume_constant_result: torch.compile calls this once
    while tracing and keeps the numbers; the batch is left out (as the package does under
    compile), so no tile shrinks for a small batch, and so is dropout (the heuristic ignores it)."""
    from disentangled_flash.tuning import heuristic_config
    limits = gpu_limits(device)
    phases = ("training_forward", "backward_dq", "backward_dkv")
    picked = [heuristic_config(phase=ph, sequence_length=T, head_dim=head_dim, dtype=dtype,
                               batch_heads=None, resources=limits) for ph in phases]
    return tuple((c.block_m, c.block_n, c.num_warps, c.num_stages) for c in picked)


def gpu_limits(device: str):
    """The package's DeviceResources of `device` (shared memory per block, SMs, compute
    capability), read from CUDA: what the tile heuristic sizes its tiles against."""
    from disentangled_flash.tuning import DeviceResources
    return DeviceResources.current(torch.device(device))


def fused_relative(q, k, v, qp, kp, idx, keep, scale, dropout_p: float, plan=None):
    """softmax((q k^T + relative_scores) * scale), keys where keep is False masked, dropped
    with dropout_p, @ v, in the fused kernels of disentangled-flash (Triton; a DeBERTa-style
    flash attention: no (B, H, T, T) tensor, the dropout mask regenerated in the backward).
    Its contract (disentangled_flash/kernel.py, 1.1.1): pair (i, j) reads slot s of the
    position tables, s = slots[i - j + T - 1] for one map shared by the batch, or slots[b, i, j];
    c2p = q_i . pos_key[s], p2c = k_j . pos_query[s], the same slot for both, as ours (DeBERTa's
    p2c index is -r(j, i) = r(i, j): symmetric buckets). q, k, v (B, H, T, hd), hd 32, 64 or
    128; qp, kp (H, R, hd); idx (B or 1, 1, T, T) rows of the relative table; keep (B, T) bool;
    plan: toeplitz_plan of a shared idx (its slots and gradient band; model.fused_plan), None
    for per-row maps (BootBERT's compact MAE student), whose position gradients the kernels
    then accumulate with float32 atomics.
    Returns (B, H, T, hd) as a view of its (B, T, H*hd) output. A padded query row attends to
    every key uniformly (Hugging Face's rule) where ours attends to the real keys: a padded
    position's own output differs, never a real one's."""
    B, H, T, hd = q.shape
    if plan is not None:
        slots, low, high, columns = plan                                   # (2T - 1,), (C,)
    else:  # BootBERT's MAE student: each row's tokens at their own positions
        slots = idx[:, 0].expand(B, T, T).int().contiguous()               # (B, T, T)
        low, high, columns = 0, 0, torch.empty(0, dtype=torch.long, device=q.device)
    rows = -kp.shape[1] % 8  # Hopper's fast GEMMs want 16-byte rows: zero rows never read
    kp, qp = (F.pad(t, (0, 0, 0, rows)) for t in (kp, qp))
    tiles = launch_configs(T, hd, str(q.dtype).removeprefix("torch."), str(q.device))
    # a fresh seed per call, drawn on the device (no host sync); the backward regenerates the
    # mask from it
    seed = (torch.randint(0, 2 ** 62, (1,), device=q.device) if dropout_p > 0
            else torch.empty(0, dtype=torch.int64, device=q.device))
    names = ("block_m", "block_n", "num_warps", "num_stages")
    y, _ = fused_kernels()(
        query=q, key=k, value=v, pos_key=kp, pos_query=qp, delta_to_local=slots,
        attention_mask=keep.contiguous(), score_scale=scale, has_padding=True, has_c2p=True,
        has_p2c=True, strict_fp32=True, store_lse=torch.is_grad_enabled(),
        dropout_p=float(dropout_p), dropout_seed=seed, band_low=low, band_high=high,
        column_slots=columns, autotune_bundle_id=0,  # unused: every tile given
        **{f"{phase}_{n}": x for phase, tile in zip(("forward", "dq", "dkv"), tiles)
           for n, x in zip(names, tile)})                                  # (B, T, H*hd)
    return y.view(B, T, H, hd).transpose(1, 2)
