"""Pretrain the shared encoder with one objective: batches -> masking -> its loss -> step.

    python train.py --objective mlm --data babylm_10m --size tiny --max-steps 2000   # CPU demo
    python train.py --objective mlm --data babylm_10m --size small            # one GPU, compiled
    torchrun --nproc_per_node 4 train.py --objective mlm --data babylm_10m     # DDP
    python train.py --out-dir runs/mlm_babylm_10m_small --resume               # continue
    python train.py --objective boot --data babylm_10m                         # BootBERT
    python train.py --objective kd+mlm --data babylm_10m --phase1-steps 0.2    # MLM, then KD
    python train.py --objective mlsm+mlm --data babylm_10m                     # MLM, then MLSM
    python train.py --objective mlm --two-phase --masking uniform              # their baseline

The data is prepared on first use (data/prepare.py). A run folder (--out-dir; opened by
helpers/training_run.py) keeps the settings, log, checkpoints and code of a run. SIGINT/SIGTERM
save the current step and print the --resume command.

Adding an objective = its loss function `loss, stats = fn(model, batch, extras)` (+ a setup
function if it trains extra modules or needs a teacher) + one OBJECTIVES entry; the loop names no
objective. Two-phase objectives (kd, kd+mlm, mlsm, mlsm+mlm) train plain MLM for
--phase1-steps, keep that model as phase1.pt, then continue with the objective against it as a
frozen teacher: one command, one schedule per phase. mlsm learns its dictionary between the
phases (sparse.dictionary_for_run, into RUN/dict.pt). mlm --two-phase runs the same schedule
with MLM in phase 2: the baseline they are compared with. Each objective defaults to its paper's
recipe (OBJECTIVES[...].defaults; docs/objectives/ has the recipe cards).

Reproducibility: batches and masks are functions of (seed, step, micro-batch), and dropout is
reseeded the same way at every micro-batch, so a run resumed from any checkpoint follows the very
path of an uninterrupted one (bit for bit on CPU; tests/test_train.py checks it).
"""
import argparse
import contextlib
import copy
import functools
import json
import time
from dataclasses import fields
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import sparse
from data.prepare import VOCAB_SIZE
from helpers.training_run import (ObjectiveParts, Phase, Run, check_warmup, checked_settings,
                                  describe, log_line, nothing_to_do, open_run, save,
                                  save_words_flag, start_phase, summary, train_batch, validate,
                                  word_marks)
from machinery import flags
from machinery.device import add_device_flag, use_compile
from machinery.optim import ema_decay_at, ema_update, set_schedule
from machinery.progress import bar, line_buffered
from machinery.run_folder import REPO, repo_sources
from machinery.stopping import SafetyNet, exit_now, on_stop_signals
from model import (PARTS, PRESETS, BootHeads, BootPredictor, ModelConfig, boot_states, init_linears,
                   load_checkpoint, small_init)


# ---------------------------------------------------------------------------------------------
# Objectives: loss, stats = fn(model, batch, extras)
#   model:   a Trainee; model.encoder is the shared Encoder, model.heads what the objective adds
#   batch:   input_ids (B, T) clean, attention_mask (B, T), inputs (B, T) masked, labels (B, T)
#            (-100 where nothing is predicted); slots (C,) the flat positions b * T + t of the
#            predicted tokens, then padding slots; targets (C,) their labels, -100 in padding
#   extras:  what the loss reads besides the batch that the optimizer does not train: frozen
#            teachers, a dictionary..., and "args"; a mean teacher under "ema" is updated by the
#            loop after every optimizer step
#   stats:   {name: 0-dim tensor}, averaged over the log interval and written to log.jsonl
# Losses are means over the predicted slots, padding weighed out: a batch with nothing to
# predict gives 0 and no gradient, not 0/0. No tensor becomes a Python number in a loss.


def slot_mean(x, predicted):
    """x (C,) per slot -> its mean over the predicted slots (predicted (C,) bool)."""
    return torch.where(predicted, x, 0.0).sum() / predicted.sum().clamp(min=1)


def cross_entropy(logits, targets):
    """Mean cross-entropy over the slots whose target is not -100."""
    per_slot = F.cross_entropy(logits.float(), targets, reduction="none")  # 0 where -100
    return slot_mean(per_slot, targets != -100)


def slot_accuracy(logits, targets):
    return slot_mean((logits.argmax(-1) == targets).float(), targets != -100)


def mlm(model, batch, extras):
    """Masked language modelling (Devlin et al. 2019): cross-entropy at the chosen positions."""
    _, logits = model.encoder(batch["inputs"], batch["attention_mask"],
                              predict=batch["slots"])                       # (C, V)
    return cross_entropy(logits, batch["targets"]), {"acc": slot_accuracy(logits, batch["targets"])}


def causal_rows(B: int, fraction: float) -> int:
    """How many of a batch's B rows are causal: round(B f), but at least one for f > 0 and at
    most B - 1 for f < 1, so that a small batch keeps both objectives. A Python int, from flags
    alone: the split is static, one graph."""
    return min(max(round(B * fraction), int(fraction > 0)), B - int(fraction < 1))


