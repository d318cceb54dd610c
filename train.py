"""Pretrain the shared encoder with one objective: batches -> masking -> its loss -> step.

    python train.py --objective mlm --data babylm_10m --size tiny --max-steps 2000   # CPU demo
    python train.py --objective mlm --data babylm_10m --size small            # one GPU, compiled
    torchrun --nproc_per_node 4 train.py --objective mlm --data babylm_10m     # DDP
    python train.py --out-dir runs/mlm_babylm_10m_small --resume               # continue
    python train.py --objective kd+mlm --data babylm_10m --phase1-steps 0.2    # MLM, then KD

Each objective is a loss and an entry in objectives.py, with its flags and its paper's defaults
(docs/objectives/). A run folder (--out-dir) keeps settings, log, checkpoints and code; SIGINT or
SIGTERM saves the step. Batches, masks and dropout are functions of (seed, step, micro-batch):
a resumed run follows the path of an uninterrupted one (bit for bit on the CPU).
"""
import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

import objectives
from data.masking import MASKINGS, make_batch, mask_p_at, seed_of
from machinery import flags
from machinery.progress import StepProgress, line_buffered
from machinery.run_folder import REPO, repo_sources
from machinery.stopping import exit_now, exit_on_stop_signals, on_stop_signals
from model import PARTS
from objectives import BASELINE, DICT_FLAG_NAMES, OBJECTIVES, ObjectiveParts, Trainee, dict_config
from training.guard import SafetyNet
from training.optim import clipped_step, ema_decay_at, ema_update, set_schedule
from training.run import (Phase, Run, build_encoder, check_warmup, checkpoint_state,
                          checked_settings, describe, load_corpus, log_line, nothing_to_do,
                          open_folder, save, save_words_flag, start_phase, start_processes,
                          start_run, summary, validate, word_marks)
from training.run_flags import SIZE_DEFAULTS, add_run_flags


# ---------------------------------------------------------------------------------------------
# Arguments


def build_parser():
    """The loop's flags here; the shared run flags (training/run_flags.py); the objectives'."""
    p = flags.Parser(prog="train.py", description=__doc__, allow_abbrev=False,
                     usage="train.py [--objective NAME] [--data DATA] [--size SIZE] [flags]")
    add = p.add_argument
    add("--objective", default=BASELINE, choices=sorted(OBJECTIVES), metavar="NAME",
        help="pretraining objective: " + ", ".join(OBJECTIVES))
    add("--max-steps", type=int, default=None, range=flags.at_least(1),
        help="optimizer steps (default: --epochs of the data)")
    add("--grad-accum", type=int, default=1, range=flags.at_least(1),
        help="micro-batches per optimizer step")
    add("--clip", type=float, default=2.0, range=flags.at_least(0),
        help="gradient-norm clipping, 0 = off")
    add("--spike", type=float, default=10.0, range=flags.at_least(0), help="stop a diverging "
        "run at its last good state (docs/robustness.md); 0 = off")
    add("--seed", type=int, default=0, range=flags.at_least(0),
        help="seed for init, data order, masks and dropout")
    add("--out-dir", default=None, metavar="DIR",
        help="run folder (default runs/OBJECTIVE_DATA_SIZE)")
    add("--resume", action="store_true", help="continue the run in --out-dir (--lr, device, "
        "logging, saving may change)")
    add("--log-every", type=int, default=50, range=flags.at_least(1),
        help="steps between log lines")
    add("--eval-every", type=int, default=500, range=flags.at_least(1),
        help="steps between validations")
    add("--eval-batches", type=int, default=20, range=flags.at_least(1),
        help="validation batches, always the same ones")
    add("--save-every", type=int, default=1000, range=flags.at_least(1),
        help="steps between checkpoints")
    add("--save-words", default="", type=save_words_flag,
        help="also keep weights at these words seen: 1M,2M or babylm (for export.py)")
    add("--stop-at", type=int, default=None, range=flags.at_least(1),
        help="save and exit after this step; the schedule stays --max-steps'")
    add("--check", action="store_true", help="print the settings the flags resolve to, exit")
    add_run_flags(p)
    objectives.add_flags(p)
    objectives.note_defaults(p)
    return p


def get_args(argv, parser=None):
    """The flags as the loop reads them: checked (a bad one stops in one line), the size's and
    the objective's defaults filled in where a flag was not typed."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    args.given = flags.typed(parser, argv)  # a resumed run refuses those that differ
    entry = OBJECTIVES[args.objective]
    objectives.refuse_others(args, args.given, parser.error)
    if "phase1_steps" in args.given and not has_phase1(args) and not args.resume:
        parser.error("--phase1-steps needs a phase 1: mlm --two-phase, or kd and mlsm without "
                     "--teacher")
    if args.reset and not args.init_from:
        parser.error("--reset only applies with --init-from")
    if entry.declares("dict"):  # the dictionary's flags: fail now, not after phase 1
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


# more tokens than a year of training even at 3M tokens/s, several times our fastest measured
# step (docs/bench.md): a --max-steps this large is a typo, not a plan
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
