"""The pretraining objectives, each one loss function and one OBJECTIVES entry, read by
train.py's loop (which names no objective):

    loss, stats = OBJECTIVES[name].loss(model, batch, parts, **settings)

  mlm       masked language modelling, LTG-BERT's recipe (docs/objectives/mlm.md)
  gpt-bert  GPT-BERT's hybrid: masked next-token prediction and causal LM (gpt-bert.md)
  boot      latent bootstrapping with a mean teacher and an MAE student (boot.md)
  kd, kd+mlm, mlsm, mlsm+mlm   taught by the phase-1 model's predictions, or by the sparse
            codes of its states (kd.md, mlsm.md)
An entry adds a setup function where the objective trains extra modules or reads a teacher, its
paper's defaults, its own flags (declared beside its loss; train.py's --help has a group for
them, and refuses them for another objective), and what the loop, the scorers and the export
need to know of it (a phase of plain MLM first, how its checkpoints predict): fields, never its
name.
"""
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import sparse
from machinery.plumbing import Range, above, at_least, use_compile
from model import (BootHeads, BootPredictor, boot_states, init_linears, load_checkpoint,
                   small_init)


# ---------------------------------------------------------------------------------------------
# Objectives: loss, stats = fn(model, batch, parts)
#   model:   a Trainee; model.encoder is the shared Encoder, model.heads what the objective adds
#   batch:   input_ids (B, T) clean, attention_mask (B, T), inputs (B, T) masked, labels (B, T)
#            (-100 where nothing is predicted); slots (C,) the flat positions b * T + t of the
#            predicted tokens, then padding slots; targets (C,) their labels, -100 in padding
#   parts:   ObjectiveParts: what the loss reads besides the batch that the optimizer does not
#            train (frozen teachers, a dictionary...), in named fields
#   settings: the flags its entry's `settings` names, by name (train.py binds them once a
#            phase starts: functools.partial(entry.loss, **settings))
#   stats:   {name: 0-dim tensor}, averaged over the log interval and written to log.jsonl
# Losses are means over the predicted slots, padding weighed out: a batch with nothing to
# predict gives 0 and no gradient, not 0/0. No tensor becomes a Python number in a loss.


@dataclass
class ObjectiveParts:
    """What an objective's setup adds to its phase besides the loss: the heads trained with the
    encoder, and what the loss reads besides the batch. A module here other than `heads` is not
    trained by the optimizer."""
    heads: nn.Module = field(default_factory=nn.ModuleDict)
    ema: nn.Module | None = None       # boot: the mean teacher, which the loop updates after
    #                                    every optimizer step; kept in checkpoints
    compact: bool = False              # boot: the student encodes only the kept tokens (eager)
    teacher: nn.Module | None = None   # kd, mlsm: the frozen phase-1 model (or --teacher)
    dictionary: torch.Tensor | None = None  # mlsm: D (d, k), unit columns
    lipschitz: torch.Tensor | None = None   # mlsm: ||D||_2^2, fista_fixed's step is 1/L
    layer: int = -1                    # mlsm: the teacher's layer whose states are coded
    momentum: torch.Tensor | None = None    # mlsm: fista_fixed's momentum schedule (steps,)
    exact_coder: Callable | None = None     # mlsm --mlsm-coder exact: sparse_code, run eagerly


class Trainee(nn.Module):
    """What one phase trains: the encoder plus the modules its objective adds. Its forward is
    the objective's loss, so DDP and torch.compile see every trained parameter in one call."""

    def __init__(self, encoder, heads, loss):
        super().__init__()
        self.encoder, self.heads, self.loss = encoder, heads, loss

    def forward(self, batch, parts: ObjectiveParts):
        return self.loss(self, batch, parts)


def slot_mean(x, predicted):
    """x (C,) per slot -> its mean over the predicted slots (predicted (C,) bool)."""
    return torch.where(predicted, x, 0.0).sum() / predicted.sum().clamp(min=1)


def cross_entropy(logits, targets):
    """Mean cross-entropy over the slots whose target is not -100."""
    per_slot = F.cross_entropy(logits.float(), targets, reduction="none")  # 0 where -100
    return slot_mean(per_slot, targets != -100)


