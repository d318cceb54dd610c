"""Artificial languages sampled from a PCFG learned on dependency treebanks, relexicalised into
a vocabulary of made-up words (Castagné 2023, "Artificial Pretraining of Masked Language
Models"; word distributions after Ri & Tsuruoka 2022, "Pretraining with Artificial Language").

    python synth.py --relex zipf --sentences 1000000 --out data/raw/synth_zipf
    python synth.py --relex loglinear --sentences 1000000 --out data/raw/synth_loglinear

The output folder reads like any corpus (`train.py --data data/raw/synth_zipf`); its
tokenizer.json asks data/prepare.py for a word-level vocabulary, one token per made-up word, and
for [SEP] after every sentence in the token stream (--no-separate-sentences: none).

The transfer study (train.py --init-from CKPT --reset embeddings[,positions], --freeze
embeddings; data/breton.py; evaluate.py weights) is described, with commands and results, in
docs/studies/breton_transfer.md.

The grammar. Every node of a dependency tree is a nonterminal named by its relation to its head
(the root's is `root`); it expands into its dependents' relations in sentence order, with `*`
where the node's own word stands:  obj -> det amod * nmod  says an object is a determiner, an
adjective, the object's word, a nominal modifier. Rule probabilities are counted (maximum
likelihood). Relation subtypes are folded into their universal relation (`obl:mod` -> `obl`),
the `--n-rels` most frequent relations are kept, and the rest either become one extra
nonterminal, `other`, keeping their positions and subtrees (--rare other, the default), or are
deleted with their subtrees (--rare drop: most likely the blog's rule, whose corpus has about 15
tokens a sentence). Multiword-token ranges (`1-2`) and empty nodes (`1.1`) are not tree nodes and
are skipped.

The sampler expands every nonterminal of a whole batch of sentences at once with numpy, one
tree level per pass: no Python work per token. At --max-depth, nonterminals are rewritten as
their own word; sentences longer than --max-len are dropped and drawn again.
"""
import argparse
import json
import math
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from data.prepare import raw_root
from machinery.plumbing import Parser, at_least, folder_to_write, one_line_os_errors


TREEBANKS = ["UD_French-GSD", "UD_French-Sequoia", "UD_French-ParTUT"]
OTHER = "other"


# ---------------------------------------------------------------------------------------------
# CoNLL-U

def read_conllu(path) -> list[list[dict]]:
    """Sentences of a CoNLL-U file, each a list of words {id, form, lemma, upos, head, deprel}
    with integer ids 1..n. Comment lines, multiword-token ranges (`3-4`) and empty nodes (`5.1`)
    are skipped; a malformed line is an error naming the file and line."""
    sentences, words = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                if words:
                    sentences.append(words)
                words = []
                continue
            if line.startswith("#"):
                continue
            cols = line.split("\t")
            if len(cols) != 10:
                raise SystemExit(f"error: {path}:{n}: a CoNLL-U word line has 10 tab-separated "
                                 f"columns, this one {len(cols)}")
            if "-" in cols[0] or "." in cols[0]:
                continue
            try:
                words.append(dict(id=int(cols[0]), form=cols[1], lemma=cols[2], upos=cols[3],
                                  head=int(cols[6]), deprel=cols[7]))
            except ValueError:
                raise SystemExit(f"error: {path}:{n}: ID and HEAD must be integers") from None
    if words:
        sentences.append(words)
    return sentences


def treebank_files(root, names=TREEBANKS) -> list[Path]:
    files = sorted(f for name in names for f in (Path(root) / name).glob("*.conllu"))
    if not files:
        raise SystemExit(f"error: no .conllu file of {', '.join(names)} under {root}")
    return files


# ---------------------------------------------------------------------------------------------
# The grammar

def relation(deprel: str) -> str:
    return deprel.split(":")[0]


