"""Meta-learning's examples (meta.py), one (x, y) format for every task: the meta tokens after a
base vocabulary, the tokens of a task's labels, MLM examples, a support and a query batch drawn
apart, and a labelled batch. On the device, drawn from the caller's generator (seeded by (seed,
step), so a resumed run draws the same batches). meta.py's docstring gives the format.
"""
import torch

from data.prepare import MASK, PAD, SEP


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
# Batches

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
