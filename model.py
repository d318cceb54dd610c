"""The one encoder every objective trains: an LTG-BERT-style masked language model.

    from model import load_checkpoint
    model, tok = load_checkpoint("runs/mlm/ckpt.pt", "cuda")
    ids = torch.tensor([[2] + tok.encode("the cat sat") + [3]])     # [CLS] ... [SEP]
    logits = model.logits(ids, torch.ones_like(ids))               # (B, T, vocab)

Architecture (Samuel et al. 2023, "Trained on 100 million words and still in shape: BERT meets
British National Corpus", EACL Findings; code: ltgoslo/ltg-bert), read against BERT:
  - the word embedding is LayerNorm-ed (no affine) before the first layer;
  - each attention sublayer has a pre-LN (no affine) and a post-LN (affine) inside the residual
    branch: x + LN_post(Attn(LN_pre(x)));
  - the feed-forward is GEGLU with a LayerNorm between its two projections:
    x + W2 LN(W1a x * gelu(W1b x)), where x is LN_pre-ed first; no biases;
  - positions are `relative` (default): DeBERTa-style disentangled attention whose content-to-
    position and position-to-content scores use log-bucketed relative offsets, with the position
    vectors projected by the same query/key map as the content; or `absolute`: a learned table
    added to the word embeddings (the synthetic-transfer experiments reset it);
  - the MLM head (LN, dense, GELU, LN, decoder) has its decoder tied to the word embeddings and
    runs only on the positions asked for.
Attention runs through F.scaled_dot_product_attention; the position scores and the padding mask
enter as its additive bias, so padded keys get probability 0 and never change a real position
(by hand when training on the CPU, for dropout's cheaper mask there). `use_attention` switches
how relative attention is computed, the same function each way (docs/bench.md times them).

init_weights documents the initialisation of every tensor.
"""
import math
from dataclasses import asdict, dataclass, fields, replace

import sentencepiece as spm
import torch
import torch.nn as nn
import torch.nn.functional as F

from machinery.kernels import flex_relative, fused_relative, toeplitz_plan
from machinery.plumbing import read_checkpoint


@dataclass
class ModelConfig:
    vocab_size: int = 16384       # tokenizer pieces; train.py takes it from the prepared data
    n_layer: int = 12             # transformer layers
    n_head: int = 6               # attention heads (d_model must divide evenly)
    d_model: int = 384            # hidden size
    d_ff: int = 1024              # feed-forward inner size (GEGLU's first projection: 2*d_ff)
    dropout: float = 0.1          # on embeddings, attention probabilities and sublayer outputs
    position: str = "relative"    # relative (log-bucketed, LTG-BERT) or absolute (a learned table)
    position_buckets: int = 32    # relative: offsets up to buckets/2 exact, log-spaced beyond
    max_position: int = 512       # longest sequence the position scheme covers
    layer_norm_eps: float = 1e-7  # LTG-BERT's epsilon
    final_norm: bool = False      # an affine LayerNorm after the last layer (boot's, as boot-bert)


PRESETS = {
    "tiny": dict(n_layer=2, n_head=2, d_model=128, d_ff=384),     # tests and CPU demos
    "small": dict(n_layer=12, n_head=6, d_model=384, d_ff=1024),  # LTG-BERT small
    "base": dict(n_layer=12, n_head=12, d_model=768, d_ff=2048),  # LTG-BERT base
}