def grammar(sentences, n_rels: int = 20, rare: str = "other"):
    """-> dict(symbols, rules, lemmas, lengths): symbols = the kept relations by frequency (+
    `other` if anything was folded into it); rules[lhs] = {rhs tuple: probability} where rhs
    lists dependents' relations and "*" for the head's word; lemmas[rel] = distinct lemmas seen
    with that relation; lengths = the sentence lengths of the trees the rules were read from.
    rare: what becomes of the relations outside the n_rels most frequent: `other`, one
    nonterminal for all of them (their words and subtrees stay), or `drop`, the word and its
    whole subtree removed (most likely the blog's rule: its 1M sentences are ~15M tokens, ours
    with `other` 21.6M words)."""
    counts = Counter(relation(w["deprel"]) for s in sentences for w in s)
    keep = [r for r, _ in counts.most_common(n_rels)]
    if "root" not in keep:
        keep = ["root"] + keep[:-1]
    name = lambda deprel: relation(deprel) if relation(deprel) in keep else OTHER
    rule_counts = defaultdict(Counter)
    lemmas = defaultdict(set)
    lengths = []
    for s in sentences:
        children = defaultdict(list)
        for w in s:
            children[w["head"]].append(w)
        words = s
        if rare == "drop":  # the words reached from the root through kept relations only
            words, todo = [], [c for c in children[0] if name(c["deprel"]) != OTHER]
            while todo:
                words.append(todo.pop())
                todo += [c for c in children[words[-1]["id"]] if name(c["deprel"]) != OTHER]
        here = {w["id"] for w in words}
        for w in words:
            rhs = tuple(name(c["deprel"]) if c is not w else "*"
                        for c in sorted(children[w["id"]] + [w], key=lambda c: c["id"])
                        if c["id"] in here)
            rule_counts[name(w["deprel"])][rhs] += 1
            lemmas[name(w["deprel"])].add(w["lemma"])
        lengths.append(len(words))
    symbols = keep + ([OTHER] if OTHER in rule_counts else [])
    rules = {lhs: {rhs: c / sum(rc.values()) for rhs, c in rc.items()}
             for lhs, rc in rule_counts.items()}
    return dict(symbols=symbols, rules=rules, lemmas={r: len(v) for r, v in lemmas.items()},
                lengths=lengths)


def block_cdf(block, weight) -> np.ndarray:
    """For items in consecutive blocks (block (n,) non-decreasing ints) with weights (n,): block +
    the cumulative share of its block's weight, each block ending at exactly block + 1. The result
    increases, so searchsorted(result, b + u, side="right"), u ~ U[0, 1), draws an item of block b
    in proportion to its weight: one call samples any mix of blocks."""
    ends = np.r_[np.flatnonzero(np.diff(block)), len(block) - 1]
    within = np.concatenate([np.cumsum(w) / w.sum() for w in np.split(weight, ends[:-1] + 1)])
    within[ends] = 1.0
    return block + within


