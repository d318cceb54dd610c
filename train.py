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
training/run.py) keeps the settings, log, checkpoints and code of a run. SIGINT/SIGTERM
save the current step and print the --resume command.

The objectives sit one file below, in objectives.py: adding one = its loss function
`loss, stats = fn(model, batch, parts)` (+ a setup function if it trains extra modules or needs
a teacher) + one OBJECTIVES entry; the loop names no objective. Two-phase objectives (kd,
kd+mlm, mlsm, mlsm+mlm) train plain MLM for --phase1-steps, keep that model as phase1.pt, then
continue with the objective against it as a frozen teacher: one command, one schedule per phase.
mlsm learns its dictionary between the phases (sparse.dictionary_for_run, into RUN/dict.pt). mlm
--two-phase runs the same schedule with MLM in phase 2: the baseline they are compared with. Each
objective defaults to its paper's recipe (OBJECTIVES[...].defaults; docs/objectives/ has the
recipe cards).

Reproducibility: batches and masks are functions of (seed, step, micro-batch), and dropout is
reseeded the same way at every micro-batch, so a run resumed from any checkpoint follows the very
path of an uninterrupted one (bit for bit on CPU; tests/test_train.py checks it).
"""
import argparse
import contextlib
import json
import time
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

import sparse
from data.masking import MASKINGS, make_batch, mask_p_at, seed_of
from data.prepare import VOCAB_SIZE
from machinery import flags
from machinery.device import add_device_flag
from machinery.optim import clipped_step, ema_decay_at, ema_update, set_schedule
from machinery.progress import StepProgress, line_buffered
from machinery.run_folder import REPO, repo_sources
from machinery.stopping import SafetyNet, exit_now, exit_on_stop_signals, on_stop_signals
from model import PARTS, PRESETS, TRAINING_ATTENTION, ModelConfig
from objectives import (BASELINE, DICT_FLAG_NAMES, DICT_FLAGS, OBJECTIVES,
                        ObjectiveParts, Trainee, causal_fraction, dict_config)
from training.run import (COMPILE_SCOPES, Phase, Run, build_encoder, check_warmup,
                          checkpoint_state, checked_settings, describe, load_corpus, log_line,
                          nothing_to_do, open_folder, save, save_words_flag, start_phase,
                          start_processes, start_run, summary, validate, word_marks)


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
    return (BASELINE, 0, p1) if step < p1 else (args.objective, p1, args.max_steps)


def phase_at(run: Run, step: int) -> Phase:
    """The phase `step` belongs to, ready to train: its objective's parts (heads, a teacher...)
    and trainee, then training/run.start_phase. Phase 2 with --student-init scratch starts from
    a fresh encoder."""
    objective, start, end = phase_of(step, run.args)
    entry = OBJECTIVES[objective]
    kept = (run.folder.path / "ckpt.pt").exists()  # a set-up may take minutes: a signal ends it
    with exit_on_stop_signals(
            f"while phase {2 if start else 1} was being set up; " +
            (f"continue with: python train.py --out-dir {run.folder.path} --resume" if kept else
             "nothing was saved")):
        return start_phase(run, step, objective, entry, start, end,
                           *make_trainee(run, step, objective, entry, start))


def make_trainee(run: Run, step: int, objective: str, entry, start: int):
    """(the trainee, its objective's parts) of the phase `step` starts: what its setup makes
    (heads, a teacher, a dictionary...), on a fresh encoder if --student-init scratch."""
    args = run.args
    if step == start > 0 and args.student_init == "scratch":
        torch.manual_seed(seed_of(args.seed, step))
        run.encoder.init_weights()
    parts = (entry.setup(run.encoder, args, run.folder.path, run.device) if entry.setup
             else ObjectiveParts())
    parts.args = args
    if step == start > 0:
        init = "scratch" if args.student_init == "scratch" else "the phase-1 weights"
        teacher = args.teacher or run.folder.path / "phase1.pt"
        run.say(f"step {step}: phase 2, {objective} from {init}, a fresh optimizer and warm-up"
                + (f", taught by {teacher}" if entry.setup else ""))
    return Trainee(run.encoder, parts.heads.to(run.device), entry.loss), parts


def train_batch(run: Run, step: int, micro: int) -> dict:
    """Micro-batch `micro` of `step`, and dropout reseeded for it: both functions of (seed, step,
    its index in the global batch), so a resumed run draws what an uninterrupted one would."""
    args = run.args
    k = run.rank * args.grad_accum + micro  # this micro-batch's index in the global batch
    torch.manual_seed(seed_of(args.seed, step, k))  # dropout
    gen = torch.Generator(run.device).manual_seed(seed_of(args.seed, step, k, 1))  # masks
    ids = run.train.batch(step * run.global_batch + k * args.batch_size, args.batch_size)
    return make_batch(ids.to(run.device), args, run.meta["vocab_size"], gen,  # ids: on the GPU
                      mask_p_at(step, args))


# ---------------------------------------------------------------------------------------------
# Arguments


def objective_defaults(flag: str) -> str:
    """For a flag's help, the objectives whose entries set its default otherwise, grouped by
    value: 'boot 0.005', 'kd, kd+mlm, mlsm, mlsm+mlm uniform'."""
    names = {}
    for name, entry in OBJECTIVES.items():
        if flag in (entry.defaults or {}):
            names.setdefault(entry.defaults[flag], []).append(name)
    show = lambda v: ("on" if v else "off") if isinstance(v, bool) else (
        f"{v:g}" if isinstance(v, float) else str(v))
    return "; ".join(f"{', '.join(n)} {show(v)}" for v, n in names.items())


def build_parser():
    p = flags.Parser(prog="train.py", description=__doc__, allow_abbrev=False)
    add = p.add_argument
    add("--objective", default=BASELINE, choices=sorted(OBJECTIVES), help="pretraining objective")
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
    sizes = ", ".join(f"{size} {d['lr']:g}" for size, d in SIZE_DEFAULTS.items())
    add("--lr", type=float, default=None, help=f"peak learning rate (default by --size: {sizes}; "
        f"{objective_defaults('lr')}; see docs/objectives/mlm.md)", range=flags.at_least(0))
    add("--warmup", type=float, default=0.016,
        help="warmup: a fraction of --max-steps if < 1, else steps", range=flags.at_least(0))
    add("--schedule", default="cosine", choices=["cosine", "linear", "cosine-cooldown"],
        help="decay after warmup; cosine-cooldown: gpt-bert's, the cosine then a line to 0 over "
        f"the last --cooldown (default %(default)s; {objective_defaults('schedule')})")
    add("--cooldown", type=float, default=0.016, range=flags.Range(0, 1, high_open=True),
        help="cosine-cooldown: the share of the phase's steps that falls linearly to 0")
    add("--min-lr", type=float, default=0.1, range=flags.Range(0, 1),
        help="final learning rate as a fraction of --lr")
    add("--weight-decay", type=float, default=0.1, help="decoupled weight decay on weight "
        f"matrices (default %(default)s; {objective_defaults('weight_decay')})",
        range=flags.at_least(0))
    add("--weight-decay-end", type=float, default=None, range=flags.at_least(0),
        help="cosine weight decay from --weight-decay to this over the phase (default: "
        f"constant; {objective_defaults('weight_decay_end')})")
    add("--decay-embeddings", action=argparse.BooleanOptionalAction, default=False,
        help="weight-decay the embedding and position tables too, as gpt-bert's groups "
        f"(default: not, as LTG-BERT's; {objective_defaults('decay_embeddings')})")
    add("--eps", type=float, default=1e-6, range=flags.above(0), help="the optimizer's epsilon "
        f"(default %(default)g; {objective_defaults('eps')})")
    add("--clip", type=float, default=2.0, range=flags.at_least(0),
        help="gradient-norm clipping, 0 = off")
    add("--spike", type=float, default=10.0, range=flags.at_least(0),
        help="stop a diverging run: when its 20-step gradient norm stays above this multiple "
        "of its 1000-step average, or its 20-step loss above its best by max(1 nat, 8x its "
        "noise), for 10 steps; it writes the last good state it kept (docs/robustness.md); "
        "0 = off")
    add("--mask-p", type=float, default=0.15, help="fraction of tokens to predict (with "
        f"--mask-p-end: at the first step) (default %(default)s; {objective_defaults('mask_p')})",
        range=flags.Range(0, 1, low_open=True, high_open=True))
    add("--mask-p-end", type=float, default=None, range=flags.Range(0, 1, low_open=True,
                                                                    high_open=True),
        help="the fraction falls linearly from --mask-p to this over the run, as gpt-bert's "
        f"(default: constant; {objective_defaults('mask_p_end')})")
    add("--causal-fraction", type=causal_fraction, default=1 / 16, range=flags.Range(0, 1),
        help="gpt-bert: the share of each batch trained causally, the rest masked next-token "
        "prediction; a decimal fraction, or masked-focus (1/16, gpt-bert's 15:1), mixed (1/2) "
        "or causal-focus (15/16) (default masked-focus)")
    add("--masking", default="span", choices=list(MASKINGS), help="span: "
        "LTG-BERT's spans, 80/10/10 per span; token: BERT's, each token chosen alone, 80/10/10 "
        "(the synthetic-language blog's); uniform: int(p T) tokens per sequence, all [MASK], as "
        f"the MLSM code (default %(default)s; {objective_defaults('masking')})")
    add("--max-steps", type=int, default=None, range=flags.at_least(1),
        help="optimizer steps (default: --epochs of the training data at the global batch)")
    add("--epochs", type=float, default=10.0, help="the budget when --max-steps is not given: "
        "passes over the training segments, rounded down to whole steps (default %(default)g, "
        "BabyLM's "
        "limit: 7,246 steps of 128 x 128 on babylm_10m)", range=flags.above(0))
    add("--seed", type=int, default=0, range=flags.at_least(0),
        help="seed for init, data order, masks and dropout")
    add_device_flag(add, "where to train")
    add("--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the model (default: on with CUDA, off on the CPU)")
    add("--compile-scope", default="model", choices=COMPILE_SCOPES, help="with --compile, "
        "what one compiled graph covers: the whole step's model (default), or one transformer "
        "layer, whose graph every layer reuses, the rest eager (on a CPU at 12 layers: 1/7 of "
        "the compile time, the same step time; not yet timed on a GPU, docs/bench.md)")
    add("--compile-lamb", action=argparse.BooleanOptionalAction, default=False,
        help="with --compile, compile LAMB's update too (one graph of fused kernels); off: on an "
        "H200 it added ~35 s to a run's start, and no gain in tokens/s (docs/bench.md)")
    add("--attention", default="gather", choices=TRAINING_ATTENTION, help="how "
        "relative attention is computed, the same function each way (tests/test_model.py): "
        "each pair's position bucket picked by a gather (default; its backward adds into the "
        "buckets with atomics, bf16 ones under --bf16), by the gather in float32 (float32 "
        "atomics), or by a one-hot product (matrix products, no atomics); or fused: "
        "disentangled-flash's Triton kernels, no (B, H, T, T) tensor (CUDA; pip install -r "
        "requirements-kernels.txt). Which is fastest on a GPU: gpu_check.sh speed, "
        "docs/bench.md")
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
        help="continue the run in --out-dir from its ckpt.pt, with its saved settings (these may "
        "change: --lr, --device, --compile, --bf16, the logging, evaluation, save and stop "
        "flags)")
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
             help="weight of the MLM loss in kd+mlm, mlsm+mlm and boot (default %(default)g; "
             f"{objective_defaults('mlm_weight')}, its decoder's)")
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
    for action in p._actions:  # defaults an objective sets at one size say so in --help
        at = [f"{name} at {size}: {v[action.dest]}" for name, o in OBJECTIVES.items()
              for size, v in (o.size_defaults or {}).items() if action.dest in v]
        if at:
            default = "" if action.default is None else "default %(default)s; "
            action.help += f" ({default}{', '.join(at)})"
    return p


def get_args(argv, parser=None):
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    args.given = flags.typed(parser, argv)  # a resumed run refuses those that differ
    entry = OBJECTIVES[args.objective]
    for flag in sorted({f for o in OBJECTIVES.values() for f in o.flags} - set(entry.flags)):
        if flag in args.given and not args.resume:  # a resumed run's saved objective decides
            mine = ", ".join(name for name, o in OBJECTIVES.items() if flag in o.flags)
            parser.error(f"--{flag.replace('_', '-')} only applies to {mine}")
    if args.reset and not args.init_from:
        parser.error("--reset only applies with --init-from")
    if "dict" in entry.flags:  # the dictionary's flags: fail now, not after phase 1
        dict_config(args).check(flags=DICT_FLAG_NAMES)
    for flag, allowed in (("reset", PARTS), ("freeze", ["embeddings"])):
        bad = [x for x in getattr(args, flag).split(",") if x and x not in allowed]
        if bad:
            parser.error(f"--{flag}: unknown part {bad[0]!r} (choose from {', '.join(allowed)})")
    if args.max_steps is not None:
        check_phases(args)
    if args.out_dir is None:
        args.out_dir = str(REPO / "runs" / f"{args.objective}_{Path(args.data).name}_{args.size}")
    preset = {**SIZE_DEFAULTS[args.size], **(entry.defaults or {}),
              **(entry.size_defaults or {}).get(args.size, {})}
    flags.fill_unset(args, preset, typed=args.given)
    lowest = min(args.mask_p, args.mask_p_end or 1)
    if MASKINGS[args.masking] is None and int(lowest * args.seq_len) < 1:
        parser.error(f"--mask-p {lowest:g} masks no token of a --seq-len {args.seq_len} "
                     f"sequence under uniform masking (int(p T) = 0); raise either")
    return args


# more tokens than a year of training even at 3M tokens/s (about 7x `small`'s step on an H200,
# docs/bench.md): a --max-steps this large is a typo, not a plan
MOST_TOKENS = 10 ** 14


def check_phases(args):
    """Each phase gets at least one step, and its warmup (once --max-steps is known); the
    budget is one a year could train."""
    tokens = args.max_steps * args.batch_size * args.grad_accum * args.seq_len
    if tokens > MOST_TOKENS:
        raise SystemExit(f"error: --max-steps {args.max_steps} is {tokens:.2g} tokens: more than "
                         f"a year even at 3M tokens/s; give the steps you mean to train")
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
    # one parser: the flags as given, and their defaults (for flags newer than a resumed run)
    args, defaults = get_args(argv, parser := build_parser()), vars(parser.parse_args([]))
    if args.check:
        print(json.dumps(checked_settings(args, defaults)))
        return
    procs = start_processes(args)                            # torchrun's, the device, bf16
    folder, args, ckpt = open_folder(args, defaults, procs.rank)  # new, or resumed as it was
    corpus = load_corpus(args, procs, folder, ckpt)          # the prepared data
    encoder, step = build_encoder(args, corpus.meta["vocab_size"], ckpt)  # fresh or resumed
    run = start_run(args, procs, folder, corpus, encoder, step, ckpt, repo_sources(), check_phases)
    if nothing_to_do(run):  # a finished run resumed, or --stop-at already passed
        return
    phase = phase_at(run, step)
    run.say(describe(run, phase1_steps(args), OBJECTIVES[args.objective].note))
    word_saves = word_marks(run)  # {step: (name, words)} of --save-words
    guard = SafetyNet(folder, procs.device, procs.ddp, args.spike, args.log_every, ckpt and step)
    sums, since_log = {}, 0  # each stat summed over the steps since the last log line
    t_log, t0, step0 = time.time(), time.time(), step
    progress = StepProgress(step, args.max_steps, shown=run.rank == 0)  # and the ETA's rate
    while step < args.max_steps:
        if step == phase.end:  # phase 2 begins; phase1.pt was written as phase 1 ended
            phase = phase_at(run, step)
            guard.new_phase()
            t_log = time.time()  # its set-up (teacher, dictionary) is not a step's
        lr = set_schedule(phase.optimizer, step, args, phase.start, phase.end)
        step_loss = 0.0
        for micro in range(args.grad_accum):
            batch = train_batch(run, step, micro)
            if phase.graphs:  # a new replay may overwrite the last one's outputs: read already
                torch.compiler.cudagraph_mark_step_begin()
            sync = not run.ddp or micro == args.grad_accum - 1  # DDP all-reduces on the last one
            with contextlib.nullcontext() if sync else phase.model.no_sync():
                with run.amp:
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
            ema_update(phase.parts.ema, run.encoder, decay)  # one fused lerp over all tensors
        step += 1
        since_log += 1
        if step == max(step0, phase.start) + 1:  # this phase's first step here: it compiled
            progress.restart(step)  # so the rate of the bar and of the ETA counts from here
        progress.update()

        stop = guard.stopping and step < args.max_steps  # a stop signal: save this step, exit
        is_save = (step % args.save_every == 0 or step in (phase.end, args.stop_at) or stop
                   or guard.deferred and step % args.log_every == 0)  # a held-back save, again
        is_log = step % args.log_every == 0 or step == phase.end or is_save  # saves are checked
        is_eval = step % args.eval_every == 0 or step == phase.end
        if is_log or is_eval or step in word_saves:  # the only places the loop waits for the device
            guard.check_finite(step)  # (so the queued step is not timed as the pause that follows)
        if is_log:  # means over the steps since the last log line, across all processes
            record = run.log_stats(step, sums, since_log, time.time() - t_log, lr)
            if guard.judge(step, args.lr):  # a good state, kept to go back to
                guard.keep(checkpoint_state(run, phase, step), step)
            run.say(log_line(record, stats, args.max_steps, progress.eta(step)))
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
