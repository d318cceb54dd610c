"""Masking, vectorised over a batch on its device: LTG-BERT's spans (80/10/10 per span), BERT's
tokens (spans of one), the MLSM code's uniform int(p T) per row; the predicted positions as a
fixed number of slots (so a compiled step has one shape); make_batch, which turns a batch of
token ids into the dict every objective in train.py reads; and seed_of, the seeds each step's
masks and dropout are drawn with.
"""
import math

import numpy as np
import torch

from data.prepare import MASK, SPECIALS


def span_mask(ids, p, vocab_size, gen, mean_span=3.0, capacity=None):
    """ids (B, T) -> (inputs (B, T), labels (B, T) with -100 where nothing is predicted).

    Each position starts a new span with probability 1/mean_span, so span lengths are geometric
    with mean `mean_span`. One uniform u per span decides everything: the span is chosen iff u < p
    (so every token is chosen with probability exactly p), and, given it is chosen, u/p is uniform
    on [0, 1) and picks LTG-BERT's per-span replacement: [MASK] below 0.8, a random token below
    0.9, else the token itself. Special tokens ([CLS], [SEP], [PAD], ...) are never chosen.
    capacity: at most this many chosen tokens in the batch (mask_capacity's bound, which a batch
    rarely reaches): those beyond it, in row-major order, are not chosen.
    """
    B, T = ids.shape
    start = torch.rand(B, T, generator=gen, device=ids.device) < 1.0 / mean_span
    span = start.cumsum(1)                                                   # (B, T) span index
    u = torch.rand(B, T + 1, generator=gen, device=ids.device).gather(1, span)  # per-span uniform
    chosen = (u < p) & (ids >= len(SPECIALS))
    if capacity is not None:
        chosen &= chosen.flatten().cumsum(0).view(B, T) <= capacity
    r = u / p
    noise = torch.randint(len(SPECIALS), vocab_size, (B, T), generator=gen, device=ids.device)
    inputs = torch.where(chosen & (r < 0.8), MASK, ids)
    inputs = torch.where(chosen & (r >= 0.8) & (r < 0.9), noise, inputs)
    labels = torch.where(chosen, ids, -100)
    return inputs, labels


def uniform_mask(ids, p, gen):
    """ids (B, T) -> (inputs, labels) as span_mask, by the MLSM code's rule (szegedai/MLSM,
    mlsm_pretrainer.py, July 2023): in each row exactly int(p * T) of the tokens that are not
    special ([CLS], [SEP] and the rest are never chosen), drawn uniformly without replacement,
    all replaced by [MASK]: no spans and no 80/10/10. T counts [CLS] and [SEP], as the
    reference's count of a sequence's tokens does."""
    B, T = ids.shape
    score = torch.rand(B, T, generator=gen, device=ids.device)
    score = score.masked_fill(ids < len(SPECIALS), 2.0)                # specials rank last
    chosen = score.argsort(1).argsort(1) < int(p * T)                  # (B, T): the lowest ranks
    return torch.where(chosen, MASK, ids), torch.where(chosen, ids, -100)


def mask_capacity(B, T, p, mean_span=None) -> int:
    """A fixed bound on the tokens a batch of B rows of T tokens ([CLS] and [SEP] included)
    has chosen: exactly B int(p T) for uniform_mask (mean_span None); for span_mask, the mean
    p n of its n = B (T - 2) choosable tokens plus 7 standard deviations of their count, plus 8.
    Given the spans, the count is a sum of independent [chosen] * length terms, so its variance
    is p (1 - p) times the sum of squared span lengths, about n (2m - 1) for geometric lengths
    of mean m (a little less: rows cut their last span short). Computed exactly (a dynamic
    program over a row's spans), a batch exceeds the bound with probability 6e-12
    at 128 x 128 tokens (where it is 1.30x the mean count) and 4e-10 at the tests' 8 x 32; a
    single short row with few masks more often (1 x 64 tokens at p 0.05: 2e-6). span_mask
    then leaves the tokens beyond it unchosen."""
    if mean_span is None:
        return B * int(p * T)
    n = B * (T - 2)
    std = math.sqrt(n * p * (1 - p) * (2 * mean_span - 1))
    return min(B * T, math.ceil(p * n + 7 * std) + 8)


def predicted_slots(labels, capacity):
    """labels (B, T), -100 where nothing is predicted -> slots (capacity,) long: the flat
    positions (row * T + column) of the predicted tokens in row-major order, then positions
    that predict nothing, up to `capacity` (at least their count). One shape for every batch,
    so a compiled step gathers the predicted positions without a host sync; boolean indexing
    would read their count first (a nonzero, a sync and a graph break). labels.flatten()[slots]
    is -100 in the padding slots, which the losses weigh out."""
    rest = (labels.flatten() == -100).to(torch.uint8)                  # 0: predicted, 1: not
    return torch.argsort(rest, stable=True)[:capacity]


# --masking: each scheme's mean span length, or None for the MLSM code's uniform int(p T) per row
# (LTG-BERT's spans; BERT's tokens, spans of one; uniform_mask)
MASKINGS = {"span": 3.0, "token": 1.0, "uniform": None}

# The held-out questions `evaluate.py mlm` asks, every hidden token [MASK] (none kept or
# replaced): `uniform`, uniform_mask's isolated tokens (the question the MLSM code's arms train
# on); `span`, span_mask's spans of mean 3 (the question mlm and boot train on).
HELD_OUT_MASKINGS = ("uniform", "span")


def mask_p_at(step: int, args) -> float:
    """The fraction to predict at `step`: --mask-p, or with --mask-p-end a line from one to the
    other over the run (gpt-bert's dataset.py: start + (end - start) * step / max_steps)."""
    if args.mask_p_end is None:
        return args.mask_p
    return args.mask_p + (args.mask_p_end - args.mask_p) * step / args.max_steps


def make_batch(ids, args, vocab_size, gen, mask_p=None):
    """ids (B, T) -> the batch every objective reads, `mask_p` (default --mask-p) of the tokens
    predicted. The predicted positions are also given as a fixed number C of slots
    (mask_capacity of the run's largest fraction: exactly B int(p T) for uniform masking, a
    bound for spans), so that the compiled step has one shape and never waits for the device."""
    B, T = ids.shape
    p = args.mask_p if mask_p is None else mask_p
    mean_span = MASKINGS[args.masking]
    capacity = mask_capacity(B, T, max(args.mask_p, getattr(args, "mask_p_end", None) or 0),
                             mean_span)
    if mean_span is None:  # the MLSM code's: int(p T) tokens per row, all [MASK]
        inputs, labels = uniform_mask(ids, p, gen)
    else:  # spans, 80/10/10 per span
        inputs, labels = span_mask(ids, p, vocab_size, gen, mean_span, capacity)
    slots = predicted_slots(labels, capacity)                              # (C,)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), inputs=inputs, labels=labels,
                slots=slots, targets=labels.flatten()[slots])


def seed_of(*parts) -> int:
    """A well-mixed 63-bit seed from integers (seed, step, micro-batch...): whatever is drawn with
    it is a function of those integers alone, so a resumed run draws what the first would have."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, np.uint64)[0] >> np.uint64(1))