def slot_accuracy(logits, targets):
    return slot_mean((logits.argmax(-1) == targets).float(), targets != -100)


def mlm(model, batch, parts):
    """Masked language modelling (Devlin et al. 2019): cross-entropy at the chosen positions."""
    _, logits = model.encoder(batch["inputs"], batch["attention_mask"],
                              predict=batch["slots"])                       # (C, V)
    return cross_entropy(logits, batch["targets"]), {"acc": slot_accuracy(logits, batch["targets"])}


class Flag(NamedTuple):
    """An objective's flag, declared beside its loss: its option and add_argument's keywords;
    train.py adds it (add_flags)."""
    option: str
    spec: dict

    @property
    def dest(self) -> str:
        return self.option[2:].replace("-", "_")


def flag(option: str, **spec) -> Flag:
    return Flag(option, spec)


# the flags of an objective (OBJECTIVES[...].flags) sit beside its loss; a flag several declare
# is declared once
MLM_WEIGHT = flag("--mlm-weight", type=at_least(float, 0), default=1.0,
                  help="weight of the MLM loss beside the objective's own")
MLM_TWO_PHASE = flag("--two-phase", action="store_true",
                     help="kd's two phases, MLM in both (Better Together's baseline)")
PHASES = (flag("--phase1-steps", type=above(float, 0), default=0.2,
               help="phase 1's MLM steps: a fraction of --max-steps if < 1"),
          flag("--student-init", default="continued", choices=["continued", "scratch"],
               help="phase 2 from the phase-1 weights, or fresh"))


def causal_rows(B: int, fraction: float) -> int:
    """How many of a batch's B rows are causal: round(B f), but at least one for f > 0 and at
    most B - 1 for f < 1, so that a small batch keeps both objectives. A Python int, from flags
    alone: the split is static, one graph."""
    return min(max(round(B * fraction), int(fraction > 0)), B - int(fraction < 1))


# GPT-BERT's mixes, named as the BabyLM 2025 baselines: gpt-bert trains 15 masked : 1 causal
# (hybrid_numerator/denominator 15/16); the baselines' own shares are not published (recipe card)
MIXES = {"masked-focus": 1 / 16, "mixed": 1 / 2, "causal-focus": 15 / 16}


def causal_fraction(text: str) -> float:
    """--causal-fraction: a named mix, or a number in [0, 1]."""
    return MIXES[text] if text in MIXES else Range(float, 0, 1)(text)


CAUSAL_FRACTION = flag("--causal-fraction", type=causal_fraction, default=1 / 16, metavar="F",
                       help="each batch's causal share: a fraction, "
                       "masked-focus (1/16), mixed or causal-focus (default 1/16)")


def gpt_bert(model, batch, parts, causal_fraction):
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
    n = B - causal_rows(B, causal_fraction)                               # MNTP rows: [0, n)
    scored = {}                                # name: (its share, logits (N, V), targets (N,))
    if n > 0:
        slots, targets = batch["slots"], batch["targets"]                  # (C,)
        mine = (targets != -100) & (slots < n * T)  # masked, rows [0, n)
        before = torch.where(mine, slots - 1, 0)                           # (C,) t - 1, same row
        _, logits = model.encoder(batch["inputs"][:n], batch["attention_mask"][:n],
                                  predict=before)                          # (C, V)
        scored["mntp"] = (n / B, logits, torch.where(mine, targets, -100))
        mask_rate = mine.sum() / (n * (T - 2))  # of the text's tokens ([CLS], [SEP] never)
    if n < B:
        ids, mask = batch["input_ids"][n:], batch["attention_mask"][n:]   # (B_c, T)
        h = model.encoder(ids, mask, causal=True)                          # (B_c, T, D)
        # every token of the text a target, not the [SEP] that closes the window
        logits = model.encoder.head(h[:, :-2]).flatten(0, 1)               # (B_c (T-2), V)
        targets = ids[:, 1:-1].masked_fill(mask[:, 1:-1] == 0, -100).flatten()
        scored["clm"] = ((B - n) / B, logits, targets)
    loss, z, stats = 0, 0, {}
    for name, (share, logits, targets) in scored.items():
        part = cross_entropy(logits, targets)
        loss = loss + share * part
        z = z + share * slot_mean(torch.logsumexp(logits.float(), -1) ** 2, targets != -100)
        stats[f"{name}_acc"], stats[f"{name}_loss"] = slot_accuracy(logits, targets), part.detach()
    if n > 0:
        stats["mask_rate"] = mask_rate
    return loss + 1e-4 * z, {**stats, "z_loss": z.detach()}


