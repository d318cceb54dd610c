"""Evaluate checkpoints with torch and numpy only: what a model fills in for [MASK], BLiMP by
pseudo-log-likelihood, (Super)GLUE/MSGS fine-tuning, and the Multi-Bootstrap to compare two
pretraining procedures.

    python evaluate.py fill --ckpt runs/X "the cat sat on the [MASK] ."   # its top guesses
    E=../shared/data/babylm_eval
    python evaluate.py blimp --ckpt runs/X/ckpt.pt \
        --blimp-dir $E/fast_eval/blimp_fast $E/fast_eval/supplement_fast
    python evaluate.py finetune --ckpt runs/X/ckpt.pt --task rte \
        --data-dir $E/full_eval/glue_filtered --seeds 1,2,3
    python evaluate.py mlm --ckpt runs/X/ckpt.pt       # masked-token loss and accuracy
    python evaluate.py compare "runs/mlm_s*/eval/blimp.json" "runs/boot_s*/eval/blimp.json"
    python evaluate.py weights --ckpt runs/X/ckpt.pt

Each command writes RUN/eval/NAME.json next to the checkpoint (or --out) with every per-example
result, so that `compare` can resample examples as well as pretraining seeds.

BLiMP: a pair counts as correct iff PLL(good) > PLL(bad), ties wrong. PLL (Salazar et al. 2020)
masks every token in turn ([CLS]/[SEP] never) and sums the log-probabilities of the masked
tokens; `--scorer word-l2r` (Kauf & Ivanova 2023) also hides the later pieces of the word being
scored. A gpt-bert model is scored as the BabyLM 2025 pipeline scores GPT-BERT: `mntp` (its
default here; each token masked in turn, read at the position before it) or `causal` (one
causal forward). Temperature: scores under logits/T for a grid of T; the best T is chosen on one
half of the pairs (a fixed split by pair id) and reported on the other half only.
"""
import argparse
import json
import math
import time
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from data.masking import HELD_OUT_MASKINGS, seed_of, span_mask, uniform_mask
from data.prepare import (CLS, MASK, SEP, SPECIALS, Segments, check_tokenizer, encode_masked,
                          prepare)
from data.tasks import TASKS, pad, read_jsonl
from evaluation.finetune import RECIPES, finetune
from evaluation.multibootstrap import compare
from evaluation.results import read_partial, result_path, write_lines, write_result
from machinery.plumbing import (Parser, Range, above, add_device_flag, at_least, autocast, bar,
                                checkpoint_identity, duration, exit_on_stop_signals, file_to_write,
                                hold_lock, line_buffered, numbers, one_line_os_errors, pick_device)
from model import Encoder, load_checkpoint


# ---------------------------------------------------------------------------------------------
# BLiMP: pseudo-log-likelihood

# tokens per PLL batch: on the CPU the fastest of 2k/4k/16k, measured on 3,000 sentences
BATCH_TOKENS = {"cpu": 4096, "cuda": 32768}

# BLiMP's 12 phenomena (Warstadt et al. 2020, Table 4), the grouping the BabyLM pipeline reports.
# The jsonl files label the two animate_subject paradigms "s-selection"; the paper counts them
# under argument structure.
PHENOMENON = {"s-selection": "argument_structure"}


def read_blimp(dirs) -> list[dict]:
    """Pairs of every *.jsonl in each folder; original (pairID) or BabyLM (pair_id) schema, or the
    BabyLM supplement (no UID: the file name is the paradigm and the phenomenon)."""
    pairs = []
    for d in map(Path, dirs):
        if not d.is_dir():
            raise SystemExit(f"error: no BLiMP folder at {d}")
        files = sorted(d.glob("*.jsonl"))
        if not files:
            raise SystemExit(f"error: {d} holds no *.jsonl files")
        for f in files:
            rows = read_jsonl(f)
            if not rows:
                raise SystemExit(f"error: {f} holds no pairs")
            items = [r.get("pair_id", r.get("pairID", r.get("pair_ID"))) for r in rows]
            if None in items:  # most of the supplement has no pair id: the line is the item
                items = list(range(len(rows)))
            # subject_aux_inversion's pair_ID names an item shared by its variants (3,867 pairs,
            # 988 ids): a pair is then item/line, and the item keeps its variants in one half
            unique = len(set(items)) == len(items)
            for n, (r, pid) in enumerate(zip(rows, items), 1):
                good, bad = r.get("sentence_good"), r.get("sentence_bad")
                if not isinstance(good, str) or not isinstance(bad, str):
                    raise SystemExit(f"error: {f}:{n} has no sentence_good/sentence_bad strings")
                uid = r.get("UID", f.stem)
                term = r.get("linguistics_term", f.stem)
                pairs.append({"id": f"{uid}/{pid}" if unique else f"{uid}/{pid}/{n}",
                              "item": f"{uid}/{pid}", "uid": uid, "group": d.name,
                              "field": r.get("field", "supplement"),
                              "phenomenon": PHENOMENON.get(term, term), "good": good, "bad": bad})
    return pairs


def read_at(model, hidden):
    """Where a model's prediction of each hidden token (B, T) bool is read: there, or where it
    predicts_before, at the position before it ([CLS] at 0 is never hidden), in the same
    row-major order."""
    return hidden.roll(-1, 1) if model.predicts_before else hidden


