"""Pretrain the shared encoder with one objective, the whole run here from top to bottom: the
flags, the processes, the run folder, the corpus, the encoder, each phase made ready, the loop
(batches -> masking -> its loss -> step, the guard read at its sync points), validation and
checkpoints.

    python train.py --objective mlm --data babylm_10m --size tiny --max-steps 2000   # CPU demo
    python train.py --objective mlm --data babylm_10m --size small            # one GPU, compiled
    torchrun --nproc_per_node 4 train.py --objective mlm --data babylm_10m     # DDP
    python train.py --out-dir runs/mlm_babylm_10m_small --resume               # continue
    python train.py --objective kd+mlm --data babylm_10m --phase1-steps 0.2    # MLM, then KD

Each objective is a loss and an entry in objectives.py, with its flags and its paper's defaults
(docs/objectives/). A flag not typed takes the recipe's value (recipe: the --size's, then the
objective's, then the objective's at that size), else its own default; --check prints what they
resolve to. A run folder (--out-dir, machinery/plumbing.py) keeps settings, log, checkpoints and
code; SIGINT or SIGTERM saves the step. Batches, masks and dropout are functions of (seed, step,
micro-batch): a resumed run follows the path of an uninterrupted one (bit for bit on the CPU).
A checkpoint (ckpt.pt) holds the model, heads, optimizer, config, args, step, RNG states, data
position, code version, tokenizer, how it predicts (its objective's predicts_before and decoder)
and a checksum.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

import objectives
from data.masking import MASKINGS, make_batch, mask_p_at, seed_of
from data.prepare import VOCAB_SIZE, Segments, load_meta, located, prepare, raw_root, text_bytes
from machinery.kernels import fused_unavailable
from machinery.plumbing import (REPO, Parser, Range, RunFolder, SafetyNet, StepProgress, above,
                                add_device_flag, at_least, autocast, code_version, duration,
                                exit_now, exit_on_stop_signals, line_buffered, on_stop_signals,
                                peak_memory_gb, pick_device, read_checkpoint, repo_sources,
                                use_compile, use_deterministic, use_tf32)
from model import (PRESETS, RESET_PARTS, TRAINING_ATTENTION, Encoder, Layer,
                   check_config, load_weights, model_config, use_attention)
from objectives import BASELINE, DICT_FLAG_NAMES, OBJECTIVES, ObjectiveParts, Trainee, dict_config
from training.optim import (clipped_step, ema_decay_at, ema_update, make_optimizer,
                            set_schedule)


# ---------------------------------------------------------------------------------------------
# Flags: the loop's, the data and model's, the optimizer's, the masking's, the device's, where a
# run starts from; then each objective's own (declared beside its loss in objectives.py)

# Per-size defaults, under an objective's own: `small` MLM diverged at LAMB lr 1e-2 with 128 x 128
# batches and trains stably at 5e-3; LTG-BERT's 1e-2 goes with 8x larger batches
# (docs/objectives/mlm.md, deviation 4). `tiny` keeps the CPU sweep's 1e-2 (docs/studies/).
SIZE_DEFAULTS = {"tiny": dict(lr=1e-2), "small": dict(lr=5e-3), "base": dict(lr=5e-3)}
COMPILE_SCOPES = ("model", "layers")  # --compile-scope: the whole model, or one graph per layer
# the flags a resumed run may change (--lr: a run the guard stopped goes on at a lower one)
RESUMABLE = {"resume", "out_dir", "device", "compile", "compile_scope", "compile_lamb",
             "cuda_graphs", "attention", "bf16", "deterministic", "log_every", "lr",
             "eval_every", "save_every", "stop_at", "spike", "save_words", "check", "force"}
BABYLM_WORDS = [*range(1, 10), *range(10, 101, 10)]  # millions: chck_1M ... chck_100M


def word_counts(text: str) -> list[int]:
    """--save-words: "1M,2M,500K" or "babylm" -> the word counts (ValueError if unreadable)."""
    if text == "babylm":
        return [m * 10 ** 6 for m in BABYLM_WORDS]
    try:
        counts = [round(float(c[:-1]) * {"K": 1e3, "M": 1e6}[c[-1].upper()])
                  for c in text.split(",")] if text else []
    except (KeyError, ValueError, IndexError):
        counts = [0]
    if any(n <= 0 for n in counts):
        raise ValueError(f"{text!r}: give positive counts such as 1M,2M,500K, or babylm")
    return counts


def save_words_flag(text: str) -> str:
    """--save-words' type: the text as given, once word_counts reads it."""
    try:
        word_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


parser = Parser(prog="train.py", description=__doc__, allow_abbrev=False,
                      usage="train.py [--objective NAME] [--data DATA] [--size SIZE] [flags]")
add = parser.add_argument
add("--objective", default=BASELINE, choices=sorted(OBJECTIVES), metavar="NAME",
    help="pretraining objective: " + ", ".join(OBJECTIVES))
add("--max-steps", type=at_least(int, 1), default=None,
    help="optimizer steps (default: --epochs of the data)")
add("--grad-accum", type=at_least(int, 1), default=1,
    help="micro-batches per optimizer step")
add("--clip", type=at_least(float, 0), default=2.0,
    help="gradient-norm clipping, 0 = off")
add("--spike", type=at_least(float, 0), default=10.0, help="stop a diverging "
    "run, its last good checkpoint kept (docs/robustness.md); 0 = off")
add("--seed", type=at_least(int, 0), default=0,
    help="seed for init, data order, masks and dropout")
