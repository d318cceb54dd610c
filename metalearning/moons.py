"""Two Moons, Shen's toy task, as meta.py meta-learns with it: the data (16 points a sequence, one
token a coordinate), the protocols (ours, quick; Shen's Appendix A), the batches a cell of the
table pretrains on, the classification rule its fine-tuned student is scored by, and the table.

    python meta.py --task two_moons --labels none,mlm,hard,soft
"""
from typing import NamedTuple

import numpy as np
import torch

from metalearning.examples import (extra_tokens, label_tokens, mask_tokens, support_and_query,
                                task_batch)
from data.prepare import MASK, PAD, SEP, SPECIALS


class Labeled(NamedTuple):
    x: np.ndarray | torch.Tensor  # (n, T) examples in the (x, y) format's x
    y: np.ndarray | torch.Tensor  # (n,) their classes


COORD, GRID = len(SPECIALS), 64  # coordinate c in [0, 64) is token COORD + c, after the specials


MOONS_TOKENS = extra_tokens(COORD + GRID, ["moon"], size=512)  # Shen's 512-token vocabulary
MOONS_TOKENS["label"] = label_tokens(MOONS_TOKENS["task"]["moon"], 2)
MOONS_NAMES = {MOONS_TOKENS["mlm"]: "[MLM]", MOONS_TOKENS["unl"]: "[U]",  # moons_text's
               MOONS_TOKENS["task"]["moon"]: "[MOON]", SEP: "[SEP]", MASK: "[MASK]"}


def on_moons(t, label):
    """(n,) angles and labels -> (n, 2) points on two interleaved half circles: label 0 on
    (cos t, sin t), label 1 on (1 - cos t, 1/2 - sin t)."""
    upper = np.stack([np.cos(t), np.sin(t)], 1)
    lower = np.stack([1 - np.cos(t), 0.5 - np.sin(t)], 1)
    return np.where(label[:, None] == 0, upper, lower)


def make_moons(n: int, rng, noise: float = 0.1):
    """n points on the moons plus N(0, noise^2) (scikit-learn's make_moons, drawn afresh): random
    labels, t ~ U[0, pi]."""
    label = rng.integers(0, 2, n)
    t = rng.uniform(0, np.pi, n)
    return on_moons(t, label) + rng.normal(0, noise, (n, 2)), label