def relative_buckets(n: int, buckets: int, max_position: int) -> torch.Tensor:
    """(n, n) long: index into the (2*buckets - 1)-row relative table for query i, key j.

    Offsets d = i - j with |d| <= buckets/2 keep their own row; larger ones share rows whose width
    grows geometrically, reaching the last row at |d| = max_position - 1 (LTG-BERT's scheme).
    """
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    mid = buckets // 2
    a = d.abs().clamp(min=mid, max=max_position - 1).double()  # clamp: log(a/mid) >= 0 below
    log_ratio = torch.log(a / mid) / math.log((max_position - 1) / mid)  # 0 at mid, 1 at the end
    far = mid + torch.ceil(log_ratio * (mid - 1)).long()
    # at |d| = max_position - 1 the ratio is 1 only up to rounding, and torch.log's vectorised and
    # scalar paths can round differently, so an unclamped ceil sometimes gave one bucket too many
    far = far.clamp(max=2 * mid - 1)
    bucket = torch.where(d.abs() <= mid, d, d.sign() * far)
    return bucket + buckets - 1


def relative_scores(q, k, qp, kp, idx, pick: str = "gather"):
    """The content-to-position plus position-to-content scores (B, H, T, T), unscaled:
    q_i.kp[r(i,j)] + k_j.qp[r(i,j)] for q, k (B, H, T, hd), projected position vectors qp, kp
    (H, R, hd) and buckets r = idx (B or 1, 1, T, T): scored against every bucket (B, H, T, R),
    then each pair's picked by `pick`: `gather` (its backward a scatter-add into the buckets:
    atomics on a GPU, bf16 ones under autocast, up to 26 keys of a row per bucket at T = 128);
    `gather-fp32`, the gather on the scores cast to at least float32 (float32 atomics; float32
    scores); `onehot` (a shared idx), a product with idx's (T, T, R) one-hot (matrix products
    both ways, no atomics, 2 B H T^2 R more FLOPs each way); any other (fused, flex where they
    do not apply), the gather. The same numbers each way, up to the order of the sums."""
    B, H, T, _ = q.shape
    c2p, p2c = q @ kp.transpose(-1, -2), k @ qp.transpose(-1, -2)       # (B, H, T, R)
    if pick == "onehot" and idx.shape[0] == 1:
        one = F.one_hot(idx[0, 0], kp.shape[1]).to(q.dtype)               # (Ti, Tj, R)
        return (torch.einsum("bhir,ijr->bhij", c2p, one)
                + torch.einsum("bhjr,ijr->bhij", p2c, one))
    if pick == "gather-fp32":
        wide = torch.promote_types(c2p.dtype, torch.float32)
        c2p, p2c = c2p.to(wide), p2c.to(wide)
    idx = idx.expand(B, H, T, T)
    return c2p.gather(-1, idx) + p2c.gather(-1, idx.transpose(-1, -2)).transpose(-1, -2)


# how relative attention may be computed in training (train.py --attention); `flex` scores only
TRAINING_ATTENTION = ("gather", "gather-fp32", "onehot", "fused")


_FUSED_PLANS = {}  # (T, buckets, max_position, device) -> fused_plan's


@torch.compiler.assume_constant_result
def fused_plan(T: int, buckets: int, max_position: int, device: str) -> tuple:
    """kernels.toeplitz_plan of relative_buckets(T, ...), the map every layer reads when the
    batch shares its positions (Encoder.attention_inputs' top-left T x T of its buckets): made
    on the host once per length and device, outside any step; assume_constant_result:
    torch.compile calls it while tracing and keeps what it returned (the tensors as constants)."""
    key = (T, buckets, max_position, device)
    if key not in _FUSED_PLANS:
        pair = relative_buckets(T, buckets, max_position)
        offsets = torch.cat([pair[0].flip(0), pair[1:, 0]])  # bucket of i - j = -(T-1) .. T-1
        _FUSED_PLANS[key] = toeplitz_plan(offsets.tolist(), device)
    return _FUSED_PLANS[key]


def use_attention(model: nn.Module, form: str = "gather") -> nn.Module:
    """Every Attention of `model` computes relative attention as `gather`, `gather-fp32` or
    `onehot` (relative_scores), `flex` (kernels.flex_relative) where that is exact, or `fused`
    (kernels.fused_relative, CUDA) where the mask is padding alone: the same function."""
    assert form in (*TRAINING_ATTENTION, "flex"), f"unknown attention form {form!r}"
    for m in filter(lambda m: isinstance(m, Attention), model.modules()):
        m.form = form
    return model