add("--out-dir", default=None, metavar="DIR",
    help="run folder (default runs/OBJECTIVE_DATA_SIZE)")
add("--resume", action="store_true", help="continue the run in --out-dir (--lr, device, "
    "logging, saving may change)")
add("--force", action="store_true", help="start a new run in an --out-dir that holds other "
    "files (never over a run: a ckpt.pt there needs --resume)")
add("--log-every", type=at_least(int, 1), default=50,
    help="steps between log lines")
add("--eval-every", type=at_least(int, 1), default=500,
    help="steps between validations")
add("--eval-batches", type=at_least(int, 1), default=20,
    help="validation batches, always the same ones")
add("--save-every", type=at_least(int, 1), default=1000,
    help="steps between checkpoints")
add("--save-words", default=None, type=save_words_flag,
    help="also keep weights at these words seen: 1M,2M or babylm (for export.py)")
add("--stop-at", type=at_least(int, 1), default=None,
    help="save and exit after this step; the schedule stays --max-steps'")
add("--check", action="store_true", help="print the settings the flags resolve to, exit")

add = parser.add_argument_group("data and model").add_argument
add("--data", default="babylm_10m", help="a corpus in $NANOMLM_RAW, or a text or "
    "prepared folder")
# the 5 specials and 256 byte pieces at least (sentencepiece may need more for a corpus)
add("--vocab-size", type=at_least(int, 262), default=VOCAB_SIZE,
    help="sentencepiece vocabulary when the data is prepared")
add("--seq-len", type=at_least(int, 3), default=128,
    help="tokens per sequence, [CLS] and [SEP] included")
add("--batch-size", type=at_least(int, 1), default=128,
    help="sequences per micro-batch per process")
add("--size", default="small", choices=PRESETS, metavar="SIZE",
    help=f"model preset: {', '.join(PRESETS)} (flags below override)")
# ModelConfig's fields (but vocab_size, the tokenizer's): unset, the --size preset decides
add("--n-layer", type=at_least(int, 1), help="transformer layers")
add("--n-head", type=at_least(int, 1), help="attention heads (d_model must divide evenly)")
add("--d-model", type=at_least(int, 1), help="hidden size")
add("--d-ff", type=at_least(int, 1),
    help="feed-forward inner size (GEGLU's first projection: 2*d_ff)")
add("--dropout", type=Range(float, 0, 1, high_open=True),
    help="on embeddings, attention probabilities and sublayer outputs")
add("--position", choices=("relative", "absolute"),
    help="relative (log-bucketed, LTG-BERT) or absolute (a learned table)")
add("--position-buckets", type=at_least(int, 2),
    help="relative: offsets up to buckets/2 exact, log-spaced beyond")
add("--max-position", type=at_least(int, 3),
    help="longest sequence the position scheme covers")
add("--layer-norm-eps", type=above(float, 0), help="LTG-BERT's epsilon")
add("--final-norm", action=argparse.BooleanOptionalAction,
    help="an affine LayerNorm after the last layer (boot's, as boot-bert)")

add = parser.add_argument_group("optimizer and schedule").add_argument
add("--optim", default="lamb", choices=["adamw", "lamb"],
    help="optimizer; betas (0.9, 0.98)")
sizes = ", ".join(f"{size} {d['lr']:g}" for size, d in SIZE_DEFAULTS.items())  # by --size
add("--lr", type=at_least(float, 0), default=None,
    help=f"peak learning rate ({sizes})")
add("--warmup", type=at_least(float, 0), default=0.016,
    help="warmup: a fraction of --max-steps if < 1, else steps")
add("--schedule", default="cosine", choices=["cosine", "linear", "cosine-cooldown"],
    metavar="NAME", help="decay after warmup: cosine, linear, or cosine-cooldown (to 0 "
    "over --cooldown)")
add("--cooldown", type=Range(float, 0, 1, high_open=True), default=0.016,
    help="cosine-cooldown: the share of steps falling linearly to 0")
add("--min-lr", type=Range(float, 0, 1), default=0.1,
    help="final learning rate as a fraction of --lr")
add("--weight-decay", type=at_least(float, 0), default=0.1,
    help="decoupled weight decay on weight matrices")
add("--weight-decay-end", type=at_least(float, 0), default=None,
    help="cosine weight decay to this (default: constant)")
add("--decay-embeddings", action=argparse.BooleanOptionalAction, default=False,
    help="decay embeddings and positions too")
add("--eps", type=above(float, 0), default=1e-6, help="the optimizer's epsilon")
add("--epochs", type=above(float, 0), default=10.0,
    help="without --max-steps: passes over the data (BabyLM's limit)")

add = parser.add_argument_group("masking").add_argument
add("--masking", default="span", choices=list(MASKINGS), metavar="NAME", help="span "
    "(LTG-BERT's), token (BERT's) or uniform (the MLSM code's)")
add("--mask-p", type=Range(float, 0, 1, True, True), default=0.15,
    help="fraction of tokens predicted (first step)")
add("--mask-p-end", type=Range(float, 0, 1, True, True), default=None,
    help="falls linearly from --mask-p to this (default: constant)")

add = parser.add_argument_group("device and speed (docs/bench.md)").add_argument
add_device_flag(add, "where to train")
add("--compile", action=argparse.BooleanOptionalAction, default=None,
    help="torch.compile the model (default: on with CUDA)")
add("--compile-scope", default="model", choices=COMPILE_SCOPES, metavar="NAME",
    help="model (one graph) or layers (one graph all layers reuse)")
