"""A training run's machinery, under train.py's loop, each piece called there in one line: the
processes and device (start_processes), the folder, fresh or resumed with its saved settings
(open_folder), the corpus (load_corpus), the encoder (build_encoder), the run (start_run); a
phase made ready to train (the trainee wrapped for DDP and compiled, a fresh or restored
optimizer); its checkpoints; the steps at which --save-words keeps the weights. Nothing here
knows an objective: train.py hands each phase its objective's entry, trainee and parts. What a
run folder holds: machinery/run_folder.py. A checkpoint (ckpt.pt) holds the model, heads,
optimizer, config, args, step, RNG states, data position, code version, tokenizer, how it
predicts (its objective's predicts_before and decoder) and a checksum (save, below).
"""
import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

from data.masking import make_batch, seed_of
from data.prepare import Segments, load_meta, located, prepare, raw_root, text_bytes
from machinery.device import (autocast, peak_memory_gb, pick_device, use_compile,
                              use_deterministic, use_tf32)
from machinery.kernels import fused_unavailable
from machinery.progress import duration
from machinery.run_folder import RunFolder, code_version
from machinery.storage import read_checkpoint
from model import (PRESETS, Encoder, Layer, ModelConfig, check_config, load_weights,
                   use_attention)
from training.optim import make_optimizer


# the flags a resumed run may change (--lr: a run the guard stopped goes on at a lower one)
COMPILE_SCOPES = ("model", "layers")  # --compile-scope: the whole model, or one graph per layer
RESUMABLE = {"resume", "out_dir", "device", "compile", "compile_scope", "compile_lamb",
             "cuda_graphs", "attention", "bf16", "deterministic", "log_every", "lr",
             "eval_every", "save_every", "stop_at", "spike", "save_words", "check"}


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
    meta: dict                 # the prepared corpus' meta.json
    train: Segments
    val: Segments
    encoder: Encoder
    step: int                  # the next step to take
    ckpt: dict | None          # the checkpoint resumed from
    tokenizer: bytes
    version: dict              # code_version of its code, kept in every checkpoint
    global_batch: int          # segments per optimizer step, all processes and micro-batches

    def say(self, text):  # rank 0 only; tqdm.write keeps the progress bar intact
        if self.rank == 0:
            tqdm.write(text)

    def log_stats(self, step: int, sums: dict, n: int, seconds: float, lr: float) -> dict:
        """The log record of the n steps since the last one, written to log.jsonl: each figure's
        mean (sums: {name: its sum over those steps}), across the processes too; the learning
        rate, tokens per second of training and peak memory."""
        names = list(sums)
        values = torch.stack([sums[k] for k in names]) / n
        if self.ddp:
            dist.all_reduce(values)
            values /= self.world
        record = {"step": step, **dict(zip(names, values.tolist())), "lr": lr,
                  "tok_per_s": n * self.global_batch * self.args.seq_len / seconds,
                  "peak_mem_gb": peak_memory_gb(self.device)}
        self.folder.log(record)
        return record


@dataclass
class Phase:
    """One phase of training: its objective, its steps [start, end), and what trains in it."""
    objective: str
    entry: NamedTuple          # its OBJECTIVES entry (objectives.Objective)
    start: int
    end: int
    trainee: nn.Module         # the encoder and the objective's heads; its forward is the loss
    model: nn.Module           # the trainee, wrapped for DDP and compiled as asked
    graphs: bool               # its compiled forward and backward replayed as CUDA graphs
    optimizer: torch.optim.Optimizer
    parts: object              # objectives.ObjectiveParts: what the loss reads besides the batch


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


def build_encoder(args, vocab_size, ckpt):
    """(the encoder, the step it is at): fresh from --seed, the checkpoint's, or --init-from's
    weights with the --reset parts re-initialised; --freeze applied."""
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


class Processes(NamedTuple):
    """This process among torchrun's (one alone without it), its device and precision."""
    ddp: bool                  # launched by torchrun
    rank: int
    world: int                 # processes
    device: torch.device
    amp: object                # bf16 autocast, or a disabled one


class Corpus(NamedTuple):
    """The prepared corpus a run reads."""
    meta: dict                 # its meta.json, and the prepared folder's name (NAME-KEY)
    train: Segments            # on the device: a batch is one indexing there
    val: Segments
    tokenizer: bytes


