"""nanoMLM's encoder for Hugging Face transformers, self-contained (torch + transformers only).

`python export.py --ckpt RUN/ckpt.pt --out DIR` copies this file into DIR next to config.json,
the weights and the tokenizer; then

    from transformers import AutoModelForMaskedLM, AutoTokenizer
    model = AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)  # (else transformers asks)

It transcribes model.py of the nanoMLM repository (the LTG-BERT-style encoder, relative
positions included) and is tested against it: the logits equal model.load_checkpoint's.
Dropout here is torch's (nanoMLM's CPU training draws its masks its own way; in eval the two are
the same function). A BootBERT checkpoint with a masked-autoencoder student predicts through
the path it was trained on: the encoder reads the tokens that are not [MASK], each at its own
position, and a light decoder reads those states with a learned vector at the [MASK]s.
NanoMLMModel (AutoModel) gives the encoder's states; NanoMLMForSequenceClassification puts
nanoMLM's fine-tuning head on the [CLS] state. A gpt-bert model is also a causal LM
(NanoMLMForCausalLM, AutoModelForCausalLM): the same weights under a causal mask, the logits at
t predicting the token at t + 1, as the BabyLM 2025 pipeline's causal backend reads them; its
mntp backend reads NanoMLMForMaskedLM's logits at the position before each masked token.
"""
import math
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import (BaseModelOutput, CausalLMOutput, MaskedLMOutput,
                                           SequenceClassifierOutput)


class NanoMLMConfig(PretrainedConfig):
    model_type = "nanomlm"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layer",
                     "num_attention_heads": "n_head", "intermediate_size": "d_ff",
                     "max_position_embeddings": "max_position"}

    def __init__(self, vocab_size=16384, n_layer=12, n_head=6, d_model=384, d_ff=1024,
                 dropout=0.1, position="relative", position_buckets=32, max_position=512,
                 layer_norm_eps=1e-7, final_norm=False, boot_decoder_layers=0, boot_mae=False,
                 pad_token_id=0, mask_token_id=4, **kwargs):
        self.vocab_size, self.n_layer, self.n_head = vocab_size, n_layer, n_head
        self.d_model, self.d_ff, self.dropout = d_model, d_ff, dropout
        self.position, self.position_buckets = position, position_buckets
        self.max_position, self.layer_norm_eps = max_position, layer_norm_eps
        self.final_norm = final_norm
        self.boot_decoder_layers, self.boot_mae = boot_decoder_layers, boot_mae
        self.mask_token_id = mask_token_id
        super().__init__(pad_token_id=pad_token_id, **kwargs)


def relative_buckets(n, buckets, max_position, device=None):
    """(n, n) long: the relative-position table's row for query i, key j (model.py's rule:
    offsets up to buckets/2 exact, log-spaced beyond, the last row at max_position - 1)."""
    d = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]
    mid = buckets // 2
    a = d.abs().clamp(min=mid, max=max_position - 1).double()
    log_ratio = torch.log(a / mid) / math.log((max_position - 1) / mid)
    far = (mid + torch.ceil(log_ratio * (mid - 1)).long()).clamp(max=2 * mid - 1)
    return torch.where(d.abs() <= mid, d, d.sign() * far) + buckets - 1


def norm(d, eps, affine=False):
    return nn.LayerNorm(d, eps, elementwise_affine=affine)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.head_dim, self.p = cfg.n_head, cfg.d_model // cfg.n_head, cfg.dropout
        self.relative = cfg.position == "relative"
        self.scale = 1 / math.sqrt((3 if self.relative else 1) * self.head_dim)
        self.pre_norm = norm(cfg.d_model, cfg.layer_norm_eps)
        self.qk = nn.Linear(cfg.d_model, 2 * cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.post_norm = norm(cfg.d_model, cfg.layer_norm_eps, affine=True)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, bias, rel, idx):
        # x (B, T, D); bias (B, 1, 1, T): 0 at real keys, -inf at padding; rel (R, D); idx (T, T)
        B, T, D = x.shape
        H, hd = self.n_head, self.head_dim
        h = self.pre_norm(x)
        q, k = self.qk(h).chunk(2, dim=-1)
        q, k, v = (t.view(B, T, H, hd).transpose(1, 2) for t in (q, k, self.v(h)))
        if self.relative:  # q_i.kp[r(i,j)] + k_j.qp[r(i,j)], scored per bucket, then gathered
            qp, kp = self.qk(self.drop(rel)).chunk(2, dim=-1)
            qp, kp = (t.view(-1, H, hd).transpose(0, 1) for t in (qp, kp))    # (H, R, hd)
            pick = idx.expand(B, H, T, T)
            c2p = (q @ kp.transpose(-1, -2)).gather(-1, pick)
            p2c = (k @ qp.transpose(-1, -2)).gather(-1, pick.transpose(-1, -2)).transpose(-1, -2)
            bias = bias + (c2p + p2c) * self.scale
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=self.scale,
                                           dropout_p=self.p if self.training else 0.0)
        return self.drop(self.post_norm(self.out(y.transpose(1, 2).reshape(B, T, D))))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.pre_norm = norm(cfg.d_model, cfg.layer_norm_eps)
        self.up = nn.Linear(cfg.d_model, 2 * cfg.d_ff, bias=False)
        self.mid_norm = norm(cfg.d_ff, cfg.layer_norm_eps)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        a, gate = self.up(self.pre_norm(x)).chunk(2, dim=-1)  # GEGLU
        return self.drop(self.down(self.mid_norm(a * F.gelu(gate, approximate="tanh"))))


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn, self.ffn = Attention(cfg), FeedForward(cfg)

    def forward(self, x, bias, rel, idx):
        x = x + self.attn(x, bias, rel, idx)
        return x + self.ffn(x)