add("--compile-lamb", action=argparse.BooleanOptionalAction, default=False,
    help="compile LAMB's update too (a longer start)")
add("--attention", default="gather", choices=TRAINING_ATTENTION, metavar="NAME",
    help="one function: gather, gather-fp32, onehot (no atomics) or fused (CUDA kernels)")
add("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
    help="replay the compiled step as CUDA graphs")
add("--bf16", action=argparse.BooleanOptionalAction, default=None,
    help="bfloat16 autocast of the forward (default: on with CUDA)")
add("--deterministic", action=argparse.BooleanOptionalAction, default=False,
    help="deterministic kernels: bit-equal resumes on a GPU")

add = parser.add_argument_group("start from").add_argument
add("--init-from", default=None,
    help="start from this checkpoint's weights (fresh optimizer, step 0)")
add("--reset", default="", help="with --init-from, these fresh: embeddings, positions")
add("--freeze", default="", help="parts not trained: embeddings (and so the tied output)")
objectives.add_flags(parser)
objectives.note_defaults(parser)
DEFAULTS = vars(parser.parse_args([]))  # every flag's own default, read once


def recipe(objective: str, size: str) -> dict:
    """The untyped flags' values where they differ from their own defaults: the size's, then the
    objective's paper's, then the objective's at that size (--check prints the result)."""
    entry = OBJECTIVES[objective]
    return {**SIZE_DEFAULTS[size], **(entry.defaults or {}),
            **(entry.size_defaults or {}).get(size, {})}


UNSET = object()  # a flag not typed, until get_args fills it


def get_args(argv=None):
    """The flags: typed ones as typed, the others the recipe's or their default, checked (one line
    if bad); args.given: the typed ones."""
    typed = {k: v for k, v in vars(parser.parse_args(
        argv, argparse.Namespace(**dict.fromkeys(DEFAULTS, UNSET)))).items() if v is not UNSET}
    objective, size = (typed.get(k, DEFAULTS[k]) for k in ("objective", "size"))
    args = argparse.Namespace(**{**DEFAULTS, **recipe(objective, size), **typed},
                              given=sorted(typed))
    objectives.refuse_others(args, args.given, parser.error)
    if "phase1_steps" in args.given and not has_phase1(args) and not args.resume:
        parser.error("--phase1-steps needs a phase 1: mlm --two-phase, or kd and mlsm without "
                     "--teacher")
    if args.reset and not args.init_from:
        parser.error("--reset only applies with --init-from")
    if OBJECTIVES[objective].declares("dict"):  # its dictionary's flags: now, not after phase 1
        dict_config(args).check(names=DICT_FLAG_NAMES)
    for flag, allowed in (("reset", RESET_PARTS), ("freeze", ["embeddings"])):
        bad = [x for x in getattr(args, flag).split(",") if x and x not in allowed]
        if bad:
            parser.error(f"--{flag}: unknown part {bad[0]!r} (choose from {', '.join(allowed)})")
    if args.max_steps is not None:
        check_phases(args)
    if args.out_dir is None:
        args.out_dir = str(REPO / "runs" / f"{objective}_{Path(args.data).name}_{size}")
    lowest = min(args.mask_p, args.mask_p_end or 1)
    if MASKINGS[args.masking] is None and int(lowest * args.seq_len) < 1:
        parser.error(f"--mask-p {lowest:g} masks no token of a --seq-len {args.seq_len} "
                     f"sequence under uniform masking (int(p T) = 0); raise either")
    return args


# more tokens than a year of training even at 3M tokens/s, several times our fastest measured
# step (docs/bench.md): a --max-steps this large is a typo, not a plan
MOST_TOKENS = 10 ** 14


def check_phases(args):
    """Each phase has a step, and a warmup in steps fits in each; a year could train the budget."""
    tokens = args.max_steps * args.batch_size * args.grad_accum * args.seq_len
    if tokens > MOST_TOKENS:
        raise SystemExit(f"error: --max-steps {args.max_steps} is {tokens:.2g} tokens: more than "
                         f"a year even at 3M tokens/s; give the steps you mean to train")
    p1 = phase1_steps(args)
    if has_phase1(args) and not 0 < p1 < args.max_steps:
        raise SystemExit(f"error: --phase1-steps must leave both phases at least one of the "
                         f"{args.max_steps} steps")
    phases = [p1, args.max_steps - p1] if p1 else [args.max_steps]
    if args.warmup >= 1 and args.warmup > min(phases):
        what = "the run's" if len(phases) == 1 else "its shorter phase's"
        raise SystemExit(f"error: --warmup {args.warmup:g} steps is longer than {what} "
                         f"{min(phases)} steps; give fewer, or a fraction (< 1) of the steps")


