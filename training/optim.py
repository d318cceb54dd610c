"""Optimisers and schedules: LAMB (LTG-BERT's), the fused EMA update of a mean teacher, the
parameter groups, the learning-rate, weight-decay and EMA-decay schedules of a pretraining phase,
and the learning-rate schedules of fine-tuning and meta-learning.
"""
import math

import torch
import torch.nn as nn

from machinery.plumbing import use_compile


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, decay: float, fused: bool = True) -> None:
    """teacher <- decay * teacher + (1 - decay) * student, for every parameter. Fused: one
    torch._foreach_lerp_ over all tensors (a few multi-tensor kernels instead of one or more per
    tensor); otherwise the same lerp_, tensor by tensor."""
    t = list(teacher.parameters())
    s = [p.detach() for p in student.parameters()]
    if fused:
        torch._foreach_lerp_(t, s, 1.0 - decay)
    else:
        for a, b in zip(t, s):
            a.lerp_(b, 1.0 - decay)


def lamb_update(params, grads, m, v, steps, lr, wd, trusted, b1: float, b2: float, eps: float,
                max_norm: float | None = None) -> torch.Tensor:
    """One LAMB step of every tensor, in place, in multi-tensor (torch._foreach_*) ops: no
    Python loop over tensors and no host sync. steps (each tensor's count, already advanced),
    lr and wd (its learning rate and weight decay) are per-tensor lists, either of Python
    numbers (eager: each op one multi-tensor kernel, as LTG-BERT's numbers are) or of 0-dim
    tensors on the device (compiled: numbers that change every step would be guarded as
    constants and recompile the graph). trusted (tensors,) bool, on the device: where the trust
    ratio applies (LTG-BERT: groups with weight decay; at init the ratio would shrink embedding
    steps ~30x). Returns the gradients' total norm (0-dim); with max_norm they are first clipped
    to it in place by clip_grad_norm_'s operations (the norm summed in the groups' order, not
    the model's: the same to float32 rounding, 2.5e-7 relative at most in tiny runs' logs)."""
    norm = torch.nn.utils.get_total_norm(grads)                       # () before clipping
    if max_norm is not None:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    torch._foreach_lerp_(m, grads, 1 - b1)
    torch._foreach_mul_(v, b2)
    torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
    denom = torch._foreach_div(v, [1 - b2 ** s for s in steps])     # bias corrections, per tensor
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    r = torch._foreach_div(m, [1 - b1 ** s for s in steps])
    torch._foreach_div_(r, denom)                                     # r = m^ / (sqrt(v^) + eps)
    torch._foreach_add_(r, torch._foreach_mul(params, wd))                        # r + wd w
    w_norm = torch.stack(torch._foreach_norm(params))                 # (tensors,)
    r_norm = torch.stack(torch._foreach_norm(r))
    ratio = torch.where(trusted & (w_norm > 0) & (r_norm > 0), w_norm / r_norm, 1.0)
    torch._foreach_mul_(r, list(ratio.unbind()))  # the one op with a kernel per tensor, eager
    torch._foreach_mul_(r, lr)
    torch._foreach_sub_(params, r)
    return norm


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Algorithm 2) as
    LTG-BERT's lamb.py runs it: the bias-corrected Adam direction r = m/(sqrt(v)+eps) plus
    decoupled weight decay, rescaled per tensor by the trust ratio ||w|| / ||r + wd*w|| (1 where
    either norm is 0) in groups with weight decay only; a group without (embeddings, positions,
    gains, biases) takes plain Adam steps. torch has none. A step is one lamb_update of all
    groups' tensors, gradient clipping included (step(max_norm)). Eager (the default), the step
    counts, learning rates and weight decays are Python numbers, as in torch.optim's Adam; with
    `compile`, one compiled graph (fused kernels) reading them from device memory, at the cost
    of its compile at a run's start (docs/bench.md). One betas and eps."""

    def __init__(self, params, lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0,
                 compile=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if len({(g["betas"], g["eps"]) for g in self.param_groups}) > 1:
            raise ValueError("Lamb: one betas and eps for every group")
        self.compiled = compile
        self.update = torch.compile(lamb_update, fullgraph=True) if compile else lamb_update
        self.hyper = None       # compiled: (groups, 2) each group's lr and weight decay, on device
        self.group_of = {}      # compiled: the tensors stepped -> (tensors,) the group of each
        self.trusted = {}       # eager: which tensors take the trust ratio -> that (tensors,) mask

    @torch.no_grad()
    def step(self, max_norm: float | None = None):
        """One step; with max_norm, the gradients clipped to that total norm first. Returns
        their total norm before clipping (0-dim, on the device), or None without gradients."""
        stepped = [(i, p) for i, g in enumerate(self.param_groups) for p in g["params"]
                   if p.grad is not None]
        if not stepped:
            return None
        params = [p for _, p in stepped]
        for p in params:
            if not self.state[p]:
                self.state[p].update(step=self.count(0, p), m=torch.zeros_like(p),
                                     v=torch.zeros_like(p))
        state = [self.state[p] for p in params]
        if self.compiled:  # the counts on the device, advanced by one multi-tensor kernel
            steps = [st["step"] for st in state]  # per tensor: one may miss a step
            torch._foreach_add_(steps, 1.0)
            lr, wd, trusted = self.device_hyper(stepped)
        else:
            for st in state:
                st["step"] += 1
            steps = [st["step"] for st in state]
            lr = [self.param_groups[i]["lr"] for i, _ in stepped]
            wd = [self.param_groups[i]["weight_decay"] for i, _ in stepped]
            key = tuple(w > 0 for w in wd)
            if key not in self.trusted:  # made once per pattern: a copy to the device
                self.trusted[key] = torch.tensor(key, device=params[0].device)
            trusted = self.trusted[key]
        (b1, b2), eps = self.param_groups[0]["betas"], self.param_groups[0]["eps"]
        return self.update(params, [p.grad for p in params], [st["m"] for st in state],
                           [st["v"] for st in state], steps, lr, wd, trusted, b1, b2, eps,
                           max_norm)

    def count(self, n, p):
        """A step count as this optimizer keeps it: a Python number eager, a 0-dim tensor in
        the parameter's dtype beside it compiled."""
        if self.compiled:
            return torch.as_tensor(n, dtype=p.dtype, device=p.device)
        return float(n)

    def device_hyper(self, stepped):
        """Each stepped tensor's learning rate and weight decay as 0-dim tensors on the device,
        and the trust-ratio mask (tensors,), with no host sync: the numbers written into device
        memory by fill_ (`hyper[i, 0] = lr` would copy a CPU tensor and wait for the GPU, as CUDA's
        sync-debug mode shows), picked per tensor by a gather."""
        device = stepped[0][1].device
        key = tuple(id(p) for _, p in stepped)
        if key not in self.group_of:  # made once per set of tensors: a copy to the device
            self.group_of[key] = torch.tensor([i for i, _ in stepped], device=device)
        if self.hyper is None:
            self.hyper = torch.zeros(len(self.param_groups), 2, dtype=stepped[0][1].dtype,
                                     device=device)
        for i, g in enumerate(self.param_groups):
            self.hyper[i, 0].fill_(g["lr"])
            self.hyper[i, 1].fill_(g["weight_decay"])
        lr, wd = self.hyper[self.group_of[key]].unbind(1)                      # (tensors,)
        return list(lr.unbind()), list(wd.unbind()), wd > 0

    def load_state_dict(self, state_dict):
        """A checkpoint's state, its step counts kept as this optimizer keeps them (a number or
        a tensor, whichever wrote the checkpoint)."""
        super().load_state_dict(state_dict)
        for st in self.state.values():
            st["step"] = self.count(float(st["step"]), st["m"])


def make_optimizer(model, args):
    """Group 0 decays (the weight matrices), group 1 does not (biases, LayerNorm gains,
    embedding tables, BootBERT's mask vector), as LTG-BERT; with --decay-embeddings the
    embedding and position tables decay too, as gpt-bert's groups (every parameter but biases
    and LayerNorms; train_10m.py's no_decay = ["bias", "layer_norm"])."""
    table = lambda name: name.endswith(("word.weight", "pos.weight", ".rel")) or name == "rel"
    decays = lambda name, p: p.ndim >= 2 and (args.decay_embeddings or not table(name))
    named = list(model.named_parameters())
    groups = [dict(params=[p for n, p in named if decays(n, p)], weight_decay=args.weight_decay),
              dict(params=[p for n, p in named if not decays(n, p)], weight_decay=0.0)]
    device = next(model.parameters()).device
    if args.optim == "lamb":  # compiled only when asked: ~35 s of compile for no measured gain
        return Lamb(groups, lr=args.lr, betas=(0.9, 0.98), eps=args.eps,
                    compile=args.compile_lamb and use_compile(device, args.compile))
    fused = device.type == "cuda" or None  # one kernel on a GPU
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=args.eps, fused=fused)


