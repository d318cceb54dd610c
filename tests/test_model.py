"""model.py: position buckets, attention against a pair-by-pair reference, padding and translation
invariance, initialisation statistics, and checkpoints."""
import copy
import math
from dataclasses import asdict

import numpy as np
import pytest
import scipy.stats
import sentencepiece as spm
import torch
import torch.nn.functional as F

from benchmarks.ltg_bert import LtgBert, ltg_buckets
from training.optim import Lamb, ema_update
from machinery.plumbing import read_checkpoint, save_checkpoint
from model import (PRESETS, BootHeads, Decoder, Encoder, ModelConfig, boot_states, check_config,
                   dropout, load_checkpoint, relative_buckets, relative_scores, use_attention)


V = 300


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**PRESETS["tiny"], "vocab_size": V, "d_model": 32, "d_ff": 48, **kw})


# --- relative positions --------------------------------------------------------------------------

def test_buckets_hand_computed():
    b = relative_buckets(512, 32, 512)  # LTG-BERT's setting; b[i, j] is for offset d = i - j
    row = lambda d: b[d, 0].item() if d >= 0 else b[0, -d].item()
    assert row(0) == 31 and row(16) == 47 and row(-16) == 15      # |d| <= 16: one row each
    # d = 17: 16 + ceil(15 * ln(17/16) / ln(511/16)) = 16 + ceil(0.263) = 17
    assert row(17) == 31 + 17 and row(-17) == 31 - 17
    assert row(511) == 62 and row(-511) == 0                        # the last rows of 2*32-1


def test_buckets_stay_in_the_table_at_the_longest_offset():
    # |d| = max_position - 1 lands exactly on the last row in exact arithmetic; rounding (which
    # differed between torch.log's vectorised and scalar paths) once pushed it one row past the
    # table, intermittently (seen with max_position 64)
    for P in (33, 64, 100, 128, 129, 512):
        for _ in range(5):
            b = relative_buckets(P, 32, P)
            assert b.min() == 0 and b.max() == 62, P


def test_buckets_against_scalar_loop():
    K, P, n = 16, 64, 80  # n > P: offsets beyond max_position share the last bucket
    b = relative_buckets(n, K, P)
    mid = K // 2
    for i in range(n):
        for j in range(n):
            d = i - j
            if abs(d) <= mid:
                want = d
            else:
                far = math.log(min(abs(d), P - 1) / mid) / math.log((P - 1) / mid) * (mid - 1)
                want = int(math.copysign(mid + math.ceil(far), d))
            assert b[i, j].item() == want + K - 1, (i, j)
    assert b.min() == 0 and b.max() == 2 * K - 2
    assert (b[:, 0].diff() >= 0).all()  # monotone in the offset


def naive_attention(att, x, mask, rel, r, keep=None, p=0.0):
    """LTG-BERT's attention written pair by pair: score(i, j) = (q_i.k_j + q_i.kp_r + k_j.qp_r) /
    sqrt(3 d_head) with r = bucket(i - j); padded keys excluded; softmax; sum of values. keep:
    dropout's masks (of rel, of the probabilities (B, H, T, T), of the output), kept / (1 - p)."""
    B, T, D = x.shape
    H, hd = att.n_head, att.head_dim
    drop = lambda t, i: t if keep is None else t * keep[i] / (1 - p)
    h = F.layer_norm(x, (D,), eps=att.pre_norm.eps)
    q, k = att.qk(h).chunk(2, -1)
    v = att.v(h)
    qp, kp = att.qk(drop(rel, 0)).chunk(2, -1)
    out = torch.zeros(B, T, D, dtype=x.dtype)
    for b in range(B):
        for i in range(T):
            for head in range(H):
                s = slice(head * hd, (head + 1) * hd)
                c2c = lambda j: q[b, i, s] @ k[b, j, s]
                c2p = lambda j: q[b, i, s] @ kp[r[i, j], s]
                p2c = lambda j: k[b, j, s] @ qp[r[i, j], s]
                scores = torch.stack([
                    (c2c(j) + c2p(j) + p2c(j)) / math.sqrt(3 * hd) if mask[b, j]
                    else torch.tensor(-math.inf, dtype=x.dtype) for j in range(T)])
                probs = torch.softmax(scores, 0)
                out[b, i, s] = (probs if keep is None else drop(probs, 1)[b, head, i]) @ v[b, :, s]
    return drop(att.post_norm(att.out(out)), 2)


def attention_inputs(model):
    """One layer's inputs for 2 rows of 13 states, the second padded after 9: x (2, 13, 32), the
    mask, its additive bias, the normed position vectors and each pair's bucket."""
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 9:] = 0
    bias = torch.zeros(2, 1, 1, 13, dtype=torch.float64)
    bias = bias.masked_fill(mask[:, None, None, :] == 0, -math.inf)
    return x, mask, bias, model.rel_norm(model.rel), model.buckets[:13, :13][None, None]