def word_starts(tok) -> torch.Tensor:
    """(V,) bool: does this piece begin a word? Sentencepiece marks word starts with U+2581;
    specials are words of their own; byte pieces continue the word they are in."""
    special = lambda i: tok.is_control(i) or tok.is_unknown(i)
    starts = lambda i: special(i) or tok.id_to_piece(i).startswith("\u2581")
    return torch.tensor([starts(i) for i in range(tok.get_piece_size())])


# How a sentence's tokens are scored (--scorer): pll, each token masked in turn and read where it
# is; word-l2r, also hiding the later pieces of its word; mntp, masked in turn but read at the
# position before it (GPT-BERT's masked next-token prediction: the BabyLM 2025 pipeline's mntp
# backend); causal, one causal forward, each token read at the position before it (its causal
# backend). The first three need a copy of the sentence per token, causal one forward.
SCORERS = ("pll", "word-l2r", "mntp", "causal")


@torch.no_grad()
def token_logprobs(model, seqs, temps, scorer, batch_tokens, device, starts, progress=True,
                   bf16=False):
    """Log-probability of every scored token of every sequence, under every temperature.

    seqs: token-id lists, [CLS] ... [SEP]; every token between them is scored, the first from
    [CLS]'s state under mntp and causal. Returns (sentence index (C,), position (C,), log-probs
    (C, len(temps))) for the C = sum(len - 2) scored tokens, by sentence, then position. Inputs
    of equal length share a batch of at most `batch_tokens` tokens, so nothing is padded and no
    Python loop runs per token. Scored in float32 unless bf16: in bf16 near-ties flip from one
    GPU kind to another, and BLiMP pairs are decided by such differences.
    """
    assert scorer in SCORERS, scorer
    L = np.array([len(s) for s in seqs])
    ids = pad(seqs)
    words = starts[torch.from_numpy(ids)].cumsum(1).numpy()      # (S, Lmax) word index per position
    n = L - 2
    sent = np.repeat(np.arange(len(seqs)), n)                    # copy -> its sentence
    pos = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + 1  # copy -> the position it masks
    out = np.zeros((len(sent), len(temps)))
    causal = scorer == "causal"
    items = np.arange(len(seqs)) if causal else sent            # what a batch row holds
    batches = []
    for length in np.unique(L):
        rows = np.flatnonzero(L[items] == length)
        parts = math.ceil(len(rows) * length / batch_tokens)
        batches += [(length, c) for c in np.array_split(rows, parts)]
    first = np.cumsum(n) - n                                     # a sentence's first copy
    for length, c in bar(batches, desc=scorer, unit="batch", leave=False,
                         disable=None if progress else True):
        rows = torch.from_numpy(ids[items[c], :length]).to(device)
        if causal:  # (r, length): positions 0..length-3 predict tokens 1..length-2
            with autocast(device, bf16):
                z = model.logits(rows, causal=True)[:, :-2].float().flatten(0, 1)
            targets = rows[:, 1:-1].reshape(-1, 1)
            c = (first[c][:, None] + np.arange(length - 2)).ravel()   # their copies, in order
        else:
            word = torch.from_numpy(words[sent[c], :length]).to(device)  # (n, length) word index
            p = torch.from_numpy(pos[c]).to(device)[:, None]
            ar = torch.arange(length, device=device)
            target = ar == p                                             # (n, length)
            hide = target | ((ar > p) & (word == word.gather(1, p))) if scorer == "word-l2r" \
                else target
            read = ar == p - 1 if scorer == "mntp" else target       # where the prediction is
            with autocast(device, bf16):
                _, logits = model(rows.masked_fill(hide, MASK), predict=read)  # (n, V)
            z, targets = logits.float(), rows.gather(1, p)
        z_target = z.gather(1, targets)                                # (n, 1)
        lp = [z_target[:, 0] / t - (z / t).logsumexp(-1) for t in temps]  # log softmax(z/t)[target]
        out[c] = torch.stack(lp, 1).double().cpu().numpy()
    return sent, pos, out


def pll(model, seqs, temps, scorer, batch_tokens, device, starts, progress=True,
        bf16=False) -> np.ndarray:
    """(len(seqs), len(temps)) log-likelihoods by `scorer` (SCORERS): the sums of token_logprobs
    per sentence."""
    sent, _, lp = token_logprobs(model, seqs, temps, scorer, batch_tokens, device, starts,
                                 progress, bf16)
    scores = np.zeros((len(seqs), len(temps)))
    np.add.at(scores, sent, lp)
    return scores


def half_of(pair_id: str) -> int:
    """0 = the half that chooses the temperature, 1 = the half it is reported on. A fixed hash of
    the pair id: the same on every machine and for every model, independent of file order."""
    return zlib.crc32(pair_id.encode()) % 2


def macro(correct, uids) -> np.ndarray:
    """Mean over paradigms of the per-paradigm accuracy; correct (P, ...) -> (...)."""
    uids = np.asarray(uids)
    return np.mean([correct[uids == u].mean(0) for u in np.unique(uids)], axis=0)


def choose_temperature(correct, uids, halves, temps) -> int:
    """Index of the temperature with the best macro accuracy on half 0 (ties: nearest to T=1).
    Rows of half 1 are never read."""
    sel = np.asarray(halves) == 0
    if not sel.any():  # too few pairs for a selection half: no choice to make, T = 1
        return min(range(len(temps)), key=lambda t: abs(math.log(temps[t])))
    acc = macro(correct[sel], np.asarray(uids)[sel])
    return max(range(len(temps)),
               key=lambda t: (round(float(acc[t]), 12), -abs(math.log(temps[t]))))