def gpt_bert(model, batch, extras):
    """GPT-BERT's hybrid (Charpentier & Samuel 2024, "GPT or BERT: why not both?", sec. 2): the
    first rows of the batch are masked next-token prediction (MNTP), the last B_c causal LM
    (B_c = causal_rows), in the same encoder and its relative attention.
      MNTP:   bidirectional, masked as for MLM; a masked token at t is predicted from the state
              at t - 1, the position before it, so the head predicts the next token in both.
              [CLS] (t = 0) is never masked, so t - 1 stays in the row.
      causal: the clean text under a causal mask; the state at t predicts the token at t + 1,
              [CLS]'s the first, up to the last token of the window (its closing [SEP] marks
              only where the window was cut: gpt-bert has no such target).
    loss = (1 - c) L_mntp + c L_clm, c = B_c / B, each a mean over its own tokens (gpt-bert
    gives each GPU one objective and averages the GPUs' means: the same weighting), plus
    gpt-bert's z-loss 1e-4 mean(logsumexp(logits)^2) on every scored position."""
    B, T = batch["input_ids"].shape
    n = B - causal_rows(B, extras["args"].causal_fraction)                 # MNTP rows: [0, n)
    parts = {}                                 # name: (its share, logits (N, V), targets (N,))
    if n > 0:
        slots, targets = batch["slots"], batch["targets"]                  # (C,)
        mine = (targets != -100) & (slots < n * T)  # masked, rows [0, n)
        before = torch.where(mine, slots - 1, 0)                           # (C,) t - 1, same row
        _, logits = model.encoder(batch["inputs"][:n], batch["attention_mask"][:n],
                                  predict=before)                          # (C, V)
        parts["mntp"] = (n / B, logits, torch.where(mine, targets, -100))
    if n < B:
        ids, mask = batch["input_ids"][n:], batch["attention_mask"][n:]   # (B_c, T)
        h = model.encoder(ids, mask, causal=True)                          # (B_c, T, D)
        # every token of the text a target, not the [SEP] that closes the window
        logits = model.encoder.head(h[:, :-2]).flatten(0, 1)               # (B_c (T-2), V)
        targets = ids[:, 1:-1].masked_fill(mask[:, 1:-1] == 0, -100).flatten()
        parts["clm"] = ((B - n) / B, logits, targets)
    loss, z, stats = 0, 0, {}
    for name, (share, logits, targets) in parts.items():
        part = cross_entropy(logits, targets)
        loss = loss + share * part
        z = z + share * slot_mean(torch.logsumexp(logits.float(), -1) ** 2, targets != -100)
        stats[f"{name}_acc"], stats[f"{name}_loss"] = slot_accuracy(logits, targets), part.detach()
    return loss + 1e-4 * z, {**stats, "z_loss": z.detach()}


def boot(model, batch, extras):
    """Latent bootstrapping (Samuel 2023, "Mean BERTs make erratic language teachers", sec. 3).

    The student encoder sees only the kept tokens, each at its original position (a masked
    autoencoder, He et al. 2022); its states are scattered back to full length with a learned
    vector at the hidden positions, and a light decoder reads that (model.boot_states, which
    also scores the checkpoint). At the hidden positions a head regresses the mean teacher's
    last-layer states (after its final affine LayerNorm, then LayerNorm-ed without affine, as
    boot-bert) with smooth-L1, and the tied MLM head predicts the tokens:
    loss = lb_weight * LB + mlm_weight * MLM. Student, teacher and decoder each end in an affine
    LayerNorm (--final-norm, on for boot).
    """
    args, enc, heads = extras["args"], model.encoder, model.heads
    ids, mask, slots, targets = (batch[k] for k in ("input_ids", "attention_mask", "slots",
                                                    "targets"))
    hide = batch["labels"] != -100                                         # (B, T)
    predicted = targets != -100                                            # (C,)
    out = boot_states(enc, heads, batch["inputs"], mask, hide, extras["compact"])
    out = out.flatten(0, 1)[slots]                                         # (C, D)
    with torch.no_grad():
        target = extras["ema"](ids, mask).flatten(0, 1)[slots].float()        # (C, D)
        target = F.layer_norm(target, target.shape[-1:])
    per_slot = F.smooth_l1_loss(heads.regress(out).float(), target, reduction="none").mean(-1)
    lb = slot_mean(per_slot, predicted)
    logits = enc.head(out)                                                 # (C, V)
    ce = cross_entropy(logits, targets)
    # a collapse gauge: how much the targets differ from token to token, per dimension (1: as
    # much as within a vector; 0: every position gets the same target); the predicted slots'
    # standard deviation, written out so that the padding slots stay out of it
    w, n = predicted[:, None].float(), predicted.sum()
    centred = target - (target * w).sum(0) / n.clamp(min=1)
    spread = ((centred ** 2 * w).sum(0) / (n - 1).clamp(min=1)).sqrt().mean()
    stats = {"lb": lb, "mlm": ce, "acc": slot_accuracy(logits, targets), "target_std": spread}
    return args.lb_weight * lb + args.mlm_weight * ce, stats