def resumed_args(args, path, defaults: dict):
    """(the saved settings of the run at `path`, its checkpoint). A resumed run keeps them: typed
    flags that would change them are refused (but the RESUMABLE ones), and flags newer than the
    checkpoint take their `defaults` ({flag: default}). A run stopped before its first save has
    no checkpoint (None): its args.json, and it begins again from step 0 (the command that the
    messages of a run stopped that early give: --resume, at a lower --lr say)."""
    settings = path.parent / "args.json"
    if path.exists():
        ckpt = read_checkpoint(path)
        saved = ckpt["args"]
    elif settings.exists():  # stopped before its first save: it begins again, as it was begun
        ckpt = None
        try:
            saved = json.loads(settings.read_text())
        except ValueError:
            raise SystemExit(f"error: --resume: {settings} is not a run's settings (no "
                             f"checkpoint at {path} either)") from None
    else:
        raise SystemExit(f"error: --resume, but there is no checkpoint at {path}")
    changed = [k for k in args.given if k not in RESUMABLE and getattr(args, k) != saved.get(k)]
    if changed:
        flags = ", ".join("--" + k.replace("_", "-") for k in changed)
        budget = [k for k in ("max_steps", "epochs") if k in changed]
        hint = ""
        if budget:  # a longer run is a new one from these weights; a shorter one, --stop-at
            longer = (getattr(args, budget[0]) or 0) > (saved.get(budget[0]) or 0)
            hint = (f"; to train on past its end, start a new run from its weights: --init-from "
                    f"{path} --out-dir NEW (a fresh optimizer and schedule)" if longer else
                    "; to end it sooner, resume with --stop-at STEP")
        raise SystemExit(f"error: a resumed run keeps its settings, but {flags} "
                         f"{'differs' if len(changed) == 1 else 'differ'} from the checkpoint's; "
                         f"drop {'it' if len(changed) == 1 else 'them'} or start a new --out-dir"
                         + hint)
    # --stop-at holds for one command: the run it resumes stopped there, this one goes on
    now = {k: getattr(args, k) for k in RESUMABLE
           if k in args.given or k in ("resume", "out_dir", "stop_at")}
    return argparse.Namespace(**{**defaults, **saved, **now, "given": args.given}), ckpt


# ---------------------------------------------------------------------------------------------
# Phases and batches


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
    return (BASELINE, 0, p1) if step < p1 else (args.objective, p1, args.max_steps)


@dataclass
class Run:
    """What the loop needs that stays the same from phase to phase."""
    args: argparse.Namespace
    ddp: bool                  # launched by torchrun
    rank: int
    world: int                 # processes
    device: torch.device
    amp: object                # bf16 autocast, or a disabled one
    folder: RunFolder
    meta: dict                 # the prepared corpus' meta.json, and its folder's name (NAME-KEY)
    train: Segments            # on the device: a batch is one indexing there
    val: Segments
    encoder: Encoder
    ckpt: dict | None          # the checkpoint resumed from
    tokenizer: bytes
    version: dict              # code_version of its code, kept in every checkpoint
    global_batch: int          # segments per optimizer step, all processes and micro-batches

    def say(self, text):  # rank 0 only; tqdm.write keeps the progress bar intact
        if self.rank == 0:
            tqdm.write(text)


class Phase(NamedTuple):
    """One phase of training: its objective, its steps [start, end), and what trains in it."""
    objective: str
    entry: objectives.Objective  # its OBJECTIVES entry
    start: int
    end: int
    trainee: nn.Module         # the encoder and the objective's heads; its forward is the loss
    model: nn.Module           # the trainee, wrapped for DDP and compiled as asked
    graphs: bool               # its compiled forward and backward replayed as CUDA graphs
    optimizer: torch.optim.Optimizer
    parts: ObjectiveParts      # what the loss reads besides the batch (a teacher, ...)


def start_phase(run: Run, step: int) -> Phase:
    """The phase `step` belongs to, ready: its entry's parts (heads, a teacher...), the trainee
    whose forward is its loss with the entry's settings bound, wrapped and compiled as asked, and
    an optimizer (the checkpoint's when resuming inside the phase)."""
    args = run.args
    objective, start, end = phase_of(step, args)
    entry = OBJECTIVES[objective]
    kept = (run.folder.path / "ckpt.pt").exists()
    with exit_on_stop_signals(
            f"while phase {2 if start else 1} was being set up; " +
            (f"continue with: python train.py --out-dir {run.folder.path} --resume" if kept else
             "nothing was saved")):
        if step == start > 0 and args.student_init == "scratch":
            torch.manual_seed(seed_of(args.seed, step))
            run.encoder.init_weights()
        parts = (entry.setup(run.encoder, args, run.folder.path, run.device) if entry.setup
                 else ObjectiveParts())
    if step == start > 0:
        init = "scratch" if args.student_init == "scratch" else "the phase-1 weights"
        teacher = args.teacher or run.folder.path / "phase1.pt"
        run.say(f"step {step}: phase 2, {objective} from {init}, a fresh optimizer and warm-up"
                + (f", taught by {teacher}" if entry.setup else ""))
    loss = functools.partial(entry.loss, **{k: getattr(args, k) for k in entry.settings})
    trainee = Trainee(run.encoder, parts.heads.to(run.device), loss)
    head_dim = run.encoder.config.d_model // run.encoder.config.n_head
    if args.attention == "fused" and (why := fused_unavailable(run.device, head_dim)):
        raise SystemExit(f"error: --attention fused: {why}")
    use_attention(trainee, args.attention)  # the same function in each form (not saved)
    model = trainee
    if run.ddp:
        ids = [run.device.index] if run.device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(trainee, device_ids=ids,
                                                    broadcast_buffers=False)
    graphs = replays_graphs(run)
    if use_compile(run.device, args.compile):  # reduce-overhead: graphs captured once, replayed
        mode = "reduce-overhead" if graphs else None
        if args.compile_scope == "layers":  # one layer's graph, which the others reuse
            for layer in filter(lambda m: isinstance(m, Layer), trainee.modules()):
                layer.compile(mode=mode)
        else:
            model = torch.compile(model, mode=mode)
    optimizer = make_optimizer(trainee, args)
    saved = run.ckpt if run.ckpt is not None and run.ckpt["step"] == step else None
    if saved is not None and saved["objective"] != objective and step != start:
        raise SystemExit(f"error: {run.folder.path / 'ckpt.pt'} was written in the "
                         f"{saved['objective']} phase, but step {step} belongs to the "
                         f"{objective} phase; it cannot be resumed with these settings")
    if saved is not None and step > start:  # resumed inside the phase, not at its start
        trainee.heads.load_state_dict(saved["heads"], strict=True)
        if parts.ema is not None:
            parts.ema.load_state_dict(saved["extras_state"]["ema"], strict=True)
        optimizer.load_state_dict(saved["optimizer"])
    return Phase(objective, entry, start, end, trainee, model, graphs, optimizer, parts)


