"""Pretrain the shared encoder with one objective: batch -> span masking -> LOSSES[objective] -> step.

    python train.py --objective mlm --data babylm_10m --size tiny --max-steps 2000   # CPU demo
    python train.py --objective mlm --data babylm_10m --size small                   # one GPU, compiled
    torchrun --nproc_per_node 4 train.py --objective mlm --data babylm_10m            # DDP
    python train.py --out-dir runs/mlm_babylm_10m_small --resume                      # continue
    python train.py --objective boot --data babylm_10m                                # BootBERT
    python train.py --objective kd+mlm --data babylm_10m --phase1-steps 0.2           # MLM, then KD
    python train.py --objective mlsm+mlm --data babylm_10m                            # MLM, then MLSM

The data is prepared on first use (data/prepare.py). A run folder (--out-dir) holds args.json,
config.json, data.json (the corpus' meta.json), log.jsonl (every logged figure), ckpt.pt (model,
optimizer, config, args, step, RNG states, data position, code version, tokenizer) and code/
(the exact model.py, train.py and prepare.py that ran).

Adding an objective = one function `loss, figures = fn(model, batch, ctx)` + one LOSSES entry
(+ one SETUP entry if it trains extra modules or needs a teacher). Two-phase objectives (kd,
kd+mlm, mlsm, mlsm+mlm) train plain MLM for --phase1-steps, keep that model as phase1.pt, then
continue with the objective against it as a frozen teacher; one command, one schedule per phase.
mlsm learns its dictionary between the phases by running sparse.py (RUN/dict.pt).

Reproducibility: batches and masks are functions of (seed, step, micro-batch), and dropout is
reseeded the same way at every micro-batch, so a run resumed from any checkpoint follows the very
path of an uninterrupted one (bit for bit on CPU; tests/test_train.py checks it).
"""
import argparse
import contextlib
import copy
import functools
import hashlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from data.prepare import Segments, load_meta, prepare, span_mask
from model import (PARTS, PRESETS, BootHeads, Encoder, Lamb, ModelConfig, check_config, config_help, ema_update,
                   load_checkpoint, read_checkpoint, save_checkpoint, small_init)
from sparse import sparse_code

HERE = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------------------------
# Objectives: loss, figures = fn(model, batch, ctx)
#   model:   a Trainee; model.encoder is the shared Encoder, model.heads what the objective adds
#   batch:   input_ids (B, T) clean, attention_mask (B, T), inputs (B, T) masked, labels (B, T)
#   ctx:     what an objective owns beyond what it trains (frozen teachers), plus "args", "step"
#   figures: {name: 0-dim tensor}, averaged over the log interval and written to log.jsonl

class Trainee(nn.Module):
    """What one phase trains: the encoder plus the modules its objective adds. Its forward is the
    objective's loss, so DDP and torch.compile see every trained parameter in one call."""

    def __init__(self, encoder, heads, loss):
        super().__init__()
        self.encoder, self.heads, self.loss = encoder, heads, loss

    def forward(self, batch, ctx):
        return self.loss(self, batch, ctx)


def accuracy(logits, target):
    return (logits.argmax(-1) == target).float().mean()


def mlm(model, batch, ctx):
    """Masked language modelling (Devlin et al. 2019): cross-entropy at the chosen positions."""
    predict = batch["labels"] != -100
    _, logits = model.encoder(batch["inputs"], batch["attention_mask"], predict=predict)   # (N, V)
    target = batch["labels"][predict]
    return F.cross_entropy(logits.float(), target), {"acc": accuracy(logits, target)}


def boot(model, batch, ctx):
    """Latent bootstrapping (Samuel 2023, "Mean BERTs make erratic language teachers", sec. 3).

    The student encoder sees only the kept tokens, each at its original position (a masked
    autoencoder, He et al. 2022); its states are scattered back to full length with a learned
    vector at the hidden positions, and a light decoder reads that. At the hidden positions a
    head regresses the mean teacher's last-layer states (LayerNorm-ed, no affine) with smooth-L1,
    and the tied MLM head predicts the tokens: loss = lb_weight * LB + mlm_weight * MLM.
    """
    args, enc, heads = ctx["args"], model.encoder, model.heads
    ids, mask = batch["input_ids"], batch["attention_mask"]
    hide = batch["labels"] != -100                                           # (B, T)
    B, T = ids.shape
    if args.boot_student == "mae":
        keep = ~hide & (mask == 1)
        n = int(keep.sum(1).max())
        order = torch.argsort((~keep).int(), dim=1, stable=True)[:, :n]     # (B, n): kept positions first
        kept = enc(ids.gather(1, order), keep.gather(1, order).long(), positions=order)  # (B, n, D)
        x = torch.zeros(B, T, kept.shape[-1], device=ids.device, dtype=kept.dtype)
        x = x.scatter(1, order[..., None].expand_as(kept), kept)            # back to (B, T, D)
        fill = heads.mask if enc.config.position == "relative" else heads.mask + enc.pos.weight[:T]
        x = torch.where(hide[..., None], fill, x)
    else:  # the ablation: a BERT-style student reads the whole masked input
        x = enc(batch["inputs"], mask)
    out = heads.decoder(x, enc.attention_inputs(mask))[hide]                # (N, D)
    if out.shape[0] == 0:  # the smooth-L1 and cross-entropy means would be 0/0 = NaN
        raise SystemExit("error: boot: no token of this batch is masked, so there is nothing to "
                         "reconstruct; raise --mask-p or --seq-len")
    with torch.no_grad():
        target = ctx["ema"](ids, mask)[hide].float()
        target = F.layer_norm(target, target.shape[-1:])
    lb = F.smooth_l1_loss(heads.regress(out).float(), target)
    labels = batch["labels"][hide]
    logits = enc.head(out)
    ce = F.cross_entropy(logits.float(), labels)
    # a collapse gauge: how much the targets differ from token to token, per dimension (1: as
    # much as within a vector; 0: every position gets the same target)
    spread = target.std(0).mean()
    return args.lb_weight * lb + args.mlm_weight * ce, {"lb": lb, "mlm": ce, "acc": accuracy(logits, labels), "target_std": spread}


