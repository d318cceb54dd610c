"""Meta-learning the pretraining objective: a teacher network writes the student's pretraining
examples and learns from how much they help the student on a labelled task.

    python meta.py --task two_moons --labels hard     # 15 entries of ~72 s: ~9 min with 2 workers
    python meta.py --task two_moons --labels none,mlm,hard,soft  # docs/studies/ (32 min)
    python meta.py --task two_moons --labels soft --sizes 10,160 --seeds 0,1,2,3,4
    python meta.py --task two_moons --protocol shen --labels none,mlm,hard,soft,denoise \\
        --sizes 10,160 --seeds 0,1,2 --workers 16     # Shen's Appendix A: hours
    NANOMLM_RAW=../shared/data python meta.py --task glue --data babylm_10m \\
        --glue-tasks rte,mrpc,cola --labels hard --size tiny --steps 2000
    python evaluate.py finetune --ckpt runs/meta_glue_hard/ckpt.pt --task rte --data-dir ...

The method is this file: the teacher, the meta steps and the pretraining loop, then how each task
runs it. The tasks themselves (metalearning/moons.py, metalearning/glue.py) hand it their batches
and, for Two Moons, the rule that scores a student; the (x, y) format is metalearning/examples.py.

Shen (2021), "Meta-learning a Language Modeling Objective" (Stanford CS330 report; code:
jeffdshen/MetaLMO), which carries Meta Pseudo Labels (Pham et al. 2021) from image labels over to
whole input-output text examples. Every example of every task has one shape: an input x whose
first token names the task, and a target y of the same length, PAD meaning "no loss here":
  MLM         x = [MLM] + the masked text, y = the original token at the masked positions;
  a task      x = [TASK] + its input, y = the label's token at every position (predicted: the
              label token with the largest logit averaged over the positions).
The teacher, an encoder from model.py with a second, untied output head, reads an unlabelled x_u
and writes a pseudo example per position: x^ from one head, y^ from the other. A meta step with
the student at theta0 and a support and a query batch of one labelled task:
  (1) theta1 = the student's own AdamW step on (x^, y^)      the only update the student keeps
  (2) theta2 = theta1 - eta grad L_support(theta1)            "fine-tuning"; eta = --inner-lr
  (3) L_query(theta2); the teacher learns to lower it:
  hard labels  x^, y^ are sampled tokens; the teacher's gradient is h grad_T CE((x^, y^), T(x_u))
      with h = cos(grad L_query(theta2), theta0 - theta1): the first-order (MAML-like) MPL signal,
      in which the parameter change of the adaptive optimiser stands in for the gradient (Shen,
      eq. 8). h > 0: the pseudo example moved the student downhill on the query; make it likelier.
  soft labels  x^, y^ are the teacher's distributions (the student embeds x^ as expected word
      vectors, y^ is a soft cross-entropy target), so L_query(theta2) is a differentiable function
      of the teacher and its gradient is exact. Step (1) is unrolled as the student's own AdamW
      step, from the moments its optimiser holds (adamw_unroll; MetaLMO does it with `higher`),
      or with --unroll sgd as theta0 - eta grad L_pseudo(theta0); torch.func.functional_call
      runs the student on the unrolled weights. As in MetaLMO's soft runs, the meta term weighs
      100 and half of the steps take MLM on other text as their labelled task (--meta-weight,
      --mlm-task-p).
The support and the query batch of a labelled task never share an example. Auxiliary teacher
losses (Shen, sec. 3.4), always on: given x_u relabelled [MLM] (the teacher reads unlabelled text
under its own [U] token for the meta loss), write an MLM task (x^ -> x_m, y^ -> the relabelled
x_u, as MetaLMO's in-place relabel makes it); given x_m, perform it (x^ -> x_m, y^ -> y_m).
--labels mlm pretrains the same student with plain MLM on the same unlabelled batches; --labels
none does not pretrain at all.
"""
import argparse
import contextlib
import json
import shlex
import signal
import sys
import time
from dataclasses import asdict, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from metalearning.examples import task_batch
from data.prepare import PAD, VOCAB_SIZE, raw_root
from machinery.plumbing import (REPO, Parser, Range, RunFolder, above, add_device_flag, at_least,
                                autocast, bar, exit_on_stop_signals, fill_unset, line_buffered,
                                load_state, numbers, pick_device, repo_sources, stop_after_the_step)
from metalearning.glue import glue_task
from metalearning.moons import (MOONS_TOKENS, PROTOCOLS, Labeled, ft_batch, labeled_sets,
                                moons_batches, moons_text, predict_labels, print_table, two_moons)
from model import PRESETS, Encoder, ModelConfig, init_linears, model_config, small_init
from training.optim import inverse_sqrt


# ---------------------------------------------------------------------------------------------
# Models

