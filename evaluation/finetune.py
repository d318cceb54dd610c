"""Fine-tuning a pretrained encoder on a labelled task ((Super)GLUE, MSGS), as `python evaluate.py
finetune` runs it: our recipe or the BabyLM 2025 pipeline's, one run per seed, the best epoch on
validation reported on dev, every per-example prediction kept for the Multi-Bootstrap.
"""
import copy
import functools
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from data.prepare import PAD
from data.tasks import MSGS, TASKS, Examples, pad, read_task
from evaluation.results import (METRICS, confusion, read_partial, result_path, write_lines,
                                write_result)
from machinery.plumbing import (autocast, bar, checkpoint_identity, fill_unset, one_line_os_errors,
                                pick_device)
from model import load_checkpoint
from training.optim import cosine_with_warmup, linear_warmup_decay


# Fine-tuning recipes: ours, and the BabyLM 2025 pipeline's (babylm/evaluation-pipeline-2025 at
# bf55c11: eval_finetuning.sh and evaluation_pipeline/finetune/{run,trainer,utils}.py), so that a
# score can be set beside the leaderboard's. Flags typed on the command line override either.
RECIPES = {
    "nanomlm": dict(lr=5e-5, batch_size=32, epochs=10, patience=3, max_len=128,
                    group_by_length=True),
    # AdamW (0.9, 0.999, eps 1e-8, decay 0.01 on every tensor), no clipping; warm-up over 6% of
    # the steps, then cosine to 0.1 x lr; shuffled batches, the last partial one dropped; every
    # epoch run, and the epoch with the best validation score kept (no early stopping); WSC 30
    # epochs, BoolQ and MultiRC batches of 16
    "babylm2025": dict(lr=3e-5, batch_size=32, epochs=10, patience=None, max_len=512,
                       group_by_length=False),
}


BABYLM_TASK = {"wsc": dict(epochs=30), "boolq": dict(batch_size=16),
               "multirc": dict(batch_size=16)}


def recipe_settings(args) -> None:
    """Fill the fine-tuning flags left unset from --recipe (and, for babylm2025, the task)."""
    defaults = {**RECIPES[args.recipe],
                **(BABYLM_TASK.get(args.task, {}) if args.recipe == "babylm2025" else {})}
    fill_unset(args, defaults)


class Classifier(nn.Module):
    """The pretrained encoder + a head on the [CLS] state. ltg: dropout, dense, GELU, LayerNorm,
    dropout, linear to the classes (the head LTG-BERT fine-tunes with). babylm2025: the BabyLM
    pipeline's ClassifierHead: LayerNorm (no affine), dense, GELU, LayerNorm (no affine),
    dropout 0.1, linear."""

    def __init__(self, encoder, k, head="ltg"):
        super().__init__()
        d, p = encoder.config.d_model, encoder.config.dropout
        self.encoder = encoder
        if head == "babylm2025":
            norm = lambda: nn.LayerNorm(d, 1e-5, elementwise_affine=False)
            self.head = nn.Sequential(norm(), nn.Linear(d, d), nn.GELU(), norm(), nn.Dropout(0.1),
                                      nn.Linear(d, k))
        else:
            self.head = nn.Sequential(nn.Dropout(p), nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d),
                                      nn.Dropout(p), nn.Linear(d, k))

    def forward(self, ids, mask):
        return self.head(self.encoder(ids, mask)[:, 0])


def length_grouped(lengths, batch_size, rng, pool=50) -> list[np.ndarray]:
    """One epoch of batches (arrays of example indices) whose examples have similar lengths, so
    a batch padded to its longest example is mostly tokens: shuffle, sort each run of
    pool * batch_size examples by length, cut it into batches, and shuffle the batches. Every
    example still comes once per epoch, and the batches differ from epoch to epoch (the
    "group by length" of HF's Trainer and fairseq's length-sorted buckets). On the GLUE training
    sets a random batch of 32 is 38-62% tokens and the rest padding."""
    order = rng.permutation(len(lengths))
    batches = []
    for i in range(0, len(order), pool * batch_size):
        run = order[i:i + pool * batch_size]
        run = run[np.argsort(lengths[run], kind="stable")]
        batches += [run[j:j + batch_size] for j in range(0, len(run), batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))]