def kd(model, batch, ctx, with_mlm=False):
    """Knowledge distillation (Hinton et al. 2015) from the frozen phase-1 model (Berend 2023,
    "Better Together", sec. 2.2): KL(teacher || student) over the vocabulary at the masked
    positions, mean over positions, at temperature T and times T^2 (so gradients keep their
    size as T changes); kd+mlm adds --mlm-weight x the MLM cross-entropy."""
    args = ctx["args"]
    predict = batch["labels"] != -100
    _, logits = model.encoder(batch["inputs"], batch["attention_mask"], predict=predict)      # (N, V)
    with torch.no_grad():
        seen = batch["input_ids"] if args.kd_teacher_input == "clean" else batch["inputs"]
        _, teacher = ctx["teacher"](seen, batch["attention_mask"], predict=predict)
    T = args.kd_temperature
    kl = F.kl_div(F.log_softmax(logits.float() / T, -1), F.log_softmax(teacher.float() / T, -1),
                  log_target=True, reduction="batchmean") * T * T
    target = batch["labels"][predict]
    ce = F.cross_entropy(logits.float(), target)
    return kl + (args.mlm_weight * ce if with_mlm else 0.0), {"kd": kl, "mlm": ce, "acc": accuracy(logits, target)}


class Stopwatch:
    """Seconds spent in a block, summed between two reads without making the host wait for the
    device: CUDA events on a GPU (read at log steps, where the loop waits anyway), perf_counter
    on a CPU."""

    def __init__(self, device):
        self.cuda, self.spans = device.type == "cuda", []

    @contextlib.contextmanager
    def __call__(self, on=True):
        if not on:
            yield
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            t = time.perf_counter()
            yield
            self.spans.append(time.perf_counter() - t)

    def read(self) -> float:
        total = sum(s.elapsed_time(e) / 1e3 for s, e in self.spans) if self.cuda else sum(self.spans)
        self.spans = []
        return total


def mlsm(model, batch, ctx, with_mlm=False):
    """Masked latent semantic modeling (Berend 2023, "Masked Latent Semantic Modeling", sec. 3;
    "Better Together", sec. 2.3). At every masked position the frozen phase-1 model, reading the
    unmasked sequence, gives its layer-L state h; the target is the l1-normalised non-negative
    sparse code of h / ||h|| under the dictionary D (d, k), a distribution over k latent
    properties; the student predicts it with a k-way softmax over its MLM-head features.
    Loss: KL(target || prediction), mean over the positions whose code is not all zero (those
    have no distribution to predict and are left out, counted in zero_rate); mlsm+mlm adds
    --mlm-weight x the MLM cross-entropy at the same positions."""
    args, enc = ctx["args"], model.encoder
    predict = batch["labels"] != -100                                                    # (B, T)
    with torch.no_grad():
        h = ctx["teacher"](batch["input_ids"], batch["attention_mask"], all_layers=True)[ctx["layer"]][predict]
        with ctx["stopwatch"](model.training), torch.autocast(h.device.type, enabled=False):
            codes = sparse_code(F.normalize(h.float(), dim=-1), ctx["dict"], args.mlsm_lam,
                                args.mlsm_iters, args.mlsm_tol)                            # (N, k) >= 0
        mass = codes.sum(1, keepdim=True)                                                # (N, 1)
        target = codes / mass.clamp(min=torch.finfo(codes.dtype).tiny)   # rows sum to 1, or stay 0
        coded = (mass.squeeze(1) > 0).float()
        n_coded = coded.sum().clamp(min=1)
    feats = enc.head_in(enc(batch["inputs"], batch["attention_mask"])[predict])          # (N, D)
    logp = F.log_softmax(model.heads.latent(feats).float(), -1)                          # (N, k)
    # an all-zero target row adds exactly 0 to the sum (kl_div takes 0 log 0 = 0), so dividing by
    # the number of coded rows is the batch mean over those rows, without a host sync
    kl = F.kl_div(logp, target, reduction="sum") / n_coded
    figs = {"kl": kl, "nnz": (codes > 0).sum(1).float().sum() / n_coded,
            "zero_rate": 1 - coded.sum() / max(1, coded.numel())}
    if not with_mlm:
        return kl, figs
    logits = F.linear(feats, enc.word.weight, enc.head_bias)                            # (N, V)
    labels = batch["labels"][predict]
    ce = F.cross_entropy(logits.float(), labels)
    return kl + args.mlm_weight * ce, {**figs, "mlm": ce, "acc": accuracy(logits, labels)}