def dropout(x, p: float, training: bool = True):
    """F.dropout(x, p, training); on the CPU outside torch.compile its mask is drawn four to a
    64-bit random integer: each 16-bit quarter drops with probability p' = q / 2^16, q = round(p
    2^16), the rest scaled by 1 / (1 - p'). torch's CPU bernoulli_ took 11% of a `small` MLM step
    (bench.py --profile); this mask takes a quarter of its time."""
    if not training or p == 0:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.dropout(x, p, True)
    q = round(p * 2 ** 16)
    if q in (0, 2 ** 16):
        return x if q == 0 else x * 0
    bits = torch.randint(-2 ** 63, 2 ** 63 - 1, ((x.numel() + 3) // 4,), dtype=torch.int64)
    drop = bits.view(torch.int16)[:x.numel()].view(x.shape) < q - 2 ** 15
    return x.masked_fill(drop, 0) * (2 ** 16 / (2 ** 16 - q))  # backward keeps the 1-byte mask


class Dropout(nn.Dropout):
    def forward(self, x):
        return dropout(x, self.p, self.training)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0, "d_model must be a multiple of n_head"
        self.n_head, self.head_dim, self.p = cfg.n_head, cfg.d_model // cfg.n_head, cfg.dropout
        self.relative = cfg.position == "relative"
        self.bucket_scheme = (cfg.position_buckets, cfg.max_position)  # relative_buckets
        # three score terms (content-content, content-position, position-content) share the
        # softmax, so LTG-BERT scales by 1/sqrt(3 d_head) to keep their sum at unit variance
        self.scale = 1 / math.sqrt((3 if self.relative else 1) * self.head_dim)
        self.pre_norm = nn.LayerNorm(cfg.d_model, cfg.layer_norm_eps, elementwise_affine=False)
        self.qk = nn.Linear(cfg.d_model, 2 * cfg.d_model)  # applied to content and position vectors
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.post_norm = nn.LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        self.drop = Dropout(cfg.dropout)
        self.form = "gather"  # use_attention: how relative scores pick each pair's bucket

    def forward(self, x, bias, rel=None, idx=None):
        # x (B, T, D); bias (B, 1, 1 or T, T): 0 at real keys, -inf at padding (and later keys);
        # relative only: rel (R, D) position vectors, idx (B or 1, 1, T, T) bucket of each pair
        (B, T, D), H, hd = x.shape, self.n_head, self.head_dim
        p = self.p if self.training else 0.0  # attention probabilities dropped
        # training on the CPU: SDPA's math by hand, with our dropout mask (SDPA's bernoulli_ costs
        # 4x as much); padding finite, so a row of padding alone gets uniform weights, not NaN
        by_hand = p > 0 and x.device.type == "cpu" and not torch.compiler.is_compiling()
        if by_hand:
            bias = bias.clamp(min=torch.finfo(bias.dtype).min)
        h = self.pre_norm(x)
        q, k = self.qk(h).chunk(2, dim=-1)
        q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in (q, k, self.v(h)))  # (B, H, T, hd)
        if self.relative:
            qp, kp = self.qk(self.drop(rel)).chunk(2, dim=-1)           # (R, D) each
            qp, kp = (t.view(-1, H, hd).transpose(0, 1) for t in (qp, kp))  # (H, R, hd)
        keys = bias.shape[-2] == 1  # a padding mask alone (not causal): flex and fused mask that
        # flex where it computes exactly this: nothing to drop, on the CPU nothing to differentiate
        flex = (self.form == "flex" and self.relative and keys and not p
                and (x.device.type != "cpu" or not torch.is_grad_enabled()))
        fused = self.form == "fused" and self.relative and keys
        if self.relative and not (flex or fused):
            bias = bias + self.scale * relative_scores(q, k, qp, kp, idx, self.form)
        if fused:  # the probabilities dropped inside the kernel, as SDPA's dropout_p drops them
            # a shared idx is always Encoder.buckets[:T, :T] (attention_inputs): its plan
            plan = fused_plan(T, *self.bucket_scheme, str(x.device)) if idx.shape[0] == 1 else None
            y = fused_relative(q, k, v, qp, kp, idx, bias[:, 0, 0] == 0, self.scale, p, plan)
        elif flex:
            y = flex_relative(q, k, v, qp, kp, idx, bias.to(q.dtype), self.scale)
        elif by_hand:
            att = torch.softmax(q @ k.transpose(-1, -2) * self.scale + bias, dim=-1)  # (B,H,T,T)
            y = dropout(att, self.p) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype),
                                               scale=self.scale, dropout_p=p)
        y = y.transpose(1, 2).reshape(B, T, D)
        return self.drop(self.post_norm(self.out(y)))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = nn.LayerNorm(cfg.d_model, cfg.layer_norm_eps, elementwise_affine=False)
        self.up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.mid_norm = nn.LayerNorm(cfg.d_ff, cfg.layer_norm_eps, elementwise_affine=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.drop = Dropout(cfg.dropout)

    def forward(self, x):
        a, gate = self.up(self.pre_norm(x)).chunk(2, dim=-1)  # GEGLU (Shazeer 2020)
        return self.drop(self.down(self.mid_norm(a * F.gelu(gate, approximate="tanh"))))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn, self.ffn = Attention(cfg), FeedForward(cfg)

    def forward(self, x, bias, rel, idx):
        x = x + self.attn(x, bias, rel, idx)
        return x + self.ffn(x)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        assert cfg.position in ("relative", "absolute"), f"unknown position scheme {cfg.position!r}"
        self.config = cfg
        D = cfg.d_model
        self.word = nn.Embedding(cfg.vocab_size, D)
        self.word_norm = nn.LayerNorm(D, cfg.layer_norm_eps, elementwise_affine=False)
        if cfg.position == "relative":
            self.rel = nn.Parameter(torch.empty(2 * cfg.position_buckets - 1, D))
            self.rel_norm = nn.LayerNorm(D, cfg.layer_norm_eps)
        else:
            self.pos = nn.Embedding(cfg.max_position, D)
        self.drop = Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(D, cfg.layer_norm_eps) if cfg.final_norm else None
        if cfg.position == "relative":  # derived, not learned: left out of checkpoints
            self.register_buffer("buckets", relative_buckets(cfg.max_position, cfg.position_buckets,
                                                             cfg.max_position), persistent=False)
        norm = lambda: nn.LayerNorm(D, cfg.layer_norm_eps, elementwise_affine=False)
        self.head_in = nn.Sequential(norm(), nn.Linear(D, D), nn.GELU(), norm(),
                                     Dropout(cfg.dropout))
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size))  # decoder weight: word.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """Every tensor, in one place. s = sqrt(2 / (5 d_model)), the "small init" of Nguyen &
        Salazar (2019) that LTG-BERT uses; N(0, s) is truncated at +-2s everywhere.
          word.weight (V, D), rel (2*buckets-1, D) or pos.weight (max_position, D)   N(0, s)
          layers[i].attn.qk / v / out .weight (2D|D, D)                             N(0, s)
          layers[i].ffn.up.weight (2 d_ff, D), .down.weight (D, d_ff)    N(0, s) sqrt(1 / (2(i+1)))
              (the deeper the layer, the smaller its feed-forward contribution to the residual)
          head_in[1].weight (D, D)                                                  N(0, s)
          every bias (attention qk/v/out, head_in[1], head_bias)                    0
          LayerNorm weight / bias where affine (post_norm, rel_norm, norm)          1 / 0
          the MLM decoder has no weight of its own: it is word.weight (tied)
        """
        normal = small_init(self.config.d_model)
        normal(self.word.weight)
        if self.config.position == "relative":
            normal(self.rel)
            nn.init.ones_(self.rel_norm.weight)
            nn.init.zeros_(self.rel_norm.bias)
        else:
            normal(self.pos.weight)
        init_layers(self.layers, normal)
        if self.norm is not None:
            nn.init.ones_(self.norm.weight)
            nn.init.zeros_(self.norm.bias)
        init_linears(normal, self.head_in[1])
        self.head_bias.zero_()

    def attention_inputs(self, attention_mask, positions=None, causal=False):
        """What every layer's attention needs, computed once: bias (B, 1, 1, T), 0 at real keys and
        -inf at padding, (B, 1, T, T) with causal (-inf at every later key too); for relative
        positions the normalised position vectors rel (R, D) and each pair's bucket idx (B or 1,
        1, T, T), from the tokens' positions (default 0..T-1)."""
        B, T = attention_mask.shape
        bias = torch.zeros(B, 1, 1, T, device=attention_mask.device)
        bias = bias.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        if causal:  # GPT-BERT's causal batches: the same relative attention, masked
            later = torch.ones(T, T, dtype=torch.bool, device=bias.device).triu(1)
            bias = bias.masked_fill(later, float("-inf"))
        if self.config.position == "absolute":
            return bias, None, None
        if positions is None:
            idx = self.buckets[:T, :T][None, None]
        else:  # tokens taken out of a longer sequence keep their original offsets (BootBERT's MAE)
            idx = self.buckets[positions[:, :, None], positions[:, None, :]][:, None]
        return bias, self.rel_norm(self.rel), idx

    def forward(self, input_ids, attention_mask=None, predict=None, all_layers=False,
                positions=None, causal=False):
        """input_ids (B, T) long, or soft tokens (B, T, V) float: a distribution over the
        vocabulary per position, embedded as its expected word vector (meta.py's soft-label
        teacher writes these); attention_mask (B, T), 1 = real token, 0 = padding (default all
        1); positions (B, T) long, each token's position in its sequence (default 0..T-1; a
        subset of a sequence keeps its own). Returns the last hidden states (B, T, D), or with
        all_layers the list [embeddings, layer 1, ..., layer n_layer] (the last after the final
        norm, where the config has one). With predict, the positions to score: a (B, T) bool, or
        (N,) long flat positions row * T + column (a fixed N keeps a compiled step's shapes
        static: data/masking.py's predicted_slots); returns (hidden, logits (N, V)) for those N
        positions, a bool's in row-major order (the MLM head runs on those alone). causal: each
        position attends to itself and those before it only."""
        B, T = input_ids.shape[:2]
        assert T <= self.config.max_position, f"sequence of {T} > {self.config.max_position=}"
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=input_ids.device)
        x = input_ids @ self.word.weight if input_ids.is_floating_point() else self.word(input_ids)
        if self.config.position == "absolute":
            x = x + (self.pos.weight[:T] if positions is None else self.pos(positions))
        x = self.drop(self.word_norm(x))
        att = self.attention_inputs(attention_mask, positions, causal)
        hidden = [x]
        for layer in self.layers:
            hidden.append(layer(hidden[-1], *att))
        if self.norm is not None:
            hidden[-1] = self.norm(hidden[-1])
        out = hidden if all_layers else hidden[-1]
        if predict is None:
            return out
        return out, self.head(hidden[-1].flatten(0, 1)[predict.flatten()])

    def head(self, h):
        """MLM head: (..., D) -> (..., V) logits."""
        return F.linear(self.head_in(h), self.word.weight, self.head_bias)

    def logits(self, input_ids, attention_mask=None, causal=False):
        """(B, T, V) logits at every position."""
        return self.head(self(input_ids, attention_mask, causal=causal))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def small_init(d_model: int):
    """N(0, s) truncated at +-2s with s = sqrt(2 / (5 d_model)), times an optional scale."""
    s = math.sqrt(2.0 / (5.0 * d_model))
    return lambda w, scale=1.0: nn.init.trunc_normal_(w, 0.0, s, -2 * s, 2 * s).mul_(scale)