def setup_boot(encoder, args, run_dir, device) -> ObjectiveParts:
    """The student's extra parts, and the mean teacher: an EMA copy of the encoder (its
    embeddings, layers and final norm, not the decoder). As extras["ema"], the loop updates it after
    every optimizer step, its decay scheduled over the phase (optim.ema_decay_at)."""
    # --decoder-layers, by default a third of the encoder's, at least 1: the paper's 4 on 12
    n = args.decoder_layers or max(1, encoder.config.n_layer // 3)
    heads = BootHeads(encoder.config, n, args.boot_student == "mae")
    ema = copy.deepcopy(encoder).eval().requires_grad_(False)
    # compiled, the student reads all T slots: the kept count varies per batch (boot_states)
    extras = {"ema": ema, "compact": not use_compile(torch.device(device), args.compile)}
    return ObjectiveParts(heads, extras=extras, saved={"ema": ema})


def kd(model, batch, extras, with_mlm=False):
    """Knowledge distillation (Hinton et al. 2015) from the frozen phase-1 model (Berend 2023,
    "Better Together", sec. 2.2): KL(teacher || student) over the vocabulary at the masked
    positions, mean over positions, at temperature T and times T^2 (so gradients keep their
    size as T changes); kd+mlm adds --mlm-weight x the MLM cross-entropy."""
    args, slots, targets = extras["args"], batch["slots"], batch["targets"]
    _, logits = model.encoder(batch["inputs"], batch["attention_mask"], predict=slots)  # (C, V)
    with torch.no_grad():
        seen = batch["input_ids"] if args.kd_teacher_input == "clean" else batch["inputs"]
        # a boot teacher hides what it predicts from its encoder, as it was trained to
        hidden = ({"hide": batch["labels"] != -100} if isinstance(extras["teacher"], BootPredictor)
                  else {})
        _, teacher = extras["teacher"](seen, batch["attention_mask"], predict=slots, **hidden)
    T = args.kd_temperature
    per_slot = F.kl_div(F.log_softmax(logits.float() / T, -1),
                        F.log_softmax(teacher.float() / T, -1),
                        log_target=True, reduction="none").sum(-1)              # (C,)
    kl = slot_mean(per_slot, targets != -100) * T * T
    ce = cross_entropy(logits, targets)
    stats = {"kd": kl, "mlm": ce, "acc": slot_accuracy(logits, targets)}
    return kl + (args.mlm_weight * ce if with_mlm else 0.0), stats


def load_teacher(encoder, args, run_dir, device, encoder_only=False):
    """(the frozen teacher, its path): this run's phase-1 model, or --teacher. kd reads its
    predictions (a boot checkpoint's through its decoder), mlsm its encoder's states."""
    path = args.teacher or Path(run_dir) / "phase1.pt"
    teacher, _ = load_checkpoint(path, device, encoder_only)
    if teacher.predicts_before and not encoder_only:
        raise SystemExit(f"error: the teacher {path} is a gpt-bert model, which predicts a masked "
                         f"token from the position before it; kd reads a teacher where the token "
                         f"is")
    if teacher.config.vocab_size != encoder.config.vocab_size:
        raise SystemExit(f"error: the teacher {path} has a {teacher.config.vocab_size}-token "
                         f"vocabulary, the data {encoder.config.vocab_size}")
    return teacher.requires_grad_(False), path


def setup_kd(encoder, args, run_dir, device) -> ObjectiveParts:
    """The frozen teacher. A boot teacher inside a compiled step reads all T slots, as a
    compiled boot student does (boot_states: a static shape, no host sync)."""
    teacher = load_teacher(encoder, args, run_dir, device)[0]
    if isinstance(teacher, BootPredictor):
        teacher.compact = not use_compile(torch.device(device), args.compile)
    return ObjectiveParts(extras={"teacher": teacher})


# the MLSM code's targets (szegedai/MLSM, sparser.py): this many FISTA steps from zero, no stopping
# test; --mlsm-coder fista100 is named for it
MLSM_FISTA_STEPS = 100


def mlsm(model, batch, extras, with_mlm=False):
    """Masked latent semantic modeling (Berend 2023, "Masked Latent Semantic Modeling", sec. 3;
    "Better Together", sec. 2.3). At every masked position the frozen phase-1 model, reading the
    unmasked sequence, gives its layer-L state h; the target is the l1-normalised non-negative
    sparse code of h / ||h|| under the dictionary D (d, k), a distribution over k latent
    properties; the student predicts it with a k-way softmax over its MLM-head features.
    Loss: KL(target || prediction), mean over the positions whose code is not all zero (those
    have no distribution to predict and are left out, counted in zero_rate); mlsm+mlm adds
    --mlm-weight x the MLM cross-entropy at the same positions."""
    args, enc, slots, targets = extras["args"], model.encoder, batch["slots"], batch["targets"]
    predicted = targets != -100                                           # (C,)
    with torch.no_grad():
        states = extras["teacher"](batch["input_ids"], batch["attention_mask"], all_layers=True)
        h = states[extras["layer"]].flatten(0, 1)[slots]                     # (C, d)
        with torch.autocast(h.device.type, enabled=False):
            h = F.normalize(h.float(), dim=-1)
            if args.mlsm_coder == "fista100":  # the MLSM code's targets
                codes = sparse.fista_fixed(h, extras["dict"], args.mlsm_lam, MLSM_FISTA_STEPS,
                                           extras["L"], extras["momentum"])             # (C, k)
            else:  # its working set is sized by the data: run eagerly (setup_mlsm)
                codes = extras["exact_coder"](h, extras["dict"], args.mlsm_lam, args.mlsm_iters,
                                           args.mlsm_tol)
        mass = codes.sum(1, keepdim=True)                                 # (C, 1)
        coded = (mass.squeeze(1) > 0) & predicted                         # (C,)
        # rows sum to 1; all-zero codes and padding slots stay 0
        target = codes / mass.clamp(min=torch.finfo(codes.dtype).tiny) * coded[:, None]
        n_coded = coded.sum().clamp(min=1)
    feats = enc.head_in(enc(batch["inputs"], batch["attention_mask"]).flatten(0, 1)[slots])
    logp = F.log_softmax(model.heads.latent(feats).float(), -1)           # (C, k)
    # an all-zero target row adds exactly 0 to the sum (kl_div takes 0 log 0 = 0), so dividing by
    # the number of coded rows is the batch mean over those rows, without a host sync
    kl = F.kl_div(logp, target, reduction="sum") / n_coded
    stats = {"kl": kl, "nnz": ((codes > 0) & coded[:, None]).sum() / n_coded,
            "zero_rate": 1 - coded.sum() / predicted.sum().clamp(min=1)}
    if not with_mlm:
        return kl, stats
    logits = F.linear(feats, enc.word.weight, enc.head_bias)              # (C, V)
    ce = cross_entropy(logits, targets)
    return kl + args.mlm_weight * ce, {**stats, "mlm": ce, "acc": slot_accuracy(logits, targets)}


# train.py's mlsm flags -> the sparse.DictConfig fields they set (their defaults come from there)
DICT_FLAGS = {"mlsm_layer": "layer", "mlsm_k": "k", "mlsm_lam": "lam", "dict_vectors": "vectors",
              "dict_epochs": "epochs", "dict_max_freq": "max_freq"}
DICT_FLAG_NAMES = {f: "--" + a.replace("_", "-") for a, f in DICT_FLAGS.items()}


def dict_config(args) -> sparse.DictConfig:
    """The dictionary train.py's flags ask for."""
    given = {field: getattr(args, flag) for flag, field in DICT_FLAGS.items()}
    return sparse.DictConfig(seq_len=args.seq_len, seed=args.seed, **given)


def setup_mlsm(encoder, args, run_dir, device) -> ObjectiveParts:
    """The frozen teacher (as kd), the dictionary of its layer --mlsm-layer, and the student's
    k-way head (a Linear on the MLM head's features, N(0, s) weight, zero bias: a separate head
    rather than k extra tied rows, so the MLM head stays as it is). The dictionary is
    RUN/dict.pt: --dict is copied there; without one, it is learned from the teacher (rank 0; the
    others wait), so a resumed run and its code/ folder keep the very dictionary it trained on."""
    teacher, teacher_path = load_teacher(encoder, args, run_dir, device, encoder_only=True)
    path = Path(run_dir) / "dict.pt"
    sparse.dictionary_for_run(path, args.dict, teacher_path, teacher.config.n_layer, args.data,
                              dict_config(args), device, DICT_FLAG_NAMES)
    n_layer = teacher.config.n_layer
    D, layer = sparse.load_dictionary(path, teacher.config.d_model, n_layer)
    if "mlsm_layer" in args.given and args.mlsm_layer % (n_layer + 1) != layer:
        raise SystemExit(f"error: the dictionary {path} was learned on layer {layer}, not "
                         f"--mlsm-layer {args.mlsm_layer}")
    head = nn.Linear(encoder.config.d_model, D.shape[1])
    init_linears(small_init(encoder.config.d_model), head)
    D = D.to(device)
    L = torch.linalg.matrix_norm(D, ord=2) ** 2  # fista_fixed's step 1/L, of the frozen D: once
    extras = {"teacher": teacher, "dict": D, "L": L, "layer": layer,
              "momentum": sparse.fista_momentum(MLSM_FISTA_STEPS, device)}
    if args.mlsm_coder == "exact":  # outside any compiled graph: a break in a compiled step
        extras["exact_coder"] = torch.compiler.disable(sparse.sparse_code)
    return ObjectiveParts(nn.ModuleDict({"latent": head}), extras=extras)


class Objective(NamedTuple):
    loss: Callable                  # (model, batch, extras) -> (loss, stats)
    setup: Callable | None = None   # (encoder, args, run_dir, device) -> ObjectiveParts
    two_phase: bool = False         # plain MLM first; then this, taught by the phase-1 model
    defaults: dict | None = None    # shared flags whose default differs, as its paper trained it
    note: str | Callable | None = None  # said as a run starts (a function: of the args)


UNIFORM = dict(masking="uniform")  # Berend 2023's masking, in both phases (szegedai/MLSM)
OBJECTIVES = {
    "mlm": Objective(mlm),
    "gpt-bert": Objective(gpt_bert, note=lambda args: (
        f"gpt-bert trains {causal_rows(args.batch_size, args.causal_fraction)} of each "
        f"micro-batch's {args.batch_size} rows causally, the rest masked next-token prediction "
        f"(--causal-fraction {args.causal_fraction:g})")),
    "boot": Objective(boot, setup_boot, defaults=dict(lr=5e-3, weight_decay=0.02,
                                                      weight_decay_end=0.2, mlm_weight=0.1,
                                                      final_norm=True)),
    "kd": Objective(kd, setup_kd, two_phase=True, defaults=UNIFORM),
    "kd+mlm": Objective(functools.partial(kd, with_mlm=True), setup_kd, two_phase=True,
                        defaults=UNIFORM),
    # faithful: Berend 2023 (Table 1a) has MLSM alone below MLSM+MLM on BLiMP
    "mlsm": Objective(mlsm, setup_mlsm, two_phase=True, defaults=UNIFORM, note=(
        "mlsm's phase 2 trains the latent head alone: no loss trains the vocabulary logits after "
        "phase 1 while the encoder under them moves, and BLiMP's pseudo-log-likelihoods read "
        "those logits; mlsm+mlm is the joint objective")),
    "mlsm+mlm": Objective(functools.partial(mlsm, with_mlm=True), setup_mlsm, two_phase=True,
                          defaults=UNIFORM),
}
TWO_PHASE = sorted(name for name, o in OBJECTIVES.items() if o.two_phase)

# Per-size defaults, under an objective's own. On an H100 `small` MLM at LAMB lr 1e-2 with
# 128 x 128 batches diverged in two seeds, and ran 10 epochs stably at 5e-3; LTG-BERT's 1e-2 goes
# with 8x larger batches (docs/objectives/mlm.md, deviation 4). `tiny` keeps the CPU sweep's 1e-2
# (docs/studies/tiny_mlm.md).
SIZE_DEFAULTS = {"tiny": dict(lr=1e-2), "small": dict(lr=5e-3), "base": dict(lr=5e-3)}


def has_phase1(args) -> bool:
    """Whether an MLM phase comes first: kd and mlsm (unless --teacher), mlm --two-phase."""
    return (OBJECTIVES[args.objective].two_phase or args.two_phase) and not args.teacher


def phase1_steps(args) -> int:
    if not has_phase1(args):
        return 0
    p = args.phase1_steps
    return round(p * args.max_steps) if p < 1 else int(p)


def phase_of(step, args):
    """(objective, first step, end step) of the training phase that `step` belongs to."""
    p1 = phase1_steps(args)
    return ("mlm", 0, p1) if step < p1 else (args.objective, p1, args.max_steps)


def phase_at(run: Run, step: int) -> Phase:
    """The phase `step` belongs to, ready to train (training_run.start_phase)."""
    objective, start, end = phase_of(step, run.args)
    return start_phase(run, step, objective, start, end, OBJECTIVES[objective])


# ---------------------------------------------------------------------------------------------
# Arguments


# GPT-BERT's mixes, named as the BabyLM 2025 baselines: gpt-bert trains 15 masked : 1 causal
# (hybrid_numerator/denominator 15/16); the baselines' own shares are not published (recipe card)
MIXES = {"masked-focus": 1 / 16, "mixed": 1 / 2, "causal-focus": 15 / 16}


def causal_fraction(text: str) -> float:
    """--causal-fraction: a named mix, or a number."""
    return MIXES[text] if text in MIXES else float(text)


def build_parser():
    p = flags.Parser(prog="train.py", description=__doc__, allow_abbrev=False)
    add = p.add_argument
    add("--objective", default="mlm", choices=sorted(OBJECTIVES), help="pretraining objective")
    add("--data", default="babylm_10m", help="corpus name under $NANOMLM_RAW, a folder of text "
        "files, or a prepared folder")
    # the 5 specials and 256 byte pieces at least (sentencepiece may need more for a corpus)
    add("--vocab-size", type=int, default=VOCAB_SIZE,
        help="sentencepiece vocabulary when the data is prepared", range=flags.at_least(262))
    add("--size", default="small", choices=PRESETS,
        help="model preset; ModelConfig flags below override it")
    add("--seq-len", type=int, default=128, range=flags.at_least(3),
        help="tokens per sequence, [CLS] and [SEP] included")
    add("--batch-size", type=int, default=128, range=flags.at_least(1),
        help="sequences per micro-batch per process")
    add("--grad-accum", type=int, default=1, range=flags.at_least(1),
        help="micro-batches per optimizer step")
    add("--optim", default="lamb", choices=["adamw", "lamb"],
        help="optimizer; betas (0.9, 0.98), eps 1e-6")
    add("--lr", type=float, default=1e-2, help="peak learning rate (default: tiny 1e-2, small "
        "and base 5e-3; boot 5e-3; see docs/objectives/mlm.md)", range=flags.at_least(0))
    add("--warmup", type=float, default=0.016,
        help="warmup: a fraction of --max-steps if < 1, else steps", range=flags.at_least(0))
    add("--schedule", default="cosine", choices=["cosine", "linear"], help="decay after warmup")
    add("--min-lr", type=float, default=0.1, range=flags.Range(0, 1),
        help="final learning rate as a fraction of --lr")
    add("--weight-decay", type=float, default=0.1, help="decoupled weight decay on weight "
        "matrices (default 0.1; boot 0.02, rising to 0.2)", range=flags.at_least(0))
    add("--weight-decay-end", type=float, default=None, range=flags.at_least(0),
        help="cosine weight decay from --weight-decay to this over the phase (default: "
        "constant; boot 0.2)")
    add("--clip", type=float, default=2.0, range=flags.at_least(0),
        help="gradient-norm clipping, 0 = off")
    add("--spike", type=float, default=10.0, range=flags.at_least(0),
        help="stop a diverging run: when a log interval's mean gradient norm exceeds this "
        "multiple of its median over the phase so far, or its loss stays 1 nat above the "
        "phase's lowest for two log lines; 0 = off")
    add("--mask-p", type=float, default=0.15, help="fraction of tokens to predict",
        range=flags.Range(0, 1, low_open=True, high_open=True))
    add("--causal-fraction", type=causal_fraction, default=1 / 16, range=flags.Range(0, 1),
        help="gpt-bert: the share of each batch trained causally, the rest masked next-token "
        "prediction; a decimal fraction, or masked-focus (1/16, gpt-bert's 15:1), mixed (1/2) "
        "or causal-focus (15/16) (default masked-focus)")
    add("--masking", default="span", choices=["span", "token", "uniform"], help="span: "
        "LTG-BERT's spans, 80/10/10 per span; token: BERT's, each token chosen alone, 80/10/10 "
        "(the synthetic-language blog's); uniform: int(p T) tokens per sequence, all [MASK], as "
        "the MLSM code (default span; kd, kd+mlm, mlsm, mlsm+mlm uniform)")
    add("--max-steps", type=int, default=None, range=flags.at_least(1),
        help="optimizer steps (default: --epochs of the training data at the global batch)")
    add("--epochs", type=float, default=10.0, help="the budget when --max-steps is not given: "
        "passes over the training segments, rounded down to whole steps (default 10, BabyLM's "
        "limit: 7,246 steps of 128 x 128 on babylm_10m)", range=flags.above(0))
    add("--seed", type=int, default=0, range=flags.at_least(0),
        help="seed for init, data order, masks and dropout")
    add_device_flag(add, "where to train")
    add("--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the model (default: on with CUDA, off on the CPU)")
    add("--attention", default="gather", choices=["gather", "onehot"], help="how relative "
        "attention picks each pair's position bucket: a gather (default), or a one-hot product "
        "whose backward needs no atomics on a GPU; the same function (tests/test_model.py), "
        "not yet timed against each other on a GPU")
    add("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
        help="with --compile on CUDA, replay the compiled step's forward and backward as CUDA "
        "graphs (torch.compile mode reduce-overhead): fewer kernel launches, more memory; off "
        "until measured faster (docs/bench.md)")
    add("--bf16", action=argparse.BooleanOptionalAction, default=None,
        help="bfloat16 autocast of the forward pass; weights, optimizer and losses stay float32 "
        "(default: on with CUDA, off on the CPU; measured 2x faster on a CPU with AMX: see "
        "docs/bench.md)")
    add("--deterministic", action=argparse.BooleanOptionalAction, default=False, help="torch's "
        "deterministic kernels only: resumes agree bit for bit on a GPU too, a little slower")
    add("--out-dir", default=None, help="run folder (default runs/OBJECTIVE_DATA_SIZE)")
    add("--resume", action="store_true",
        help="continue the run in --out-dir from its ckpt.pt, with its saved settings")
    add("--init-from", default=None,
        help="start from this checkpoint's weights (fresh optimizer, step 0)")
    add("--reset", default="", help="with --init-from, re-initialise these parts instead of "
        "loading them: embeddings (token embeddings and the tied output; the vocabulary may "
        "then differ), positions; comma-separated")
    add("--freeze", default="", help="parts that get no updates: embeddings (the token "
        "embeddings, so the tied output too)")
    add("--log-every", type=int, default=50, range=flags.at_least(1),
        help="steps between log lines")
    add("--eval-every", type=int, default=500, range=flags.at_least(1),
        help="steps between validations")
    add("--eval-batches", type=int, default=20,
        help="validation batches, always the same ones", range=flags.at_least(1))
    add("--save-every", type=int, default=1000, range=flags.at_least(1),
        help="steps between checkpoints")
    add("--save-words", default="", type=save_words_flag, help="also keep the weights when "
        "this many training words have been seen, as chck_<N>.pt in the run folder (export.py "
        "makes them the BabyLM pipeline's folders): a list such as 1M,2M,500K, or babylm "
        "(BabyLM 2025: every 1M to 10M, then every 10M to 100M)")
    add("--check", action="store_true", help="check the flags, print the settings they resolve "
        "to (defaults applied) as JSON, and exit without training (study.py's pre-flight)")
    add("--stop-at", type=int, default=None, help="checkpoint and exit after this step; the "
        "schedule still runs to --max-steps (for time-limited jobs)", range=flags.at_least(1))
    add_boot = p.add_argument_group("boot (latent bootstrapping, Samuel 2023)").add_argument
    add_boot("--lb-weight", type=float, default=1.0, range=flags.at_least(0),
             help="weight of the latent-bootstrapping loss; 0 removes it")
    add_boot("--mlm-weight", type=float, default=1.0, range=flags.at_least(0),
             help="weight of the MLM loss in kd+mlm, mlsm+mlm and boot (default 1; boot 0.1, "
             "its decoder's)")
    add_boot("--ema-start", type=float, default=0.996, range=flags.Range(0, 1),
             help="mean-teacher EMA decay at the first step")
    add_boot("--ema-end", type=float, default=1.0, range=flags.Range(0, 1),
             help="EMA decay at the last step, reached linearly")
    add_boot("--decoder-layers", type=int, default=None, range=flags.at_least(1),
             help="layers of the student's decoder (default: a third of --n-layer, at least 1; "
             "the paper's 4 on 12)")
    add_boot("--boot-student", default="mae", choices=["mae", "bert"],
             help="mae: the encoder sees the kept tokens only; bert: the whole masked input "
             "(ablation)")
    add_phased = p.add_argument_group(
        "kd, kd+mlm, mlsm, mlsm+mlm, mlm --two-phase (a phase of MLM, then the objective, taught "
        "by that model; Berend 2023)").add_argument
    add_phased("--phase1-steps", type=float, default=0.2, range=flags.above(0),
               help="MLM steps of phase 1: a fraction of --max-steps if < 1, else steps")
    add_phased("--two-phase", action="store_true",
               help="mlm only: train in kd's two phases, the second restarting optimizer and "
               "warm-up from the phase-1 weights (Better Together's baseline)")
    add_phased("--teacher", default=None,
               help="distil from this checkpoint instead of training a phase 1")
    add_phased("--student-init", default="continued", choices=["continued", "scratch"],
               help="phase 2 starts from the phase-1 weights, or from a fresh init")
    add_phased("--kd-temperature", type=float, default=1.0, range=flags.above(0),
               help="softmax temperature T; the KL is scaled by T^2")
    add_phased("--kd-teacher-input", default="clean", choices=["clean", "masked"],
               help="what the teacher reads")
    add_phased("--dict", default=None, help="mlsm: a dictionary from sparse.py (default: learn "
               "one from the teacher into RUN/dict.pt)")
    flags.add_fields(add_phased, sparse.DictConfig, DICT_FLAGS, prefix="mlsm: ",
                     ranges=sparse.DICT_RANGES)
    add_phased("--mlsm-coder", default="fista100", choices=["fista100", "exact"],
               help="mlsm: the targets' codes: fista100, 100 plain FISTA steps from zero as the "
               "MLSM code (denser, softer); exact, the working-set FISTA run to --mlsm-tol")
    add_phased("--mlsm-iters", type=int, default=200, range=flags.at_least(1),
               help="mlsm --mlsm-coder exact: FISTA iteration cap per batch of targets")
    add_phased("--mlsm-tol", type=float, default=1e-2, range=flags.above(0),
               help="mlsm --mlsm-coder exact: FISTA stops when its gradient mapping is below "
               "tol*lam")
    add_model = p.add_argument_group(
        "model (ModelConfig fields; default: the --size preset)").add_argument
    flags.add_fields(add_model, ModelConfig, {f.name: f.name for f in fields(ModelConfig)
                                              if f.name != "vocab_size"},  # the tokenizer's
                     preset=True, choices={"position": ("relative", "absolute")},
                     ranges={**dict.fromkeys(("n_layer", "n_head", "d_model", "d_ff"),
                                             flags.at_least(1)),
                             "dropout": flags.Range(0, 1, high_open=True),
                             "position_buckets": flags.at_least(2),
                             "max_position": flags.at_least(3),
                             "layer_norm_eps": flags.above(0)})
    return p


def get_args(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    mlsm_family = OBJECTIVES[args.objective].setup is setup_mlsm
    for flag, applies, to in (("teacher", args.objective in TWO_PHASE, ", ".join(TWO_PHASE)),
                              ("dict", mlsm_family, "mlsm and mlsm+mlm"),
                              ("reset", args.init_from, "with --init-from")):
        if getattr(args, flag) and not applies:
            parser.error(f"--{flag} only applies {'' if to.startswith('with') else 'to '}{to}")
    if args.two_phase and args.objective != "mlm":
        parser.error(f"--two-phase only applies to mlm ({', '.join(TWO_PHASE)} always have two)")
    if mlsm_family:  # fail now, not after phase 1
        dict_config(args).check(flags=DICT_FLAG_NAMES)
    for flag, allowed in (("reset", PARTS), ("freeze", ["embeddings"])):
        bad = [x for x in getattr(args, flag).split(",") if x and x not in allowed]
        if bad:
            parser.error(f"--{flag}: unknown part {bad[0]!r} (choose from {', '.join(allowed)})")
    if args.max_steps is not None:
        check_phases(args)
    if args.out_dir is None:
        args.out_dir = str(REPO / "runs" / f"{args.objective}_{Path(args.data).name}_{args.size}")
    args.given = flags.typed(parser, argv)  # a resumed run refuses those that differ
    if "causal_fraction" in args.given and args.objective != "gpt-bert" and not args.resume:
        parser.error("--causal-fraction only applies to gpt-bert")
    preset = {**SIZE_DEFAULTS[args.size], **(OBJECTIVES[args.objective].defaults or {})}
    flags.fill_unset(args, preset, typed=args.given)
    if args.masking == "uniform" and int(args.mask_p * args.seq_len) < 1:
        parser.error(f"--mask-p {args.mask_p:g} masks no token of a --seq-len {args.seq_len} "
                     f"sequence under uniform masking (int(p T) = 0); raise either")
    return args


def check_phases(args):
    """Each phase gets at least one step, and its warmup (once --max-steps is known)."""
    p1 = phase1_steps(args)
    if has_phase1(args) and not 0 < p1 < args.max_steps:
        raise SystemExit(f"error: --phase1-steps must leave both phases at least one of the "
                         f"{args.max_steps} steps")
    check_warmup(args, [p1, args.max_steps - p1] if p1 else [args.max_steps])


# ---------------------------------------------------------------------------------------------
# Training


def main(argv=None):
    line_buffered()
    on_stop_signals(exit_now)
    args = get_args(argv)
    if args.check:
        print(json.dumps(checked_settings(args, vars(build_parser().parse_args([])))))
        return
    run = open_run(args, repo_sources(), vars(build_parser().parse_args([])), check_phases)
    args, step = run.args, run.step
    if nothing_to_do(run):  # a finished run resumed, or --stop-at already passed
        return
    phase = phase_at(run, step)
    run.say(describe(run, phase1_steps(args)))
    if note := OBJECTIVES[args.objective].note:
        run.say("note: " + (note(args) if callable(note) else note))
    word_saves = word_marks(run)  # {step: (name, words)} of --save-words
    guard = SafetyNet(run.folder, run.device, run.ddp, args.spike, args.log_every,
                      last_saved=step if run.ckpt is not None else None)
    sums, since_log = {}, 0  # each stat summed over the steps since the last log line
    t_log, t_phase, t0, step0 = time.time(), time.time(), time.time(), step
    progress = bar(total=args.max_steps, initial=step, disable=None if run.rank == 0 else True,
                   unit="step", desc="train")
    while step < args.max_steps:
        if step == phase.end:  # phase 2 begins; phase1.pt was written as phase 1 ended
            phase = phase_at(run, step)
            guard.new_phase()
            t_log = t_phase = time.time()  # its set-up (teacher, dictionary) is not a step's
        lr = set_schedule(phase.optimizer, step, args, phase.start, phase.end)
        step_loss = 0.0
        for micro in range(args.grad_accum):
            batch = train_batch(run, step, micro)
            if phase.graphs:  # a new replay may overwrite the last one's outputs: read already
                torch.compiler.cudagraph_mark_step_begin()
            sync = not run.ddp or micro == args.grad_accum - 1  # DDP all-reduces on the last one
            with contextlib.nullcontext() if sync else phase.model.no_sync():
                with run.amp:
                    loss, stats = phase.model(batch, phase.extras)
                (loss / args.grad_accum).backward()
            step_loss = step_loss + loss.detach()
            for name, v in {"loss": loss, **stats}.items():
                sums[name] = sums.get(name, 0.0) + v.detach().float() / args.grad_accum
        clip = args.clip if args.clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(phase.trainee.parameters(), clip)
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm
        guard.watch(step, step_loss, grad_norm)
        phase.optimizer.step()
        phase.optimizer.zero_grad(set_to_none=True)
        if "ema" in phase.extras:  # a mean teacher follows the student (BootBERT, sec. 3)
            decay = ema_decay_at(step, args, phase.start, phase.end)
            ema_update(phase.extras["ema"], run.encoder, decay)  # one fused lerp over all tensors
        step += 1
        since_log += 1
        progress.update()

        stop = guard.stop_requested(step, args.max_steps)
        is_save = (step % args.save_every == 0 or step in (phase.end, args.stop_at) or stop
                   or guard.save_pending(step))
        is_log = step % args.log_every == 0 or step == phase.end or is_save  # saves are checked
        is_eval = step % args.eval_every == 0 or step == phase.end
        if is_log or is_eval or step in word_saves:  # the only places the loop waits for the device
            guard.check_finite()  # (so the queued step is not timed as the pause that follows)
        if is_log:  # means over the steps since the last log line, across all processes
            record = run.log_stats(step, sums, since_log, time.time() - t_log, lr)
            guard.judge(record, stop, args.lr)
            # at this phase's rate: the set-up between the phases is behind, not spread
            rate = (step - max(step0, phase.start)) / max(time.time() - t_phase, 1e-9)
            run.say(log_line(record, stats, args.max_steps, (args.max_steps - step) / rate))
            sums, since_log, t_log = {}, 0, time.time()
        paused = time.time()  # throughput counts training time only: evals and saves are not
        if is_eval:
            validate(run, phase, step)
        if step == phase.end < args.max_steps:  # phase 1 is over: its model teaches phase 2
            save(run, phase, step, "phase1.pt")
            if run.ddp:
                dist.barrier()  # every process loads it as the teacher next
        if is_save and guard.may_save(must=step in (phase.end, args.stop_at) or stop):
            guard.last_saved = save(run, phase, step)
        if step in word_saves:
            save(run, phase, step, f"{word_saves[step][0]}.pt", words=word_saves[step][1])
        t_log += time.time() - paused  # (not reset: the steps since the last log line still count)
        if stop:
            progress.close()
            guard.stop(step, run.rank, run.folder.path)
        if step == args.stop_at:
            break
    progress.close()
    guard.release()
    run.say(summary(run, step, step - step0, time.time() - t0))
    if run.ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