class Teacher(nn.Module):
    """An encoder with two per-position output heads: x^ (the encoder's own MLM head, tied to its
    word embeddings) and y^ (the same shape, untied: dense, GELU, LayerNorm, linear to V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, V = cfg.d_model, cfg.vocab_size
        self.encoder = Encoder(cfg)
        norm = lambda: nn.LayerNorm(D, cfg.layer_norm_eps, elementwise_affine=False)
        self.y_head = nn.Sequential(norm(), nn.Linear(D, D), nn.GELU(), norm(), nn.Linear(D, V))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """encoder: Encoder.init_weights; y_head[1].weight (D, D), y_head[4].weight (V, D) N(0, s)
        as every encoder matrix (s = sqrt(2 / (5 d_model))); their biases 0."""
        init_linears(small_init(self.encoder.config.d_model), self.y_head[1], self.y_head[4])

    def forward(self, x, mask):
        """-> logits of x^ and of y^, (B, T, V) each. x^ never gets [PAD]: it would hide a
        position."""
        h = self.encoder(x, mask)
        lx = self.encoder.head(h)
        return lx.index_fill(-1, torch.tensor([PAD], device=x.device), -torch.inf), self.y_head(h)


def at_least_float32(t):
    """Half-precision logits (bf16 autocast on GPU) to float32 for the softmax; float64 stays."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def seq_loss(model, params, x, y, mask):
    """Mean cross-entropy of the student's per-position predictions against y. x: ids (B, T) or
    soft tokens (B, T, V); y: ids (B, T), PAD = no loss, or distributions (B, T, V) scored at
    every real position. params: the tensors to run with, so one function serves the stored
    student, its unrolled copies (theta1, theta2 above) and plain training."""
    scored = (mask > 0) & (y != PAD) if y.dim() == 2 else mask > 0
    _, logits = functional_call(model, params, (x, mask), {"predict": scored})
    logp = at_least_float32(logits).log_softmax(-1)                 # (N, V), N scored
    if y.dim() == 2:
        nll = -logp.gather(1, y[scored][:, None]).sum()
    else:
        nll = -(at_least_float32(y[scored]) * logp).sum()
    return nll / scored.sum().clamp(min=1)                       # no scored position: 0, not NaN


def token_ce(logits, target, mask):
    """Mean cross-entropy of logits (B, T, V) against ids (B, T) at real positions whose target is
    not PAD (ignore_index rather than boolean indexing, whose backward would scatter into
    (B, T, V))."""
    target = target.masked_fill(mask == 0, PAD)
    total = F.cross_entropy(at_least_float32(logits).flatten(0, 1), target.flatten(),
                            ignore_index=PAD, reduction="sum")
    return total / (target != PAD).sum().clamp(min=1)