def clipped_step(optimizer, clip: float) -> torch.Tensor:
    """Clip the gradients of the optimizer's parameters to total norm `clip` (0: not at all) and
    take its step; returns their norm before clipping (0-dim, on the device: no host sync). LAMB
    clips inside its own update, one compiled graph with it; another optimizer after
    clip_grad_norm_."""
    if isinstance(optimizer, Lamb):
        return optimizer.step(max_norm=clip if clip > 0 else None)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    optimizer.step()
    return norm


def lr_at(step, args, start=0, end=None):
    """Linear warmup to --lr, then cosine or linear decay to --min-lr * --lr, over the phase
    [start, end) (default the whole run); cosine-cooldown: gpt-bert's (cosine_with_cooldown)."""
    end = args.max_steps if end is None else end
    step, n = step - start, end - start
    if args.schedule == "cosine-cooldown":
        return args.lr * cosine_with_cooldown(step, int(args.warmup * n) if args.warmup < 1
                                              else int(args.warmup), int(args.cooldown * n), n,
                                              args.min_lr)
    warmup = round(args.warmup * n) if args.warmup < 1 else int(args.warmup)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, n - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * t)) if args.schedule == "cosine" else 1 - t
    return args.lr * (args.min_lr + (1 - args.min_lr) * decay)