@torch.no_grad()
def init_linears(normal, *linears) -> None:
    """Each nn.Linear's weight drawn by `normal` (small_init's), in the order given; its bias 0."""
    for lin in linears:
        normal(lin.weight)
        lin.bias.zero_()


@torch.no_grad()
def init_layers(layers, normal):
    """Attention weights N(0, s), biases 0; feed-forward weights of layer i (from 0) scaled by
    sqrt(1 / (2(i+1))); affine LayerNorms 1 / 0 (see Encoder.init_weights)."""
    for i, layer in enumerate(layers):
        init_linears(normal, layer.attn.qk, layer.attn.v, layer.attn.out)
        depth = math.sqrt(1.0 / (2.0 * (i + 1)))
        normal(layer.ffn.up.weight, depth)
        normal(layer.ffn.down.weight, depth)
        nn.init.ones_(layer.attn.post_norm.weight)
        nn.init.zeros_(layer.attn.post_norm.bias)


class Decoder(nn.Module):
    """A stack of encoder layers over hidden states rather than tokens, without dropout, ending in
    an affine LayerNorm: BootBERT's light decoder (Samuel 2023; boot-bert's model.py builds it
    from its Encoder class, which ends so). It attends with the attention_inputs of the encoder
    it decodes for, so the two share their relative position vectors."""

    def __init__(self, cfg: ModelConfig, n_layer: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer(replace(cfg, dropout=0.0)) for _ in range(n_layer))
        self.norm = nn.LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        init_layers(self.layers, small_init(cfg.d_model))

    def forward(self, x, att):
        for layer in self.layers:
            x = layer(x, *att)
        return self.norm(x)