def replays_graphs(run: Run) -> bool:
    """Whether the compiled step is replayed as CUDA graphs: --cuda-graphs, compiled, on CUDA."""
    return (run.args.cuda_graphs and run.device.type == "cuda"
            and use_compile(run.device, run.args.compile))


def train_batch(run: Run, step: int, micro: int) -> dict:
    """Micro-batch `micro` of `step`, dropout reseeded: functions of (seed, step, index), so a
    resumed run draws what an uninterrupted one would."""
    args = run.args
    k = run.rank * args.grad_accum + micro  # this micro-batch's index in the global batch
    torch.manual_seed(seed_of(args.seed, step, k))  # dropout
    gen = torch.Generator(run.device).manual_seed(seed_of(args.seed, step, k, 1))  # masks
    ids = run.train.batch(step * run.global_batch + k * args.batch_size, args.batch_size)
    return make_batch(ids.to(run.device), args, run.meta["vocab_size"], gen,  # ids: on the GPU
                      mask_p_at(step, args))


# ---------------------------------------------------------------------------------------------
# Set-up: the corpus and the encoder


def load_corpus(args, ddp: bool, rank: int, device, folder: RunFolder, ckpt: dict | None):
    """(meta, train, val, tokenizer) of --data, prepared on first use by rank 0; a resumed run's
    must be the one it trained on."""
    if rank == 0:
        if note := wants_a_gpu(args, device):  # before minutes of preparation
            print(note)
        data_dir = prepare(args.data, args.vocab_size)
    if ddp:
        dist.barrier()
    if rank != 0:
        data_dir = prepare(args.data, args.vocab_size, quiet=True)
    meta = {**load_meta(data_dir), "folder": data_dir.name}  # NAME-KEY: what it was made of
    tokenizer = (data_dir / "tokenizer.model").read_bytes()
    train = Segments(data_dir / "train.bin", args.seq_len - 2, args.seed,
                     shuffle=True).count_words(tokenizer)  # the words each step reads
    val = Segments(data_dir / "val.bin", args.seq_len - 2, args.seed, shuffle=False)
    if ckpt is not None and (ckpt["tokenizer"] != tokenizer or
                             ckpt["data"]["folder"] != data_dir.name):
        raise SystemExit(f"error: {folder.path / 'ckpt.pt'} was trained on other data than the "
                         f"prepared {data_dir} (the corpus at {args.data}, or its tokenizer, "
                         f"changed since the run began); it cannot be resumed on it")
    return meta, train.to(device), val, tokenizer


def build_encoder(args, vocab_size, ckpt):
    """(encoder, step): fresh from --seed, the checkpoint's, or --init-from's; --freeze applied."""
    config = model_config(args, vocab_size)
    torch.manual_seed(args.seed)
    encoder = Encoder(config)
    step = 0
    init_from = args.init_from or (args.teacher if args.student_init == "continued" else None)
    if ckpt is not None:
        check_config(ckpt["config"], config, Path(args.out_dir) / "ckpt.pt")
        encoder.load_state_dict(ckpt["model"], strict=True)
        step = ckpt["step"]
    elif init_from:
        load_weights(encoder, init_from, [x for x in args.reset.split(",") if x])
    if "embeddings" in args.freeze.split(","):  # the blog's "is it all in the embeddings?"
        encoder.word.weight.requires_grad_(False)  # (the tied output with them)
    return encoder, step


# ---------------------------------------------------------------------------------------------
# Checkpoints


DATA_KEYS = ("name", "folder", "vocab_size", "train_tokens", "unigram_entropy")  # in checkpoints


def checkpoint_state(run: Run, phase: Phase, step: int, words: int | None = None) -> dict:
    """What a resumed run needs to go on bit for bit (the live tensors); with `words`
    (--save-words), the model alone."""
    state = {
        "model": run.encoder.state_dict(), "objective": phase.objective,
        "predicts_before": phase.entry.predicts_before, "decoder": phase.entry.decoder,
        "heads": phase.trainee.heads.state_dict(), "config": asdict(run.encoder.config),
        "args": {k: v for k, v in vars(run.args).items() if k != "given"}, "step": step,
        "code_version": run.version, "tokenizer": run.tokenizer,
        "data": {k: run.meta[k] for k in DATA_KEYS}}
    # the words read by the end of `step`, counted; a --save-words checkpoint names its mark
    state["words_seen"] = int(run.train.words_read(step * run.global_batch).sum())
    if words is not None:
        state["words_mark"] = words
    if words is None:
        cuda = run.device.type == "cuda"
        state.update({
            "extras_state": ({"ema": phase.parts.ema.state_dict()} if phase.parts.ema
                             else None),
            "optimizer": phase.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if cuda else None},
            "data_pos": step * run.global_batch})
    return state


def save(run: Run, phase: Phase, step: int, name: str = "ckpt.pt", words: int | None = None):
    """checkpoint_state, written atomically by rank 0 (phase1.pt, a --save-words checkpoint;
    ckpt.pt goes through the guard, SafetyNet.save)."""
    if run.rank == 0:
        run.folder.save(checkpoint_state(run, phase, step, words), name)


