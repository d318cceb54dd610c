"""bench.py's whole-model rows: our MLM training step against transformers' BertForMaskedLM at
the same shape (`bert`) and against LTG-BERT's own model code with the same weights (`ltg`),
and the matrix-FLOP count behind MFU.

    python bench.py --only bert,ltg
"""

import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.ltg_bert import LtgBert
from benchmarks.timing import PROFILES, alternate, failed_row, profile_ops, row
from data.masking import mask_capacity, predicted_slots
from data.prepare import MASK, SPECIALS, VOCAB_SIZE
from machinery.plumbing import autocast, use_bf16, use_compile
from machinery.kernels import fused_unavailable
from model import PRESETS, Encoder, ModelConfig, use_attention


V = VOCAB_SIZE


# dense bf16 peak FLOP/s, for MFU (vendor datasheets; SXM parts)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12}


def flops_per_token(cfg: ModelConfig, seq_len: int, masked=0.15, batch_tokens=None) -> float:
    """Training FLOPs per token (3x forward, 2 per multiply-add): the layers' matrices, attention
    scores and values (2 T D each), the relative-position scores (2 R D each way), the MLM head
    on the `masked` share of tokens only, and, given the step's batch_tokens, each layer's
    projection of the R relative embeddings (once per step, R x D -> 2D), spread over them.
    tests/test_bench.py checks it against torch's FlopCounterMode on one step."""
    D, L, Ff = cfg.d_model, cfg.n_layer, cfg.d_ff
    R = 2 * cfg.position_buckets - 1 if cfg.position == "relative" else 0
    layer = 2 * (3 * D * D + D * D + 2 * D * Ff + Ff * D) + 2 * 2 * seq_len * D + 2 * 2 * R * D
    head = masked * 2 * (D * D + D * cfg.vocab_size)
    positions = 2 * R * D * 2 * D / batch_tokens if batch_tokens else 0.0
    return 3 * (L * (layer + positions) + head)


def bert_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """The same count for BertForMaskedLM at cfg's shape: a plain d_ff-wide FFN, no position
    scores, and the head on every position (it computes logits everywhere, then ignores -100)."""
    D, L, Ff = cfg.d_model, cfg.n_layer, cfg.d_ff
    layer = 2 * (4 * D * D + 2 * D * Ff) + 2 * 2 * seq_len * D
    return 3 * (L * layer + 2 * (D * D + D * cfg.vocab_size))