LOSSES = {"mlm": mlm, "boot": boot, "kd": kd, "kd+mlm": functools.partial(kd, with_mlm=True),
          "mlsm": mlsm, "mlsm+mlm": functools.partial(mlsm, with_mlm=True)}


# Objectives that train modules besides the encoder, or need a teacher:
#   setup(encoder, args, run_dir, device) -> (heads: nn.Module, ctx: dict)

def setup_boot(encoder, args, run_dir, device):
    """The student's extra parts, and the mean teacher: an EMA copy of the encoder (its
    embeddings and layers, not the decoder), updated after every optimizer step."""
    return BootHeads(encoder.config, args.decoder_layers, args.boot_student == "mae"), \
        {"ema": copy.deepcopy(encoder).eval().requires_grad_(False)}


def setup_kd(encoder, args, run_dir, device):
    """The frozen teacher: this run's phase-1 model, or --teacher."""
    path = args.teacher or Path(run_dir) / "phase1.pt"
    teacher, _ = load_checkpoint(path, device)
    if teacher.config.vocab_size != encoder.config.vocab_size:
        raise SystemExit(f"error: the teacher {path} has a {teacher.config.vocab_size}-token vocabulary, "
                         f"the data {encoder.config.vocab_size}")
    return nn.ModuleDict(), {"teacher": teacher.requires_grad_(False)}


def setup_mlsm(encoder, args, run_dir, device):
    """The frozen teacher (as kd), the dictionary of its layer --mlsm-layer, and the student's
    k-way head (a Linear on the MLM head's features, N(0, s) weight, zero bias: a separate head
    rather than k extra tied rows, so the MLM head stays as it is). The dictionary is RUN/dict.pt:
    --dict is copied there; without one, sparse.py learns it from the teacher (rank 0; the
    others wait), so a resumed run and its code/ folder keep the very dictionary it trained on."""
    _, ctx = setup_kd(encoder, args, run_dir, device)
    teacher_path = args.teacher or Path(run_dir) / "phase1.pt"
    path = Path(run_dir) / "dict.pt"
    master = not dist.is_initialized() or dist.get_rank() == 0
    if master and not path.exists():
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        if args.dict:
            if not Path(args.dict).is_file():
                raise SystemExit(f"error: --dict {args.dict}: no such file")
            shutil.copy(args.dict, path)
        else:
            tqdm.write(f"learning the MLSM dictionary from layer {args.mlsm_layer} of {teacher_path} (sparse.py)")
            cmd = [sys.executable, str(HERE / "sparse.py"), "--ckpt", str(teacher_path), "--data", args.data,
                   "--layer", str(args.mlsm_layer), "--k", str(args.mlsm_k), "--lam", str(args.mlsm_lam),
                   "--vectors", str(args.dict_vectors), "--epochs", str(args.dict_epochs), "--seq-len", str(args.seq_len),
                   "--seed", str(args.seed), "--device", device.type, "--out", str(path)]
            if subprocess.run(cmd).returncode != 0:
                raise SystemExit(f"error: learning the dictionary failed (command: {' '.join(cmd)})")
    if dist.is_initialized():
        dist.barrier()
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        D = saved["D"]
    except Exception as e:
        raise SystemExit(f"error: cannot read the dictionary {path} ({type(e).__name__}: {e})") from None
    n_layer, d = ctx["teacher"].config.n_layer, ctx["teacher"].config.d_model
    if D.ndim != 2 or D.shape[0] != d:
        raise SystemExit(f"error: the dictionary {path} has shape {tuple(D.shape)}, but the teacher's states have {d} dimensions")
    layer = saved.get("layer", n_layer)
    if "mlsm_layer" in args.given and args.mlsm_layer % (n_layer + 1) != layer:
        raise SystemExit(f"error: the dictionary {path} was learned on layer {layer}, not --mlsm-layer {args.mlsm_layer}")
    head = nn.Linear(encoder.config.d_model, D.shape[1])
    with torch.no_grad():
        small_init(encoder.config.d_model)(head.weight)
        head.bias.zero_()
    return nn.ModuleDict({"latent": head}), {**ctx, "dict": D.float().to(device), "layer": layer, "stopwatch": Stopwatch(device)}


SETUP = {"boot": setup_boot, "kd": setup_kd, "kd+mlm": setup_kd, "mlsm": setup_mlsm, "mlsm+mlm": setup_mlsm}
# shared flags whose default differs for an objective, as its paper trained it (typed flags win)
DEFAULTS = {"boot": {"lr": 5e-3, "weight_decay": 0.02, "weight_decay_end": 0.2, "mlm_weight": 0.1}}
TWO_PHASE = {"kd", "kd+mlm", "mlsm", "mlsm+mlm"}  # plain MLM first; then the objective, taught by the phase-1 model


def phase1_steps(args) -> int:
    if args.objective not in TWO_PHASE or args.teacher:
        return 0
    return round(args.phase1_steps * args.max_steps) if args.phase1_steps < 1 else int(args.phase1_steps)