CHUNK_PAIRS = 2000  # BLiMP is scored, shown and kept in chunks of whole paradigms this large


def chunks(pairs, size: int) -> list[np.ndarray]:
    """Pair indices in runs of consecutive whole paradigms of at least `size` pairs (the last
    may hold fewer): large enough to batch well, small enough that an interrupted evaluation
    loses little (the full BLiMP's 67,000 pairs make 34 chunks)."""
    out, run = [], []
    for i, p in enumerate(pairs):
        if run and len(run) >= size and (p["group"], p["uid"]) != (pairs[i - 1]["group"],
                                                                   pairs[i - 1]["uid"]):
            out.append(np.array(run))
            run = []
        run.append(i)
    return out + [np.array(run)] if run else out


def own_scorers(model) -> tuple[str, ...]:
    """The scorers that read a model where its objective trained it to predict, its own first:
    mntp for a model that predicts a hidden token from the position before it (gpt-bert), and
    causal too if its run trained causal rows; pll and word-l2r for every other."""
    if model.predicts_before:
        causal = model.train_args.get("causal_fraction", 0) > 0
        return ("mntp", "causal") if causal else ("mntp",)
    return ("pll", "word-l2r")


def blimp(args):
    device = pick_device(args.device)
    model, tok = load_checkpoint(args.ckpt, device)
    # a model read by a rule it was never trained for scores a number with no meaning, which
    # would sit beside the real results: refused unless asked for (--any-scorer)
    own = own_scorers(model)
    args.scorer = args.scorer or own[0]
    if args.scorer not in own and not args.any_scorer:
        name = model.train_args.get("objective")
        args.error(f"--scorer {args.scorer}: {f'a {name} model' if name else 'this model'} is "
                   f"read by {' or '.join(own)} (--any-scorer scores it by {args.scorer} anyway)")
    if args.scorer == "causal" and not isinstance(model, Encoder):
        raise SystemExit(f"error: --scorer causal needs an encoder; {args.ckpt} predicts through "
                         f"a decoder")
    pairs = read_blimp(args.blimp_dir)
    temps = sorted({1.0, *args.temperatures})
    t1 = temps.index(1.0)
    sentences = [p["good"] for p in pairs] + [p["bad"] for p in pairs]
    seqs = [[CLS] + s + [SEP] for s in tok.encode(sentences)]
    if max(map(len, seqs)) > model.config.max_position:
        raise SystemExit(f"error: a sentence has {max(map(len, seqs))} tokens, more than the "
                         f"model's {model.config.max_position}")
    batch_tokens = args.batch_tokens or BATCH_TOKENS[device.type]
    # blimp.json holds the model's own scorer (gpt-bert: mntp, the others: pll); another
    # scorer writes blimp_SCORER.json beside it
    suffix = "" if args.scorer == own[0] else "_" + args.scorer.replace("word-", "")
    out = result_path(args.out, args.ckpt, f"blimp{suffix}")
    # scores kept chunk by chunk as they are made, so that an interrupted run goes on from there;
    # the fingerprint: what they depend on (a checkpoint's size and time stand for its weights)
    partial = out.with_name(out.name + ".partial")
    # one scorer per result: a second would write the same partial file and result
    lock = hold_lock(out.with_name(out.name + ".lock"), out,  # noqa: F841 (held)
                     "wait for that evaluate.py blimp to end, or give another --out")
    fingerprint = {**checkpoint_identity(args.ckpt), "scorer": args.scorer, "temperatures": temps,
                   "dirs": [str(d) for d in args.blimp_dir], "pairs": len(pairs),
                   "batch_tokens": batch_tokens, "device": str(device), "chunk_pairs": CHUNK_PAIRS,
                   "bf16": args.bf16}
    done = read_partial(partial, fingerprint, "chunk", "scores")
    parts, starts = chunks(pairs, CHUNK_PAIRS), word_starts(tok)
    if done:
        print(f"resuming: {len(done)} of {len(parts)} chunks already scored in {partial}")
    write_lines(partial, [fingerprint, *({"chunk": i, "scores": s} for i, s in done.items())])
    scores = np.zeros((len(seqs), len(temps)))
    t0, scored = time.time(), 0
    for i, idx in enumerate(parts):
        rows = np.concatenate([idx, idx + len(pairs)])  # the good sentences, then the bad
        if i in done:
            scores[rows] = done[i]
            continue
        s = pll(model, [seqs[r] for r in rows], temps, args.scorer, batch_tokens, device, starts,
                bf16=args.bf16)
        with one_line_os_errors(partial), open(partial, "a") as f:
            f.write(json.dumps({"chunk": i, "scores": s.tolist()}) + "\n")
        scores[rows], scored = s, scored + len(rows)
        rate = scored / (time.time() - t0)
        left = 2 * sum(len(c) for j, c in enumerate(parts) if j > i and j not in done)
        print(f"blimp: {i + 1}/{len(parts)} chunks, {idx[-1] + 1:,}/{len(pairs):,} pairs, up to "
              f"{pairs[idx[-1]]['uid']} | {rate:.0f} sentences/s | eta {duration(left / rate)}",
              flush=True)
    seconds = time.time() - t0
    good, bad = scores[:len(pairs)], scores[len(pairs):]
    correct = good > bad                                             # (P, T); ties are wrong
    uids = [p["uid"] for p in pairs]
    halves = np.array([half_of(p["item"]) for p in pairs])
    best = choose_temperature(correct, uids, halves, temps)
    report = halves == 1

    groups = np.array([p["group"] for p in pairs])
    # nan where no pair is in that half
    acc = lambda m, t: float(correct[m, t].mean()) if m.any() else float("nan")

    # {group: {paradigm: [acc T=1, acc T=1 and T* on the report half, pairs]}}
    uid_of = np.array(uids)
    paradigms = {}
    for g, u in sorted(set(zip(groups, uid_of))):
        m = (groups == g) & (uid_of == u)
        row = [acc(m, t1), acc(m & report, t1), acc(m & report, best), int(m.sum())]
        paradigms.setdefault(str(g), {})[str(u)] = row
    # a phenomenon's accuracy is the mean of its paradigms' (BLiMP's Table 4), not of its pairs
    phenomena = {}
    for g, u, ph in sorted({(p["group"], p["uid"], p["phenomenon"]) for p in pairs}):
        phenomena.setdefault(g, {}).setdefault(ph, []).append(paradigms[g][u])
    phenomena = {g: {ph: [*np.nanmean([r[:3] for r in rows], 0).tolist(),
                          sum(r[3] for r in rows)] for ph, rows in tab.items()}
                 for g, tab in phenomena.items()}
    # the BabyLM pipeline's average: over paradigms, T=1, a tie counted right (torch.max)
    won_or_tied = good[:, t1] >= bad[:, t1]
    summary = {g: {"macro_paradigms": np.mean([r[:3] for r in rows.values()], 0).tolist(),
                   "macro_phenomena": np.mean([r[:3] for r in phenomena[g].values()], 0).tolist(),
                   "pipeline_average": float(np.mean([won_or_tied[(groups == g) & (uid_of == u)]
                                                      .mean() for u in rows]))}
               for g, rows in paradigms.items()}
    name_width = max(len(k) for k in [*(k for t in (paradigms, phenomena)
                                         for rows in t.values() for k in rows),
                                       *(f"{g}: over phenomena" for g in summary)])
    best_head = f"half T={temps[best]:g}*"
    best_width = max(9, len(best_head))
    line = lambda name, r: (f"  {name:<{name_width}} {100 * r[0]:8.1f} {100 * r[1]:9.1f} "
                            f"{100 * r[2]:{best_width}.1f}" + (f" {r[3]:6d}" if len(r) > 3 else ""))
    head = f"  {'':<{name_width}} {'all T=1':>8} {'half T=1':>9} {best_head:>{best_width}}"
    # the headline first: each folder's means over paradigms and over phenomena
    print(f"\nBLiMP accuracy %: all pairs at T=1; the reporting half of the pairs at T=1, and at "
          f"T={temps[best]:g} (*: chosen on the other half)\n{head}")
    for g, s in summary.items():
        print(line(f"{g}: over paradigms", s["macro_paradigms"]))
        print(line(f"{g}: over phenomena", s["macro_phenomena"]))
    ties = int((good[:, t1] == bad[:, t1]).sum())
    print(f"ties: {ties} of {len(pairs):,} pairs score both sentences the same at T=1, counted "
          f"wrong here (the BabyLM pipeline picks with torch.max: a tie counts as right)")
    print("to quote (over paradigms, all pairs, T=1): " + ", ".join(
        f"{g} {100 * s['macro_paradigms'][0]:.2f}" for g, s in summary.items())
        + "; the BabyLM pipeline's average, ties counted right: " + ", ".join(
        f"{g} {100 * s['pipeline_average']:.2f}" for g, s in summary.items()))
    for name, tab in (("paradigm", paradigms), ("phenomenon", phenomena)):
        for g, rows in tab.items():
            if name == "phenomenon" and rows.keys() == paradigms[g].keys():
                continue  # one paradigm per phenomenon (the supplement): the table above again
            what = "accuracy %" if name == "paradigm" else "mean of its paradigms' accuracies %"
            print(f"\n{g}, per {name} ({what})\n{head}  pairs")
            for k, r in rows.items():
                print(line(k, r))
    print(f"\n{scored} sentences scored in {seconds:.1f}s: {scored / seconds:.0f} sentences/s "
          f"on {device}" + (f" ({len(seqs) - scored} kept from {partial})" if done else ""))

    result = {
        "kind": "blimp", "ckpt": str(args.ckpt), "step": model.trained_steps,
        "pretrain_seed": model.train_args.get("seed"),
        "scorer": args.scorer, "bf16": args.bf16, "dirs": [str(d) for d in args.blimp_dir],
        "temperatures": temps,
        "best_temperature": temps[best], "sentences_per_s": scored / seconds, "ties": ties,
        "summary": summary, "paradigms": paradigms, "phenomena": phenomena,
        "pairs": [{"id": p["id"], "uid": p["uid"], "group": p["group"],
                   "phenomenon": p["phenomenon"], "half": int(h), "good": g.tolist(),
                   "bad": b.tolist()} for p, h, g, b in zip(pairs, halves, good, bad)],
        # for `compare`: one row per pair, label 1 = "good wins", prediction = did it win
        "examples": {"id": [p["id"] for p in pairs], "label": [1] * len(pairs),
                     "pred": [correct[:, t1].astype(int).tolist()],
                     "metric": "accuracy", "k": 2, "name": "BLiMP accuracy, all pairs, T=1"},
        "examples_best_t": {"id": [p["id"] for p, r in zip(pairs, report) if r],
                            "label": [1] * int(report.sum()),
                            "pred": [correct[report, best].astype(int).tolist()],
                            "metric": "accuracy", "k": 2,
                            "name": "BLiMP accuracy, reporting half, chosen T"},
    }
    print(f"wrote {write_result(result, out, args.ckpt, 'blimp')}")
    partial.unlink()  # (the lock file stays, as a run folder's: it is taken over next time)