def word_marks(run: Run) -> dict[int, tuple[str, int]]:
    """{step: (checkpoint name, words seen)} for --save-words: the first step by whose end that
    many training words have been read (counted, Segments.words_read)."""
    counts = word_counts(run.args.save_words)  # readable: the parser checked it
    args, G = run.args, run.global_batch
    name = lambda n: f"chck_{n // 10 ** 6}M" if n % 10 ** 6 == 0 else f"chck_{n // 1000}K"
    # seen[s - 1]: the words read by the end of step s
    seen = run.train.words_read(args.max_steps * G).reshape(-1, G).sum(1).cumsum()
    late = [name(n) for n in sorted(counts) if n > seen[-1]]
    if late:
        run.say(f"note: --save-words: not written, beyond --max-steps {args.max_steps} "
                f"({seen[-1]:,} words): {', '.join(late)}")
    return {int(seen.searchsorted(n)) + 1: (name(n), n) for n in sorted(counts)
            if n <= seen[-1]}


# ---------------------------------------------------------------------------------------------
# What a run says: before it starts, as it goes, when it ends


# the CPU demo: the command a CPU-only user is pointed to when a run would take hours there
CPU_DEMO = ("python train.py --objective mlm --size tiny --vocab-size 4000 --batch-size 32 "
            "--max-steps 1100 --device cpu")  # the README's first block (its time: the README)


def wants_a_gpu(args, device) -> str:
    """The line said before any preparation (a tokenizer takes minutes) when the run is a model
    larger than tiny on a CPU, for long (over 10M tokens): hours there. The tokens: from
    --max-steps, or --epochs of the raw text at about 4 bytes a token (sentencepiece's English
    at 16k pieces is near that)."""
    if device.type != "cpu" or args.size == "tiny":
        return ""
    if args.max_steps:
        tokens, about = args.max_steps * args.batch_size * args.grad_accum * args.seq_len, ""
    else:
        tokens, about = args.epochs * text_bytes(args.data) / 4, "about "
    return (f"note: {args.size} on a CPU, {about}{tokens / 1e6:,.0f}M tokens: hours or days (the "
            f"eta says how long once it starts); this wants a GPU. The CPU demo: {CPU_DEMO}"
            if tokens > 1e7 else "")


def past_end(args, step: int, path) -> str | None:
    """What a resumed run at `step` says when it is at or past its last step or --stop-at."""
    end = min(args.max_steps, args.stop_at or args.max_steps)
    why = f"--stop-at {end}" if end == args.stop_at else f"--max-steps {end}, the run's end"
    return f"nothing to do: {path} is at step {step}, at or past {why}" if step >= end else None


def checked_settings(args, defaults: dict) -> dict:
    """train.py --check: the settings the run would use, a resumed run's saved ones (refusing
    what its resumption would refuse), and on stderr where a resumed run stands; the corpus
    must be there (raw or prepared), as the run would find it."""
    if args.resume:
        path = Path(args.out_dir) / "ckpt.pt"
        args, ckpt = resumed_args(args, path, defaults)
        end = min(args.max_steps, args.stop_at or args.max_steps)
        said = past_end(args, ckpt["step"], path) if ckpt else None
        where = f"is at step {ckpt['step']}" if ckpt else "is not there: the run begins again"
        print(said or f"--resume: {path} {where}; it would train on to step {end}",
              file=sys.stderr)
    located(args.data, args.vocab_size)  # the corpus is there, raw or prepared (one line if not)
    if not args.resume and args.max_steps is None and args.warmup >= 1:
        print(f"note: --epochs sets the steps once the data is read; --warmup {args.warmup:g} "
              f"steps is checked against them then", file=sys.stderr)
    return {k: v for k, v in vars(args).items() if k not in ("given", "check")}


def describe(run: Run, p1: int, note: Callable | None = None) -> str:
    """Two lines on what trains (after p1 steps of MLM), on what and where; then `note`'s."""
    args, cfg, meta = run.args, run.encoder.config, run.meta
    phases = f"mlm for {p1} steps, then " if p1 else ""
    epochs = args.max_steps * run.global_batch / run.train.n
    epochs = f"{epochs:.1f}" if epochs >= 0.1 else f"{epochs:.2g}"  # a short run: not "0.0"
    notes = ""
    if args.cuda_graphs and not replays_graphs(run):
        notes += "\nnote: --cuda-graphs needs CUDA and --compile; the step runs without them here"
    if note is not None:
        notes += "\nnote: " + note(args)
    return (f"model: {run.encoder.num_params() / 1e6:.2f}M parameters ({args.size}: "
            f"{cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.position} positions) | data: "
            f"{meta['train_tokens']:,} train tokens, vocab {meta['vocab_size']}, unigram entropy "
            f"{meta['unigram_entropy']:.3f} nats\n"
            f"train: {phases}{args.objective} on {run.device} x{run.world} | "
            f"{run.global_batch} seqs x {args.seq_len} tokens per step ({args.batch_size} x "
            f"{args.grad_accum} accum x {run.world} procs) | {args.max_steps} steps = "
            f"{epochs} epochs | {run.folder.path}" + notes)