class BootHeads(nn.Module):
    """What a BootBERT student has beyond the encoder (Samuel 2023, section 3): the vector that
    stands in for the hidden tokens (MAE student only), a light decoder without dropout, and the
    head that regresses the teacher's states (dense, GELU, LayerNorm, dense; LTG-BERT init).
    The vector is N(0, 1) per component, as boot-bert draws it: the scale of the LayerNorm-ed
    encoder states it stands among (a small-init vector would be a near-zero input)."""

    def __init__(self, cfg: ModelConfig, n_layer: int, mae: bool):
        super().__init__()
        normal, D = small_init(cfg.d_model), cfg.d_model
        with torch.no_grad():
            self.mask = nn.Parameter(torch.randn(D)) if mae else None
            self.decoder = Decoder(cfg, n_layer)
            norm = nn.LayerNorm(D, cfg.layer_norm_eps, elementwise_affine=False)
            self.regress = nn.Sequential(nn.Linear(D, D), nn.GELU(), norm, nn.Linear(D, D))
            init_linears(normal, self.regress[0], self.regress[3])


def boot_states(encoder: "Encoder", heads: BootHeads, inputs, attention_mask, hide,
                compact: bool = True):
    """A BootBERT student's states, up to its decoder's output (B, T, D): the path its MLM head
    is trained on, and so the one that scores it (Samuel 2023, sec. 3). inputs (B, T) token ids,
    attention_mask (B, T), hide (B, T) bool: the positions to predict.

    MAE student (heads.mask set): the encoder reads only the kept tokens, each at its position
    in the sequence (so [MASK] never reaches it); its states are scattered back to full length,
    the learned vector fills the hidden positions, and the decoder reads all of it. BERT-style
    student (the ablation): the encoder reads `inputs` whole, [MASK]s included.

    compact: the encoder reads the kept tokens gathered into the batch's longest kept row, a
    width known only by reading the masks (a host sync, and a new shape per batch under
    torch.compile). Otherwise it reads all T slots, the hidden ones attention-masked and holding
    a kept token: the same kept states at a static shape, for ~1/(1 - p) of the encoder's work.
    """
    if heads.mask is None:
        return heads.decoder(encoder(inputs, attention_mask),
                             encoder.attention_inputs(attention_mask))
    B, T = inputs.shape
    keep = ~hide & (attention_mask == 1)
    if compact:
        n = int(keep.sum(1).max())
        order = torch.argsort((~keep).int(), dim=1, stable=True)[:, :n]  # (B, n): kept first
    else:
        order = torch.arange(T, device=inputs.device).expand(B, T)        # (B, T): as they are
    seen = keep.gather(1, order)       # (B, n): False on the slots that are not kept tokens
    tokens = inputs.gather(1, order)   # those slots repeat the row's first kept token
    first = tokens.gather(1, seen.int().argmax(1, keepdim=True))        # (B, 1)
    tokens = torch.where(seen, tokens, first)  # (attention-masked), never a [MASK]
    # not compact: every row's slots at positions 0..T-1, so the batch shares one bucket map
    kept = encoder(tokens, seen.long(), positions=order if compact else None)  # (B, n, D)
    kept = kept.masked_fill(~seen[..., None], 0.0)  # padding slots: zeros, whichever layout
    x = torch.zeros(B, T, kept.shape[-1], device=inputs.device, dtype=kept.dtype)
    x = x.scatter(1, order[..., None].expand_as(kept), kept)            # back to (B, T, D)
    relative = encoder.config.position == "relative"
    fill = heads.mask if relative else heads.mask + encoder.pos.weight[:T]
    x = torch.where(hide[..., None], fill, x)
    return heads.decoder(x, encoder.attention_inputs(attention_mask))