# ---------------------------------------------------------------------------------------------
# Masked-token loss and accuracy on held-out text: a diagnostic, under more than one masking,
# beside what counting alone achieves

# How `mlm` hides tokens (HELD_OUT_MASKINGS), every hidden one by [MASK]: `uniform`, int(p T)
# isolated tokens per segment; `span`, LTG-BERT's spans of mean length 3, where a hidden token's
# neighbours are often hidden too. One masking alone favours the arms that trained on it, and a
# model that reads its prediction at t - 1 (gpt-bert) sees the real previous token under
# `uniform` far more often than under `span` (docs/evaluation.md): hence two, each named beside
# its figures.


class CountFloors:
    """What counts of the training split alone score on a hidden token: the unigram (add-one)
    and an interpolated bigram, Witten-Bell (1991): p(w | v) = (c(v w) + N(v) p1(w)) / (c(v) +
    N(v)), with N(v) the distinct pieces seen after v, so nothing is tuned on the text it
    scores. The bigram reads the previous piece only where the model's input shows it (a real
    piece: not [MASK], not [CLS]); elsewhere it is the unigram. A model above the bigram has
    learnt less than a counter."""

    def __init__(self, stream: np.ndarray, vocab: int):
        s = stream.astype(np.int64)
        counts = np.bincount(s, minlength=vocab) + 1.0
        self.p1, self.vocab = counts / counts.sum(), vocab                   # (V,)
        self.pairs, self.pair_counts = np.unique(s[:-1] * vocab + s[1:], return_counts=True)
        self.seen = np.bincount(s[:-1], minlength=vocab).astype(np.float64)  # c(v)
        self.after = np.bincount(self.pairs // vocab, minlength=vocab).astype(np.float64)  # N(v)

    def unigram(self, target: np.ndarray) -> np.ndarray:
        return -np.log(self.p1[target])

    def bigram(self, prev: np.ndarray, target: np.ndarray) -> np.ndarray:
        """Negative log-probabilities of `target` after `prev` (-1 where none is shown)."""
        v = np.maximum(prev, 0)
        code = v * self.vocab + target
        at = np.searchsorted(self.pairs, code).clip(max=len(self.pairs) - 1)
        c = np.where(self.pairs[at] == code, self.pair_counts[at], 0)
        p1, n, seen = self.p1[target], self.after[v], self.seen[v]
        p2 = (c + n * p1) / np.maximum(seen + n, 1)
        return -np.log(np.where((prev >= 0) & (seen > 0), p2, p1))


def hide(ids, masking: str, p: float, vocab: int, gen):
    """ids (b, T) -> (inputs, labels) under a held-out masking, every hidden token [MASK]."""
    if masking == "uniform":
        return uniform_mask(ids, p, gen)
    _, labels = span_mask(ids, p, vocab, gen)
    return torch.where(labels != -100, MASK, ids), labels


@torch.no_grad()
def masked_lm(args):
    """Cross-entropy and accuracy of the hidden tokens of the first --segments validation
    segments of the corpus the checkpoint trained on, under each of --maskings, hidden by the
    same fixed draw for every model (`uniform` draws what this command drew before it had two).
    Scored through load_checkpoint's path, so a boot model predicts through its decoder, and
    read where the model predicts (read_at: a gpt-bert model at the position before). Beside
    each, the unigram and bigram counts of the training split on the same tokens (CountFloors),
    and the share of hidden tokens whose previous piece the input shows, with the loss there
    and elsewhere. One example per segment (its mean over its hidden tokens), so `compare`
    resamples segments: sections loss_MASKING and acc_MASKING. A segment in which a masking
    hides nothing (span, rarely) is left out, the same ones for every model."""
    device = pick_device(args.device)
    model, tok = load_checkpoint(args.ckpt, device)
    if args.seq_len and args.seq_len > model.config.max_position:
        args.error(f"--seq-len {args.seq_len}: the model reads at most "
                   f"{model.config.max_position} positions")
    data, vocab = args.data or model.train_args.get("data"), model.config.vocab_size
    if data is None:
        raise SystemExit(f"error: {args.ckpt} does not say what it trained on; pass --data")
    seq_len = args.seq_len or model.train_args.get("seq_len", 128)
    if int(args.mask_p * seq_len) < 1:
        args.error(f"--mask-p {args.mask_p} of {seq_len} tokens hides none; raise --mask-p or "
                   f"--seq-len")
    folder = prepare(data, vocab, quiet=True)
    check_tokenizer(folder, tok.serialized_model_proto(), args.ckpt)
    val = Segments(folder / "val.bin", seq_len - 2, 0, shuffle=False)
    floors = CountFloors(np.fromfile(folder / "train.bin", dtype=np.uint16), vocab)
    n = min(args.segments, val.n)
    read = "t - 1" if model.predicts_before else "t"
    result = {"kind": "mlm", "ckpt": str(args.ckpt), "step": model.trained_steps,
              "pretrain_seed": model.train_args.get("seed"), "data": str(data), "segments": n,
              "seq_len": seq_len, "mask_p": args.mask_p, "bf16": args.bf16, "read_at": read,
              "maskings": {}}
    for masking in args.maskings:
        got = {k: [] for k in ("segment", "nll", "hit", "shown", "unigram", "bigram")}
        for i in bar(range(0, n, args.batch_size), desc=f"mlm {masking}", unit="batch",
                     disable=None):
            ids = val.batch(i, min(args.batch_size, n - i)).to(device)     # (b, T)
            # each masking's draw is its own, whichever others are asked for; the uniform one
            # is the draw this command made before it had two
            seed = (seed_of(args.seed, i) if masking == "uniform" else
                    seed_of(args.seed, i, HELD_OUT_MASKINGS.index(masking)))
            gen = torch.Generator(device).manual_seed(seed)
            inputs, labels = hide(ids, masking, args.mask_p, vocab, gen)
            hidden = labels != -100                                        # (b, T)
            with autocast(device, args.bf16):  # float32 unless --bf16, as blimp: a score
                _, logits = model(inputs, predict=read_at(model, hidden))  # (hidden, V)
            target = labels[hidden]                                        # row-major, as logits
            row, col = hidden.nonzero(as_tuple=True)
            prev = inputs[row, col - 1]
            prev = torch.where(prev >= len(SPECIALS), prev, -1).cpu().numpy()
            got["segment"].append(i + row.cpu().numpy())
            got["nll"].append(F.cross_entropy(logits.float(), target, reduction="none").cpu()
                              .numpy())
            got["hit"].append((logits.argmax(-1) == target).float().cpu().numpy())
            got["shown"].append(prev >= 0)
            target = target.cpu().numpy()
            got["unigram"].append(floors.unigram(target))
            got["bigram"].append(floors.bigram(prev, target))
        got = {k: np.concatenate(v) for k, v in got.items()}
        count = np.bincount(got["segment"], minlength=n)
        kept = np.flatnonzero(count)                                       # segments with any
        per_segment = lambda x: (np.bincount(got["segment"], x, minlength=n) / np.maximum(
            count, 1))[kept]
        loss, acc = per_segment(got["nll"]), per_segment(got["hit"])
        shown = got["shown"]
        summary = {
            "hidden": int(len(shown)), "segments": int(len(kept)), "loss": float(loss.mean()),
            "accuracy": float(acc.mean()),
            "floors": {f: float(per_segment(got[f]).mean()) for f in ("unigram", "bigram")},
            # token means where the input shows the previous piece, and where it does not
            "previous_shown": float(shown.mean()),
            "loss_previous_shown": float(got["nll"][shown].mean()) if shown.any() else None,
            "loss_previous_hidden": float(got["nll"][~shown].mean()) if (~shown).any() else None,
            "bigram_previous_shown": float(got["bigram"][shown].mean()) if shown.any() else None}
        result["maskings"][masking] = summary
        ids = [f"val/{k}" for k in kept]
        for key, values, better, name in ((f"loss_{masking}", loss, "lower", "loss"),
                                          (f"acc_{masking}", acc, "higher", "accuracy")):
            result[key] = {"id": ids, "label": [0] * len(ids), "pred": [values.tolist()],
                           "metric": "mean", "k": 0, "better": better,
                           "name": f"masked-token {name}, {masking} masking"}
    print(f"{data}: {n} validation segments of {seq_len} tokens, {args.mask_p:g} of each hidden "
          f"by [MASK]; each hidden token t read from the model at {read}. Loss in nats (mean over "
          f"segments); unigram and bigram: counts of the training split on the same tokens; "
          f"prev. shown: the hidden tokens whose previous piece the input shows, with the token "
          f"mean loss there and elsewhere")
    none = lambda x: "-" if x is None else f"{x:.4f}"
    print(f"{'masking':<8} {'hidden':>7} {'loss':>7} {'acc':>7} {'unigram':>8} {'bigram':>7}  "
          f"{'prev. shown':>11} {'loss there':>10} {'bigram there':>12} {'loss elsewhere':>14}")
    for masking, s in result["maskings"].items():
        print(f"{masking:<8} {s['hidden']:>7,} {s['loss']:>7.4f} {100 * s['accuracy']:>6.2f}% "
              f"{s['floors']['unigram']:>8.4f} {s['floors']['bigram']:>7.4f}  "
              f"{100 * s['previous_shown']:>10.1f}% {none(s['loss_previous_shown']):>10} "
              f"{none(s['bigram_previous_shown']):>12} {none(s['loss_previous_hidden']):>14}")
    print(f"wrote {write_result(result, args.out, args.ckpt, 'mlm')}")


# ---------------------------------------------------------------------------------------------
# weights: where a model's parameters went (Castagné 2023: synthetic-language models transfer
# worse because their weights stay near initialisation)

def weight_stats(model) -> list[dict]:
    """Per module (the parameters grouped by name up to the layer: word, layers.0.attn, ...):
    parameter count, mean, std and max |w| over its tensors together."""
    groups = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        key = ".".join(parts[:3] if parts[0] == "layers" else parts[:1])
        groups.setdefault(key, []).append(p.detach().float().flatten())
    rows = []
    for key, ts in groups.items():
        w = torch.cat(ts)
        std = w.std().item() if w.numel() > 1 else 0.0
        rows.append(dict(module=key, params=w.numel(), mean=w.mean().item(), std=std,
                         max_abs=w.abs().max().item()))
    return rows


def weights(args):
    model, _ = load_checkpoint(args.ckpt, "cpu", encoder_only=True)
    rows = weight_stats(model)
    print(f"{'module':<22} {'params':>9} {'mean':>10} {'std':>9} {'max |w|':>9}")
    for r in rows:
        print(f"{r['module']:<22} {r['params']:9d} {r['mean']:10.5f} {r['std']:9.5f} "
              f"{r['max_abs']:9.4f}")
    write_result({"ckpt": str(args.ckpt), "modules": rows}, args.out, args.ckpt, "weights", 1)


# ---------------------------------------------------------------------------------------------
# fill: what the model puts in a [MASK]

@torch.no_grad()
def fill(args):
    """Each [MASK] of a sentence you type, and the model's top-k pieces for it with their
    probabilities: every [MASK] is hidden at once and each gets its own distribution (not a
    joint guess). The text between masks is tokenized as running text (data.prepare's
    encode_masked), so a piece that starts a word carries "▁" (shown as a leading space)."""
    device = pick_device(args.device)
    model, tok = load_checkpoint(args.ckpt, device)
    sentences = [encode_masked(tok, text) for text in args.text]  # all checked, then scored
    for text, ids in zip(args.text, sentences):
        if MASK not in ids:
            raise SystemExit(f"error: {text[:80]!r} has no [MASK] to fill")
        if len(ids) > model.config.max_position:
            raise SystemExit(f"error: {text[:40]!r}... is {len(ids)} tokens; the model reads at "
                             f"most {model.config.max_position}")
    for ids in sentences:
        x = torch.tensor([ids], device=device)                                 # (1, T)
        _, logits = model(x, predict=read_at(model, x == MASK))               # (masks, V)
        top = logits.float().softmax(-1).topk(min(args.top_k, logits.shape[-1]), -1)
        best = iter(top.indices[:, 0].tolist())
        print(tok.decode([next(best) if t == MASK else t for t in ids[1:-1]]))  # the top guesses
        piece = lambda i: tok.id_to_piece(i).replace("\u2581", " ")
        for m, (p, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            print(f"  [MASK] {m}: " + "  ".join(f"{piece(t)!r} {100 * q:.1f}%"
                                                for q, t in zip(p, i)))


# ---------------------------------------------------------------------------------------------
# Command line

def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="evaluate.py", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    def maskings(text: str) -> list[str]:
        names = text.split(",")
        if not names or any(m not in HELD_OUT_MASKINGS for m in names) or len(set(names)) < len(
                names):
            raise argparse.ArgumentTypeError(f"{text}: give distinct names among "
                                             f"{', '.join(HELD_OUT_MASKINGS)}")
        return names
    common = lambda p, out: (
        p.add_argument("--ckpt", required=True,
                       help="checkpoint written by train.py, or its run folder (its ckpt.pt)"),
        p.add_argument("--out", default=None, help=f"result JSON (default RUN/eval/{out}.json)"))
    device = lambda p: add_device_flag(p.add_argument)

    f = sub.add_parser("fill", help="the model's top guesses for each [MASK] in a sentence")
    f.add_argument("--ckpt", required=True,
                   help="checkpoint written by train.py, or its run folder (its ckpt.pt)")
    f.add_argument("text", nargs="+", help='sentences with [MASK] in them, each quoted: '
                   '"the cat sat on the [MASK] ."')
    f.add_argument("--top-k", type=at_least(int, 1), default=5,
        help="guesses shown per [MASK]")
    device(f)
    f.set_defaults(func=fill)

    b = sub.add_parser("blimp", help="zero-shot BLiMP by pseudo-log-likelihood")
    common(b, "blimp")
    add = b.add_argument
    add("--blimp-dir", required=True, nargs="+",
        help="folder(s) of BLiMP-style *.jsonl, one paradigm per file")
    add("--scorer", default=None, choices=SCORERS,
        help="pll (Salazar et al.), word-l2r (Kauf & Ivanova), mntp or causal (the BabyLM 2025 "
        "pipeline's backends for GPT-BERT); default: mntp for a gpt-bert model, else pll; "
        "a scorer other than the model's own writes blimp_SCORER.json. A scorer that reads the "
        "model where it was not trained to predict is refused (--any-scorer)")
    add("--any-scorer", action="store_true",
        help="score by --scorer even where the model was not trained to predict as it reads "
        "(pll or word-l2r on gpt-bert, mntp or causal on the others)")
    add("--temperatures", type=numbers(above(float, 0)),
        default=[0.5, 0.75, 1.0, 1.5, 2.0, 3.0],
        help="comma-separated grid; 1 is always added (default 0.5,0.75,1,1.5,2,3)")
    add("--bf16", action="store_true", help="score under bfloat16 autocast (faster on a GPU; "
        "near-ties then differ between GPU kinds). Default: float32")
    add("--batch-tokens", type=at_least(int, 1), default=None,
        help="tokens per scoring batch (default 4096 on CPU, the fastest of 2k/4k/16k measured; "
        "32768 on CUDA)")
    device(b)
    b.set_defaults(func=blimp)

    m = sub.add_parser("mlm", help="masked-token loss and accuracy on the validation split "
                       "under each masking (the same hidden tokens for every model), beside "
                       "unigram and bigram counts")
    common(m, "mlm")
    add = m.add_argument
    add("--data", default=None, help="corpus (default: the one the checkpoint trained on)")
    add("--segments", type=at_least(int, 1), default=1024,
        help="validation segments scored, from the first")
    add("--seq-len", type=at_least(int, 3), default=None,
        help="segment length (default: the checkpoint's)")
    add("--maskings", type=maskings, default=list(HELD_OUT_MASKINGS),
        help="comma-separated: uniform (isolated tokens, int(p T) a segment), span (LTG-BERT's "
        "spans of mean 3); every hidden token [MASK] (default uniform,span)")
    add("--mask-p", type=Range(float, 0, 1, low_open=True, high_open=True), default=0.15,
        help="fraction of each segment hidden")
    add("--bf16", action="store_true", help="score under bfloat16 autocast (faster on a GPU). "
        "Default: float32")
    add("--batch-size", type=at_least(int, 1), default=64, help="segments per batch")
    add("--seed", type=at_least(int, 0), default=0,
        help="seed of the hidden positions (default 0)")
    device(m)
    m.set_defaults(func=masked_lm)

    f = sub.add_parser("finetune",
                       help="fine-tune on a (Super)GLUE or MSGS task and score its validation set")
    common(f, "TASK")
    add = f.add_argument
    add("--task", required=True,
        help=f"{', '.join(TASKS)}, or any name with MSGS-style files (sentence, label; MCC)")
    add("--data-dir", required=True, help="folder with TASK.train.jsonl and TASK.valid.jsonl")
    add("--seeds", type=numbers(at_least(int, 0)), default=[1],
        help="comma-separated fine-tuning seeds; mean ± std over them (default 1)")
    add("--recipe", default="nanomlm", choices=list(RECIPES),
        help="defaults for the flags below: nanomlm (ours: lr 5e-5, batch 32, 10 epochs, "
        "patience 3, 128 tokens, length-grouped, clipped, linear decay) or babylm2025 (the BabyLM "
        "2025 pipeline's: lr 3e-5, batch 32 (16 for boolq, multirc), 10 epochs (30 for wsc), no "
        "early stopping, 512 tokens, cosine to 0.1 after 6%% warm-up, no clipping, its head) "
        "(default nanomlm)")
    add("--lr", type=at_least(float, 0), default=None,
        help="AdamW learning rate (default: the recipe's)")
    add("--weight-decay", type=at_least(float, 0), default=0.01,
        help="AdamW weight decay")
    add("--batch-size", type=at_least(int, 1), default=None,
        help="examples per batch (default: the recipe's)")
    add("--epochs", type=at_least(int, 1), default=None,
        help="at most this many epochs (default: the recipe's)")
    add("--patience", type=at_least(int, 0), default=None,
        help="stop after this many epochs without a better validation score (default: the "
        "recipe's; babylm2025 has none)")
    add("--holdout", type=Range(float, 0, 1, high_open=True), default=0.0,
        help="choose the epoch on this fraction of the training set instead of on the validation "
        "set it reports (default 0: as the BabyLM pipeline)")
    add("--group-by-length", action=argparse.BooleanOptionalAction, default=None,
        help="training batches of similar lengths, so less of each is padding (default: on for "
        "nanomlm; --no-group-by-length: plain shuffled batches)")
    add("--max-len", type=at_least(int, 3), default=None,
        help="tokens per example, longer pairs truncated longest-first (default: the recipe's, "
        "128 or 512)")
    device(f)
    f.set_defaults(func=finetune)

    c = sub.add_parser("compare",
                       help="Multi-Bootstrap of two procedures over pretraining seeds and examples")
    add = c.add_argument
    add("results", nargs="+", help="two groups of result JSONs: two folders or quoted globs, "
        "e.g. 'A/*.json' 'B/*.json'")
    add("--nboot", type=at_least(int, 1), default=1000, help="bootstrap resamples")
    add("--seed", type=at_least(int, 0), default=0, help="seed of the resampling")
    add("--examples", default="examples", help="which per-example section to use; BLiMP also "
        "has examples_best_t")
    add("--out", default=None, help="also write the result to this JSON")
    c.set_defaults(func=compare)

    w = sub.add_parser("weights", help="per-module parameter mean / std / max |w| of a checkpoint")
    common(w, "weights")
    w.set_defaults(func=weights)
    # a flag wrong for the checkpoint it points at, found once that is read: one line, exit 2,
    # as the subcommand's parser says a bad flag (args.error)
    for p in sub.choices.values():
        p.set_defaults(error=p.error)
    return ap


def main(argv=None):
    line_buffered()
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "ckpt", None) and (Path(args.ckpt) / "ckpt.pt").is_file():
        args.ckpt = str(Path(args.ckpt) / "ckpt.pt")  # a run folder: its checkpoint
    if getattr(args, "out", None):
        file_to_write(args.out, args.error, "the result file's path")
    kept = {"blimp": "the chunks scored so far are kept: the same command goes on from them",
            "finetune": "the seeds fine-tuned so far are kept: the same command goes on from "
            "them"}.get(args.command, "run the same command again")
    with exit_on_stop_signals(f"`evaluate.py {args.command}`; {kept}"):  # one line, at once
        args.func(args)


if __name__ == "__main__":
    main()