def phase_of(step, args):
    """(objective, first step, end step) of the training phase that `step` belongs to."""
    p1 = phase1_steps(args)
    return ("mlm", 0, p1) if step < p1 else (args.objective, p1, args.max_steps)


# ---------------------------------------------------------------------------------------------
# Optimisers (LAMB: model.py) and schedules

def make_optimizer(model, args):
    """Group 0 decays (the weight matrices), group 1 does not (biases, LayerNorm gains, embedding
    tables, BootBERT's mask vector), as LTG-BERT."""
    table = lambda name: name.endswith(("word.weight", "pos.weight")) or name.rsplit(".", 1)[-1] == "rel"
    decays = lambda name, p: p.ndim >= 2 and not table(name)
    groups = [dict(params=[p for n, p in model.named_parameters() if decays(n, p)], weight_decay=args.weight_decay),
              dict(params=[p for n, p in model.named_parameters() if not decays(n, p)], weight_decay=0.0)]
    if args.optim == "lamb":
        return Lamb(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    cuda = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-6, fused=cuda or None)  # one kernel on a GPU


def lr_at(step, args, start=0, end=None):
    """Linear warmup to --lr, then cosine or linear decay to --min-lr * --lr, over the phase
    [start, end) (default the whole run)."""
    end = args.max_steps if end is None else end
    step, n = step - start, end - start
    warmup = round(args.warmup * n) if args.warmup < 1 else int(args.warmup)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, n - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * t)) if args.schedule == "cosine" else 1 - t
    return args.lr * (args.min_lr + (1 - args.min_lr) * decay)


def weight_decay_at(step, args, start, end):
    """--weight-decay, or with --weight-decay-end a cosine from one to the other over the phase
    (BootBERT raises it from 0.02 to 0.2)."""
    if args.weight_decay_end is None:
        return args.weight_decay
    t = (step - start) / max(1, end - start - 1)
    return args.weight_decay_end + (args.weight_decay - args.weight_decay_end) * 0.5 * (1 + math.cos(math.pi * t))


def ema_decay_at(step, args, start, end):
    """The mean teacher's decay rises linearly from --ema-start to --ema-end over the phase."""
    return args.ema_start + (args.ema_end - args.ema_start) * (step - start) / max(1, end - start - 1)


# ---------------------------------------------------------------------------------------------
# Data: the token stream's segments (data/prepare.py) as masked batches