def even_moons(n: int, rng, noise: float = 0.1):
    """scikit-learn's make_moons(n, noise=0.1) as MetaLMO draws its labelled and validation sets
    ("an even distribution since the sizes are so small", data/config/two_moons.py): t evenly
    spaced, linspace(0, pi, n/2) on each moon, plus N(0, noise^2); classes alternate. n even."""
    t, label = np.repeat(np.linspace(0, np.pi, n // 2), 2), np.tile([0, 1], n // 2)
    return on_moons(t, label) + rng.normal(0, noise, (n, 2)), label


def to_grid(xy):
    """Scale x from [-1.5, 2.5] and y from [-1, 1.5] to [0, 64), floor, clip: integer
    coordinates."""
    lo, hi = np.array([-1.5, -1.0]), np.array([2.5, 1.5])
    return np.clip(np.floor((xy - lo) / (hi - lo) * GRID), 0, GRID - 1).astype(np.int64)


def two_moons(seed: int, n_unlabeled=32000, n_labeled=160, n_test=1000, points=16) -> dict:
    """The toy data, a pure function of the seed. unlabeled (n, 2 + 2 points): [U], the points
    sorted by (x, y) with coordinates flattened, [SEP]; labeled: 160 examples [MOON] x y [SEP]
    (MetaLMO's "[CLS] $A [SEP]") and their labels, alternating classes so that every even-sized
    prefix (the 10, 20, ... sets) is balanced; test: n_test more; valid: a second set drawn like
    labeled (fine-tuning's validation under --protocol shen)."""
    tok = MOONS_TOKENS
    rng = np.random.default_rng(seed)
    c = to_grid(make_moons(n_unlabeled * points, rng)[0]).reshape(n_unlabeled, points, 2)
    order = np.lexsort((c[..., 1], c[..., 0]), axis=-1)               # (n, points): by x, then y
    c = np.take_along_axis(c, order[..., None], 1).reshape(n_unlabeled, 2 * points)
    column = lambda n, t: np.full((n, 1), t)
    unlabeled = np.concatenate([column(n_unlabeled, tok["unl"]), COORD + c,
                                column(n_unlabeled, SEP)], 1)

    def alternating() -> Labeled:  # n_labeled of a pool of 4x, classes alternating
        xy, label = make_moons(4 * n_labeled, rng)
        half = n_labeled // 2
        pick = np.stack([np.flatnonzero(label == 0)[:half], np.flatnonzero(label == 1)[:half]], 1)
        return Labeled(moon_examples(xy[pick.ravel()]), label[pick.ravel()])

    labeled = alternating()
    xy_t, label_t = make_moons(n_test, rng)
    return {"tokens": tok, "unlabeled": unlabeled, "labeled": labeled,
            "test": Labeled(moon_examples(xy_t), label_t), "valid": alternating(),
            "random": (COORD, COORD + GRID)}


def moon_examples(xy) -> np.ndarray:
    """(n, 2) points -> (n, 4) examples [MOON] x y [SEP] (MetaLMO's "[CLS] $A [SEP]")."""
    n, tok = len(xy), MOONS_TOKENS
    return np.concatenate([np.full((n, 1), tok["task"]["moon"]), COORD + to_grid(xy),
                           np.full((n, 1), SEP)], 1)


def labeled_sets(data: dict, size: int, layout: str, data_seed: int) -> tuple:
    """(train, valid) for a labelled-set size. random: the first `size` points of one draw (the
    sets are nested) and of a second; even: MetaLMO's, each size its own evenly spaced draw.
    The validation set has the training set's size, at most 128 (Shen)."""
    k = min(size, 128)
    if layout == "random":
        return (Labeled(*(a[:size] for a in data["labeled"])),
                Labeled(*(a[:k] for a in data["valid"])))
    draw = lambda n, part: even_moons(n, np.random.default_rng((data_seed, part, n)))
    return tuple(Labeled(moon_examples(xy), y) for xy, y in (draw(size, 1), draw(k, 2)))


def moons_batches(data: dict, train: Labeled, label_ids, args, device):
    """(unlabeled, labeled), a cell's batches as meta.pretrain reads them, each (step, generator)
    -> a dict of (B, T) tensors: --batch-size unlabelled sequences and their MLM example (x_u,
    m_u, x_m, y_m); a support and a query batch of --task-batch of the labelled points `train`
    (x_s, y_s, m_s, x_q, y_q, m_q), their labels written as the tokens label_ids."""
    tok = data["tokens"]
    U = torch.as_tensor(data["unlabeled"], device=device)

    def unlabeled(step, gen):
        x = U[torch.randint(len(U), (args.batch_size,), generator=gen, device=device)]
        x_m, y_m = mask_tokens(x, gen, *data["random"], tok["mlm"])
        return {"x_u": x, "m_u": torch.ones_like(x), "x_m": x_m, "y_m": y_m}

    def labeled(step, gen):
        out = {}
        for s, idx in zip("sq", support_and_query(len(train.y), args.task_batch, gen)):
            x, y = task_batch(train.x, train.y, idx, label_ids)
            out.update({f"x_{s}": x, f"y_{s}": y, f"m_{s}": torch.ones_like(x)})
        return out

    return unlabeled, labeled


def moons_text(t) -> str:
    """The first sequence of t (B, T) as text: coordinates as numbers, the meta tokens named."""
    name = lambda i: str(i - COORD) if COORD <= i < COORD + GRID else MOONS_NAMES.get(i, f"[{i}]")
    return " ".join(map(name, t[0].tolist()))


@torch.no_grad()
def predict_labels(model, x, label_ids) -> torch.Tensor:
    """Classes of examples x (n, T): the label token with the largest logit averaged over the
    positions."""
    mask = (x != PAD).long()
    logits = model.logits(x, mask)[..., label_ids]                       # (n, T, classes)
    return ((logits * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).argmax(-1)


# The Two Moons protocols: ours (small and quick), and Shen's (his report's Appendix A, Tables
# 4-6). His batch of 4 with 4-fold accumulation is one batch of 16 here (for the teacher, he
# notes, not quite the same: each of his micro-batches took its own student steps).
PROTOCOLS = {
    "nanomlm": dict(steps=1000, batch_size=32, task_batch=8, lr=3e-3, clip=1.0,
                    dropout=0.0, betas=(0.9, 0.999), eps=1e-8, warmup=None, ft_lr=1e-2,
                    ft_steps=200, ft_epochs=None, ft_warmup=None, labeled_points="random"),
    # 640k samples = 40k steps of 16; lr/sqrt(n) after a linear warm-up, from 0.08 (so 2.5e-3
    # at its peak, step 1000); fine-tuning: 100 epochs, the peak 0.04/sqrt(10) = 1.2e-2
    "shen": dict(steps=40000, batch_size=16, task_batch=4, lr=0.08, clip=5.0,
                 dropout=0.1, betas=(0.9, 0.98), eps=1e-6, warmup=1000, ft_lr=0.04,
                 ft_steps=None, ft_epochs=100, ft_warmup=10, labeled_points="even"),
}


FT_BATCH = {"mlm": (1, 1, 1, 8, 16)}  # Shen's Table 6, for n = 10, 20, 40, 80, 160


FT_BATCH_OTHERS = (1, 2, 4, 8, 16)


def ft_batch(labels: str, n: int) -> int:
    """Shen's fine-tuning batch size (Table 6) for n labelled examples."""
    sizes = FT_BATCH.get(labels, FT_BATCH_OTHERS)
    return dict(zip((10, 20, 40, 80, 160), sizes)).get(n, max(1, min(16, n // 10)))


def print_table(results, labels_list, sizes, seeds):
    """Shen's Table 10 layout: one row per pretraining, one column per labelled-set size."""
    print(f"\nTwo Moons test accuracy (%), mean ± std over seeds {','.join(map(str, seeds))}")
    print("| pretraining | " + " | ".join(f"n={s}" for s in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    for labels in labels_list:
        cells = []
        for size in sizes:
            v = 100 * np.array([results[f"{labels}/{size}/{s}"] for s in seeds])
            cells.append(f"{v.mean():.1f} ± {v.std(ddof=1) if len(v) > 1 else 0:.1f}")
        print(f"| {labels} | " + " | ".join(cells) + " |")