def boot(model, batch, parts, lb_weight, mlm_weight):
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
    enc, heads = model.encoder, model.heads
    ids, mask, slots, targets = (batch[k] for k in ("input_ids", "attention_mask", "slots",
                                                    "targets"))
    hide = batch["labels"] != -100                                         # (B, T)
    predicted = targets != -100                                            # (C,)
    out = boot_states(enc, heads, batch["inputs"], mask, hide, parts.compact)
    out = out.flatten(0, 1)[slots]                                         # (C, D)
    with torch.no_grad():
        target = parts.ema(ids, mask).flatten(0, 1)[slots].float()            # (C, D)
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
    return lb_weight * lb + mlm_weight * ce, stats


def setup_boot(encoder, args, run_dir, device) -> ObjectiveParts:
    """The student's extra parts, and the mean teacher: an EMA copy of the encoder (its
    embeddings, layers and final norm, not the decoder). As parts.ema, the loop updates it after
    every optimizer step, its decay scheduled over the phase (optim.ema_decay_at)."""
    # --decoder-layers, by default a third of the encoder's, at least 1: the paper's 4 on 12
    n = args.decoder_layers or max(1, encoder.config.n_layer // 3)
    heads = BootHeads(encoder.config, n, args.boot_student == "mae")
    ema = copy.deepcopy(encoder).eval().requires_grad_(False)
    # compiled, the student reads all T slots: the kept count varies per batch (boot_states)
    return ObjectiveParts(heads, ema=ema,
                          compact=not use_compile(torch.device(device), args.compile))


BOOT_FLAGS = (
    flag("--lb-weight", type=at_least(float, 0), default=1.0,
         help="weight of the latent-bootstrapping loss; 0 removes it"),
    flag("--ema-start", type=Range(float, 0, 1), default=0.996,
         help="mean-teacher EMA decay at the first step"),
    flag("--ema-end", type=Range(float, 0, 1), default=1.0,
         help="EMA decay at the last step, reached linearly"),
    flag("--decoder-layers", type=at_least(int, 1), default=None,
         help="the student's decoder (default: n_layer / 3, the paper's 4 of 12)"),
    flag("--boot-student", default="mae", choices=["mae", "bert"], metavar="NAME",
         help="the encoder reads the kept tokens (mae) or all (bert)"))


def kd(model, batch, parts, kd_temperature, kd_teacher_input, mlm_weight=None):
    """Knowledge distillation (Hinton et al. 2015) from the frozen phase-1 model (Berend 2023,
    "Better Together", sec. 2.2): KL(teacher || student) over the vocabulary at the masked
    positions, mean over positions, at temperature T and times T^2 (so gradients keep their
    size as T changes); kd+mlm adds --mlm-weight x the MLM cross-entropy."""
    slots, targets = batch["slots"], batch["targets"]
    _, logits = model.encoder(batch["inputs"], batch["attention_mask"], predict=slots)  # (C, V)
    with torch.no_grad():
        seen = batch["input_ids"] if kd_teacher_input == "clean" else batch["inputs"]
        # a boot teacher hides what it predicts from its encoder, as it was trained to
        hidden = ({"hide": batch["labels"] != -100} if isinstance(parts.teacher, BootPredictor)
                  else {})
        _, teacher = parts.teacher(seen, batch["attention_mask"], predict=slots, **hidden)
    T = kd_temperature
    per_slot = F.kl_div(F.log_softmax(logits.float() / T, -1),
                        F.log_softmax(teacher.float() / T, -1),
                        log_target=True, reduction="none").sum(-1)              # (C,)
    kl = slot_mean(per_slot, targets != -100) * T * T
    ce = cross_entropy(logits, targets)
    stats = {"kd": kl, "mlm": ce, "acc": slot_accuracy(logits, targets)}
    return kl + (0.0 if mlm_weight is None else mlm_weight * ce), stats


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
    return ObjectiveParts(teacher=teacher)


TEACHER = flag("--teacher", default=None,
               help="distil from this checkpoint instead of training a phase 1")
KD_FLAGS = (flag("--kd-temperature", type=above(float, 0), default=1.0,
                 help="softmax temperature T; the KL is scaled by T^2"),
            flag("--kd-teacher-input", default="clean", choices=["clean", "masked"],
                 metavar="NAME", help="what the teacher reads: clean or masked"))


# the MLSM code's targets (szegedai/MLSM, sparser.py): this many FISTA steps from zero, no stopping
# test; --mlsm-coder fista100 is named for it
MLSM_FISTA_STEPS = 100


def mlsm(model, batch, parts, mlsm_coder, mlsm_lam, mlsm_iters, mlsm_tol, mlm_weight=None):
    """Masked latent semantic modeling (Berend 2023, "Masked Latent Semantic Modeling", sec. 3;
    "Better Together", sec. 2.3). At every masked position the frozen phase-1 model, reading the
    unmasked sequence, gives its layer-L state h; the target is the l1-normalised non-negative
    sparse code of h / ||h|| under the dictionary D (d, k), a distribution over k latent
    properties; the student predicts it with a k-way softmax over its MLM-head features.
    Loss: KL(target || prediction), mean over the positions whose code is not all zero (those
    have no distribution to predict and are left out, counted in zero_rate); mlsm+mlm adds
    --mlm-weight x the MLM cross-entropy at the same positions."""
    enc, slots, targets = model.encoder, batch["slots"], batch["targets"]
    predicted = targets != -100                                           # (C,)
    with torch.no_grad():
        states = parts.teacher(batch["input_ids"], batch["attention_mask"], all_layers=True)
        h = states[parts.layer].flatten(0, 1)[slots]                         # (C, d)
        with torch.autocast(h.device.type, enabled=False):
            h = F.normalize(h.float(), dim=-1)
            if mlsm_coder == "fista100":  # the MLSM code's targets
                codes = sparse.fista_fixed(h, parts.dictionary, mlsm_lam,
                                           MLSM_FISTA_STEPS, parts.lipschitz,
                                           parts.momentum)                    # (C, k)
            else:  # its working set is sized by the data: run eagerly (setup_mlsm)
                codes = parts.exact_coder(h, parts.dictionary, mlsm_lam, mlsm_iters, mlsm_tol)
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
    if mlm_weight is None:
        return kl, stats
    logits = F.linear(feats, enc.word.weight, enc.head_bias)              # (C, V)
    ce = cross_entropy(logits, targets)
    return kl + mlm_weight * ce, {**stats, "mlm": ce, "acc": slot_accuracy(logits, targets)}


# train.py's mlsm flags -> the sparse.DictConfig fields they set (their defaults come from there)
DICT_FLAGS = {"mlsm_layer": "layer", "mlsm_k": "k", "mlsm_lam": "lam", "dict_vectors": "vectors",
              "dict_epochs": "epochs", "dict_max_freq": "max_freq"}
DICT_FLAG_NAMES = {f: "--" + a.replace("_", "-") for a, f in DICT_FLAGS.items()}
MLSM_FLAGS = (
    flag("--dict", default=None,
         help="a sparse.py dictionary (default: learned into RUN/dict.pt)"),
    *(flag("--" + dest.replace("_", "-"), **sparse.dict_flag(field))
      for dest, field in DICT_FLAGS.items()),
    flag("--mlsm-coder", default="fista100", choices=["fista100", "exact"], metavar="NAME",
         help="fista100: the MLSM code's 100 steps; exact: to --mlsm-tol"),
    flag("--mlsm-iters", type=at_least(int, 1), default=200,
         help="exact: FISTA's iteration cap"),
    flag("--mlsm-tol", type=above(float, 0), default=1e-2,
         help="exact: stop at a gradient mapping below tol*lam"))


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
    # the exact coder outside any compiled graph: a break in a compiled step
    exact = torch.compiler.disable(sparse.sparse_code) if args.mlsm_coder == "exact" else None
    return ObjectiveParts(nn.ModuleDict({"latent": head}), teacher=teacher, dictionary=D,
                          lipschitz=L, layer=layer, exact_coder=exact,
                          momentum=sparse.fista_momentum(MLSM_FISTA_STEPS, device))


class Objective(NamedTuple):
    loss: Callable                  # (model, batch, parts, **settings) -> (loss, stats)
    settings: tuple[str, ...] = ()  # the flags (dests) its loss reads, passed to it by name
    setup: Callable | None = None   # (encoder, args, run_dir, device) -> ObjectiveParts
    two_phase: bool = False         # plain MLM first; then this, taught by the phase-1 model
    defaults: dict | None = None    # shared flags whose default differs, as its paper trained it
    size_defaults: dict | None = None  # {--size: {flag: default}}: its paper's widths, say
    note: Callable | None = None    # (args) -> what to say as a run starts
    flags: tuple[Flag, ...] = ()    # its own flags; typed with another objective, refused
    about: str = ""                 # its flags' group in --help: what it is, whose paper
    # how its checkpoints predict a hidden token, written into them for the scorers and export:
    predicts_before: bool = False   # from the state at the position before it (MNTP)
    decoder: bool = False           # through its heads' decoder (BootBERT's student)

    def declares(self, dest: str) -> bool:
        return any(f.dest == dest for f in self.flags)


UNIFORM = dict(masking="uniform")  # Berend 2023's masking, in both phases (szegedai/MLSM)
# at tiny the recipe's dictionary (3,000 atoms from 100,000 states, 4 epochs) would take longer
# than the run: the cpu studies' smaller one (docs/objectives/mlsm.md)
TINY_DICT = {"tiny": dict(mlsm_k=500, dict_vectors=20000, dict_epochs=2)}
KD_SETTINGS = ("kd_temperature", "kd_teacher_input")  # and kd+mlm's --mlm-weight
MLSM_SETTINGS = ("mlsm_coder", "mlsm_lam", "mlsm_iters", "mlsm_tol")  # and mlsm+mlm's
BASELINE = "mlm"  # plain MLM: what every objective is compared with, and a two-phase one's phase 1
PHASED = (*PHASES, TEACHER)  # a two-phase objective's: phase 1 trained here, or a --teacher
OBJECTIVES = {
    BASELINE: Objective(mlm, flags=(MLM_TWO_PHASE, *PHASES),
                        about="masked language modelling, LTG-BERT's recipe"),
    # the reference's recipe (ltgoslo/gpt-bert, train_10m.py, configs/): docs/objectives/gpt-bert.md
    "gpt-bert": Objective(gpt_bert, ("causal_fraction",), predicts_before=True,
                          flags=(CAUSAL_FRACTION,),
                          about="masked next-token and causal LM, Charpentier & Samuel 2024",
                          defaults=dict(schedule="cosine-cooldown", cooldown=0.016, mask_p=0.3,
                                        mask_p_end=0.15, decay_embeddings=True, eps=1e-8),
                          size_defaults={"small": dict(d_ff=1280), "base": dict(d_ff=2560)},
                          note=lambda args: (
        f"gpt-bert trains {causal_rows(args.batch_size, args.causal_fraction)} of each "
        f"micro-batch's {args.batch_size} rows causally, the rest masked next-token prediction "
        f"(--causal-fraction {args.causal_fraction:g})")),
    "boot": Objective(boot, ("lb_weight", "mlm_weight"), setup_boot, decoder=True,
                      flags=(*BOOT_FLAGS, MLM_WEIGHT),
                      about="latent bootstrapping, Samuel 2023",
                      defaults=dict(lr=5e-3, weight_decay=0.02, weight_decay_end=0.2,
                                    mlm_weight=0.1, final_norm=True)),
    "kd": Objective(kd, KD_SETTINGS, setup_kd, two_phase=True, defaults=UNIFORM,
                    flags=(*PHASED, *KD_FLAGS),
                    about="distilling the phase-1 model's predictions, Berend 2023"),
    "kd+mlm": Objective(kd, (*KD_SETTINGS, "mlm_weight"), setup_kd, two_phase=True,
                        defaults=UNIFORM, flags=(*PHASED, *KD_FLAGS, MLM_WEIGHT)),
    # faithful: Berend 2023 (Table 1a) has MLSM alone below MLSM+MLM on BLiMP
    "mlsm": Objective(mlsm, MLSM_SETTINGS, setup_mlsm, two_phase=True, defaults=UNIFORM,
                      size_defaults=TINY_DICT,
                      flags=(*PHASED, *MLSM_FLAGS),
                      about="sparse codes of the phase-1 model's states, Berend 2023",
                      note=lambda args: (
        "mlsm's phase 2 trains the latent head alone: no loss trains the vocabulary logits after "
        "phase 1 while the encoder under them moves, and BLiMP's pseudo-log-likelihoods read "
        "those logits; mlsm+mlm is the joint objective")),
    "mlsm+mlm": Objective(mlsm, (*MLSM_SETTINGS, "mlm_weight"), setup_mlsm, two_phase=True,
                          defaults=UNIFORM, size_defaults=TINY_DICT,
                          flags=(*PHASED, *MLSM_FLAGS, MLM_WEIGHT)),
}
TWO_PHASE = sorted(name for name, o in OBJECTIVES.items() if o.two_phase)


# ---------------------------------------------------------------------------------------------
# The objectives' flags on train.py's command line


def owners() -> dict[str, tuple[Flag, list[str]]]:
    """{dest: (the flag, the objectives that declare it)}, in the registry's order."""
    found = {}
    for name, entry in OBJECTIVES.items():
        for f in entry.flags:
            found.setdefault(f.dest, (f, []))[1].append(name)
    return found


def add_flags(parser) -> None:
    """Every objective's own flags, one --help group per set of objectives that declares them:
    titled by the objective and what it is where one does, by their names where several do."""
    groups = {}
    for f, names in owners().values():
        title = ", ".join(names)
        if title not in groups:
            about = OBJECTIVES[names[0]].about if len(names) == 1 else ""
            groups[title] = parser.add_argument_group(title + (f" ({about})" if about else ""))
        groups[title].add_argument(f.option, **f.spec)


def refuse_others(args, given, error) -> None:
    """A flag of other objectives typed with this one stops, in one line naming whose it is
    (typed: `given`, the flags' dests; a resumed run's saved objective decides, so it passes)."""
    for dest, (f, names) in owners().items():
        if dest in given and args.objective not in names and not args.resume:
            error(f"{f.option} only applies to {', '.join(names)}, not {args.objective}")


def note_defaults(parser) -> None:
    """Each flag whose default an objective's entry changes says so in its help ('boot 0.1;
    gpt-bert cosine-cooldown'), at one size too ('gpt-bert at small: 1280')."""
    show = lambda v: ("on" if v else "off") if isinstance(v, bool) else (
        f"{v:g}" if isinstance(v, float) else str(v))
    for action in parser._actions:
        by_value, by_size = {}, {}  # {value: objectives}, {(size, value): objectives}
        for name, entry in OBJECTIVES.items():
            if action.dest in (entry.defaults or {}):
                by_value.setdefault(entry.defaults[action.dest], []).append(name)
            for size, v in (entry.size_defaults or {}).items():
                if action.dest in v:
                    by_size.setdefault((size, v[action.dest]), []).append(name)
        said = [f"{', '.join(n)} {show(v)}" for v, n in by_value.items() if v != action.default]
        said += [f"{', '.join(n)} at {size}: {show(v)}" for (size, v), n in by_size.items()]
        if said:
            default = "" if action.default is None else f"default {show(action.default)}; "
            action.help += f" ({default}{'; '.join(said)})"