@torch.no_grad()
def validate(run: Run, phase: Phase, step: int) -> dict:
    """The objective's loss and stats on the same --eval-batches masked batches every time."""
    args, val, trainee = run.args, run.val, phase.trainee
    trainee.eval()
    sums = {}
    for i in range(min(args.eval_batches, max(1, val.n // args.batch_size))):
        ids = val.batch(i * args.batch_size % val.n, min(args.batch_size, val.n)).to(run.device)
        gen = torch.Generator(run.device).manual_seed(seed_of(args.seed, 2**31, i))
        with run.amp:
            loss, stats = trainee(make_batch(ids, args, run.meta["vocab_size"], gen), phase.parts)
        for k, v in {"loss": loss, **stats}.items():
            sums[k] = sums.get(k, 0.0) + v.float()
    trainee.train()
    record = {"step": step, **{f"val_{k}": (v / (i + 1)).item() for k, v in sums.items()}}
    run.folder.log(record)
    run.say(f"step {step}/{args.max_steps} | {phase.objective} | " +
            " | ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step"))
    return record


def summary(run: Run, step: int, steps_now: int, seconds: float) -> str:
    """A finished run's last lines: what it trained, its first and last validation, the
    checkpoint, and the commands that evaluate and export it."""
    if run.rank != 0:  # only rank 0 says it (Run.say), and only it reads the log
        return ""
    args, path = run.args, run.folder.path
    tokens = step * run.global_batch * args.seq_len
    rate = steps_now * run.global_batch * args.seq_len / max(seconds, 1e-9)
    val = [r for r in run.folder.records() if "val_loss" in r]
    val = [r for r in val if r.keys() == val[-1].keys()]  # the last phase's objective's
    shown = lambda r: " ".join(f"{k[4:]} {r[k]:.4f}" for k in ("val_loss", "val_acc") if k in r)
    evals = (f"\nvalidation: {shown(val[0])} at step {val[0]['step']} -> {shown(val[-1])} at step "
             f"{val[-1]['step']}" if val else "")
    blimp = raw_root() / "babylm_eval" / "fast_eval"
    blimp = (f"{blimp / 'blimp_fast'} {blimp / 'supplement_fast'}" if blimp.is_dir() else
             f"DIR  (BabyLM's BLiMP files; none at {blimp}: set NANOMLM_RAW)")
    return (f"done: {step} steps, {tokens:,} tokens; this sitting {steps_now} steps in "
            f"{duration(seconds)}, {rate / 1e3:.1f}k tok/s with its evaluations and saves{evals}\n"
            f"checkpoint: {path / 'ckpt.pt'}\n"
            f"next: python evaluate.py blimp --ckpt {path / 'ckpt.pt'} --blimp-dir {blimp}\n"
            f"      python evaluate.py mlm --ckpt {path / 'ckpt.pt'}\n"
            f"      python export.py --ckpt {path} --out hf/{path.name}")


def log_line(record: dict, stats: dict, max_steps: int, eta: float | None) -> str:
    """A log record as one line: the loss, the stats but accuracy, lr, throughput, time left."""
    terms = "".join(f" | {k} {record[k]:.4f}" for k in stats if k != "acc")
    return (f"step {record['step']}/{max_steps} | loss {record['loss']:.4f}{terms} | "
            f"lr {record['lr']:.1e} | {record['tok_per_s'] / 1e3:.1f}k tok/s | "
            f"eta {'?' if eta is None else duration(eta)}")



# ---------------------------------------------------------------------------------------------
# The run


def main(argv=None):
    line_buffered()
    on_stop_signals(exit_now)
    args = get_args(argv)
    if args.check:
        print(json.dumps(checked_settings(args, DEFAULTS)))
        return

    # the processes: torchrun's (NCCL on GPUs, gloo on CPUs) when launched by it; this one's
    # device (--device, the LOCAL_RANK-th GPU), TF32 matmuls where it has them, bf16 as asked
    # (as typed now, like --device: not a resumed run's setting)
    ddp, rank, world, local = "RANK" in os.environ, 0, 1, 0
    if ddp:
        dist.init_process_group("nccl" if pick_device(args.device).type == "cuda" else "gloo")
        rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    device = pick_device(args.device, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    use_tf32(device)
    amp = autocast(device, args.bf16)

    # the run folder: a new run's must hold no run (checked now, before a long data
    # preparation, and again once locked); a resumed one is locked, its saved settings taken
    folder, ckpt = RunFolder(args.out_dir, master=rank == 0), None
    if folder.path.is_dir() and (args.resume or {"lock", "args.json"} & set(os.listdir(
            folder.path))):
        folder.lock()  # one process per run folder (rank 0 holds it for all): a busy one says so
    if args.resume:
        args, ckpt = resumed_args(args, folder.path / "ckpt.pt", DEFAULTS)  # newer flags: theirs
    else:
        folder.check_new("ckpt.pt", others=args.force)
    if args.deterministic:  # before any kernel runs (the run's saved setting, when resumed)
        use_deterministic()
    meta, train, val, tokenizer = load_corpus(args, ddp, rank, device, folder, ckpt)
    encoder, step = build_encoder(args, meta["vocab_size"], ckpt)
    code = repo_sources()  # what decides the results: copied into code/, hashed into ckpts
    run = Run(args, ddp, rank, world, device, amp, folder, meta, train, val, encoder.to(device),
              ckpt, tokenizer, code_version(code), args.batch_size * args.grad_accum * world)
    if args.max_steps is None:  # --epochs: saved in args.json as steps, so a resume keeps them
        args.max_steps = max(1, math.floor(args.epochs * train.n / run.global_batch))
        check_phases(args)
    folder.lock()  # a new run locks its folder as it first writes there
    if ckpt is None:
        if (folder.path / "ckpt.pt").exists():  # another run began and saved there meanwhile
            folder.check_new("ckpt.pt")
        if args.resume:  # (resumed_args: stopped before its first save)
            run.say(f"no checkpoint at {folder.path / 'ckpt.pt'}: the run begins again from "
                    f"step 0, with its settings")
        saved_args = {k: v for k, v in vars(args).items() if k != "given"}
        folder.start(code, args=saved_args, config=asdict(encoder.config), data=meta)
    else:
        folder.resume(step)
        run.say(f"resumed from step {step} of {args.max_steps} ({folder.path / 'ckpt.pt'})")
        if ckpt["code_version"]["sha256"] != run.version["sha256"]:
            run.say("warning: the code changed since this run started; resuming with the new code")
        # the loop reseeds every micro-batch; this covers what is drawn outside it (a phase 2's
        # new heads, when the run was cut off just as phase 1 ended)
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    if said := past_end(args, step, folder.path / "ckpt.pt"):  # a finished run resumed, or
        run.say(said)                                          # --stop-at already passed
        return

    phase = start_phase(run, step)
    run.say(describe(run, phase1_steps(args), OBJECTIVES[args.objective].note))
    word_saves = word_marks(run) if args.save_words else {}  # {step: (name, words)}
    guard = SafetyNet(folder, device, ddp, args.spike, ckpt and step)
    sums, since_log = {}, 0  # each stat summed over the steps since the last log line
    t_log, t0, step0 = time.time(), time.time(), step
    progress = StepProgress(step, args.max_steps, shown=rank == 0, cpu=device.type == "cpu")
    while step < args.max_steps:
        if step == phase.end:  # phase 2 begins; phase1.pt was written as phase 1 ended
            phase = start_phase(run, step)
            t_log = time.time()  # its set-up (teacher, dictionary) is not a step's
        lr = set_schedule(phase.optimizer, step, args, phase.start, phase.end)
        step_loss = 0.0
        for micro in range(args.grad_accum):
            batch = train_batch(run, step, micro)
            if phase.graphs:  # a new replay may overwrite the last one's outputs: read already
                torch.compiler.cudagraph_mark_step_begin()
            sync = not ddp or micro == args.grad_accum - 1  # DDP all-reduces on the last one
            with contextlib.nullcontext() if sync else phase.model.no_sync():
                with amp:
                    loss, stats = phase.model(batch, phase.parts)
                (loss / args.grad_accum).backward()
            step_loss = step_loss + loss.detach()
            for name, v in {"loss": loss, **stats}.items():
                sums[name] = sums.get(name, 0.0) + v.detach().float() / args.grad_accum
        grad_norm = clipped_step(phase.optimizer, args.clip)
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + grad_norm
        guard.recent.append((step_loss, grad_norm))  # the guard reads them at the next sync
        phase.optimizer.zero_grad(set_to_none=True)
        if phase.parts.ema is not None:  # a mean teacher follows the student (BootBERT, sec. 3)
            decay = ema_decay_at(step, args, phase.start, phase.end)
            ema_update(phase.parts.ema, encoder, decay)  # one fused lerp over all tensors
        step += 1
        since_log += 1
        if step == max(step0, phase.start) + 1:  # this phase's first step here: it compiled
            progress.restart(step)  # so the rate of the bar and of the ETA counts from here
        progress.update()

        stop = guard.stopping and step < args.max_steps  # a stop signal: save this step, exit
        is_save = step % args.save_every == 0 or step in (phase.end, args.stop_at) or stop
        is_log = step % args.log_every == 0 or step == phase.end or is_save  # saves are checked
        is_eval = step % args.eval_every == 0 or step == phase.end
        if is_log or is_eval or step in word_saves:  # the only places the loop waits for the device
            guard.check(step, phase.start)  # a NaN stops; the queued step is timed as a step
        if is_log:  # means over the steps since the last log line, across all processes
            names = list(sums)
            means = torch.stack([sums[k] for k in names]) / since_log
            if ddp:
                dist.all_reduce(means)
                means /= world
            seconds = time.time() - t_log
            record = {"step": step, **dict(zip(names, means.tolist())), "lr": lr,
                      "tok_per_s": since_log * run.global_batch * args.seq_len / seconds,
                      "peak_mem_gb": peak_memory_gb(device)}
            folder.log(record)
            guard.judge(step, args.lr)  # a diverging run stops here, its last line logged
            run.say(log_line(record, stats, args.max_steps, progress.eta(step)))
            if said := progress.starved(record["tok_per_s"], folder.path):  # on a CPU only
                run.say(said)
            sums, since_log, t_log = {}, 0, time.time()
        paused = time.time()  # throughput counts training time only: evals and saves are not
        if is_eval:
            validate(run, phase, step)
        if step == phase.end < args.max_steps:  # phase 1 is over: its model teaches phase 2
            save(run, phase, step, "phase1.pt")
            if ddp:
                dist.barrier()  # every process loads it as the teacher next
        if is_save:  # not while the run is suspect, unless it must be saved now
            guard.save(checkpoint_state(run, phase, step), step,
                       must=step in (phase.end, args.stop_at) or stop)
        if step in word_saves:
            save(run, phase, step, f"{word_saves[step][0]}.pt", words=word_saves[step][1])
        t_log += time.time() - paused  # (not reset: the steps since the last log line still count)
        if stop:
            progress.close()
            guard.stop(step, rank, folder.path)
        if step == args.stop_at:
            break
    progress.close()
    guard.release()
    run.say(summary(run, step, step - step0, time.time() - t0))
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