class Encoder(nn.Module):
    """model.Encoder: embeddings, layers, the MLM head (tied to the word embeddings)."""

    def __init__(self, cfg):
        super().__init__()
        self.config, D = cfg, cfg.d_model
        self.word = nn.Embedding(cfg.vocab_size, D)
        self.word_norm = norm(D, cfg.layer_norm_eps)
        if cfg.position == "relative":
            self.rel = nn.Parameter(torch.zeros(2 * cfg.position_buckets - 1, D))
            self.rel_norm = norm(D, cfg.layer_norm_eps, affine=True)
        else:
            self.pos = nn.Embedding(cfg.max_position, D)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        self.norm = norm(D, cfg.layer_norm_eps, affine=True) if cfg.final_norm else None
        self.head_in = nn.Sequential(norm(D, cfg.layer_norm_eps), nn.Linear(D, D), nn.GELU(),
                                     norm(D, cfg.layer_norm_eps), nn.Dropout(cfg.dropout))
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def attention_inputs(self, attention_mask, causal=False):
        """bias (B, 1, 1, T) ((B, 1, T, T) when causal: no key after the query); rel (R, D) and
        idx (1, 1, T, T), or None, None (absolute)."""
        B, T = attention_mask.shape
        bias = torch.zeros(B, 1, 1, T, device=attention_mask.device)
        bias = bias.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        if causal:
            later = torch.ones(T, T, dtype=torch.bool, device=bias.device).triu(1)
            bias = bias.masked_fill(later, float("-inf"))
        if self.config.position == "absolute":
            return bias, None, None
        cfg = self.config
        idx = relative_buckets(T, cfg.position_buckets, cfg.max_position, bias.device)
        return bias, self.rel_norm(self.rel), idx[None, None]

    def forward(self, input_ids, attention_mask, causal=False):
        T = input_ids.shape[1]
        if T > self.config.max_position:
            raise ValueError(f"sequence of {T} tokens > max_position {self.config.max_position}")
        x = self.word(input_ids)
        if self.config.position == "absolute":
            x = x + self.pos.weight[:T]
        x = self.drop(self.word_norm(x))
        att = self.attention_inputs(attention_mask, causal)
        for layer in self.layers:
            x = layer(x, *att)
        return x if self.norm is None else self.norm(x)

    def head(self, h):
        return F.linear(self.head_in(h), self.word.weight, self.head_bias)


class Decoder(nn.Module):
    """BootBERT's light decoder: encoder layers without dropout, then an affine LayerNorm."""

    def __init__(self, cfg):
        super().__init__()
        plain = NanoMLMConfig(**{**cfg.to_dict(), "dropout": 0.0})
        self.layers = nn.ModuleList(Layer(plain) for _ in range(cfg.boot_decoder_layers))
        self.norm = norm(cfg.d_model, cfg.layer_norm_eps, affine=True)

    def forward(self, x, att):
        for layer in self.layers:
            x = layer(x, *att)
        return self.norm(x)


class Boot(nn.Module):
    """What a BootBERT student adds for predicting tokens: the vector standing in for the hidden
    tokens (masked-autoencoder student only) and the decoder."""

    def __init__(self, cfg):
        super().__init__()
        self.mask = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.boot_mae else None
        self.decoder = Decoder(cfg)


class NanoMLMPreTrainedModel(PreTrainedModel):
    config_class = NanoMLMConfig
    base_model_prefix = "nanomlm"

    def _init_weights(self, module):
        """Weights not in the checkpoint (a new classifier): torch's default initialisation,
        as nanoMLM's own fine-tuning head has."""
        if isinstance(module, (nn.Linear, nn.LayerNorm, nn.Embedding)):
            module.reset_parameters()