def start_processes(args) -> Processes:
    """torchrun's process group (NCCL on GPUs, gloo on CPUs) when launched by it; this process's
    device (--device, the LOCAL_RANK-th GPU), TF32 matmuls where it has them, bf16 as asked."""
    ddp = "RANK" in os.environ
    rank, world, local = 0, 1, 0
    if ddp:
        dist.init_process_group("nccl" if pick_device(args.device).type == "cuda" else "gloo")
        rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    device = pick_device(args.device, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    use_tf32(device)
    # as typed now, like --device: not a resumed run's setting
    return Processes(ddp, rank, world, device, autocast(device, args.bf16))


def open_folder(args, defaults: dict, rank: int) -> tuple[RunFolder, argparse.Namespace, dict]:
    """(the run folder, the run's settings, the checkpoint resumed from or None): a new run's
    folder must hold no run; a resumed one is locked and its saved settings taken (`defaults`:
    the flags' defaults, for flags newer than it). --deterministic from here on."""
    folder = RunFolder(args.out_dir, master=rank == 0)
    ckpt = None
    if args.resume:
        if folder.path.is_dir():
            folder.lock()  # one process per run folder (rank 0 holds it for all)
        args, ckpt = resumed_args(args, folder.path / "ckpt.pt", defaults)
    else:
        folder.check_new("ckpt.pt")  # now, before a long data preparation; again once locked
    if args.deterministic:  # before any kernel runs (the run's saved setting, when resumed)
        use_deterministic()
    return folder, args, ckpt


def load_corpus(args, procs: Processes, folder: RunFolder, ckpt: dict | None) -> Corpus:
    """The corpus --data names, prepared on first use (rank 0 prepares it, the others wait);
    a resumed run's must be the one it trained on. A run that wants a GPU says so first."""
    if procs.rank == 0:
        if note := wants_a_gpu(args, procs.device):  # before minutes of preparation
            print(note)
        data_dir = prepare(args.data, args.vocab_size)
    if procs.ddp:
        dist.barrier()
    if procs.rank != 0:
        data_dir = prepare(args.data, args.vocab_size, quiet=True)
    meta = {**load_meta(data_dir), "folder": data_dir.name}  # NAME-KEY: what it was made of
    train = Segments(data_dir / "train.bin", args.seq_len - 2, args.seed, shuffle=True)
    val = Segments(data_dir / "val.bin", args.seq_len - 2, args.seed, shuffle=False)
    tokenizer = (data_dir / "tokenizer.model").read_bytes()
    if ckpt is not None and (ckpt["tokenizer"] != tokenizer or
                             ckpt["data"]["folder"] != data_dir.name):
        raise SystemExit(f"error: {folder.path / 'ckpt.pt'} was trained on other data than the "
                         f"prepared {data_dir} (the corpus at {args.data}, or its tokenizer, "
                         f"changed since the run began); it cannot be resumed on it")
    return Corpus(meta, train.to(procs.device), val, tokenizer)


def start_run(args, procs: Processes, folder: RunFolder, corpus: Corpus, encoder: Encoder,
              step: int, ckpt: dict | None, code: list[str], check_steps: Callable) -> Run:
    """The run, from its parts: its step budget (--epochs, once the data is read; check_steps
    refuses one the objective cannot use), its folder started with a copy of the `code` files
    or reopened at `step`, the RNG state resumed."""
    version = code_version(code)
    run = Run(args, *procs, folder, corpus.meta, corpus.train, corpus.val,
              encoder.to(procs.device), step, ckpt, corpus.tokenizer, version,
              args.batch_size * args.grad_accum * procs.world)
    if args.max_steps is None:  # --epochs: saved in args.json as steps, so a resume keeps them
        args.max_steps = max(1, math.floor(args.epochs * corpus.train.n / run.global_batch))
        check_steps(args)
    folder.lock()  # a new run locks its folder as it first writes there
    if ckpt is None:
        folder.check_new("ckpt.pt")  # another run may have begun there meanwhile
        if args.resume:  # (resumed_args: stopped before its first save)
            run.say(f"no checkpoint at {folder.path / 'ckpt.pt'}: the run begins again from "
                    f"step 0, with its settings")
        saved_args = {k: v for k, v in vars(args).items() if k != "given"}
        folder.start(code, args=saved_args, config=asdict(encoder.config), data=corpus.meta)
    else:
        folder.resume(step)
        run.say(f"resumed from step {step} of {args.max_steps} ({folder.path / 'ckpt.pt'})")
        if ckpt["code_version"]["sha256"] != version["sha256"]:
            run.say("warning: the code changed since this run started; resuming with the new code")
        # the loop reseeds every micro-batch; this covers what is drawn outside it (a phase 2's
        # new heads, when the run was cut off just as phase 1 ended)
        torch.set_rng_state(ckpt["rng"]["torch"])
        if procs.device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    return run


def start_phase(run: Run, step: int, objective: str, entry, start: int, end: int,
                trainee: nn.Module, parts) -> Phase:
    """The phase [start, end) of `objective` (its OBJECTIVES entry, the trainee and parts its
    setup made) ready to train: the trainee wrapped for DDP and compiled as asked, a fresh
    optimizer; restored from the checkpoint when resuming inside the phase."""
    args = run.args
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


DATA_KEYS = ("name", "folder", "vocab_size", "train_tokens", "unigram_entropy")  # in checkpoints


def checkpoint_state(run: Run, phase: Phase, step: int, words: int | None = None) -> dict:
    """Everything a resumed run needs to go on bit for bit (references to the live tensors);
    with `words` (--save-words), the model alone at the first step past that many training
    words (words_mark; words_seen, as always, what the run had read by then)."""
    state = {
        "model": run.encoder.state_dict(), "objective": phase.objective,
        "predicts_before": phase.entry.predicts_before, "decoder": phase.entry.decoder,
        "heads": phase.trainee.heads.state_dict(), "config": asdict(run.encoder.config),
        "args": {k: v for k, v in vars(run.args).items() if k != "given"}, "step": step,
        "code_version": run.version, "tokenizer": run.tokenizer,
        "data": {k: run.meta[k] for k in DATA_KEYS}}
    # the words read by the end of `step`; a --save-words checkpoint also names its mark
    state["words_seen"] = round(step * words_per_step(run))
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
    """checkpoint_state, written atomically by rank 0."""
    if run.rank == 0:
        run.folder.save(checkpoint_state(run, phase, step, words), name)
    return step


BABYLM_WORDS = [*range(1, 10), *range(10, 101, 10)]  # millions: chck_1M ... chck_100M


def past_end(args, step: int, path) -> str | None:
    """What a resumed run at `step` says when it is at or past its last step or --stop-at."""
    end = min(args.max_steps, args.stop_at or args.max_steps)
    why = f"--stop-at {end}" if end == args.stop_at else f"--max-steps {end}, the run's end"
    return f"nothing to do: {path} is at step {step}, at or past {why}" if step >= end else None


def nothing_to_do(run: Run) -> bool:
    """Whether the run's checkpoint is at or past its last step or --stop-at; if so, says so."""
    said = past_end(run.args, run.step, run.folder.path / "ckpt.pt")
    if said:
        run.say(said)
    return said is not None


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
    """--save-words' type: the text as given, once readable (refused by the parser, in one
    line, before anything runs)."""
    try:
        word_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def check_warmup(args, phases: list[int]) -> None:
    """A warmup given in steps (--warmup >= 1) fits in each phase (their lengths in steps)."""
    if args.warmup >= 1 and args.warmup > min(phases):
        what = "the run's" if len(phases) == 1 else "its shorter phase's"
        raise SystemExit(f"error: --warmup {args.warmup:g} steps is longer than {what} "
                         f"{min(phases)} steps; give fewer, or a fraction (< 1) of the steps")


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


def words_per_step(run: Run) -> float:
    """Training words a step reads: global_batch segments of seq_len - 2 corpus tokens ([CLS]
    and [SEP] are not text), at the corpus' train_words / train_tokens words per token
    (meta.json; whitespace-separated words, as BabyLM counts)."""
    meta = run.meta
    return run.global_batch * (run.args.seq_len - 2) * meta["train_words"] / meta["train_tokens"]


def word_marks(run: Run) -> dict[int, tuple[str, int]]:
    """{step: (checkpoint name, words seen)} for --save-words: the first step by which that
    many training words have been seen (words_per_step)."""
    counts = word_counts(run.args.save_words)  # readable: the parser checked it
    if not counts:
        return {}
    args, per_step = run.args, words_per_step(run)
    name = lambda n: f"chck_{n // 10 ** 6}M" if n % 10 ** 6 == 0 else f"chck_{n // 1000}K"
    marks = {math.ceil(n / per_step - 1e-9): (name(n), n) for n in sorted(counts)}
    late = [v[0] for k, v in marks.items() if k > args.max_steps]
    if late:
        run.say(f"note: --save-words: not written, beyond --max-steps {args.max_steps} "
                f"({round(args.max_steps * per_step):,} words): {', '.join(late)}")
    return marks


# the CPU demo: the command a CPU-only user is pointed to when a run would take hours there
CPU_DEMO = ("python train.py --objective mlm --size tiny --vocab-size 4000 --batch-size 32 "
            "--max-steps 1100 --device cpu")  # the README's first block: 3.6 min on 2 cores


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


def describe(run: Run, p1: int, note: Callable | None = None) -> str:
    """Two lines on what is about to train (after p1 steps of MLM), on what and where; the
    objective's own `note` (a function of the flags) last."""
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
    """The objective's own loss and stats on the first --eval-batches validation batches, logged
    and said: the same masked batches every time, so stats compare across steps and runs."""
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
    """The lines a finished run ends with: what it trained (over all its sittings, and in this
    one), its first and last validation figures of the objective it ended with (log.jsonl), the
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
    """A training log record as one line: the loss, the objective's stats (but accuracy), the
    learning rate, the throughput and the time left (? while no step is timed yet)."""
    terms = "".join(f" | {k} {record[k]:.4f}" for k in stats if k != "acc")
    return (f"step {record['step']}/{max_steps} | loss {record['loss']:.4f}{terms} | "
            f"lr {record['lr']:.1e} | {record['tok_per_s'] / 1e3:.1f}k tok/s | "
            f"eta {'?' if eta is None else duration(eta)}")