def padded(seqs, idx, device):
    ids = torch.from_numpy(pad([seqs[i] for i in idx]))
    return ids.to(device), (ids != PAD).long().to(device)


@torch.no_grad()
def classify(model, seqs, batch_size, device) -> np.ndarray:
    model.eval()
    order = np.argsort([len(s) for s in seqs])  # similar lengths together: little padding
    preds = np.empty(len(seqs), dtype=int)
    for i in range(0, len(seqs), batch_size):
        idx = order[i:i + batch_size]
        with autocast(device):
            preds[idx] = model(*padded(seqs, idx, device)).argmax(-1).cpu().numpy()
    model.train()
    return preds


def finetune_once(args, encoder, task, train: Examples, valid: Examples, dev: Examples | None,
                  seed, device) -> dict:
    """One fine-tuning run, by --recipe. nanomlm: AdamW, linear warmup (10%) and decay, gradients
    clipped at 1, early stopping with --patience epochs on the first metric of `dev` (the
    validation set itself when dev is None, as the BabyLM pipeline does). babylm2025: as
    RECIPES says. Returns the chosen epoch's validation predictions and metrics."""
    _, k, metrics = TASKS.get(task, MSGS)
    babylm = args.recipe == "babylm2025"
    torch.manual_seed(seed)
    model = Classifier(copy.deepcopy(encoder), k, args.recipe).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    per_epoch = (len(train.seqs) // args.batch_size if babylm  # (the last partial batch dropped)
                 else math.ceil(len(train.seqs) / args.batch_size))
    steps = args.epochs * max(1, per_epoch)
    if babylm:
        rate = functools.partial(cosine_with_warmup, warmup=int(0.06 * steps), steps=steps)
    else:
        rate = functools.partial(linear_warmup_decay, warmup=max(1, steps // 10), steps=steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, rate)
    rng = np.random.default_rng(seed)
    lengths = np.array([len(s) for s in train.seqs])
    score = lambda data, preds, metric: float(METRICS[metric](confusion(data.labels, preds, k)))
    best, waited, t0 = None, 0, time.time()
    for epoch in range(1, args.epochs + 1):
        if args.group_by_length:
            batches = length_grouped(lengths, args.batch_size, rng)
        else:
            order = rng.permutation(len(train.seqs))
            batches = [order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)]
            if babylm and len(batches) > 1 and len(batches[-1]) < args.batch_size:
                batches.pop()
        for idx in bar(batches, desc=f"seed {seed} epoch {epoch}", leave=False, disable=None):
            with autocast(device):
                logits = model(*padded(train.seqs, idx, device)).float()
                loss = F.cross_entropy(logits, torch.from_numpy(train.labels[idx]).to(device))
            loss.backward()
            if not babylm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        preds = classify(model, valid.seqs, args.batch_size * 2, device)
        scores = {m: score(valid, preds, m) for m in metrics}
        if dev is None:
            judge = scores[metrics[0]]
        else:
            judge = score(dev, classify(model, dev.seqs, args.batch_size * 2, device), metrics[0])
        held_out = "" if dev is None else f" | held-out train {metrics[0]} {judge:.4f}"
        print(f"  seed {seed} epoch {epoch}: "
              + ", ".join(f"{m} {v:.4f}" for m, v in scores.items()) + held_out)
        if best is None or judge > best["selected_by"]:
            best = {"metrics": scores, "epoch": epoch, "pred": preds.tolist(), "selected_by": judge}
            waited = 0
        else:
            waited += 1
            if args.patience is not None and waited >= args.patience:
                stopped = (f"stopped after epoch {epoch} of {args.epochs}: no better "
                           f"{'held-out ' if dev is not None else ''}{metrics[0]} for "
                           f"{waited} epochs (--patience {args.patience})")
                break
    else:
        stopped = f"ran all {args.epochs} epochs"
    print(f"  seed {seed}: {stopped}; kept epoch {best['epoch']}")
    return {**best, "epochs_run": epoch, "stopped": stopped, "seconds": time.time() - t0}


def finetune(args):
    recipe_settings(args)
    device = pick_device(args.device)
    encoder, tok = load_checkpoint(args.ckpt, "cpu", encoder_only=True)
    if not Path(args.data_dir).is_dir():
        raise SystemExit(f"error: no task folder at {args.data_dir}")
    if args.max_len > encoder.config.max_position:
        print(f"note: --max-len {args.max_len} is more than the model's "
              f"{encoder.config.max_position} positions; examples are cut to that many tokens")
        args.max_len = encoder.config.max_position
    train = read_task(args.data_dir, args.task, "train", tok, args.max_len)
    valid = read_task(args.data_dir, args.task, "valid", tok, args.max_len)
    dev = None
    if args.holdout > 0:  # choose the epoch on held-out training examples: validation stays unseen
        perm = np.random.default_rng(0).permutation(len(train.labels))
        cut = int(len(perm) * args.holdout)
        dev, train = train.take(perm[:cut]), train.take(perm[cut:])
    _, k, metrics = TASKS.get(args.task, MSGS)
    chosen = ("the validation set (optimistic)" if dev is None
              else f"{len(dev.seqs)} held-out training examples")
    print(f"{args.task}: {len(train.seqs)} train, {len(valid.seqs)} validation examples, {k} "
          f"classes, seeds {args.seeds}; recipe {args.recipe} (lr {args.lr:g}, batch "
          f"{args.batch_size}, {args.epochs} epochs); epochs chosen on {chosen}")
    # each seed's run kept as it ends, so that an interrupted command goes on from there; the
    # fingerprint: what a run depends on (a checkpoint's size and time stand for its weights)
    out = result_path(args.out, args.ckpt, args.task)
    partial = out.with_name(out.name + ".partial")
    fingerprint = {**checkpoint_identity(args.ckpt), "device": str(device),
                   "settings": {k_: v for k_, v in vars(args).items()
                                if k_ not in ("func", "error", "seeds", "out", "device")}}
    done = {int(s): r for s, r in read_partial(partial, fingerprint, "seed", "run").items()
            if s in args.seeds}
    if done:
        print(f"resuming: seeds {sorted(done)} already fine-tuned in {partial}")
    write_lines(partial, [fingerprint, *({"seed": s, "run": r} for s, r in done.items())])
    for seed in (s for s in args.seeds if s not in done):
        done[seed] = finetune_once(args, encoder, args.task, train, valid, dev, seed, device)
        with one_line_os_errors(partial), open(partial, "a") as f:
            f.write(json.dumps({"seed": seed, "run": done[seed]}) + "\n")
    runs = {seed: done[seed] for seed in args.seeds}
    aggregate = {}
    for m in metrics:
        v = [r["metrics"][m] for r in runs.values()]
        std = float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
        aggregate[m] = {"mean": float(np.mean(v)), "std": std, "values": v}
    spread = lambda a: f" ± {100 * a['std']:.2f}" if len(runs) > 1 else ""  # no spread of one
    print(f"{args.task} validation over {len(runs)} seed{'s' * (len(runs) > 1)}: " + ", ".join(
        f"{m} {100 * a['mean']:.2f}{spread(a)}" for m, a in aggregate.items()))
    result = {"kind": "finetune", "task": args.task, "ckpt": str(args.ckpt),
              "pretrain_seed": encoder.train_args.get("seed"),
              "settings": {k_: v for k_, v in vars(args).items() if k_ not in ("func", "error")},
              "aggregate": aggregate, "runs": {str(s): r for s, r in runs.items()},
              "examples": {"id": valid.ids, "label": valid.labels.tolist(),
                           "pred": [r["pred"] for r in runs.values()], "metric": metrics[0],
                           "k": k, "name": f"{args.task} {metrics[0]}"}}
    print(f"wrote {write_result(result, args.out, args.ckpt, args.task)}")
    partial.unlink()