def boot_shape(heads: dict) -> tuple[int, bool]:
    """(decoder layers, MAE student?) of a BootHeads state dict, read from its tensors."""
    n_layer = len({k.split(".")[2] for k in heads if k.startswith("decoder.layers.")})
    return n_layer, "mask" in heads


class BootPredictor(nn.Module):
    """A BootBERT checkpoint as load_checkpoint returns it: called as an Encoder is, it predicts
    the tokens marked [MASK] (mask_id) through boot_states and the MLM head. .encoder is the
    encoder alone, what fine-tuning builds on."""

    def __init__(self, encoder: "Encoder", heads: BootHeads, mask_id: int):
        super().__init__()
        self.encoder, self.heads, self.mask_id = encoder, heads, mask_id
        self.config = encoder.config
        self.compact = True  # boot_states' layout; a teacher inside a compiled step: False

    def forward(self, input_ids, attention_mask=None, predict=None, hide=None):
        """input_ids (B, T) -> the decoder's states (B, T, D), or with predict ((B, T) bool or
        (N,) flat positions), (states, logits (N, V)) as Encoder.forward. hide (B, T) bool: the
        positions the encoder does not read (default: those holding [MASK]); a teacher given
        clean text is told them."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hide = input_ids == self.mask_id if hide is None else hide
        x = boot_states(self.encoder, self.heads, input_ids, attention_mask, hide, self.compact)
        if predict is None:
            return x
        return x, self.encoder.head(x.flatten(0, 1)[predict.flatten()])

    def logits(self, input_ids, attention_mask=None):
        """(B, T, V) logits at every position."""
        return self.encoder.head(self(input_ids, attention_mask))


def model_config(args, vocab_size, preset: dict | None = None) -> ModelConfig:
    """The model the flags ask for: `preset` (default: --size's), every ModelConfig field a flag
    of the same name sets (not None), the data's vocabulary; one line if it cannot run."""
    overrides = {f.name: getattr(args, f.name) for f in fields(ModelConfig)
                 if getattr(args, f.name, None) is not None}
    preset = PRESETS[args.size] if preset is None else preset
    config = ModelConfig(**{**preset, **overrides, "vocab_size": vocab_size})
    if config.d_model % config.n_head:
        raise SystemExit(f"error: --d-model {config.d_model} is not a multiple of "
                         f"--n-head {config.n_head}")
    if args.seq_len > config.max_position:
        raise SystemExit(f"error: --seq-len {args.seq_len} exceeds --max-position "
                         f"{config.max_position}")
    return config


def check_config(saved: dict, config: ModelConfig, path, ignore=()) -> None:
    """A checkpoint only loads into the model it was made from: say which fields differ.
    Dropout is a training setting, not part of the model, and may differ; so may the `ignore`d
    fields (the vocabulary, when the embeddings are re-initialised for another language)."""
    want = asdict(config)
    diff = [f"{k}={saved.get(k)!r} there but {want.get(k)!r} here"
            for k in sorted(set(saved) | set(want))
            if saved.get(k) != want.get(k) and k != "dropout" and k not in ignore]
    if diff:
        raise SystemExit(f"error: {path} holds a different model: {'; '.join(diff)}")


# the tensors each part of a model holds, the parts train.py --reset names (--freeze: embeddings)
RESET_PARTS = {
    "embeddings": lambda name: name in ("word.weight", "head_bias"),  # the tied output too
    "positions": lambda name: name in ("pos.weight", "rel") or name.startswith("rel_norm."),
}


def load_weights(model: "Encoder", path, reset=()) -> None:
    """Load the weights of the checkpoint at `path` into `model`, except the `reset` parts (names
    in RESET_PARTS), which keep the model's own initialisation: a transfer run's starting point
    (the vocabulary may then differ, when the embeddings are among them)."""
    src = read_checkpoint(path)
    check_config(src["config"], model.config, path,
                 ignore=("vocab_size",) if "embeddings" in reset else ())
    if set(src["model"]) != set(model.state_dict()):
        raise SystemExit(f"error: {path} holds other tensors than this model has")
    fresh = lambda name: any(RESET_PARTS[part](name) for part in reset)
    model.load_state_dict({k: (v if fresh(k) else src["model"][k])
                           for k, v in model.state_dict().items()}, strict=True)


def load_checkpoint(path, device="cpu", encoder_only=False):
    """-> (model in eval mode on `device`, its sentencepiece tokenizer). The model predicts a
    hidden token as the checkpoint says its objective trained it: the Encoder and its MLM head,
    or through a decoder a BootPredictor (BootBERT's student); model.predicts_before: at the
    position before it (gpt-bert's masked next-token prediction). encoder_only: the Encoder alone,
    for its states. model.train_args: the flags it was trained with; trained_steps: its step."""
    ckpt = read_checkpoint(path)
    model = Encoder(ModelConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"], strict=True)
    tok = spm.SentencePieceProcessor(model_proto=ckpt["tokenizer"])
    if tok.get_piece_size() != model.config.vocab_size:
        raise SystemExit(f"error: {path} pairs a {model.config.vocab_size}-token model with a "
                         f"{tok.get_piece_size()}-piece tokenizer; it was not written by train.py")
    if "code_version" in ckpt and "decoder" not in ckpt:  # an older train.py's
        raise SystemExit(f"error: {path} predates checkpoints that say how they predict")
    if ckpt.get("decoder") and not encoder_only:
        boot = BootHeads(model.config, *boot_shape(ckpt["heads"]))
        boot.load_state_dict(ckpt["heads"], strict=True)
        model = BootPredictor(model, boot, tok.piece_to_id("[MASK]"))
    model.train_args = ckpt.get("args", {})
    model.trained_steps = ckpt.get("step")  # what an evaluation of it records as its step
    model.predicts_before = ckpt.get("predicts_before", False)
    return model.to(device).eval(), tok
