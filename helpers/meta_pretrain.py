"""Meta-learned pretraining (Shen 2021, "Meta-learning a Language Modeling Objective"; code:
jeffdshen/MetaLMO), the part both tasks share: the meta tokens, batches in the one (x, y)
format, the Teacher, one meta step (hard labels, soft labels, denoising, or plain MLM), and the
pretraining loop. meta.py's docstring gives the algorithm; run it through `python meta.py`.
"""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from data.prepare import MASK, PAD, SEP
from machinery.device import autocast
from machinery.progress import bar
from model import PRESETS, Encoder, ModelConfig, small_init


# ---------------------------------------------------------------------------------------------
# Vocabulary: a base vocabulary (text pieces, or Two Moons' 64 coordinates) and, after it, the
# tokens only meta-learning needs: [MLM], [U] (unlabelled text: what the teacher reads), one
# [TASK] per labelled task

def extra_tokens(base: int, tasks: list[str], size: int = 0) -> dict:
    """Ids of the meta tokens after a base vocabulary of `base` ids; vocab >= size."""
    return {"base": base, "mlm": base, "unl": base + 1,
            "task": {t: base + 2 + i for i, t in enumerate(tasks)},
            "vocab": max(size, base + 2 + len(tasks))}


def label_tokens(task: int, n: int) -> list[int]:
    """The tokens of a task's n <= 3 classes, MetaLMO's (data/config/two_moons.py, nlp.py):
    [SEP], the task's own token, [MASK]. [SEP] ends every input and [MASK] fills MLM inputs,
    so a student that learnt to copy what it reads already emits them; the task token starts
    every labelled input (pretraining inputs hold it only if the teacher writes it). With two
    tokens of their own, in no input, 40k steps of hard-label copying left our Two Moons
    students fine-tuning to chance (docs/studies/meta_two_moons_shen.md)."""
    if n > 3:
        raise SystemExit(f"error: a task with {n} classes: meta.py labels at most 3")
    return [SEP, task, MASK][:n]


# ---------------------------------------------------------------------------------------------
# Batches in the one (x, y) format; all on the device, seeded by (seed, step) so a resumed run
# draws the same batches

def mask_tokens(x, gen, lo: int, hi: int, mlm: int, p: float = 0.15):
    """An MLM example of x (B, T) long: BERT masking, position 0 (the task token) and PAD never:
    each other position is chosen with probability p; a chosen one becomes [MASK] (80%), a
    random token from [lo, hi) (10%) or stays (10%). -> x_m (B, T) with `mlm` ([MLM]) as its
    task token, y_m (B, T): the original token where chosen, else PAD."""
    u = torch.rand(x.shape, generator=gen, device=x.device)
    chosen = (u < p) & (x != PAD)
    chosen[:, 0] = False
    r = u / p                                                            # uniform again on chosen
    x_m = torch.where(chosen & (r < 0.8), MASK, x)
    rand = torch.randint(lo, hi, x.shape, generator=gen, device=x.device)
    x_m = torch.where(chosen & (r >= 0.8) & (r < 0.9), rand, x_m)
    x_m[:, 0] = mlm
    return x_m, torch.where(chosen, x, PAD)


def support_and_query(n: int, k: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of a support and a query batch of k examples each out of n, never sharing an
    example (MetaLMO draws its query apart from its support): the first k and the next k of a
    random permutation, or its two halves when 2k > n."""
    k = min(k, n // 2)
    if k < 1:
        raise SystemExit(f"error: {n} labelled example(s) cannot make a support and a query batch")
    perm = torch.randperm(n, generator=gen, device=gen.device)
    return perm[:k], perm[k:2 * k]


def task_batch(x, labels, idx, label_ids):
    """x (n, T) long examples, labels (n,) -> (x[idx], y): the label token at every real
    position."""
    x = x[idx]
    return x, torch.where(x != PAD, label_ids[labels[idx]][:, None], PAD)


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
        normal = small_init(self.encoder.config.d_model)
        for lin in (self.y_head[1], self.y_head[4]):
            normal(lin.weight)
            lin.bias.zero_()

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


def hard_h(student, opt, pseudo_loss, support_loss, query_loss, inner_lr, clip):
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
    h, lq, lp, ls = hard_h(student, opt, pseudo, *task_losses(student, b), args.inner_lr, args.clip)
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
    x_w = torch.cat([b["x_m"][:, :1], b["x_u"][:, 1:]], 1)                  # [MLM] + the text
    lx_w, ly_w = teacher(x_w, m)
    write = 0.5 * (token_ce(lx_w, b["x_m"], m) + token_ce(ly_w, x_w, m))   # write an MLM task
    lx_m, ly_m = teacher(b["x_m"], m)
    perform = 0.5 * (token_ce(lx_m, b["x_m"], m) + token_ce(ly_m, b["y_m"], m))  # and do it
    outer_step(teacher, opt_t, args.meta_weight * meta + write + perform, args.clip)
    return {**info, "teacher_write": write, "teacher_mlm": perform}


# ---------------------------------------------------------------------------------------------
# Pretraining loop, shared by both tasks: unlabelled batches from `unlabeled(step, gen)`,
# support/query batches from `labeled(step, gen)`

def optimizers(student, teacher, args):
    adamw = lambda model, lr: torch.optim.AdamW(model.parameters(), lr=lr, betas=args.betas,
                                                eps=args.eps, weight_decay=args.weight_decay)
    return adamw(student, args.lr), adamw(teacher, args.teacher_lr)


def inverse_sqrt(step: int, warmup: int) -> float:
    """MetaLMO's learning-rate factor (trainers/schedulers.py, power -0.5, decaying forever):
    n^-1/2 at optimizer step n = step + 1, after a linear rise to warmup^-1/2 at n = warmup."""
    n = step + 1
    return n / warmup * warmup ** -0.5 if n < warmup else n ** -0.5


def label_defaults(args):
    """--meta-weight and --mlm-task-p left unset take their labels' defaults: soft, MetaLMO's
    soft runs (soft_pretrainer.py: meta weight 100; MLM a labelled task half the time); else
    weight 1 and no MLM task."""
    soft = args.labels in ("soft", "denoise")
    return replace_args(args, meta_weight=(100.0 if soft else 1.0) if args.meta_weight is None
                        else args.meta_weight,
                        mlm_task_p=(0.5 if soft else 0.0) if args.mlm_task_p is None
                        else args.mlm_task_p)


def pretrain(student, teacher, unlabeled, labeled, args, device, desc="", log=None, show=None,
             start=0, opts=None, save=None):
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
        if save is not None and (step + 1) % args.save_every == 0:
            save(step + 1)
    return opt_s, opt_t


def replace_args(args, **kw):
    return argparse.Namespace(**{**vars(args), **kw})


# ---------------------------------------------------------------------------------------------
# The networks' shape: Shen's for Two Moons, a --size preset for text

MOONS_MODEL = dict(n_layer=2, n_head=2, d_model=8, d_ff=32)  # Shen's Two Moons models


MODEL_FLAGS = ("n_layer", "n_head", "d_model", "d_ff", "position")


def model_config(args, vocab: int) -> ModelConfig:
    preset = MOONS_MODEL if args.task == "two_moons" else PRESETS[args.size]
    given = {k: getattr(args, k) for k in MODEL_FLAGS if getattr(args, k) is not None}
    # glue: as train.py, so that evaluate.py's --max-len fits
    longest = 64 if args.task == "two_moons" else max(512, args.seq_len)
    return ModelConfig(**{**preset, "vocab_size": vocab, "dropout": args.dropout,
                          "max_position": longest, **given})