def seed_of(*parts) -> int:
    """A well-mixed 63-bit seed from integers (seed, step, micro-batch...)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, np.uint64)[0] >> np.uint64(1))


def make_batch(ids, args, vocab_size, gen):
    inputs, labels = span_mask(ids, args.mask_p, vocab_size, gen)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), inputs=inputs, labels=labels)


# ---------------------------------------------------------------------------------------------
# Arguments

RESUMABLE = {"resume", "out_dir", "device", "compile", "bf16", "log_every", "eval_every", "save_every", "stop_at"}


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--objective", default="mlm", choices=sorted(LOSSES), help="pretraining objective (default mlm)")
    p.add_argument("--data", default="babylm_10m", help="corpus name under $NANOMLM_RAW, a folder of text files, or a prepared folder (default babylm_10m)")
    p.add_argument("--vocab-size", type=int, default=16384, help="sentencepiece vocabulary when the data is prepared (default 16384)")
    p.add_argument("--size", default="small", choices=PRESETS, help="model preset; ModelConfig flags below override it (default small)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, [CLS] and [SEP] included (default 128)")
    p.add_argument("--batch-size", type=int, default=128, help="sequences per micro-batch per process (default 128)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--optim", default="lamb", choices=["adamw", "lamb"], help="optimizer; betas (0.9, 0.98), eps 1e-6 (default lamb)")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2; boot 5e-3)")
    p.add_argument("--warmup", type=float, default=0.016, help="warmup: a fraction of --max-steps if < 1, else steps (default 0.016)")
    p.add_argument("--schedule", default="cosine", choices=["cosine", "linear"], help="decay after warmup (default cosine)")
    p.add_argument("--min-lr", type=float, default=0.1, help="final learning rate as a fraction of --lr (default 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay on weight matrices (default 0.1; boot 0.02, rising to 0.2)")
    p.add_argument("--clip", type=float, default=2.0, help="gradient-norm clipping, 0 = off (default 2.0)")
    p.add_argument("--mask-p", type=float, default=0.15, help="fraction of tokens to predict (default 0.15)")
    p.add_argument("--max-steps", type=int, default=10000, help="optimizer steps (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="seed for init, data order, masks and dropout (default 0)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto = cuda if available (default auto)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on with CUDA, off on the CPU)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bfloat16 autocast of the forward pass; weights, optimizer and losses stay float32 (default: on with "
                        "CUDA, off on the CPU; measured 2x faster on a CPU with AMX: see the README's Performance)")
    p.add_argument("--out-dir", default=None, help="run folder (default runs/OBJECTIVE_DATA_SIZE)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out-dir from its ckpt.pt, with its saved settings")
    p.add_argument("--init-from", default=None, help="start from this checkpoint's weights (fresh optimizer, step 0)")
    p.add_argument("--reset", default="", help="with --init-from, re-initialise these parts instead of loading them: "
                   "embeddings (token embeddings and the tied output; the vocabulary may then differ), positions; comma-separated")
    p.add_argument("--freeze", default="", help="parts that get no updates: embeddings (the token embeddings, so the tied output too)")
    p.add_argument("--log-every", type=int, default=50, help="steps between log lines (default 50)")
    p.add_argument("--eval-every", type=int, default=500, help="steps between validations (default 500)")
    p.add_argument("--eval-batches", type=int, default=20, help="validation batches, always the same ones (default 20)")
    p.add_argument("--save-every", type=int, default=1000, help="steps between checkpoints (default 1000)")
    p.add_argument("--stop-at", type=int, default=None, help="checkpoint and exit after this step; the schedule still runs to --max-steps (for time-limited jobs)")
    p.add_argument("--weight-decay-end", type=float, default=None, help="cosine weight decay from --weight-decay to this over the phase (default: constant; boot 0.2)")
    b = p.add_argument_group("boot (latent bootstrapping, Samuel 2023)")
    b.add_argument("--lb-weight", type=float, default=1.0, help="weight of the latent-bootstrapping loss; 0 removes it (default 1)")
    b.add_argument("--mlm-weight", type=float, default=1.0, help="weight of the MLM loss in kd+mlm, mlsm+mlm and boot (default 1; boot 0.1, its decoder's)")
    b.add_argument("--ema-start", type=float, default=0.996, help="mean-teacher EMA decay at the first step (default 0.996)")
    b.add_argument("--ema-end", type=float, default=1.0, help="EMA decay at the last step, reached linearly (default 1.0)")
    b.add_argument("--decoder-layers", type=int, default=4, help="layers of the student's decoder (default 4)")
    b.add_argument("--boot-student", default="mae", choices=["mae", "bert"], help="mae: the encoder sees the kept tokens only; bert: the whole masked input (ablation) (default mae)")
    k = p.add_argument_group("kd, kd+mlm, mlsm, mlsm+mlm (a phase of MLM, then the objective taught by that model; Berend 2023)")
    k.add_argument("--phase1-steps", type=float, default=0.2, help="MLM steps before distillation: a fraction of --max-steps if < 1, else steps (default 0.2)")
    k.add_argument("--teacher", default=None, help="distil from this checkpoint instead of training a phase 1")
    k.add_argument("--student-init", default="continued", choices=["continued", "scratch"], help="phase 2 starts from the phase-1 weights, or from a fresh init (default continued)")
    k.add_argument("--kd-temperature", type=float, default=1.0, help="softmax temperature T; the KL is scaled by T^2 (default 1)")
    k.add_argument("--kd-teacher-input", default="clean", choices=["clean", "masked"], help="what the teacher reads (default clean)")
    k.add_argument("--dict", default=None, help="mlsm: a dictionary from sparse.py (default: learn one from the teacher into RUN/dict.pt)")
    k.add_argument("--mlsm-layer", type=int, default=-1, help="mlsm: the teacher's layer whose states are coded, 0 = embeddings, negative from the end (default -1)")
    k.add_argument("--mlsm-k", type=int, default=2500, help="mlsm: dictionary atoms, the size of the predicted distribution (default 2500)")
    k.add_argument("--mlsm-lam", type=float, default=0.05, help="mlsm: l1 penalty of the sparse codes (default 0.05)")
    k.add_argument("--mlsm-iters", type=int, default=200, help="mlsm: FISTA iteration cap per batch of targets (default 200)")
    k.add_argument("--mlsm-tol", type=float, default=1e-2, help="mlsm: FISTA stops when its gradient mapping is below tol*lam (default 1e-2)")
    k.add_argument("--dict-vectors", type=int, default=100000, help="mlsm: hidden states the dictionary is learned from (default 100000)")
    k.add_argument("--dict-epochs", type=int, default=4, help="mlsm: passes of dictionary learning over them (default 4)")
    model_flags = p.add_argument_group("model (ModelConfig fields; default: the --size preset)")
    for f, text in zip(fields(ModelConfig), config_help().values()):
        if f.name != "vocab_size":  # the tokenizer decides it
            model_flags.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=None, help=text,
                                     choices=("relative", "absolute") if f.name == "position" else None)
    return p


def get_args(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "log_every", "eval_every", "eval_batches", "save_every"):
        if getattr(args, name) < (3 if name == "seq_len" else 1):
            parser.error(f"--{name.replace('_', '-')} must be at least {3 if name == 'seq_len' else 1}")
    if not 0 < args.mask_p < 1:
        parser.error("--mask-p must be between 0 and 1")
    if args.teacher and args.objective not in TWO_PHASE:
        parser.error(f"--teacher only applies to {', '.join(sorted(TWO_PHASE))}")
    if args.dict and not args.objective.startswith("mlsm"):
        parser.error("--dict only applies to mlsm and mlsm+mlm")
    for flag, allowed in (("reset", PARTS), ("freeze", ["embeddings"])):
        bad = [x for x in getattr(args, flag).split(",") if x and x not in allowed]
        if bad:
            parser.error(f"--{flag}: unknown part {bad[0]!r} (choose from {', '.join(allowed)})")
    if args.reset and not args.init_from:
        parser.error("--reset only applies with --init-from")
    if args.objective in TWO_PHASE and not 0 < phase1_steps(args) < args.max_steps and not args.teacher:
        parser.error(f"--phase1-steps must leave both phases at least one of the {args.max_steps} steps")
    if args.out_dir is None:
        args.out_dir = str(HERE / "runs" / f"{args.objective}_{Path(args.data).name}_{args.size}")
    # which flags were typed (a resumed run keeps its saved settings and refuses new ones);
    # argparse has no public map from option string to destination, hence the private one
    typed = [t.split("=")[0] for t in (sys.argv[1:] if argv is None else argv)]
    args.given = sorted({parser._option_string_actions[t].dest for t in typed if t in parser._option_string_actions})
    for k, v in DEFAULTS.get(args.objective, {}).items():
        if k not in args.given:
            setattr(args, k, v)
    return args


def model_config(args, vocab_size) -> ModelConfig:
    overrides = {f.name: getattr(args, f.name) for f in fields(ModelConfig) if getattr(args, f.name, None) is not None}
    config = ModelConfig(**{**PRESETS[args.size], **overrides, "vocab_size": vocab_size})
    if config.d_model % config.n_head:
        raise SystemExit(f"error: --d-model {config.d_model} is not a multiple of --n-head {config.n_head}")
    if args.seq_len > config.max_position:
        raise SystemExit(f"error: --seq-len {args.seq_len} exceeds --max-position {config.max_position}")
    return config


def code_version() -> dict:
    files = [HERE / "model.py", HERE / "train.py", HERE / "sparse.py", HERE / "data" / "prepare.py"]
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        git = ""
    return {"git": git or "unknown", "sha256": digest}


# ---------------------------------------------------------------------------------------------
# Validation: the same masked batches every time, so figures compare across steps and runs

@torch.no_grad()
def evaluate(trainee, val, args, vocab_size, ctx, device, autocast):
    """The objective's own loss and figures on the first --eval-batches validation batches."""
    trainee.eval()
    sums = {}
    for i in range(min(args.eval_batches, max(1, val.n // args.batch_size))):
        ids = val.batch(i * args.batch_size % val.n, min(args.batch_size, val.n)).to(device)
        gen = torch.Generator(device).manual_seed(seed_of(args.seed, 2**31, i))
        with autocast:
            loss, figs = trainee(make_batch(ids, args, vocab_size, gen), ctx)
        for k, v in {"loss": loss, **figs}.items():
            sums[k] = sums.get(k, 0.0) + v.float()
    trainee.train()
    return {f"val_{k}": (v / (i + 1)).item() for k, v in sums.items()}


# ---------------------------------------------------------------------------------------------
# Training

def main(argv=None):
    args = get_args(argv)

    # --- processes and device ---------------------------------------------------------------
    ddp = "RANK" in os.environ  # launched by torchrun
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible")
    rank, world, local = 0, 1, 0
    if ddp:
        dist.init_process_group("nccl" if want_cuda else "gloo")
        rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local}" if want_cuda else "cpu")
    if want_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    master = rank == 0
    say = tqdm.write if master else (lambda *a, **k: None)  # tqdm.write keeps the progress bar intact
    bf16 = args.bf16 if args.bf16 is not None else want_cuda
    autocast = torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()

    # --- run folder, and the settings of a resumed run ----------------------------------------
    out = Path(args.out_dir)
    ckpt_path = out / "ckpt.pt"
    ckpt = None
    if args.resume:
        if not ckpt_path.exists():
            raise SystemExit(f"error: --resume, but there is no checkpoint at {ckpt_path}")
        ckpt = read_checkpoint(ckpt_path)
        saved = ckpt["args"]
        changed = [k for k in args.given if k not in RESUMABLE and getattr(args, k) != saved.get(k)]
        if changed:
            raise SystemExit(f"error: a resumed run keeps its settings, but {', '.join('--' + k.replace('_', '-') for k in changed)} "
                             f"differ from the checkpoint's; drop them or start a new --out-dir")
        now = {k: getattr(args, k) for k in RESUMABLE if k in args.given or k in ("resume", "out_dir")}
        defaults = vars(build_parser().parse_args([]))  # flags newer than the checkpoint
        args = argparse.Namespace(**{**defaults, **saved, **now, "given": args.given})
    elif ckpt_path.exists():
        raise SystemExit(f"error: {ckpt_path} exists; pass --resume to continue that run or choose another --out-dir")

    # --- data (rank 0 prepares, the others wait and reuse it) ---------------------------------
    if master:
        data_dir = prepare(args.data, args.vocab_size)
    if ddp:
        dist.barrier()
    if not master:
        data_dir = prepare(args.data, args.vocab_size, quiet=True)
    meta = load_meta(data_dir)
    V = meta["vocab_size"]
    train = Segments(data_dir / "train.bin", args.seq_len - 2, args.seed, shuffle=True).to(device)
    val = Segments(data_dir / "val.bin", args.seq_len - 2, args.seed, shuffle=False)

    # --- the encoder, and what each phase trains with it ----------------------------------
    config = model_config(args, V)
    torch.manual_seed(args.seed)
    encoder = Encoder(config)
    step = 0
    init_from = args.init_from or (args.teacher if args.student_init == "continued" else None)
    if ckpt is not None:
        check_config(ckpt["config"], config, ckpt_path)
        encoder.load_state_dict(ckpt["model"], strict=True)
        step = ckpt["step"]
    elif init_from:
        src = read_checkpoint(init_from)
        reset = [PARTS[x] for x in args.reset.split(",") if x]
        check_config(src["config"], config, init_from, ignore=("vocab_size",) if "embeddings" in args.reset else ())
        if set(src["model"]) != set(encoder.state_dict()):
            raise SystemExit(f"error: {init_from} holds other tensors than this model has")
        fresh = lambda name: any(part(name) for part in reset)   # these keep this run's own init
        encoder.load_state_dict({k: (v if fresh(k) else src["model"][k]) for k, v in encoder.state_dict().items()}, strict=True)
    if "embeddings" in args.freeze.split(","):  # the blog's "is it all in the embeddings?" ablation
        encoder.word.weight.requires_grad_(False)  # (the tied output with them)
    encoder.to(device)

    def build(objective):
        """The phase's Trainee (encoder + the objective's heads), its ctx, a fresh optimizer, and
        the module the loop calls (the trainee, wrapped for DDP and compiled if asked)."""
        heads, ctx = SETUP[objective](encoder, args, out, device) if objective in SETUP else (nn.ModuleDict(), {})
        trainee = Trainee(encoder, heads.to(device), LOSSES[objective])
        model = trainee
        if ddp:
            model = torch.nn.parallel.DistributedDataParallel(trainee, device_ids=[local] if want_cuda else None,
                                                              broadcast_buffers=False)
        if args.compile if args.compile is not None else want_cuda:
            model = torch.compile(model)
        return trainee, {**ctx, "args": args, "step": step}, make_optimizer(trainee, args), model

    current = ckpt.get("objective", "mlm") if ckpt is not None else phase_of(step, args)[0]
    trainee, ctx, optimizer, model = build(current)
    if ckpt is not None:  # the phase the checkpoint was written in, in the state it was in
        trainee.heads.load_state_dict(ckpt.get("heads", {}), strict=True)
        if "ema" in ctx:
            ctx["ema"].load_state_dict(ckpt["ctx_state"]["ema"], strict=True)
        optimizer.load_state_dict(ckpt["optimizer"])
        # the loop reseeds every micro-batch; the saved state covers randomness drawn outside it
        torch.set_rng_state(ckpt["rng"]["torch"])
        if want_cuda and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    global_batch = args.batch_size * args.grad_accum * world
    tokenizer = (data_dir / "tokenizer.model").read_bytes()
    version = code_version()

    # --- what a run folder keeps ---------------------------------------------------------------
    if master:
        out.mkdir(parents=True, exist_ok=True)
        if ckpt is None:
            (out / "args.json").write_text(json.dumps({k: v for k, v in vars(args).items() if k != "given"}, indent=1))
            (out / "config.json").write_text(json.dumps(asdict(config), indent=1))
            (out / "data.json").write_text(json.dumps(meta, indent=1))
            (out / "code").mkdir(exist_ok=True)
            for f in ("model.py", "train.py", "sparse.py", "data/prepare.py"):
                shutil.copy(HERE / f, out / "code" / Path(f).name)
            (out / "log.jsonl").unlink(missing_ok=True)
        else:  # drop log lines written after the checkpoint by the run that was cut off
            lines = (out / "log.jsonl").read_text().splitlines() if (out / "log.jsonl").exists() else []
            (out / "log.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= step))
            if ckpt["code_version"]["sha256"] != version["sha256"]:
                say("warning: the code changed since this run started; resuming with the new code")
    log_file = open(out / "log.jsonl", "a") if master else None

    def log(record):
        if master:
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()

    def save(at, path):
        if master:
            save_checkpoint({
                "model": encoder.state_dict(), "objective": current, "heads": trainee.heads.state_dict(),
                "ctx_state": {"ema": ctx["ema"].state_dict()} if "ema" in ctx else None,
                "optimizer": optimizer.state_dict(), "config": asdict(config),
                "args": {k: v for k, v in vars(args).items() if k != "given"}, "step": at,
                "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if want_cuda else None},
                "data_pos": at * global_batch, "code_version": version, "tokenizer": tokenizer,
                "data": {k: meta[k] for k in ("name", "vocab_size", "train_tokens", "unigram_entropy")},
            }, path)
        return at

    phases = f"mlm for {phase1_steps(args)} steps, then {args.objective}" if phase1_steps(args) else args.objective
    say(f"model: {encoder.num_params() / 1e6:.2f}M parameters ({args.size}: {config.n_layer} layers, d_model {config.d_model}, "
        f"{config.position} positions) | data: {meta['train_tokens']:,} train tokens, vocab {V}, "
        f"unigram entropy {meta['unigram_entropy']:.3f} nats")
    say(f"train: {phases} on {device} x{world} | {global_batch} seqs x {args.seq_len} tokens per step "
        f"({args.batch_size} x {args.grad_accum} accum x {world} procs) | {args.max_steps} steps = "
        f"{args.max_steps * global_batch / train.n:.1f} epochs | {out}")

    # --- the loop ----------------------------------------------------------------------------
    last_saved = step if ckpt is not None else None
    sums, since_log = {}, 0
    nonfinite = torch.tensor(-1, device=device)  # first step whose loss or gradient was not finite
    t_log, t0, step0 = time.time(), time.time(), step
    bar = tqdm(total=args.max_steps, initial=step, disable=None if master else True, unit="step", dynamic_ncols=True)
    while step < args.max_steps:
        objective, start, end = phase_of(step, args)
        if objective != current:  # phase 2 begins; phase1.pt was written when phase 1 ended
            if args.student_init == "scratch":
                torch.manual_seed(seed_of(args.seed, step))
                encoder.init_weights()
            current = objective
            trainee, ctx, optimizer, model = build(objective)
            say(f"step {step}: phase 2, {objective} from {'scratch' if args.student_init == 'scratch' else 'the phase-1 weights'}, "
                f"taught by {args.teacher or out / 'phase1.pt'}")
            t_log = time.time()  # phase 1 ended on a log step; its set-up (mlsm: a dictionary) is not training time
        lr = lr_at(step, args, start, end)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.param_groups[0]["weight_decay"] = weight_decay_at(step, args, start, end)
        ctx["step"] = step
        step_loss = 0.0
        for micro in range(args.grad_accum):
            k = rank * args.grad_accum + micro  # this micro-batch's index within the global batch
            torch.manual_seed(seed_of(args.seed, step, k))  # dropout
            gen = torch.Generator(device).manual_seed(seed_of(args.seed, step, k, 1))  # masking
            ids = train.batch(step * global_batch + k * args.batch_size, args.batch_size)
            batch = make_batch(ids.to(device), args, V, gen)  # already there on a GPU (Segments.to)
            sync = not ddp or micro == args.grad_accum - 1  # DDP all-reduces on the last micro-batch only
            with contextlib.nullcontext() if sync else model.no_sync():
                with autocast:
                    loss, figs = model(batch, ctx)
                (loss / args.grad_accum).backward()
            step_loss = step_loss + loss.detach()
            for name, v in {"loss": loss, **figs}.items():
                sums[name] = sums.get(name, 0.0) + v.detach().float() / args.grad_accum
        grad_norm = torch.nn.utils.clip_grad_norm_(trainee.parameters(), args.clip if args.clip > 0 else float("inf"))
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm
        bad = ~(torch.isfinite(step_loss) & torch.isfinite(grad_norm))
        nonfinite = torch.where(bad & (nonfinite < 0), step + 1, nonfinite)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if "ema" in ctx:  # the mean teacher follows the student, one fused update
            ema_update(ctx["ema"], encoder, ema_decay_at(step, args, start, end))
        step += 1
        since_log += 1
        bar.update()

        is_log = step % args.log_every == 0 or step == end
        is_save = step % args.save_every == 0 or step in (end, args.stop_at)
        if is_log or is_save:  # the only places the loop waits for the device
            if ddp:
                dist.all_reduce(nonfinite, dist.ReduceOp.MAX)
            if nonfinite.item() >= 0:
                where = f"the last good checkpoint (step {last_saved}) is kept at {ckpt_path}" if last_saved is not None \
                    else "no checkpoint had been saved yet"
                log({"step": int(nonfinite), "error": "non-finite loss or gradient"})
                raise SystemExit(f"error: the loss or gradient became NaN/inf at step {int(nonfinite)}; "
                                 f"stopped, {where}. Try a lower --lr or --clip.")
        if is_log:  # means over the steps since the last log line, across all processes
            names = list(sums)
            values = torch.stack([sums[k] for k in names]) / since_log
            if ddp:
                dist.all_reduce(values)
                values /= world
            elapsed = time.time() - t_log
            record = {"step": step, **dict(zip(names, values.tolist())), "lr": lr,
                      "tok_per_s": since_log * global_batch * args.seq_len / elapsed,
                      "peak_mem_gb": (torch.cuda.max_memory_allocated(device) if want_cuda else   # process RSS on CPU
                                      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30}
            if "stopwatch" in ctx:  # e.g. mlsm's sparse coding, as a share of the training time
                record["code_share"] = ctx["stopwatch"].read() / elapsed
            log(record)
            eta = (time.time() - t0) / (step - step0) * (args.max_steps - step)
            terms = "".join(f" | {k} {record[k]:.4f}" for k in [*figs, "code_share"] if k in record and k != "acc")
            say(f"step {step}/{args.max_steps} | loss {record['loss']:.4f}{terms} | lr {lr:.1e} | "
                f"{record['tok_per_s'] / 1e3:.1f}k tok/s | eta {eta / 60:.0f}m")
            sums, since_log, t_log = {}, 0, time.time()
        if step % args.eval_every == 0 or step == end:
            record = {"step": step, **evaluate(trainee, val, args, V, ctx, device, autocast)}
            log(record)
            say(f"step {step}/{args.max_steps} | {current} | " + " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
            t_log = time.time()  # throughput counts training time only
        if current != args.objective and step == end:  # phase 1 is over: its model teaches phase 2
            save(step, out / "phase1.pt")
            if ddp:
                dist.barrier()  # every process loads it as the teacher next
        if is_save:
            last_saved = save(step, ckpt_path)
            t_log = time.time()
        if step == args.stop_at:
            break
    bar.close()
    say(f"done: step {step}, {(time.time() - t0) / 60:.1f} min; checkpoint {ckpt_path}")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