class NanoMLMModel(NanoMLMPreTrainedModel):
    """The encoder's last states (last_hidden_state, (B, T, D)): what fine-tuning builds on
    (the BabyLM pipeline's classifier loads this through AutoModel), for every objective."""

    def __init__(self, config):
        super().__init__(config)
        self.nanomlm = Encoder(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.nanomlm.word

    def forward(self, input_ids, attention_mask=None, return_dict=None, **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return BaseModelOutput(last_hidden_state=self.nanomlm(input_ids, attention_mask))


def built_by_a_pipeline() -> bool:
    """Whether transformers.pipeline() is building this model (a frame of its module below us)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("transformers.pipelines"):
            return True
        frame = frame.f_back
    return False


class NanoMLMForMaskedLM(NanoMLMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.nanomlm = Encoder(config)
        self.boot = Boot(config) if config.boot_decoder_layers else None
        self.post_init()
        # said where a reader would be wrong: transformers' fill-mask pipeline reads logits at
        # the [MASK] itself (the BabyLM pipeline's mntp backend, and evaluate.py fill, read t - 1)
        if getattr(config, "predicts_before", False) and built_by_a_pipeline():
            warnings.warn("this gpt-bert model predicts a masked token from the position before "
                          "it: read logits[:, t - 1] for a [MASK] at t (the fill-mask pipeline "
                          "reads t; nanoMLM's evaluate.py fill reads t - 1)", stacklevel=2)

    def states(self, input_ids, attention_mask):
        """The states the MLM head reads (B, T, D): the encoder's, or for a BootBERT student its
        decoder's (model.boot_states with compact=False: the same states, static shapes)."""
        enc = self.nanomlm
        if self.boot is None:
            return enc(input_ids, attention_mask)
        att = enc.attention_inputs(attention_mask)
        if self.boot.mask is None:  # BERT-style student: reads the [MASK]s
            return self.boot.decoder(enc(input_ids, attention_mask), att)
        hide = input_ids == self.config.mask_token_id
        seen = ~hide & (attention_mask == 1)                                   # (B, T)
        first = input_ids.gather(1, seen.int().argmax(1, keepdim=True))        # (B, 1)
        kept = enc(torch.where(seen, input_ids, first), seen.long())            # (B, T, D)
        fill = self.boot.mask                                                   # (D,)
        if self.config.position == "absolute":
            fill = fill + enc.pos.weight[:input_ids.shape[1]]                  # (T, D)
        x = torch.where(hide[..., None], fill, kept.masked_fill(~seen[..., None], 0))
        return self.boot.decoder(x, att)

    def get_input_embeddings(self):
        return self.nanomlm.word

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=None, **kwargs):
        """input_ids (B, T), attention_mask (B, T) (1: token, 0: padding); labels (B, T) with
        -100 where not scored (a gpt-bert model's loss reads each label's logits at the position
        before it). Other arguments of the BERT API (token_type_ids...) are ignored."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logits = self.nanomlm.head(self.states(input_ids, attention_mask))      # (B, T, V)
        loss = None
        if labels is not None:
            scored = logits
            if getattr(self.config, "predicts_before", False):  # gpt-bert: a step before
                scored, labels = logits[:, :-1], labels[:, 1:]
            loss = F.cross_entropy(scored.flatten(0, 1).float(), labels.flatten(),
                                   ignore_index=-100)
        return MaskedLMOutput(loss=loss, logits=logits)


class NanoMLMForCausalLM(NanoMLMModel, GenerationMixin):
    """A gpt-bert model read causally: each position attends to itself and those before it, and
    its logits predict the next token (no shift inside: labels are the inputs, shifted here).
    generate() works through transformers' GenerationMixin without a key-value cache: each new
    token reads the whole sequence again (relative positions make a cache's reuse less simple
    than a GPT's; at BabyLM's lengths the recomputation is cheap). Start a prompt with [CLS]
    and no [SEP] (tok(text, add_special_tokens=False), then [CLS] in front)."""

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=None, **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        h = self.nanomlm(input_ids, attention_mask, causal=True)
        logits = self.nanomlm.head(h)                                           # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)


class NanoMLMForSequenceClassification(NanoMLMPreTrainedModel):
    """The encoder and nanoMLM's fine-tuning head on the [CLS] state (evaluate.Classifier):
    dropout, dense, GELU, LayerNorm, dropout, linear to the labels."""

    def __init__(self, config):
        super().__init__(config)
        D, p = config.d_model, config.dropout
        self.nanomlm = Encoder(config)
        self.classifier = nn.Sequential(nn.Dropout(p), nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D),
                                        nn.Dropout(p), nn.Linear(D, config.num_labels))
        self.post_init()

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=None, **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        logits = self.classifier(self.nanomlm(input_ids, attention_mask)[:, 0])  # (B, labels)
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits[:, 0].float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)
