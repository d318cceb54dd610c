"""LTG-BERT's model code, re-implemented from reading ltgoslo/ltg-bert (babylm/train/model.py,
commit 4fe9e6f): the reference for bench.py's `ltg` rows and tests/test_model.py. Its layout
(sequence first), its order of work (each pair's position vectors gathered first, a (T, T, 2D)
tensor, then two einsums), its bucket formula, its masked softmax, its in-place adds and its
per-layer copy of the scores. The function is our Encoder's, so one state dict loads into both
(parameter names follow ours); the work is theirs. A reviewer ran their file against this:
equal logits and gradients. bench.py times forward, backward and AdamW for both, not their
train.py's step.

    python bench.py --only ltg                       # our step against theirs
    python -m pytest -q tests/test_model.py -k ltg   # equal logits and gradients
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class _MaskedSoftmax(torch.autograd.Function):
    """LTG-BERT's: padding to -inf, softmax, padding to 0; the backward reads the output only."""

    @staticmethod
    def forward(ctx, x, mask):  # in place, as theirs
        y = torch.softmax(x.masked_fill_(mask, float("-inf")), -1).masked_fill_(mask, 0.0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, = ctx.saved_tensors
        return torch._softmax_backward_data(grad, y, -1, y.dtype), None


def ltg_buckets(T, buckets, max_position):
    """(T, T) bucket index of query i, key j, by LTG-BERT's make_log_bucket_position."""
    rel = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    mid = buckets // 2
    a = torch.where(rel.abs() < mid, mid - 1, rel.abs()).clamp(max=max_position - 1)
    log_pos = torch.ceil(torch.log(a / mid) / math.log((max_position - 1) / mid)
                         * (mid - 1)).long() + mid
    return torch.where(a <= mid, rel, rel.sign() * log_pos) + buckets - 1


class LtgAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.H, self.d, self.eps = cfg.n_head, cfg.d_model // cfg.n_head, cfg.layer_norm_eps
        self.scale = 1 / math.sqrt(3 * self.d)
        self.qk = nn.Linear(cfg.d_model, 2 * cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.post_norm = nn.LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, pad, rel, idx):  # x (T, B, D), pad (B, 1, 1, T) True at padding
        T, B, D = x.shape
        H, d = self.H, self.d
        h = F.layer_norm(x, (D,), eps=self.eps)
        q, k = self.qk(h).chunk(2, dim=-1)
        q, k, v = (t.reshape(T, B * H, d).transpose(0, 1) for t in (q, k, self.v(h)))
        qp, kp = F.embedding(idx, self.qk(self.drop(rel))).chunk(2, dim=-1)  # (T, T, D) each
        qp, kp = qp.view(T, T, H, d), kp.view(T, T, H, d)
        s = torch.bmm(q, k.transpose(1, 2) * self.scale).view(B, H, T, T)
        q, k = q.view(B, H, T, d), k.view(B, H, T, d)
        s.add_(torch.einsum("bhqd,qkhd->bhqk", q, kp * self.scale))
        s.add_(torch.einsum("bhkd,qkhd->bhqk", k * self.scale, qp))
        s.detach().clone().mean(dim=1)  # their layers return this copy; training drops it
        p = self.drop(_MaskedSoftmax.apply(s, pad))
        y = torch.bmm(p.flatten(0, 1), v).transpose(0, 1).reshape(T, B, D)
        return self.drop(self.post_norm(self.out(y)))


class LtgLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn, self.eps = LtgAttention(cfg), cfg.layer_norm_eps
        self.drop = nn.Dropout(cfg.dropout)
        self.ffn = nn.Module()
        self.ffn.up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.ffn.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x, pad, rel, idx):
        x = x + self.attn(x, pad, rel, idx)
        a, gate = self.ffn.up(F.layer_norm(x, x.shape[-1:], eps=self.eps)).chunk(2, dim=-1)
        a = F.layer_norm(a * F.gelu(gate, approximate="tanh"), a.shape[-1:], eps=self.eps)
        return x + self.drop(self.ffn.down(a))


class LtgBert(nn.Module):
    """Relative positions only. forward(ids (B, T), attention_mask (B, T), predict (B, T) bool)
    -> logits (N, V) of the predicted positions in sequence-major order (T, then B), as
    LTG-BERT's head selects them."""

    def __init__(self, cfg):
        super().__init__()
        D, self.cfg = cfg.d_model, cfg
        self.word = nn.Embedding(cfg.vocab_size, D)
        self.rel = nn.Parameter(torch.zeros(2 * cfg.position_buckets - 1, D))
        self.rel_norm = nn.LayerNorm(D, cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(LtgLayer(cfg) for _ in range(cfg.n_layer))
        norm = lambda: nn.LayerNorm(D, cfg.layer_norm_eps, elementwise_affine=False)
        self.head_in = nn.Sequential(norm(), nn.Linear(D, D), nn.GELU(), norm(),
                                     nn.Dropout(cfg.dropout))
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.register_buffer("buckets", ltg_buckets(cfg.max_position, cfg.position_buckets,
                                                    cfg.max_position), persistent=False)

    def forward(self, ids, attention_mask, predict):
        T, D = ids.shape[1], self.cfg.d_model
        x = self.drop(F.layer_norm(self.word(ids.t()), (D,), eps=self.cfg.layer_norm_eps))
        pad = (attention_mask == 0)[:, None, None, :]
        rel, idx = self.rel_norm(self.rel), self.buckets[:T, :T]
        for layer in self.layers:
            x = layer(x, pad, rel, idx)
        x = x.flatten(0, 1).index_select(0, predict.t().flatten().nonzero().squeeze(1))
        return F.linear(self.head_in(x), self.word.weight, self.head_bias)