# The schedules of fine-tuning and meta-learning, each as its reference writes it: factors of a
# base learning rate at optimizer step `step` (from 0)

def cosine_with_warmup(step: int, warmup: int, steps: int, floor: float = 0.1) -> float:
    """The BabyLM pipeline's schedule factor (finetune/utils.py): linear from 0 over `warmup`
    steps, then a cosine from 1 down to `floor` at `steps`."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, steps - warmup)
    return max(floor, floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def cosine_with_cooldown(step: int, warmup: int, cooldown: int, steps: int,
                         floor: float = 0.1) -> float:
    """gpt-bert's pretraining schedule factor (ltgoslo/gpt-bert, pretraining/utils.py,
    cosine_schedule_with_warmup_cooldown, as LambdaLR applies it at optimizer step `step`): linear
    from 0 over `warmup` steps, a cosine from 1 towards `floor` over the steps after the warmup,
    and over the last `cooldown` steps a line from `floor` down to 0 at `steps`."""
    if step < warmup:
        return step / max(1, warmup)
    if step >= steps - cooldown:
        return floor * (steps - step) / max(1, cooldown)
    progress = (step - warmup) / max(1, steps - warmup)
    return max(floor, floor + (1 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def linear_warmup_decay(step: int, warmup: int, steps: int) -> float:
    """Ours for fine-tuning: linear from 1/warmup up to 1 over `warmup` steps, then linear down
    to 0 at `steps`."""
    return min((step + 1) / warmup, max(0.0, (steps - step) / (steps - warmup)))


def inverse_sqrt(step: int, warmup: int) -> float:
    """MetaLMO's learning-rate factor (trainers/schedulers.py, power -0.5, decaying forever):
    n^-1/2 at optimizer step n = step + 1, after a linear rise to warmup^-1/2 at n = warmup."""
    n = step + 1
    return n / warmup * warmup ** -0.5 if n < warmup else n ** -0.5


def set_schedule(optimizer, step, args, start, end) -> float:
    """The phase [start, end)'s learning rate (every group) and weight decay (group 0, the only
    one that decays) at `step`, set in `optimizer`; returns the learning rate."""
    lr = lr_at(step, args, start, end)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.param_groups[0]["weight_decay"] = weight_decay_at(step, args, start, end)
    return lr


def weight_decay_at(step, args, start, end):
    """--weight-decay, or with --weight-decay-end a cosine from one to the other over the phase
    (BootBERT raises it from 0.02 to 0.2)."""
    if args.weight_decay_end is None:
        return args.weight_decay
    t = (step - start) / max(1, end - start - 1)
    wd, wd_end = args.weight_decay, args.weight_decay_end
    return wd_end + (wd - wd_end) * 0.5 * (1 + math.cos(math.pi * t))


def ema_decay_at(step, args, start, end):
    """The mean teacher's decay rises linearly from --ema-start to --ema-end over the phase."""
    n = max(1, end - start - 1)
    return args.ema_start + (args.ema_end - args.ema_start) * (step - start) / n