def test_relative_attention_matches_pair_by_pair_reference():
    torch.manual_seed(0)
    model = Encoder(tiny(n_head=4, position_buckets=8, max_position=64)).double().eval()
    att = model.layers[0].attn
    x, mask, bias, rel, idx = attention_inputs(model)
    got = att(x, bias, rel, idx)
    want = naive_attention(att, x, mask, rel, model.buckets)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_training_attention_on_the_cpu_drops_probabilities_as_the_reference(monkeypatch):
    """In training on the CPU, Attention applies model.dropout to rel, to the attention
    probabilities and to its output: with dropout's masks drawn by a stand-in and recorded, the
    pair-by-pair reference with the same masks gives the same output (padding in one row)."""
    import model as model_module
    torch.manual_seed(0)
    model = Encoder(tiny(n_head=4, position_buckets=8, max_position=64, dropout=0.3)).double()
    att = model.layers[0].attn.train()
    masks = []

    def recorded(t, p, training=True):
        masks.append(torch.rand(t.shape, dtype=t.dtype) >= p)
        return t * masks[-1] / (1 - p)

    monkeypatch.setattr(model_module, "dropout", recorded)
    x, mask, bias, rel, idx = attention_inputs(model)
    got = att(x, bias, rel, idx)
    assert [tuple(m.shape) for m in masks] == [tuple(rel.shape), (2, 4, 13, 13), (2, 13, 32)]
    want = naive_attention(att, x, mask, rel, model.buckets, keep=masks, p=0.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_encoder_equals_ltg_bert_model_code():
    """benchmarks/ltg_bert.py re-implements LTG-BERT's own model code (sequence first, each pair's
    position vectors gathered before two einsums, its bucket formula, its masked softmax): with
    one state dict, the MLM logits and every parameter's gradient agree in float64, padding in
    two of three rows."""
    torch.manual_seed(0)
    cfg = tiny(n_head=4, position_buckets=8, max_position=64, dropout=0.0)
    ours = Encoder(cfg).double()
    theirs = LtgBert(cfg).double()
    theirs.load_state_dict(ours.state_dict())
    assert (ltg_buckets(128, 32, 512) == relative_buckets(512, 32, 512)[:128, :128]).all()
    B, T = 3, 20
    ids = torch.randint(5, V, (B, T))
    att = torch.ones(B, T, dtype=torch.long)
    att[1, 14:], att[2, 5:] = 0, 0
    predict = att.bool()
    back = torch.arange(B * T).view(B, T).t()[predict.t()].argsort()  # their (T, B) order to ours
    got, want = ours(ids, att, predict=predict)[1], theirs(ids, att, predict)[back]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(got)
    (got * w).sum().backward()
    (want * w).sum().backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs_params[name].grad, rtol=1e-9, atol=1e-10,
                                   msg=name)

# --- dropout on the CPU ----------------------------------------------------------------------

@pytest.mark.parametrize("p", [0.1, 0.5])
def test_cpu_dropout_drops_each_element_with_probability_p(p):
    """model.dropout against the definition of dropout: each element is zeroed with probability
    p, overall and in each of the four 16-bit quarters of a random word (within 5 standard
    errors), independently of its neighbour, and the rest scaled by 1/(1 - p); the gradient
    carries the same mask and scale; eval mode and p = 0 are the identity, p = 1 (and what
    rounds to it) drops everything."""
    torch.manual_seed(0)
    n = 1 << 22
    x = torch.ones(n, dtype=torch.float64, requires_grad=True)
    y = dropout(x, p)
    dropped = y == 0
    se = math.sqrt(p * (1 - p) / n)
    assert abs(dropped.double().mean().item() - p) < 5 * se
    for lane in range(4):
        assert abs(dropped[lane::4].double().mean().item() - p) < 10 * se
    a, b = dropped[:-1].double(), dropped[1:].double()
    assert abs(((a - p) * (b - p)).mean().item() / (p * (1 - p))) < 5 / math.sqrt(n)
    p16 = round(p * 2 ** 16) / 2 ** 16           # the p the mask draws: a multiple of 2^-16
    torch.testing.assert_close(y[~dropped], torch.full_like(y[~dropped], 1 / (1 - p16)))
    g = torch.randn(n, dtype=torch.float64)
    y.backward(g)
    torch.testing.assert_close(x.grad, torch.where(dropped, 0.0, g / (1 - p16)))
    z = torch.randn(3, 5, 7)                     # a shape whose size is not a multiple of 4
    assert dropout(z, p).shape == z.shape
    assert dropout(z, p, training=False) is z and dropout(z, 0.0) is z
    assert (dropout(z, 1.0) == 0).all() and (dropout(z, 1 - 2 ** -18) == 0).all()