def sample(logits, gen):
    """One token per position from softmax(logits) (B, T, V), by inverting the CDF: a cumsum and a
    searchsorted (torch.multinomial's exponential draws took 12 ms of a 100 ms Two Moons step).
    right=True: never a token of probability 0."""
    cdf = at_least_float32(logits).softmax(-1).cumsum(-1)
    u = torch.rand(*cdf.shape[:-1], 1, generator=gen, device=cdf.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


# ---------------------------------------------------------------------------------------------
# One meta step. Each returns the teacher's meta loss (backward happens with its auxiliary
# losses) and the student's figures; the student has taken its own step when it returns.

def params_of(model, detach=False):
    return {n: (p.detach().clone().requires_grad_() if detach else p)
            for n, p in model.named_parameters()}


def outer_step(model, opt, loss, clip):
    """The student's own update (AdamW): the only change to its stored weights."""
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def support_query(theta1, support_loss, query_loss, inner_lr, create_graph):
    """Steps (2)-(3): theta2 = theta1 - eta grad L_support(theta1); -> (L_query(theta2), theta2,
    L_support). The losses map a {name: tensor} of parameters to a scalar."""
    ls = support_loss(theta1)
    g = torch.autograd.grad(ls, list(theta1.values()), create_graph=create_graph)
    theta2 = {n: p - inner_lr * gi for (n, p), gi in zip(theta1.items(), g)}
    return query_loss(theta2), theta2, ls


def cosine(a: list, b: list) -> torch.Tensor:
    """cos between two parameter-shaped lists of tensors, flattened and concatenated."""
    dot = sum((x * y).sum() for x, y in zip(a, b))
    norms = sum((x * x).sum() for x in a) * sum((y * y).sum() for y in b)
    return dot / torch.sqrt(norms).clamp(min=1e-30)


def hard_label_signal(student, opt, pseudo_loss, support_loss, query_loss, inner_lr, clip):
    """Step (1), the student's own optimiser step on pseudo_loss, then (2)-(3) on a copy:
    -> (h = cos(grad L_query(theta2), theta0 - theta1), L_query, L_pseudo, L_support)."""
    theta0 = [p.detach().clone() for p in student.parameters()]
    lp = pseudo_loss(params_of(student))
    outer_step(student, opt, lp, clip)
    delta = [a - p.detach() for a, p in zip(theta0, student.parameters())]   # theta0 - theta1
    lq, theta2, ls = support_query(params_of(student, detach=True), support_loss, query_loss,
                                   inner_lr, create_graph=False)
    g_q = torch.autograd.grad(lq, list(theta2.values()))
    return cosine(g_q, delta), lq, lp, ls


def task_losses(student, b):
    """The support and the query loss of batch b, as functions of the student's parameters."""
    return (lambda p: seq_loss(student, p, b["x_s"], b["y_s"], b["m_s"]),
            lambda p: seq_loss(student, p, b["x_q"], b["y_q"], b["m_q"]))


def hard_step(student, opt, b, lx, ly, args, gen):
    """Hard labels: sample (x^, y^), step, h; the teacher's meta loss h * CE((x^, y^), T(x_u))."""
    mask = b["m_u"]
    with torch.no_grad():
        x_hat = sample(lx, gen).masked_fill(mask == 0, PAD)
        y_hat = sample(ly, gen).masked_fill(mask == 0, PAD)
    pseudo = lambda p: seq_loss(student, p, x_hat, y_hat, mask)
    h, lq, lp, ls = hard_label_signal(student, opt, pseudo, *task_losses(student, b),
                                      args.inner_lr, args.clip)
    ce = 0.5 * (token_ce(lx, x_hat, mask) + token_ce(ly, y_hat, mask))
    return h * ce, {"h": h, "query": lq, "pseudo": lp, "support": ls, "written": (x_hat, y_hat),
                    "example": (x_hat, y_hat)}


def adamw_unroll(theta0: dict, grads: list, opt: torch.optim.AdamW, params: list,
                 clip: float) -> dict:
    """The step opt.step() takes from theta0 with `grads` (after clip_grad_norm_(clip)), as a
    differentiable function of the gradients (MetaLMO unrolls the student's own AdamW through
    `higher`): with the moments m, v and step count t the optimiser holds for `params` now,
        m' = b1 m + (1 - b1) g,  v' = b2 v + (1 - b2) g^2,
        theta1 = theta0 (1 - lr wd) - lr (m' / (1 - b1^t')) / (sqrt(v' / (1 - b2^t')) + eps).
    Its first step is nearly lr sign(g), whose derivative is nearly 0; later ones are not."""
    group = opt.param_groups[0]
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    norm = torch.sqrt(sum((g * g).sum() for g in grads))
    scale = torch.clamp(clip / (norm + 1e-6), max=1.0)         # as torch's clip_grad_norm_
    theta1 = {}
    for (n, p), g, param in zip(theta0.items(), grads, params):
        state = opt.state.get(param, {})
        g = g * scale
        t = float(state.get("step", 0)) + 1
        m = b1 * state.get("exp_avg", torch.zeros_like(g)) + (1 - b1) * g
        v = b2 * state.get("exp_avg_sq", torch.zeros_like(g)) + (1 - b2) * g * g
        denom = (v / (1 - b2 ** t)).clamp(min=1e-40).sqrt() + eps  # (clamp: no inf at v = 0)
        theta1[n] = p * (1 - lr * wd) - lr * (m / (1 - b1 ** t)) / denom
    return theta1


def soft_unroll(student, opt, px, py, b, args):
    """Steps (1)-(3) as one differentiable function of the teacher's distributions px, py
    (B, T, V), step (1) as the student's own AdamW step (--unroll adamw, MetaLMO's) or as SGD at
    --inner-lr (--unroll sgd): -> (L_query(theta2), L_pseudo, L_support, grad L_pseudo(theta0)
    (its graph kept))."""
    theta0 = params_of(student, detach=True)
    with sdpa_kernel(SDPBackend.MATH):                # the fused kernels have no double backward
        lp = seq_loss(student, theta0, px, py, b["m_u"])
        g0 = torch.autograd.grad(lp, list(theta0.values()), create_graph=True)
        if args.unroll == "adamw":
            theta1 = adamw_unroll(theta0, g0, opt, list(student.parameters()), args.clip)
        else:
            theta1 = {n: p - args.inner_lr * g for (n, p), g in zip(theta0.items(), g0)}
        lq, _, ls = support_query(theta1, *task_losses(student, b), args.inner_lr,
                                  create_graph=True)
    return lq, lp, ls, g0


def soft_step(student, opt, b, lx, ly, args, gen):
    """Soft labels: the meta loss is L_query(theta2) itself; the student keeps its AdamW step on
    g0. --labels denoise: y^ is x_u itself, one-hot (MetaLMO's --fixed_y, Shen's Appendix B):
    the teacher only learns how to corrupt the text the student restores."""
    px = at_least_float32(lx).softmax(-1)                                        # (B, T, V)
    if args.labels == "denoise":
        py = F.one_hot(b["x_u"], px.shape[-1]).to(px.dtype)
    else:
        py = at_least_float32(ly).softmax(-1)
    lq, lp, ls, g0 = soft_unroll(student, opt, px, py, b, args)
    for p, g in zip(student.parameters(), g0):
        p.grad = g.detach().clone()
    nn.utils.clip_grad_norm_(student.parameters(), args.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return lq, {"query": lq, "pseudo": lp, "support": ls, "written": (px.argmax(-1), py.argmax(-1)),
                "example": (px.detach(), py.detach())}


def mlm_step(student, opt, b, args):
    loss = seq_loss(student, params_of(student), b["x_m"], b["y_m"], b["m_u"])
    outer_step(student, opt, loss, args.clip)
    return {"pseudo": loss}


def meta_step(student, teacher, opt_s, opt_t, b, args, gen) -> dict:
    """One step of --labels hard|soft|mlm on batch b (see the docstring at the top)."""
    if args.labels == "mlm":
        return mlm_step(student, opt_s, b, args)
    lx, ly = teacher(b["x_u"], b["m_u"])
    step = hard_step if args.labels == "hard" else soft_step
    meta, info = step(student, opt_s, b, lx, ly, args, gen)
    m = b["m_u"]
    # the auxiliary losses (MetaLMO's mlm_step) read x_u under [MLM], not its own [U]: they teach
    # the teacher what an MLM task is without shaping what it writes for the meta loss
    relabelled = torch.cat([b["x_m"][:, :1], b["x_u"][:, 1:]], 1)           # [MLM] + the text
    lx, ly = teacher(relabelled, m)                                   # write an MLM task ...
    write = 0.5 * (token_ce(lx, b["x_m"], m) + token_ce(ly, relabelled, m))
    lx, ly = teacher(b["x_m"], m)                                     # ... and do it
    perform = 0.5 * (token_ce(lx, b["x_m"], m) + token_ce(ly, b["y_m"], m))
    outer_step(teacher, opt_t, args.meta_weight * meta + write + perform, args.clip)
    return {**info, "teacher_write": write, "teacher_mlm": perform}


# ---------------------------------------------------------------------------------------------
# Pretraining loop, shared by both tasks: unlabelled batches from `unlabeled(step, gen)`,
# support/query batches from `labeled(step, gen)`

def optimizers(student, teacher, args):
    adamw = lambda model, lr: torch.optim.AdamW(model.parameters(), lr=lr, betas=args.betas,
                                                eps=args.eps, weight_decay=args.weight_decay)
    return adamw(student, args.lr), adamw(teacher, args.teacher_lr)


def label_defaults(args):
    """--meta-weight and --mlm-task-p left unset take their labels' defaults: soft, MetaLMO's
    soft runs (soft_pretrainer.py: meta weight 100; MLM a labelled task half the time); else
    weight 1 and no MLM task."""
    soft, args = args.labels in ("soft", "denoise"), replace_args(args)
    fill_unset(args, dict(meta_weight=100.0 if soft else 1.0,
                                mlm_task_p=0.5 if soft else 0.0))
    return args


def pretrain(student, teacher, unlabeled, labeled, args, device, desc="", log=None, show=None,
             start=0, opts=None, save=None, stop=None) -> int:
    """The meta steps start..args.steps; -> the step it ended at: args.steps, or the step after
    which `stop()` said to stop (saved first, by `save`)."""
    args = label_defaults(args)
    opt_s, opt_t = opts or optimizers(student, teacher, args)
    warm = max(1, args.steps // 20)
    t0 = time.time()
    steps = range(start, args.steps)
    for step in bar(steps, desc=desc, initial=start, total=args.steps, leave=False, disable=None):
        if args.warmup:  # Shen's: lr / sqrt(n) after a linear warm-up
            factor = inverse_sqrt(step, args.warmup)
        else:            # ours: linear warm-up over 5% of the steps, linear decay to 10%
            factor = min(1.0, (step + 1) / warm) * (1 - 0.9 * step / args.steps)
        for opt, base in ((opt_s, args.lr), (opt_t, args.teacher_lr)):
            for g in opt.param_groups:
                g["lr"] = base * factor
        gen = torch.Generator(device).manual_seed(args.seed * 1_000_003 + step)
        b = {**unlabeled(step, gen), **labeled(step, gen)}
        if np.random.default_rng([args.seed, step]).random() < args.mlm_task_p:
            # this step's labelled task is MLM (MetaLMO's soft runs: without it the teacher
            # learns to teach only the downstream task): support and query from other text
            u = unlabeled(-1 - step, gen)
            k = min(args.task_batch, len(u["x_m"]) // 2)
            for s, rows in (("s", slice(0, k)), ("q", slice(k, 2 * k))):
                b.update({f"x_{s}": u["x_m"][rows], f"y_{s}": u["y_m"][rows],
                          f"m_{s}": u["m_u"][rows]})
        with autocast(device):
            info = meta_step(student, teacher, opt_s, opt_t, b, args, gen)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:  # .item() only here
            if log is not None:
                figures = {k: round(v.item(), 5) for k, v in info.items()
                           if torch.is_tensor(v) and v.dim() == 0}
                log({"step": step + 1, **figures, "seconds": round(time.time() - t0, 1)})
            if show is not None and "written" in info:
                show(step + 1, b["x_u"], *info["written"])
        stopping = stop is not None and stop()  # a stop signal: this step saved, the loop ends
        if save is not None and ((step + 1) % args.save_every == 0 or stopping):
            save(step + 1)
        if stopping:
            return step + 1
    return args.steps


def replace_args(args, **kw):
    return argparse.Namespace(**{**vars(args), **kw})


# ---------------------------------------------------------------------------------------------
# The networks' shape: Shen's for Two Moons, a --size preset for text

MOONS_MODEL = dict(n_layer=2, n_head=2, d_model=8, d_ff=32)  # Shen's Two Moons models
GLUE_POSITIONS = 512  # the text student's positions, as train.py's default --max-position


def student_config(args, vocab: int) -> ModelConfig:
    """Shen's Two Moons model or the --size preset, under the model flags given (as train.py)."""
    preset = MOONS_MODEL if args.task == "two_moons" else PRESETS[args.size]
    # glue: as train.py, so that evaluate.py's --max-len fits
    longest = 64 if args.task == "two_moons" else GLUE_POSITIONS
    return model_config(args, vocab, {**preset, "max_position": longest})


# ---------------------------------------------------------------------------------------------
# Two Moons: each cell of the table pretrains a student, fine-tunes it on its n labelled
# points and scores it on the test points

def finetune_predict(student, train: Labeled, valid: Labeled, test: Labeled, label_ids, args,
                     seed) -> list:
    """The test predictions after fine-tuning on the labelled examples. Ours: full-batch AdamW for
    --ft-steps, the last step. Shen's: --ft-epochs of minibatches (ft_batch), lr/sqrt(n) after
    --ft-warmup steps, and the epoch with the best accuracy on `valid` (first of ties)."""
    model = Encoder(student.config).to(train.x.device)
    model.load_state_dict(student.state_dict())
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.ft_lr, betas=args.betas, eps=args.eps,
                            weight_decay=args.weight_decay)
    n, device = len(train.x), train.x.device
    if not args.ft_epochs:
        xs, ys = task_batch(train.x, train.y, torch.arange(n, device=device), label_ids)
        for _ in range(args.ft_steps):
            loss = seq_loss(model, params_of(model), xs, ys, (xs != PAD).long())
            outer_step(model, opt, loss, args.clip)
        return predict_labels(model.eval(), test.x, label_ids).tolist()
    bs, gen, step, best = ft_batch(args.labels, n), torch.Generator().manual_seed(seed), 0, None
    for _ in range(args.ft_epochs):
        for idx in torch.randperm(n, generator=gen).to(device).split(bs):
            for g in opt.param_groups:
                g["lr"] = args.ft_lr * inverse_sqrt(step, args.ft_warmup)
            xs, ys = task_batch(train.x, train.y, idx, label_ids)
            outer_step(model, opt, seq_loss(model, params_of(model), xs, ys, (xs != PAD).long()),
                       args.clip)
            step += 1
        model.eval()
        acc = (predict_labels(model, valid.x, label_ids) == valid.y).float().mean().item()
        if best is None or acc > best[0]:
            best = (acc, predict_labels(model, test.x, label_ids).tolist())
        model.train()
    return best[1]


def moons_cell(args, data, size, seed, device):
    """One entry of the table: pretrain with --labels (its labelled task: the first `size`
    points), fine-tune on the same points, -> (test predictions, what the teacher wrote last)."""
    tok = data["tokens"]
    cfg = student_config(args, tok["vocab"])
    torch.manual_seed(seed)
    student, teacher = Encoder(cfg).to(device).train(), Teacher(cfg).to(device).train()
    train, valid = (Labeled(*(torch.as_tensor(a, device=device) for a in part))
                    for part in labeled_sets(data, size, args.labeled_points, args.data_seed))
    label_ids = torch.tensor(tok["label"], device=device)
    unlabeled, labeled = moons_batches(data, train, label_ids, args, device)
    written = []

    def show(step, x_u, x_hat, y_hat):  # keep the last thing the teacher wrote
        written[:] = [f"  read {moons_text(x_u)}\n  x^   {moons_text(x_hat)}\n"
                      f"  y^   {moons_text(y_hat)}\n"]

    if args.labels != "none":
        pretrain(student, teacher, unlabeled, labeled, replace_args(args, seed=seed), device,
                 desc=f"{args.labels} n={size} seed={seed}", show=show)
    test = Labeled(*(torch.as_tensor(a, device=device) for a in data["test"]))
    return finetune_predict(student, train, valid, test, label_ids, args, seed), "".join(written)


def cell_worker(job):
    """One table entry in a worker process (one thread each: the models are far too small to
    share cores usefully, so --workers processes run side by side)."""
    args, labels, size, seed = job
    torch.set_num_threads(1)
    t0 = time.time()
    data = two_moons(args.data_seed)
    preds, written = moons_cell(replace_args(args, labels=labels), data, size, seed,
                                pick_device("cpu"))
    return f"{labels}/{size}/{seed}", preds, written, time.time() - t0


def run_two_moons(args, device, folder: RunFolder):
    results_path = folder.path / "results.json"
    results = json.loads(results_path.read_text()) if args.resume and results_path.exists() else {}
    jobs = [(args, labels, size, seed) for labels in args.labels_list for size in args.sizes
            for seed in args.seeds if f"{labels}/{size}/{seed}" not in results]
    parallel = args.workers > 1 and device.type == "cpu" and len(jobs) > 1
    data = two_moons(args.data_seed)  # (each worker process makes its own)
    if parallel:
        # the workers start with Ctrl-C ignored (kept across exec, and Python then installs no
        # handler of its own): the terminal sends SIGINT to the whole process group, and the
        # parent alone should stop, its pool ending the workers (no traceback from each, even
        # one still starting, and no orphan)
        before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            pool = torch.multiprocessing.get_context("spawn").Pool(args.workers)
        finally:
            signal.signal(signal.SIGINT, before)
        done = pool.imap_unordered(cell_worker, jobs)
    else:
        pool = contextlib.nullcontext()
        done = ((f"{l}/{n}/{s}", *moons_cell(replace_args(a, labels=l), data, n, s, device),
                 time.time() - t0) for a, l, n, s in jobs for t0 in [time.time()])
    folder.write("config", asdict(student_config(args, MOONS_TOKENS["vocab"])))
    test_y = data["test"].y.tolist()
    (folder.path / "cells").mkdir(exist_ok=True)
    with pool, open(folder.path / "samples.txt", "a") as samples:
        for key, preds, written, seconds in done:
            acc = float(np.mean(np.array(preds) == np.array(test_y)))
            results[key] = acc
            # every test prediction, in the form evaluate.py compare reads: rows of the table
            # compared over pretraining seeds and test points, e.g.
            #   evaluate.py compare "RUN/cells/mlm_n10_s*.json" "RUN/cells/soft_n10_s*.json"
            labels, size, seed = key.split("/")
            folder.write(f"cells/{labels}_n{size}_s{seed}", {
                "kind": "two_moons", "labels": labels, "n": int(size),
                "pretrain_seed": int(seed), "accuracy": acc,
                "examples": {"id": list(range(len(test_y))), "label": test_y, "pred": [preds],
                             "metric": "accuracy", "k": 2}})
            print(f"{key}: test accuracy {100 * acc:.1f}% ({seconds:.0f}s)")
            results_path.write_text(json.dumps(results, indent=1))
            if written:  # what the teacher wrote last (Shen's Tables 1 and 3: does it degenerate?)
                samples.write(f"{key}, last step, first sequence\n{written}")
                samples.flush()
    print_table(results, args.labels_list, args.sizes, args.seeds)


# ---------------------------------------------------------------------------------------------
# (Super)GLUE: one student pretrained on text, saved as an ordinary checkpoint

def run_glue(args, device, folder: RunFolder, go_on: str):
    with exit_on_stop_signals("`meta.py` before its first step; nothing was saved"):
        return glue_loop(args, device, folder, go_on, glue_task(args, device))


def glue_loop(args, device, folder: RunFolder, go_on: str, task):
    data_dir, V, words = task.data_dir, task.text_vocab, task.words
    cfg = student_config(args, task.ids["vocab"])
    folder.write("config", asdict(cfg))
    samples = open(folder.path / "samples.txt", "a")

    def show(step, x_u, x_hat, y_hat):
        """The first two sequences the teacher read and what it wrote (Shen's Tables 1 and 3)."""
        text = "".join(f"step {step}, sequence {r}\n  read    {words(x_u[r])}\n"
                       f"  x^      {words(x_hat[r])}\n  y^      {words(y_hat[r])}\n"
                       for r in range(min(2, len(x_u))))
        samples.write(text)
        samples.flush()
        tqdm.write(text)

    torch.manual_seed(args.seed)
    student, teacher = Encoder(cfg).to(device).train(), Teacher(cfg).to(device).train()
    opts = optimizers(student, teacher, args)
    start = 0
    if args.resume and (folder.path / "meta.pt").exists():
        state = load_state(folder.path / "meta.pt", map_location=device)
        if "rng" in state:  # dropout's draws (shen's 0.1) go on as they would have
            torch.set_rng_state(state["rng"])
        student.load_state_dict(state["student"], strict=True)
        teacher.load_state_dict(state["teacher"], strict=True)
        for o, s in zip(opts, state["optimizers"]):
            o.load_state_dict(s)
        start = state["step"]
        folder.resume(start)
        print(f"resuming at step {start}")
    tokenizer = (data_dir / "tokenizer.model").read_bytes()

    def save(step):
        folder.save({"student": student.state_dict(), "teacher": teacher.state_dict(),
                     "step": step, "optimizers": [o.state_dict() for o in opts],
                     "rng": torch.get_rng_state()}, "meta.pt")
        text_only = lambda k, v: v[:V] if k in ("word.weight", "head_bias") else v
        sd = {k: text_only(k, v) for k, v in student.state_dict().items()}  # for evaluate.py
        folder.save({"model": sd, "config": asdict(replace(cfg, vocab_size=V)),
                     "tokenizer": tokenizer, "step": step, "args": vars(args),
                     "predicts_before": False, "decoder": False}, "ckpt.pt")  # an MLM encoder

    def log(record):
        folder.log(record)
        tqdm.write(" | ".join(f"{k} {v}" for k, v in record.items()))

    with stop_after_the_step() as got:  # a signal: the step in progress ends and is saved
        ended = pretrain(student, teacher, task.unlabeled, task.labeled, args, device,
                         desc=f"meta {args.labels}", log=log, show=show, start=start, opts=opts,
                         save=save, stop=lambda: bool(got))
    if ended < args.steps:
        raise SystemExit(f"{signal.Signals(got['signal']).name}: stopped at step {ended}, saved "
                         f"in {folder.path / 'meta.pt'}; the same run goes on: {go_on}")
    save(args.steps)
    print(f"wrote {folder.path / 'ckpt.pt'} (the student; fine-tune it with evaluate.py finetune)")


# ---------------------------------------------------------------------------------------------
# Command line

def protocol_defaults(args) -> None:
    """The flags left unset take the --protocol's values (two_moons), or ours (glue)."""
    fill_unset(args, PROTOCOLS[args.protocol if args.task == "two_moons" else "nanomlm"])
    if args.teacher_lr is None:
        args.teacher_lr = args.lr


def build_parser() -> Parser:
    ap = Parser(prog="meta.py", description=__doc__)
    add = ap.add_argument
    add("--task", choices=("two_moons", "glue"), default="two_moons",
        help="the toy task, or text + (Super)GLUE")
    add("--labels", default="hard", help="comma-separated, of: hard, soft (the teacher's "
        "examples), denoise (soft with y^ fixed to the text read: Shen's Appendix B), mlm (plain "
        "MLM, the baseline), none (no pretraining); --task glue takes one")
    add("--protocol", choices=tuple(PROTOCOLS), default="nanomlm",
        help="two_moons: the defaults of the flags below: nanomlm (ours: 1000 steps of 32, "
        "fine-tuned full-batch for 200 steps) or shen (his report's Appendix A: 40k steps of 16, "
        "dropout 0.1, lr/sqrt(n), fine-tuned 100 epochs, best epoch on validation) "
        "(default nanomlm)")
    add("--steps", type=at_least(int, 1), default=None,
        help="pretraining steps (default: the protocol's; glue 1000)")
    add("--batch-size", type=at_least(int, 1), default=None,
        help="unlabelled sequences per step (default: the protocol's, 32 or 16)")
    add("--task-batch", type=at_least(int, 1), default=None,
        help="labelled examples in each of the support and query batches (default 8; shen 4)")
    add("--lr", type=at_least(float, 0), default=None,
        help="the student's AdamW learning rate, the MLM baseline's too (default 3e-3; shen 0.08 x "
        "n^-1/2)")
    add("--teacher-lr", type=at_least(float, 0), default=None,
        help="the teacher's AdamW learning rate (default: as --lr)")
    add("--inner-lr", type=at_least(float, 0), default=0.1,
        help="SGD learning rate eta of the unrolled steps")
    add("--unroll", choices=("adamw", "sgd"), default="adamw",
        help="soft labels: step (1) unrolled as the student's own AdamW step (MetaLMO's) or as "
        "an SGD step at --inner-lr")
    add("--mlm-task-p", type=Range(float, 0, 1), default=None,
        help="probability that a step's labelled task is MLM on other unlabelled text (default: "
        "0.5 for soft, as MetaLMO's soft runs; 0 otherwise)")
    add("--meta-weight", type=at_least(float, 0), default=None,
        help="weight of the meta term against the teacher's two MLM losses (default 100 for "
        "soft and denoise labels, as MetaLMO's soft runs; 1 otherwise)")
    add("--weight-decay", type=at_least(float, 0), default=0.01,
        help="AdamW weight decay, all optimisers")
    # 0 would zero every gradient: no "off" here
    add("--clip", type=above(float, 0), default=None,
        help="gradient-norm clip of every outer step (default 1; shen 5)")
    add("--seed", type=at_least(int, 0), default=0,
        help="model init and batches (--task glue)")
    add("--seeds", type=numbers(at_least(int, 0)),
        default="0,1,2", help="two_moons: one pretraining + fine-tuning per seed")
    add("--sizes", type=numbers(Range(int)), default="10,20,40,80,160",
        help="two_moons: labelled-set sizes (even, at most 160)")
    add("--data-seed", type=at_least(int, 0), default=0,
        help="two_moons: seed of the generated data")
    add("--labeled-points", choices=("random", "even"), default=None,
        help="two_moons: the labelled and validation points: random (drawn as the rest; the "
        "first n of one draw) or even (MetaLMO's make_moons(n): evenly spaced along each moon, "
        "then noise; one draw per size) (default random; shen even)")
    add("--workers", type=at_least(int, 1), default=2,
        help="two_moons on CPU: table entries computed in parallel processes")
    add("--ft-steps", type=at_least(int, 0), default=None,
        help="two_moons, nanomlm: full-batch fine-tuning steps (default 200)")
    add("--ft-epochs", type=at_least(int, 0), default=None,
        help="two_moons, shen: fine-tuning epochs, the best on validation kept; 0: full-batch "
        "--ft-steps instead (default 100)")
    add("--ft-lr", type=at_least(float, 0), default=None,
        help="two_moons: fine-tuning AdamW learning rate (default 1e-2; shen 0.04 x n^-1/2)")
    add("--data", default="babylm_10m",
        help="glue: unlabelled corpus (a name under $NANOMLM_RAW or a folder)")
    add("--vocab-size", type=at_least(int, 262), default=VOCAB_SIZE,
        help="glue: tokenizer size when the corpus is prepared first")
    add("--glue-dir", default=None, help="glue: folder of TASK.train.jsonl files (default "
        "$NANOMLM_RAW/babylm_eval/full_eval/glue_filtered)")
    add("--glue-tasks", default="rte,mrpc,cola",
        help="glue: labelled tasks (TASK.train.jsonl), taking turns step by step")
    add("--seq-len", type=Range(int, 3, GLUE_POSITIONS), default=128,
        help="glue: sequence length (two_moons: 34, fixed)")
    add("--size", choices=tuple(PRESETS), default="tiny",
        help="glue: model preset (two_moons: 2 layers, d_model 8)")
    for f, about in (("n_layer", "transformer layers"), ("n_head", "attention heads"),
                     ("d_model", "hidden size"), ("d_ff", "feed-forward inner size")):
        add(f"--{f.replace('_', '-')}", type=at_least(int, 1), default=None,
            help=f"{about} (overrides the preset)")
    add("--position", choices=("relative", "absolute"), default=None,
        help="relative (log-bucketed, LTG-BERT) or absolute (a learned table)")
    add("--dropout", type=Range(float, 0, 1, high_open=True), default=None,
        help="dropout (default 0: small data, and exact unrolls; shen 0.1)")
    add("--log-every", type=at_least(int, 1), default=50,
        help="glue: steps between log lines and teacher samples")
    add("--save-every", type=at_least(int, 1), default=500,
        help="glue: steps between checkpoints")
    add("--out-dir", default=None, help="run folder (default runs/meta_<task>_<labels>)")
    add("--resume", action="store_true",
        help="continue the run in --out-dir (two_moons: skip finished cells)")
    add_device_flag(add, "where to train")
    return ap


def main(argv=None):
    line_buffered()
    ap = build_parser()
    args = ap.parse_args(argv)
    protocol_defaults(args)
    args.labels_list = args.labels.split(",")
    bad = [x for x in args.labels_list if x not in ("hard", "soft", "denoise", "mlm", "none")]
    if bad:
        ap.error(f"--labels {','.join(bad)}: each must be hard, soft, denoise, mlm or none")
    if args.task == "two_moons":
        if any(s < 2 or s > 160 or s % 2 for s in args.sizes):
            ap.error("--sizes must be even numbers from 2 to 160")
        args.seq_len = 34  # [U], 16 points, [SEP]
        if not args.ft_epochs and args.ft_steps is None:
            ap.error("--ft-epochs 0 fine-tunes full-batch for --ft-steps steps: give --ft-steps")
    else:
        if len(args.labels_list) != 1 or args.labels == "none":
            ap.error("--task glue pretrains one student: give one of --labels hard, soft or mlm")
        args.glue_tasks = args.glue_tasks.split(",")
        if args.glue_dir is None:
            args.glue_dir = str(raw_root() / "babylm_eval" / "full_eval" / "glue_filtered")
        args.glue_dir = str(args.glue_dir)
    device = pick_device(args.device)
    name = f"meta_{args.task}_{args.labels.replace(',', '+')}"
    folder = RunFolder(args.out_dir or REPO / "runs" / name)
    if args.resume and not (folder.path / "args.json").is_file():
        raise SystemExit(f"error: --resume, but {folder.path} holds no meta.py run to go on from")
    folder.lock()  # one process per run folder
    if not args.resume:
        folder.check_new()
    folder.start(repo_sources(), keep_log=args.resume, args=vars(args))
    print(f"meta.py {args.task} --labels {args.labels} on {device}; run folder {folder.path}",
          file=sys.stderr)
    typed = list(sys.argv[1:] if argv is None else argv)
    go_on = shlex.join(["python", "meta.py", *typed, *([] if args.resume else ["--resume"])])
    if args.task == "two_moons":  # each entry is kept as it ends: a stop ends at once
        with exit_on_stop_signals(f"`meta.py`; the entries finished are kept, the same run goes "
                                  f"on: {go_on}"):
            run_two_moons(args, device, folder)
    else:
        run_glue(args, device, folder, go_on)


if __name__ == "__main__":
    main()