def mfu(flops_per_token: float, tokens_per_s: float, device) -> float | None:
    """Model FLOPs utilisation: the FLOP/s a rate of tokens_per_s means, over the GPU's dense
    bf16 peak (None on a CPU, or a GPU not in PEAK_BF16)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return None if peak is None else flops_per_token * tokens_per_s / peak


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
    slow spell of the machine hits both), each compiled as train.py compiles its step (the
    forward and the loss in one torch.compile; on with CUDA, --compile/--no-compile to choose).
    Ours reads the predicted positions as train.py does, a fixed number of slots (no boolean
    indexing, so no host sync); BERT computes logits everywhere and ignores the -100 labels.
    A row per --attention form of ours, BERT built and compiled once per size for all of them.
    mfu and ref_mfu: each model's own FLOPs per token over the GPU's peak; first_step_s and
    ref_first_step_s: the seconds of each model's first step (its compilation, when compiled;
    BERT's on the first form's row). --variants adds, per size, ours with absolute positions and
    both models without dropout."""
    try:
        from transformers import BertConfig, BertForMaskedLM
    except ImportError:
        print("note: transformers is not installed; the BertForMaskedLM rows are skipped (it is "
              "never a requirement)")
        return
    B, T = args.batch_size, args.seq_len
    warmup, repeat = (1, 3) if args.quick else (3, 10)
    bf16, compiled = use_bf16(device, args.bf16), use_compile(device, args.compile)
    fused = {"fused": True} if device.type == "cuda" else {}
    ids, masked, inp, att = mlm_batch(B, T, device)
    labels = torch.where(masked, ids, -100)
    slots = predicted_slots(labels, mask_capacity(B, T, 0.15, mean_span=1.0))     # (C,)
    targets = labels.flatten()[slots]                                           # -100: padding
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
            p = cfg.dropout
            bert = BertConfig(vocab_size=V, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
                              num_attention_heads=cfg.n_head, intermediate_size=cfg.d_ff,
                              max_position_embeddings=cfg.max_position, hidden_dropout_prob=p,
                              attention_probs_dropout_prob=p)
            theirs = BertForMaskedLM(bert).to(device).train()
            opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-4, **fused)

            def loss_theirs():
                with amp:
                    return theirs(input_ids=inp, attention_mask=att, labels=labels).loss

            if compiled:  # both or neither; compiling happens in each model's first step
                torch._dynamo.reset()  # each size compiles afresh: no recompile limit reached
                loss_theirs = torch.compile(loss_theirs)
            step_theirs = training_step(loss_theirs, opt_theirs)
            theirs_first = first_step_seconds(step_theirs, device)
            for form in args.attention:
                head_dim = cfg.d_model // cfg.n_head
                case = f"mlm step {size} {B}x{T}{name}" + (", compiled (both)" if compiled else "")
                case += f", ours {form}" if form != "gather" else ""
                if form == "fused" and (why := fused_unavailable(device, head_dim)):
                    yield failed_row("bert", case, why)
                    continue
                ours = use_attention(Encoder(cfg), form).to(device).train()

                def loss_ours():  # train.py's mlm loss: the head on the C slots, padding out
                    with amp:
                        _, logits = ours(inp, att, predict=slots)                 # (C, V)
                    return F.cross_entropy(logits.float(), targets, ignore_index=-100)

                step_ours = training_step(torch.compile(loss_ours) if compiled else loss_ours,
                                          torch.optim.AdamW(ours.parameters(), lr=1e-4, **fused))
                ours_first = first_step_seconds(step_ours, device)
                a, b = alternate(step_ours, step_theirs, B * T, device, warmup, repeat)
                params = f"{ours.num_params() / 1e6:.1f}M vs {theirs.num_parameters() / 1e6:.1f}M"
                case += f" ({params} params)"
                ours_flops = flops_per_token(cfg, T, len(slots) / (B * T), B * T)
                theirs_flops = bert_flops_per_token(cfg, T)
                yield row("bert", case, "tokens/s", a, "BertForMaskedLM", b,
                          flops_ratio=ours_flops / theirs_flops,
                          mfu=mfu(ours_flops, statistics.median(a), device),
                          ref_mfu=mfu(theirs_flops, statistics.median(b), device),
                          first_step_s=ours_first, ref_first_step_s=theirs_first, form=form)
                theirs_first = None  # BERT's first step once, on the first form's row
                if args.profile:
                    PROFILES[f"bert: {case}"] = {
                        "ours": profile_ops(step_ours, device, args.profile),
                        "BertForMaskedLM": profile_ops(step_theirs, device, args.profile)}


def training_step(loss, optimizer):
    """One optimizer step on loss(): backward, step, gradients set to None."""
    def step():
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def first_step_seconds(step, device) -> float:
    """Seconds of step's first call, the GPU waited for: its compilation, when compiled."""
    t = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_ltg(args, device, tmp):
    """Our MLM step against LTG-BERT's model code (ltg_bert.py) with the same weights, the
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
        flops = flops_per_token(cfg, T, masked.float().mean().item(), B * T)
        yield row("ltg", case, "tokens/s", a, "LTG-BERT model code", b,
                  max_abs_diff=diff.max().item(), mfu=mfu(flops, statistics.median(a), device),
                  ref_mfu=mfu(flops, statistics.median(b), device))
        if args.profile:
            PROFILES[f"ltg: {case}"] = {name: profile_ops(fn, device, args.profile)
                                        for name, fn in
                                        (("ours", step_ours), ("LTG-BERT model code", step_ltg))}