def test_cpu_training_attention_is_sdpa_with_our_dropout():
    """In training on the CPU, Attention computes softmax(q k^T s + bias) v itself, so that our
    dropout applies to the probabilities. With a p that drops nothing (1e-20 rounds to 0 / 2^16,
    and 1 - p to 1) the encoder in training computes what it does in evaluation (through SDPA),
    values and gradients; padding in one row, and a row that is all padding."""
    torch.manual_seed(0)
    model = Encoder(tiny(n_head=4, dropout=1e-20)).double()
    ids = torch.randint(5, V, (3, 12))
    att = torch.ones(3, 12, dtype=torch.long)
    att[1, 7:], att[2] = 0, 0                    # the third row is all padding
    outs = []
    for train in (True, False):
        model.train(train)
        model.zero_grad()
        out = model(ids, att)[:2]                # a row of padding alone has no meaning ...
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append((out, [q.grad.clone() for q in model.parameters() if q.grad is not None]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-10, atol=1e-12)
    for got, want in zip(outs[0][1], outs[1][1]):      # ... but must not make gradients NaN
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

# --- padding, translation, hidden states ---------------------------------------------------------

@pytest.mark.parametrize("position", ["relative", "absolute"])
def test_padding_never_changes_real_positions(position):
    torch.manual_seed(0)
    model = Encoder(tiny(position=position, n_layer=3)).eval()
    a, b = torch.randint(5, V, (1, 11)), torch.randint(5, V, (1, 6))
    junk = torch.randint(0, V, (1, 5))  # whatever sits under the padding must not matter
    ids = torch.cat([a, torch.cat([b, junk], 1)])
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    out = model(ids, mask, all_layers=True)
    alone_a, alone_b = model(a, all_layers=True), model(b, all_layers=True)
    assert len(out) == 4
    for layer in range(4):
        torch.testing.assert_close(out[layer][0], alone_a[layer][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[layer][1, :6], alone_b[layer][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.logits(ids, mask)[1, :6], model.logits(b)[0], rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("position", ["relative", "absolute"])
def test_left_padding_shifts_only_absolute_positions(position):
    """Relative attention sees offsets only: hiding 4 tokens on the left changes nothing. Absolute
    embeddings see indices: the same tokens at positions 4.. instead of 0.. give other outputs."""
    torch.manual_seed(0)
    model = Encoder(tiny(position=position)).eval()
    seq = torch.randint(5, V, (1, 9))
    shifted = torch.cat([torch.randint(5, V, (1, 4)), seq], 1)
    mask = torch.ones_like(shifted)
    mask[0, :4] = 0
    diff = (model(shifted, mask)[0, 4:] - model(seq)[0]).abs().max().item()
    assert diff < 1e-5 if position == "relative" else diff > 1e-2


def test_predict_scores_only_the_asked_positions():
    torch.manual_seed(0)
    model = Encoder(tiny()).eval()
    ids = torch.randint(5, V, (3, 10))
    predict = torch.rand(3, 10) < 0.3
    hidden, logits = model(ids, predict=predict)
    torch.testing.assert_close(hidden, model(ids))
    torch.testing.assert_close(logits, model.logits(ids)[predict])


# --- initialisation ------------------------------------------------------------------------------

def test_init_matches_its_documentation():
    torch.manual_seed(0)
    cfg = tiny(d_model=256, d_ff=512, n_layer=3, vocab_size=4000)
    model = Encoder(cfg)
    s = math.sqrt(2 / (5 * 256))
    trunc_std = scipy.stats.truncnorm(-2, 2).std()  # std of N(0, 1) cut at +-2: 0.8796
    for w, scale in [(model.word.weight, 1), (model.rel, 1), (model.layers[0].attn.qk.weight, 1),
                     (model.head_in[1].weight, 1)] + \
            [(model.layers[i].ffn.up.weight, math.sqrt(1 / (2 * (i + 1)))) for i in range(3)] + \
            [(model.layers[i].ffn.down.weight, math.sqrt(1 / (2 * (i + 1)))) for i in range(3)]:
        assert w.std().item() == pytest.approx(trunc_std * s * scale, rel=0.03)
        assert w.abs().max().item() <= 2 * s * scale + 1e-7
        assert w.mean().abs().item() < 0.05 * s * scale
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert (p == 0).all(), name
        if "post_norm.weight" in name or "rel_norm.weight" in name:
            assert (p == 1).all(), name


def test_decoder_is_tied_to_word_embeddings():
    torch.manual_seed(0)
    model = Encoder(tiny()).eval()
    assert not any("decoder" in k for k in model.state_dict())
    h = torch.randn(4, 32)
    features = F.gelu(model.head_in[1](F.layer_norm(h, (32,), eps=1e-7)))
    want = F.layer_norm(features, (32,), eps=1e-7) @ model.word.weight.T
    torch.testing.assert_close(model.head(h), want)


# --- checkpoints ---------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path, prepared):
    torch.manual_seed(0)
    model = Encoder(tiny(vocab_size=2000)).eval()
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"model": model.state_dict(), "config": asdict(model.config),
                     "tokenizer": (prepared / "tokenizer.model").read_bytes(), "step": 3}, path)
    return model, path


def test_checkpoint_round_trip(saved):
    model, path = saved
    assert not path.with_name("ckpt.pt.tmp").exists()  # the temp file was renamed into place
    loaded, tok = load_checkpoint(path)
    assert isinstance(tok, spm.SentencePieceProcessor) and tok.get_piece_size() == 2000
    ids = torch.tensor([[2] + tok.encode("the cat sat on the mat") + [3]])
    torch.testing.assert_close(loaded.logits(ids, torch.ones_like(ids)), model.logits(ids),
                               rtol=0, atol=0)
    assert not loaded.training


def test_checkpoint_loads_strictly(saved, tmp_path):
    model, path = saved
    ckpt = read_checkpoint(path)
    del ckpt["model"]["head_bias"]
    save_checkpoint(ckpt, tmp_path / "broken.pt")
    with pytest.raises(RuntimeError, match="Missing key"):
        load_checkpoint(tmp_path / "broken.pt")


def test_corrupt_or_foreign_checkpoints(saved, tmp_path):
    _, path = saved
    data = path.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "noise.pt").write_bytes(bytes(range(256)) * 40)
    for name in ("truncated.pt", "noise.pt"):
        corrupt = r"^error: cannot read checkpoint .*corrupt or truncated"
        with pytest.raises(SystemExit, match=corrupt):
            read_checkpoint(tmp_path / name)
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(SystemExit, match="has no checksum: it was not written by nanoMLM"):
        read_checkpoint(tmp_path / "other.pt")
    save_checkpoint({"weights": torch.zeros(3)}, tmp_path / "other.pt")  # ours, not a model
    with pytest.raises(SystemExit, match="not a nanoMLM checkpoint"):
        read_checkpoint(tmp_path / "other.pt")
    with pytest.raises(SystemExit, match="^error: no checkpoint at"):
        read_checkpoint(tmp_path / "missing.pt")


def test_checkpoint_with_another_tokenizer(saved, tmp_path, small_raw, monkeypatch):
    from data.prepare import prepare
    _, path = saved
    monkeypatch.setenv("NANOMLM_DATA", str(tmp_path / "prep"))
    other = prepare(str(small_raw), vocab_size=1500, quiet=True)
    ckpt = read_checkpoint(path)
    ckpt["tokenizer"] = (other / "tokenizer.model").read_bytes()
    save_checkpoint(ckpt, tmp_path / "mixed.pt")
    with pytest.raises(SystemExit, match="pairs a 2000-token model with a 1500-piece tokenizer"):
        load_checkpoint(tmp_path / "mixed.pt")


def test_config_mismatch_names_the_fields():
    differ = r"d_model=32 there but 64 here; vocab_size=300 there but 500 here"
    with pytest.raises(SystemExit, match=differ):
        check_config(asdict(tiny()), tiny(d_model=64, vocab_size=500), "x.pt")
    check_config(asdict(tiny()), tiny(), "x.pt")  # equal configs pass
    check_config(asdict(tiny()), tiny(dropout=0.0), "x.pt")  # and so does another dropout


# --- a subset of tokens at their own positions (BootBERT's MAE student) --------------------------

@pytest.mark.parametrize("position", ["relative", "absolute"])
def test_subset_at_original_positions_equals_masking_the_rest(position):
    """Encoding only some tokens, each at its original position, must equal encoding the whole
    sequence with the other tokens hidden from attention."""
    torch.manual_seed(0)
    model = Encoder(tiny(position=position, n_layer=3)).eval()
    ids = torch.randint(5, V, (2, 14))
    keep = torch.rand(2, 14) < 0.6
    keep[:, 0] = True
    full = model(ids, keep.long())
    for b in range(2):
        pos = keep[b].nonzero()[:, 0]
        sub = model(ids[b, pos][None], positions=pos[None])
        torch.testing.assert_close(sub[0], full[b, pos], rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("position", ["relative", "absolute"])
def test_boot_states_in_both_layouts_equal_one_row_at_a_time(position):
    """The MAE student's states, with the kept tokens gathered (compact) or left in place at a
    static width, both equal a naive loop: per row, the encoder on that row's kept tokens alone
    at their positions, the mask vector at the hidden ones, then the decoder over the row."""
    torch.manual_seed(0)
    enc = Encoder(tiny(position=position, n_layer=2, final_norm=True)).double().eval()
    heads = BootHeads(enc.config, 1, mae=True).double().eval()
    B, T = 3, 12
    ids = torch.randint(5, V, (B, T))
    att = torch.ones(B, T, dtype=torch.long)
    att[1, 9:] = 0                                  # padding, right
    hide = torch.rand(B, T) < 0.4
    hide[:, 0] = False
    hide[2, 1:] = True                              # a row with a single kept token
    hide &= att == 1
    got = {c: boot_states(enc, heads, ids, att, hide, compact=c) for c in (True, False)}
    for b in range(B):
        n = int(att[b].sum())
        pos = (~hide[b, :n]).nonzero()[:, 0]
        x = torch.zeros(1, n, enc.config.d_model, dtype=torch.float64)
        x[0, pos] = enc(ids[b, pos][None], positions=pos[None])[0]
        fill = heads.mask if position == "relative" else heads.mask + enc.pos.weight[:n]
        x = torch.where(hide[b, :n, None], fill, x)
        want = heads.decoder(x, enc.attention_inputs(torch.ones(1, n, dtype=torch.long)))[0]
        for compact, states in got.items():
            torch.testing.assert_close(states[b, :n], want, msg=f"compact={compact}")

# --- the other forms: gather-fp32 and onehot (relative_scores), fused (kernels.fused_relative) ---

@pytest.mark.parametrize("pick", ["gather-fp32", "onehot"])
def test_relative_scores_picked_another_way_equal_the_gather_and_its_gradients(pick):
    """relative_scores picking each pair's bucket by a one-hot product, or by the gather in
    float32, equals the gather, in value and in the gradient of every input (float64: the sums
    differ in order alone)."""
    torch.manual_seed(0)
    B, H, T, hd, buckets = 3, 4, 23, 8, 8
    idx = relative_buckets(T, buckets, 64)[None, None]
    inputs = [torch.randn(*shape, dtype=torch.float64, requires_grad=True)
              for shape in [(B, H, T, hd)] * 2 + [(H, 2 * buckets - 1, hd)] * 2]
    grad = torch.randn(B, H, T, T, dtype=torch.float64)
    out = {}
    for form in ("gather", pick):
        y = relative_scores(*inputs, idx, form)
        out[form] = [y, *torch.autograd.grad(y, inputs, grad)]
    for a, b in zip(out["gather"], out[pick]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gather_fp32_accumulates_the_position_gradient_in_float32():
    """In bf16, gather-fp32's scores are float32 and its backward sums, in float32, the pairs of
    a query row that share a bucket: with q all ones and every score's gradient g = 1 + 2^-7
    (exact in bf16), kp's gradient of bucket r is the sum over rows of that row's count of pairs
    in r, times g, each row's sum rounded once to bf16 (the bf16 matrix product's input), as
    float64 gives it (n g needs more than bf16's 8 bits for most n: a sum in bf16 would round at
    each pair, as bf16 atomics on a GPU do; the CPU's bf16 scatter-add happens to sum in float32
    too, so the gather is not told apart here)."""
    B, H, T, hd, buckets = 2, 1, 64, 8, 8
    idx = relative_buckets(T, buckets, 64)[None, None]
    q = torch.ones(B, H, T, hd, dtype=torch.bfloat16)
    k, qp, kp = (torch.zeros(*shape, dtype=torch.bfloat16, requires_grad=True)
                 for shape in [(B, H, T, hd)] + [(H, 2 * buckets - 1, hd)] * 2)
    y = relative_scores(q, k, qp, kp, idx, "gather-fp32")
    assert y.dtype == torch.float32
    g = 1 + 2 ** -7
    y.backward(torch.full(y.shape, g, dtype=y.dtype))
    counts = F.one_hot(idx[0, 0], kp.shape[1]).sum(1).double()             # (T, R) per row
    row_sums = (counts * g).to(torch.bfloat16)
    want = (B * row_sums.double().sum(0)).to(torch.bfloat16)                # (R,)
    assert counts.max() > 3 and torch.equal(kp.grad[0, :, 0], want)


def trained_in_form(form, enc, heads, ids, mask, hide, causal, compact=True
                    ) -> list[torch.Tensor]:
    """With attention computed as `form`: the encoder's states and a BootBERT MAE student's,
    each at the real positions, and every gradient of a loss of both (dropout seeded alike)."""
    use_attention(enc, form)
    use_attention(heads, form)
    enc.zero_grad()
    heads.zero_grad()
    torch.manual_seed(1)
    real = mask[..., None] == 1  # (the fused kernel gives a padded query row another rule)
    y = enc(ids, mask, causal=causal) * real
    z = boot_states(enc, heads, ids, mask, hide, compact) * real
    (y.sin().sum() + z.cos().sum()).backward()
    return [y, z] + [p.grad for p in [*enc.parameters(), *heads.parameters()]
                     if p.grad is not None]


@pytest.mark.parametrize("form", ["gather-fp32", "onehot"])
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_in_another_form_trains_as_the_gather_path(form, causal, monkeypatch):
    """The whole encoder in training, dropout on, padding in one row, bidirectional and causal
    (gpt-bert's): the same outputs and every gradient in float64, with the same dropout masks;
    a BootBERT MAE student's per-row buckets take the gather in onehot."""
    import model as model_module
    picks = []  # (pick asked, idx shared) of each call

    def spy(*a):
        picks.append((a[-1], a[-2].shape[0] == 1))
        return relative_scores(*a)
    monkeypatch.setattr(model_module, "relative_scores", spy)
    torch.manual_seed(0)
    enc = Encoder(tiny(n_layer=2, position_buckets=8, max_position=64, dropout=0.1)).double()
    heads = BootHeads(enc.config, 1, mae=True).double()
    ids = torch.randint(5, V, (3, 17))
    mask = torch.ones(3, 17, dtype=torch.long)
    mask[1, 11:] = 0
    hide = (torch.rand(3, 17) < 0.4) & (mask == 1)
    hide[:, 0] = False
    out = {f: trained_in_form(f, enc, heads, ids, mask, hide, causal) for f in ("gather", form)}
    assert len(out[form]) == len(out["gather"]) > 10
    # two layers of the encoder and the student's decoder layer share their buckets; the MAE
    # student's encoder layers read per-row buckets
    assert picks.count((form, True)) == picks.count(("gather", True)) == 3
    assert picks.count((form, False)) == picks.count(("gather", False)) == 2
    for a, b in zip(out["gather"], out[form]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def kernel_contract(calls):
    """disentangled-flash 1.1.1's training op as its Triton kernel computes it
    (disentangled_flash/kernel.py, _deberta_attention_forward_kernel), pair by pair: slot
    s = delta_to_local[i - j + T - 1] (or delta_to_local[b, i, j]); score (q_i.k_j +
    q_i.pos_key[s] + k_j.pos_query[s]) * score_scale; keys where attention_mask is False get
    probability 0, and a padded query row attends to every key alike (Hugging Face's rule);
    output (B, T, H*hd) and the log-sum-exp. Each call's keyword arguments but the tensors it
    reads are appended to `calls` (the probabilities are not dropped here)."""
    def attention(*, query, key, value, pos_key, pos_query, delta_to_local, attention_mask,
                  score_scale, **rest):
        calls.append({**rest, "slots": delta_to_local})
        q, k, v, slots, keep = query, key, value, delta_to_local, attention_mask
        assert slots.dtype == torch.int32 and slots.is_contiguous() and keep.dtype == torch.bool
        assert pos_key.shape == pos_query.shape and pos_key.shape[1] % 8 == 0
        assert rest["has_padding"] and rest["has_c2p"] and rest["has_p2c"]
        B, H, T, hd = q.shape
        rows = []
        for b in range(B):
            for h in range(H):
                for i in range(T):
                    scores = []
                    for j in range(T):
                        s = slots[i - j + T - 1] if slots.ndim == 1 else slots[b, i, j]
                        score = (q[b, h, i] @ k[b, h, j] + q[b, h, i] @ pos_key[h, s]
                                 + k[b, h, j] @ pos_query[h, s]) * score_scale
                        scores.append(score if keep[b, j] else score - math.inf)
                    scores = torch.stack(scores) if keep[b, i] else torch.zeros(T, dtype=q.dtype)
                    rows.append(torch.softmax(scores, 0) @ v[b, h])
        y = torch.stack(rows).view(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd)
        return y, torch.empty(0)
    return attention


@pytest.fixture
def h100_limits(monkeypatch):
    """kernels.gpu_limits as an H100 reports them (228 KiB of shared memory per block, 132 SMs,
    sm_90), where the CPU has no GPU to ask: what the tile heuristic sizes its tiles against."""
    tuning = pytest.importorskip("disentangled_flash.tuning")
    from machinery import kernels
    monkeypatch.setattr(kernels, "gpu_limits",
                        lambda device: tuning.DeviceResources(232448, 132, (9, 0)))


@pytest.mark.parametrize("causal", [False, True])
def test_fused_encoder_trains_as_the_gather_path(causal, monkeypatch, h100_limits):
    """With the kernel's contract in place of the kernel (the CPU runs no Triton), the whole
    encoder in training, padding in one row, and a BootBERT MAE student in both layouts
    (compact: per-row slots; not: one map for the batch): the same outputs at real positions
    and every gradient as the gather path, in float64. A shared map goes with its gradient band,
    a per-row one without; every launch tile is given (no autotuning). Causal masks (gpt-bert's)
    keep the gather (the kernel masks keys alone); the probabilities' dropout goes to the kernel
    in training, none in evaluation."""
    from disentangled_flash.position import gradient_band
    from machinery import kernels
    calls = []
    monkeypatch.setitem(kernels._FUSED, "attention", kernel_contract(calls))
    tiles = kernels.launch_configs  # the kernels have no float64: tiles of float32's
    monkeypatch.setattr(kernels, "launch_configs", lambda T, hd, dtype, device: tiles(
        T, hd, dtype.replace("float64", "float32"), device))
    torch.manual_seed(0)
    enc = Encoder(tiny(n_layer=2, n_head=2, position_buckets=4, max_position=16, dropout=0.0))
    heads = BootHeads(enc.config, 1, mae=True)
    enc, heads = enc.double(), heads.double()
    ids = torch.randint(5, V, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    hide = torch.zeros(2, 9, dtype=torch.bool)
    hide[:, [2, 5]] = True
    for compact in (True, False):
        calls.clear()
        out = {form: trained_in_form(form, enc, heads, ids, mask, hide, causal, compact)
               for form in ("gather", "fused")}
        assert len(out["fused"]) == len(out["gather"]) > 10
        for a, b in zip(out["gather"], out["fused"]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        # the student's encoder (two layers) and decoder (one), the encoder's two unless causal
        assert len(calls) == (3 if causal else 5) and {c["dropout_p"] for c in calls} == {0.0}
        per_row = [c for c in calls if c["slots"].ndim == 3]
        assert len(per_row) == (2 if compact else 0)
        for c in calls:
            assert all(c[f"{phase}_{n}"] > 0 for phase in ("forward", "dq", "dkv")
                       for n in ("block_m", "block_n", "num_warps", "num_stages"))
            if c["slots"].ndim == 3:
                assert (c["band_low"], c["band_high"], c["column_slots"].numel()) == (0, 0, 0)
            else:  # the package's own band of the slots
                low, high, columns = gradient_band(c["slots"], torch.device("cpu"))
                assert (c["band_low"], c["band_high"]) == (low, high)
                assert torch.equal(c["column_slots"], columns)
    calls.clear()
    enc.layers[0].attn.p = 0.1
    with torch.no_grad():
        enc.train()(ids, mask)
        enc.eval()(ids, mask)
    assert [c["dropout_p"] for c in calls] == [0.1, 0.0, 0.0, 0.0]
    assert [c["dropout_seed"].numel() for c in calls] == [1, 0, 0, 0]


def test_fused_plan_reads_each_pairs_bucket_by_its_offset(h100_limits):
    """The slots of the fused plan, read as the kernel reads them (slot of pair (i, j) at
    i - j + T - 1), are the model's bucket of every pair, at lengths up to 512 of the small
    preset's scheme; made once per length and device."""
    from model import fused_plan
    for T in (1, 2, 17, 128, 512):
        slots, low, high, columns = fused_plan(T, 32, 512, "cpu")
        i = torch.arange(T)
        pair = slots.long()[i[:, None] - i[None, :] + T - 1]
        assert torch.equal(pair, relative_buckets(T, 32, 512)), T
        assert 0 <= low < high and columns.numel() % 8 == 0
        assert fused_plan(T, 32, 512, "cpu")[0] is slots


def test_kernel_contract_is_the_packages_own_reference():
    """The contract the fused form is tested against, against disentangled-flash's own PyTorch
    path of the same attention (_torch._torch_disentangled_attention, the math its kernels are
    validated against): random inputs, one row padded, float64."""
    pytest.importorskip("disentangled_flash")
    from disentangled_flash._torch import TorchPositionPlan, _torch_disentangled_attention
    torch.manual_seed(0)
    B, H, T, hd, R = 2, 3, 7, 4, 8
    q, k, v = (torch.randn(B, H, T, hd, dtype=torch.float64) for _ in range(3))
    pos_key, pos_query = (torch.randn(H, R, hd, dtype=torch.float64) for _ in range(2))
    slots = torch.randint(0, R, (2 * T - 1,), dtype=torch.int32)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 4:] = False
    scale = 1 / math.sqrt(3 * hd)
    want, _ = kernel_contract([])(query=q, key=k, value=v, pos_key=pos_key, pos_query=pos_query,
                                  delta_to_local=slots, attention_mask=keep, score_scale=scale,
                                  has_padding=True, has_c2p=True, has_p2c=True)
    T_ = torch.arange(T)
    pair = slots.long()[T_[:, None] - T_[None, :] + T - 1][None, None]    # (1, 1, T, T)
    plan = TorchPositionPlan(T, torch.arange(R), pair, pair, pos_key[None], pos_query[None])
    got = _torch_disentangled_attention(q, k, v, plan, keep.long(), scale=1 / scale,
                                        num_heads=H, all_head_size=H * hd, assume_unpadded=False)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# --- every form traced by torch.compile (AOTAutograd), as a compiled GPU step traces it ---------

@pytest.fixture
def traced_as_on_a_gpu(monkeypatch, h100_limits):
    """Triton with an sm_90 target where the CPU has no GPU driver: what torch.compile needs to
    trace a Triton kernel (its TTIR, for the analysis of what the kernel writes); nothing runs."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    class Target:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)
    monkeypatch.setattr(triton.runtime.driver, "_active", Target())


def graphs_of(fn, *args, run_on=None) -> list:
    """torch.compile(fn, fullgraph=True) through AOTAutograd, called on args and differentiated:
    the forward and backward graphs it traced. run_on: a FakeTensorMode in which the graphs run
    (meta tensors, whose Triton kernels nothing could run); else they run as traced (eager)."""
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def keep(gm, example):
        graphs.append(gm)
        if run_on is None:
            return make_boxed(gm)

        def run(args):
            with run_on(allow_non_fake_inputs=True):
                return gm(*args)
        run._boxed_call = True
        return run
    y = torch.compile(fn, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                      fullgraph=True)(*args)
    y.float().sum().backward()
    return graphs, y


def make_boxed(gm):
    from functorch.compile import make_boxed_func
    return make_boxed_func(gm.forward)


@pytest.mark.parametrize("form", ["gather", "gather-fp32", "onehot"])
def test_every_form_traced_by_torch_compile_trains_as_eager(form):
    """The encoder and a per-row map (positions, BootBERT's compact student), traced by
    torch.compile in one graph each way: the same outputs and gradients as eager, float64."""
    torch.manual_seed(0)
    enc = use_attention(Encoder(tiny(n_layer=2, dropout=0.0)).double(), form)
    ids = torch.randint(5, V, (2, 11))
    positions = torch.stack([torch.arange(11), torch.arange(11) * 2])  # its own map each row

    def loss(ids):
        return enc(ids).sin().sum() + enc(ids, positions=positions).cos().sum()
    out = []
    for compiled in (False, True):
        enc.zero_grad()
        if compiled:
            torch._dynamo.reset()
            graphs, y = graphs_of(loss, ids)
            assert len(graphs) == 2  # one forward, one backward: no graph break
        else:
            y = loss(ids)
            y.backward()
        out.append([y] + [p.grad.clone() for p in enc.parameters() if p.grad is not None])
    assert len(out[0]) == len(out[1]) > 10
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def fused_graphs(given_positions: bool):
    """fused_form's compiled bf16 training forward and backward, traced as on a GPU (meta tensors,
    Triton targeting sm_90), with dropout: its two graphs and output."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch._dynamo.reset()
    enc = Encoder(tiny(n_layer=2, d_model=128, n_head=2, dropout=0.1))
    enc = use_attention(enc.to(torch.bfloat16).to("meta").train(), "fused")
    ids = torch.randint(5, V, (2, 16)).to("meta")
    mask = torch.ones(2, 16, dtype=torch.long).to("meta")
    positions = torch.stack([torch.arange(16), torch.arange(16) * 2]).to("meta")
    given = positions if given_positions else None
    return graphs_of(lambda ids, mask: enc(ids, mask, positions=given), ids, mask,
                     run_on=FakeTensorMode)


@pytest.mark.parametrize("per_row", [False, True])
def test_fused_form_traced_by_torch_compile(traced_as_on_a_gpu, per_row):
    """The fused form in a compiled bf16 step: one forward graph and one backward, the package's
    Triton kernels in them (per layer: the forward; the backward's preprocessing, dQ and dK/dV),
    for a map shared by the batch and for per-row maps (BootBERT's compact student)."""
    graphs, y = fused_graphs(per_row)
    assert y.shape == (2, 16, 128) and len(graphs) == 2
    kernels = [[n.kwargs["kernel_idx"] for n in g.graph.nodes
                if "triton_kernel_wrapper" in str(n.target)] for g in graphs]
    assert [len(k) for k in kernels] == [2, 6], kernels


def test_fused_form_with_autotuned_tiles_cannot_be_traced(traced_as_on_a_gpu, monkeypatch):
    """Why every tile is given: left to the package (tiles of 0), its backward kernels autotune
    with configs whose pre_hook zeroes their atomic outputs, and torch.compile refuses to trace
    them, as the first compiled fused step on a GPU would have."""
    from machinery import kernels
    monkeypatch.setattr(kernels, "launch_configs", lambda *a: ((0, 0, 0, 0),) * 3)
    with pytest.raises(Exception, match="pre_hook and post_hook are not supported"):
        fused_graphs(False)


# --- flex attention (kernels.flex_relative) -----------------------------------------------------

@pytest.fixture
def eager_flex(monkeypatch):
    """flex_attention uncompiled: its reference path, which computes in float64."""
    import warnings
    from torch.nn.attention.flex_attention import flex_attention
    from machinery import kernels
    monkeypatch.setitem(kernels._FLEX, "cpu", flex_attention)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex's "eager mode is for debugging" note
        yield


def test_flex_attention_matches_pair_by_pair_reference(eager_flex):
    torch.manual_seed(0)
    model = use_attention(Encoder(tiny(n_head=4, position_buckets=8, max_position=64))
                          .double().eval(), "flex")
    att = model.layers[0].attn
    x, mask, bias, rel, idx = attention_inputs(model)
    with torch.no_grad():
        got = att(x, bias, rel, idx)
        want = naive_attention(att, x, mask, rel, model.buckets)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("T", [1, 9, 64])
def test_flex_encoder_equals_gather_path(eager_flex, T):
    """The whole encoder in float64, padded rows (one all padding) and T up to max_position, and
    a BootBERT MAE student whose encoder reads subsets at their own positions (per-row buckets):
    with flex as without."""
    torch.manual_seed(0)
    enc = Encoder(tiny(n_layer=2, position_buckets=8, max_position=64)).double().eval()
    heads = BootHeads(enc.config, 1, mae=True).double().eval()
    ids = torch.randint(5, V, (3, T))
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, T // 2 + 1:] = 0
    mask[2, 1:] = 0
    hide = (torch.rand(3, T) < 0.4) & (mask == 1)
    hide[:, 0] = False
    with torch.no_grad():
        want = enc(ids, mask), boot_states(enc, heads, ids, mask, hide)
        use_attention(enc, "flex")
        assert all(m.form == "flex" for m in enc.modules() if hasattr(m, "form"))
        use_attention(heads, "flex")
        got = enc(ids, mask), boot_states(enc, heads, ids, mask, hide)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_flex_only_where_it_is_exact(monkeypatch):
    """Flex drops no attention probabilities and has no CPU backward: training with dropout,
    and on the CPU any forward that records gradients, keep the gather path (never calling
    flex), and give what they gave with the gather."""
    import model as model_module
    def refuse(*a, **k):
        raise AssertionError("flex_relative called")

    enc = Encoder(tiny(n_layer=1))
    ids = torch.randint(5, V, (2, 7))
    want = {}
    for flex in (False, True):
        use_attention(enc, "flex" if flex else "gather")
        if flex:
            monkeypatch.setattr(model_module, "flex_relative", refuse)
        torch.manual_seed(1)
        want[flex] = [enc.train()(ids), enc.eval()(ids)]
        with torch.no_grad():  # dropout, nothing to differentiate
            want[flex].append(enc.train()(ids))
    for a, b in zip(want[False], want[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_flex_matches_gather_path():
    """What runs outside the tests: flex compiled (dynamic shapes), in float32, for buckets
    sliced from the encoder's (max_position, max_position) table (a strided layout that once
    made inductor's CPU template fail to build) and a padded row."""
    torch.manual_seed(0)
    enc = Encoder(tiny(n_layer=1)).eval()
    ids = torch.randint(5, V, (2, 11))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        want = enc(ids, mask)
        got = use_attention(enc, "flex")(ids, mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex's backward needs CUDA")
def test_flex_gradients_equal_gather_path_on_cuda():
    """On CUDA flex also trains (no attention dropout): values and every gradient, with padding,
    as the gather path's, in float32."""
    torch.manual_seed(0)
    enc = Encoder(tiny(n_layer=2, dropout=0.0)).cuda().train()
    ids = torch.randint(5, V, (3, 40), device="cuda")
    mask = torch.ones(3, 40, dtype=torch.long, device="cuda")
    mask[1, 25:] = 0
    out = {}
    for flex in (False, True):
        enc.zero_grad()
        y = use_attention(enc, "flex" if flex else "gather")(ids, mask)
        (y * torch.linspace(-1, 1, y.shape[-1], device="cuda")).sum().backward()
        out[flex] = [y] + [p.grad.clone() for p in enc.parameters() if p.grad is not None]
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# --- EMA -----------------------------------------------------------------------------------------

def test_ema_fused_equals_loop_and_the_formula():
    torch.manual_seed(0)
    student, teacher = Encoder(tiny()), Encoder(tiny())
    fused, loop = copy.deepcopy(teacher), copy.deepcopy(teacher)
    ema_update(fused, student, 0.9, fused=True)
    ema_update(loop, student, 0.9, fused=False)
    tensors = zip(fused.named_parameters(), loop.parameters(), teacher.parameters(),
                  student.parameters())
    for (name, a), b, t, s in tensors:
        assert torch.equal(a, b), name
        torch.testing.assert_close(a, 0.9 * t + 0.1 * s)


def test_ema_with_decay_one_keeps_the_teacher():
    torch.manual_seed(0)
    student, teacher = Encoder(tiny()), Encoder(tiny())
    before = copy.deepcopy(teacher.state_dict())
    ema_update(teacher, student, 1.0)
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())


def test_decoder_is_initialised_like_encoder_layers():
    torch.manual_seed(0)
    dec = Decoder(tiny(d_model=256, d_ff=512), 4)
    s = math.sqrt(2 / (5 * 256)) * scipy.stats.truncnorm(-2, 2).std()
    std = dec.layers[3].ffn.down.weight.std().item()
    assert std == pytest.approx(s * math.sqrt(1 / 8), rel=0.05)
    assert all(layer.attn.p == 0.0 for layer in dec.layers)  # no dropout


# --- LAMB ----------------------------------------------------------------------------------------

def lamb_reference(w, grads, lr, b1, b2, eps, wd):
    """LTG-BERT's lamb.py (babylm/train/lamb.py) for one tensor, in float64 numpy: You et al.
    (2020), Algorithm 2, with the trust ratio in groups with weight decay only."""
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + wd * w
        wn, rn = np.linalg.norm(w), np.linalg.norm(r)
        w = w - lr * (wn / rn if wd > 0 and wn > 0 and rn > 0 else 1.0) * r
    return w


@pytest.mark.parametrize("clip", [None, 1.5], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_matches_reference(wd, compiled, clip):
    """Eager, and compiled as train.py compiles it with its model (inductor, float64 here),
    against the reference transcribed from LTG-BERT, step for step; with clipping inside the
    step, the gradients first scaled by min(1, clip / (total norm + 1e-6)) as clip_grad_norm_
    scales them, and the total norm before clipping returned."""
    rng = np.random.default_rng(0)
    # a zero tensor takes the trust-ratio-1 branch; the third has no gradient at the first step,
    # so its bias correction counts one step fewer than the others'
    inits = [rng.normal(size=(5, 3)), np.zeros(4), rng.normal(size=(2,))]
    grads = [[rng.normal(size=w.shape) for _ in range(4)] for w in inits]
    grads[2] = grads[2][1:]
    params = [torch.tensor(w, requires_grad=True) for w in inits]
    opt = Lamb([{"params": params, "weight_decay": wd}], lr=0.05, betas=(0.9, 0.98), eps=1e-6,
               compile=compiled)
    seen = [[] for _ in inits]  # each tensor's gradients as the step saw them, clipped
    for t in range(4):
        now = {i: g[t - (4 - len(g))] for i, g in enumerate(grads) if t >= 4 - len(g)}
        for i, p in enumerate(params):
            p.grad = torch.tensor(now[i]) if i in now else None
        norm = math.sqrt(sum((g ** 2).sum() for g in now.values()))
        scale = 1.0 if clip is None else min(1.0, clip / (norm + 1e-6))
        for i, g in now.items():
            seen[i].append(g * scale)
        assert float(opt.step(max_norm=clip)) == pytest.approx(norm, rel=1e-12)
        for p, w, g in zip(params, inits, seen):  # after every step
            want = lamb_reference(w, g, 0.05, 0.9, 0.98, 1e-6, wd)
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12, atol=1e-12)
    if compiled:  # a new learning rate, weight decay and step count each step: no recompile
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t in range(3):
                opt.param_groups[0].update(lr=0.01 * (t + 1), weight_decay=wd * (t + 1))
                opt.step()
        assert all(torch.isfinite(p).all() for p in params)


def test_lamb_resumes_across_eager_and_compiled():
    """A checkpoint's optimizer state loads into either form (eager keeps step counts as numbers,
    compiled as tensors on the device): two steps in one form, the state through state_dict into
    the other, two more steps there, the same parameters as four steps in one form (float64)."""
    rng = np.random.default_rng(1)
    inits = [rng.normal(size=(4, 3)), rng.normal(size=(5,))]
    grads = [[rng.normal(size=w.shape) for w in inits] for _ in range(4)]

    def run(forms):
        params = [torch.tensor(w, requires_grad=True) for w in inits]
        groups = lambda: [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:]}]
        opt, saved = None, None
        for t, g in enumerate(grads):
            if t % 2 == 0:  # a new optimizer every two steps, as a resumed run makes one
                opt = Lamb(groups(), lr=0.05, compile=forms[t // 2])
                if saved is not None:
                    opt.load_state_dict(saved)
            for p, gi in zip(params, g):
                p.grad = torch.tensor(gi)
            opt.step(max_norm=1.0)
            saved = opt.state_dict()
        return [p.detach().numpy() for p in params]

    want = run([False, False])
    for forms in ([False, True], [True, False]):
        for a, b in zip(run(forms), want):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_eager_lamb_dispatches_no_op_per_tensor():
    """Eager, a LAMB step is a fixed number of dispatched operations whatever the number of
    tensors (multi-tensor kernels with the per-tensor numbers as Python scalars): a step of 3
    tensors and one of 40 dispatch the same count. Step counts kept as tensors cost four ops per
    tensor (561 at `small`'s 127 tensors), a GPU run 0.77x the tokens/s (H200, docs/bench.md)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def dispatched(n):
        params = [torch.randn(3, 2, requires_grad=True) for _ in range(n)]
        opt = Lamb([{"params": params[: n // 2], "weight_decay": 0.1},
                    {"params": params[n // 2:]}], lr=1e-3)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step(max_norm=1.0)  # the first step makes the state and the trust-ratio mask
        count = Count()
        count.n = 0
        with count:
            opt.step(max_norm=1.0)
        return count.n

    assert dispatched(3) == dispatched(40) < 60