class Sampler:
    """Sentences of relation-labelled words from a grammar, drawn level by level for a batch.

    Symbols are integers: nonterminal r in [0, R), the word of relation r is R + r. The rules of
    all nonterminals sit in flat arrays (their right-hand sides concatenated), and each
    nonterminal's rule is drawn by one searchsorted on the cumulative probabilities shifted by
    the nonterminal's index (block_cdf)."""

    def __init__(self, g, max_depth: int = 30, max_len: int = 100):
        self.symbols = g["symbols"]
        self.R = R = len(self.symbols)
        index = {s: i for i, s in enumerate(self.symbols)}
        lhs, probs, rhs, start = [], [], [], []
        for r, s in enumerate(self.symbols):
            for right, p in sorted(g["rules"].get(s, {("*",): 1.0}).items()):
                lhs.append(r)
                probs.append(p)
                start.append(len(rhs))
                rhs.extend(R + r if x == "*" else index[x] for x in right)
        self.key = block_cdf(np.array(lhs), np.array(probs))
        self.rhs, self.start = np.array(rhs), np.array(start)
        self.length = np.diff(np.r_[self.start, len(rhs)])
        self.root = index["root"]
        self.max_depth, self.max_len = max_depth, max_len

    def batch(self, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
        """(symbols, sentence index) of n sentences, flat, in order; all symbols are words
        (>= R). Sentences over max_len words are left out, so fewer than n may come back."""
        seq = np.full(n, self.root)
        sid = np.arange(n)
        for depth in range(self.max_depth + 1):
            nt = seq < self.R
            if not nt.any():
                break
            if depth == self.max_depth:               # the cap: every nonterminal becomes its word
                seq = np.where(nt, seq + self.R, seq)
                break
            rule = np.searchsorted(self.key, seq[nt] + rng.random(nt.sum()), side="right")
            rule = np.minimum(rule, len(self.key) - 1)
            grow = np.ones(len(seq), np.int64)
            grow[nt] = self.length[rule]
            first = np.repeat(np.cumsum(grow) - grow, grow)          # where each source starts
            offset = np.arange(grow.sum()) - first
            src = np.repeat(np.arange(len(seq)), grow)
            rule_of = np.zeros(len(seq), np.int64)
            rule_of[nt] = rule
            expanded = self.rhs[np.minimum(self.start[rule_of[src]] + offset, len(self.rhs) - 1)]
            seq, sid = np.where(nt[src], expanded, seq[src]), sid[src]
            too_long = np.bincount(sid, minlength=n) > self.max_len        # drop them early
            if too_long.any():
                keep = ~too_long[sid]
                seq, sid = seq[keep], sid[keep]
        return seq - self.R, sid

    def sample(self, n: int, seed: int, batch: int = 50000) -> tuple[np.ndarray, np.ndarray]:
        """(relations, sentence index 0..n-1) of exactly n sentences, reproducible by seed."""
        rng = np.random.default_rng(seed)
        rels, sids, have = [], [], 0
        while have < n:
            seq, sid = self.batch(min(batch, 2 * (n - have) + 100), rng)
            kept = np.unique(sid)[: n - have]
            mask = np.isin(sid, kept)
            new = np.searchsorted(kept, sid[mask]) + have        # renumbered consecutively
            rels.append(seq[mask])
            sids.append(new)
            have += len(kept)
        return np.concatenate(rels), np.concatenate(sids)


# ---------------------------------------------------------------------------------------------
# Relexicalisation: relation -> made-up word

def token_sets(g, vocab: int) -> np.ndarray:
    """Sizes of each relation's token set, in proportion to the distinct lemmas the treebank has
    for it, at least 1 each, summing to `vocab` (largest remainders)."""
    want = np.array([g["lemmas"].get(s, 1) for s in g["symbols"]], float)
    if vocab < len(want):
        raise SystemExit(f"error: --vocab {vocab} is smaller than the {len(want)} relations")
    share = 1 + want / want.sum() * (vocab - len(want))
    size = np.floor(share).astype(int)
    size[np.argsort(share - size)[::-1][: vocab - size.sum()]] += 1
    return size


def relex_zipf(rels, sizes, rng) -> np.ndarray:
    """Token ids: a word of relation r is the k-th token of r's set (the sets are consecutive id
    ranges) with probability proportional to 1/k, k = 1..size_r (Zipf's law within the set)."""
    weights = np.concatenate([1 / np.arange(1, m + 1) for m in sizes])
    key = block_cdf(np.repeat(np.arange(len(sizes)), sizes), weights)
    return np.searchsorted(key, rels + rng.random(len(rels)), side="right")


def relex_loglinear(rels, sids, sizes, rng, dim: int = 10, chunk: int = 2000) -> np.ndarray:
    """Token ids after Ri & Tsuruoka (2022, sec. 3.1): every token w has a vector v_w ~ N(0, I_dim),
    each sentence a topic v_t ~ N(0, I_dim), and a word of relation r is drawn from r's set with
    p(w | t) proportional to exp(v_w . v_t). Sentences are done `chunk` at a time: for each one
    the cumulative distribution of every set, then one searchsorted for all its words.
    The scale is the paper's: v_w . v_t has variance dim, so a topic favours few words of each
    set (same-sentence PMI 1.4 on the French treebanks); v_w ~ N(0, I/dim) would give unit
    variance and a PMI of 0.59, the earlier studies' corpora (docs/objectives/synthetic.md)."""
    V, R = sizes.sum(), len(sizes)
    block = np.repeat(np.arange(R), sizes)
    vec = rng.standard_normal((V, dim))
    out = np.empty(len(rels), np.int64)
    ends = np.cumsum(sizes) - 1
    bounds = np.searchsorted(sids, np.r_[np.arange(0, sids.max() + 1, chunk), sids.max() + 1])
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if lo == hi:
            continue
        first = sids[lo]
        topics = rng.standard_normal((sids[hi - 1] - first + 1, dim))
        logits = topics @ vec.T                                                # (S, V)
        p = np.exp(logits - logits.max(1, keepdims=True))
        cum = np.cumsum(p, 1)
        total = cum[:, ends]                                  # (S, R): cumulative at each set's end
        before = np.concatenate([np.zeros((len(cum), 1)), total[:, :-1]], 1)
        # (S, V): the cumulative distribution within each set, rising to 1 at its end
        within = (cum - before[:, block]) / (total - before)[:, block]
        within[:, ends] = 1.0
        key = (np.arange(len(cum))[:, None] * R + block[None, :] + within).ravel()
        q = (sids[lo:hi] - first) * R + rels[lo:hi] + rng.random(hi - lo)
        out[lo:hi] = np.searchsorted(key, q, side="right") % V
    return out


# ---------------------------------------------------------------------------------------------
# Statistics that show the sampler does what it claims

def rank_slope(tokens: np.ndarray, top: int = 50) -> float:
    """Least-squares slope of log frequency against log rank over the `top` most frequent."""
    f = np.sort(np.bincount(tokens))[::-1]
    f = f[f > 0][:top]
    return float(np.polyfit(np.log(np.arange(1, len(f) + 1)), np.log(f), 1)[0])


def same_sentence_pmi(tokens, rels, sids) -> float:
    """How much likelier two words of the same relation are to be the same token when they share
    a sentence: log P(same token | same sentence, same relation) / P(same token | same relation),
    the pointwise mutual information between "same sentence" and "same token". 0 when words are
    drawn independently given their relation (zipf); > 0 when a sentence's words share a topic
    (loglinear). Exact counts over the whole corpus."""
    R, V = int(rels.max()) + 1, int(tokens.max()) + 1
    group = sids.astype(np.int64) * R + rels                           # (sentence, relation)
    _, c = np.unique(group * V + tokens, return_counts=True)
    groups, n = np.unique(group, return_counts=True)
    pairs = (n * (n - 1)).sum()
    within = (c * (c - 1)).sum() / pairs
    # the same pairs, if their tokens were drawn from the relation's overall distribution
    f = np.bincount(rels * V + tokens, minlength=R * V).reshape(R, V).astype(float)
    collide = ((f / f.sum(1, keepdims=True).clip(min=1)) ** 2).sum(1)          # (R,)
    chance = (n * (n - 1) * collide[groups % R]).sum() / pairs
    return float(math.log(within / chance))


def build_parser() -> Parser:
    ap = Parser(prog="synth.py", description=__doc__)
    add = ap.add_argument
    add("--ud", default=None, help="folder holding the UD treebanks (default $NANOMLM_RAW/ud)")
    add("--treebanks", nargs="+", default=TREEBANKS, help=f"(default {' '.join(TREEBANKS)})")
    add("--n-rels", type=at_least(int, 1), default=20,
        help="relations kept as nonterminals; the rest become `other`")
    add("--rare", default="other", choices=["other", "drop"],
        help="relations outside the --n-rels most frequent: other (one nonterminal for them all, "
        "their subtrees kept) or drop (removed with their subtrees, most likely the blog's "
        "rule)")
    add("--separate-sentences", action=argparse.BooleanOptionalAction, default=True,
        help="ask data/prepare.py for [SEP] after every sentence in the token stream, so that a "
        "training segment packing several independent sentences keeps their boundaries "
        "(default on; --no-separate-sentences: joined, as the earliest studies)")
    add("--relex", default="zipf", choices=["zipf", "loglinear"],
        help="word distribution")
    add("--vocab", type=at_least(int, 1), default=5000, help="made-up words in all")
    add("--sentences", type=at_least(int, 1), default=1000000,
        help="sentences to sample")
    add("--max-depth", type=at_least(int, 1), default=30, help="tree depth cap")
    add("--max-len", type=at_least(int, 1), default=100,
        help="longer sentences are drawn again")
    add("--seed", type=at_least(int, 0), default=0, help="seed of the sampling")
    add("--out", required=True, help="corpus folder to write: synth.train, synth.dev (every 20th "
        "sentence), grammar.json, stats.json")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    out = folder_to_write(args.out, ap.error)  # a bad --out: one line, before the sampling
    ud = Path(args.ud or raw_root() / "ud")
    t0 = time.time()
    sentences = [s for f in treebank_files(ud, args.treebanks) for s in read_conllu(f)]
    g = grammar(sentences, args.n_rels, args.rare)
    n_rules = sum(len(r) for r in g["rules"].values())
    print(f"grammar: {len(sentences)} trees, {len(g['symbols'])} nonterminals, {n_rules} rules "
          f"({time.time() - t0:.1f} s)")
    sampler = Sampler(g, args.max_depth, args.max_len)
    t1 = time.time()
    rels, sids = sampler.sample(args.sentences, args.seed)
    t2 = time.time()
    rng = np.random.default_rng([args.seed, 1])
    sizes = token_sets(g, args.vocab)
    if args.relex == "zipf":
        tokens = relex_zipf(rels, sizes, rng)
    else:
        tokens = relex_loglinear(rels, sids, sizes, rng)
    t3 = time.time()
    lengths = np.bincount(sids)
    slopes = {s: rank_slope(tokens[rels == r]) for r, s in enumerate(g["symbols"])
              if sizes[r] >= 20}
    stats = dict(sentences=args.sentences, tokens=int(len(tokens)), sample_s=t2 - t1,
                 relex_s=t3 - t2, sentences_per_s=args.sentences / (t2 - t1),
                 mean_length=float(lengths.mean()), median_length=float(np.median(lengths)),
                 treebank_mean_length=float(np.mean(g["lengths"])), rank_slope_by_relation=slopes,
                 same_sentence_pmi=same_sentence_pmi(tokens, rels, sids))
    print(f"sampled {args.sentences} sentences, {len(tokens)} words, in {t2 - t1:.1f} s "
          f"({stats['sentences_per_s']:.0f} sentences/s); relexicalised ({args.relex}) in "
          f"{t3 - t2:.1f} s | mean length {stats['mean_length']:.1f}, median "
          f"{stats['median_length']:.0f} (treebank "
          f"{stats['treebank_mean_length']:.1f}) | same-sentence PMI "
          f"{stats['same_sentence_pmi']:.3f}")
    bounds = np.r_[0, np.cumsum(lengths)]
    with one_line_os_errors(out), open(out / "synth.train", "w") as tr, \
            open(out / "synth.dev", "w") as dv:
        for first in range(0, args.sentences, 50000):  # in chunks: 1M sentences' strings take GBs
            last = min(first + 50000, args.sentences)
            words = np.char.add("w", tokens[bounds[first]:bounds[last]].astype(str))
            for i in range(first, last):
                sentence = words[bounds[i] - bounds[first]:bounds[i + 1] - bounds[first]]
                (dv if i % 20 == 19 else tr).write(" ".join(sentence) + "\n")
    rules = {l: [[" ".join(r), p] for r, p in rs.items()] for l, rs in g["rules"].items()}
    with one_line_os_errors(out):  # a full disk: one line
        (out / "grammar.json").write_text(json.dumps(
            {"symbols": g["symbols"], "sizes": sizes.tolist(), "args": vars(args),
             "rules": rules}))
        (out / "stats.json").write_text(json.dumps(stats, indent=1))
        # data/prepare.py then makes one token per word
        (out / "tokenizer.json").write_text(json.dumps(
            {"model_type": "word", "separate_sentences": args.separate_sentences}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
