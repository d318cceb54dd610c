"""Is one pretraining procedure better than another? The Multi-Bootstrap (Sellam et al. 2022,
"The MultiBERTs", section 3), over pretraining seeds and evaluation examples both, and beside it
a seed-level Student's t (seed_interval), whose 95% holds at the few seeds a study here runs.
As `python evaluate.py compare A_PATTERN B_PATTERN` runs them on RUN/eval/NAME.json files.

At S seeds the Multi-Bootstrap's percentile interval is about the span of the S per-seed
differences, and its p is bounded by the resampling: at 3 seeds its "95%" covers the truth far
less often (tests/test_evaluate.py measures it). The MultiBERTs ran 25 seeds; below
MULTIBOOTSTRAP_SEEDS its interval is reported as a spread, not as a 95% interval, and the
verdict is the t-interval's.
"""
import glob
import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy import stats

from evaluation.results import METRICS, read_result
from machinery.plumbing import bar


def examples_of(result: dict, key: str, path="the result") -> dict:
    """One per-example section of a result (evaluate.py's or study.py's) as multibootstrap reads
    it: label (N,), pred (F, N) (F fine-tuning seeds; one row elsewhere), the metric, and whether
    higher or lower is better."""
    if key not in result:
        held = [k for k, v in result.items() if isinstance(v, dict) and "pred" in v]
        raise SystemExit(f"error: {path} has no '{key}' section" + (
            f"; its per-example sections: {', '.join(held)} (--examples NAME)" if held else
            " (not written by evaluate.py or study.py?)"))
    ex = result[key]
    return {"seed": result.get("pretrain_seed"), "id": ex["id"], "label": np.array(ex["label"]),
            "pred": np.array(ex["pred"]), "metric": ex["metric"], "k": ex["k"],
            "better": ex.get("better", "higher"), "path": str(path),
            "name": ex.get("name", f"{result.get('kind', '')} {ex['metric']}".strip())}


def load_examples(path: Path, key: str) -> dict:
    return examples_of(read_result(path), key, path)


MULTIBOOTSTRAP_SEEDS = 25  # the MultiBERTs' seed count: below it, a spread, not a 95% interval


def seed_interval(a, b, paired: bool) -> dict:
    """B - A over pretraining seeds alone, from each seed's value on all the examples (a: A's,
    b: B's, one number per seed): Student's t on the per-seed differences when the seeds are
    paired (the same seeds, in the same order), else Welch's t. Its two-sided 95% interval and
    p are exact for normally distributed seed effects at any count of at least 2 when paired,
    and Welch's approximation otherwise; below 2, no interval (None) and no verdict. Examples
    enter through each seed's value (their noise varies from seed to seed), not as a population
    of their own."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if paired:
        d = b - a
        n, diff = len(d), float(d.mean())
        if n < 2:
            return {"n": n, "diff": diff, "ci95": None, "p": None, "df": None, "test": "paired t"}
        se, df = d.std(ddof=1) / math.sqrt(n), n - 1
    else:
        n, diff = min(len(a), len(b)), float(b.mean() - a.mean())
        if n < 2:
            return {"n": n, "diff": diff, "ci95": None, "p": None, "df": None, "test": "Welch t"}
        va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
        se = math.sqrt(va + vb)
        df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if se else 1
    q = stats.t.ppf(0.975, df)
    p = 2 * stats.t.sf(abs(diff) / se, df) if se > 0 else float(diff == 0)
    return {"n": n, "diff": diff, "ci95": [diff - q * se, diff + q * se], "p": float(p),
            "df": float(df), "test": "paired t" if paired else "Welch t"}


def in_units(x: float, better: str) -> str:
    """A metric's value as the verdicts, `compare` and the study reports print it: a rate (higher
    is better) in percent to 2 decimals, a loss (lower is better) in nats to 4."""
    return f"{100 * x:.2f}" if better == "higher" else f"{x:.4f}"


def signed(x: float, better: str) -> str:
    """in_units with its sign, for a difference: +0.52, -0.0031."""
    return ("+" if x >= 0 else "-") + in_units(abs(x), better)


def verdict(t: dict, better: str, n_a: int, n_b: int) -> str:
    """The sentence a page quotes for one comparison, made from its seed-level t (seed_interval's
    dict) alone: B - A "higher/lower by X" where the 95% interval excludes 0, "not
    distinguishable" where it holds 0, "a demo" with one seed a side; always with the interval,
    the seeds it stands on and p, each number as in_units prints it. n_a, n_b: the seeds of each
    side."""
    unit = "points" if better == "higher" else "nats"
    show, sign = (lambda x: in_units(x, better)), (lambda x: signed(x, better))
    if t["ci95"] is None:
        return f"{sign(t['diff'])} {unit} from one seed a side: a demo, no verdict"
    seeds = (f"{t['n']} paired seeds" if t["test"] == "paired t" else
             f"{n_a} and {n_b} seeds (Welch's t, approximate)")
    lo, hi = t["ci95"]
    p = "p < 0.001" if t["p"] < 0.001 else f"p = {t['p']:.3f}"
    interval = f"95% t interval {sign(lo)}..{sign(hi)} over {seeds}, {p}"
    if lo > 0 or hi < 0:
        way = "higher" if t["diff"] > 0 else "lower"
        return f"{way} by {show(abs(t['diff']))} {unit}, {interval}"
    return f"not distinguishable: {sign(t['diff'])} {unit}, {interval}"


def bootstrap_counts(rng, n, size) -> np.ndarray:
    """(size, n): how often each of n items is drawn in each of `size` resamples of n with
    replacement."""
    draws = rng.integers(0, n, (size, n)) + n * np.arange(size)[:, None]
    return np.bincount(draws.ravel(), minlength=size * n).reshape(size, n).astype(np.float32)


def multibootstrap(A: list[dict], B: list[dict], nboot=1000, seed=0, block=100) -> dict:
    """A, B: per-pretraining-seed results (load_examples). The statistic of a procedure is the
    mean over its seeds (and their fine-tuning seeds) of the metric on the examples. Resample
    seeds and examples jointly, nboot times: paired (the same draw for A and B) where A and B have
    the same pretraining seeds / the same examples, independently otherwise. metric "mean": pred
    holds one number per example (a segment's loss) and the statistic is their mean."""
    metric, k, better = A[0]["metric"], A[0]["k"], A[0].get("better", "higher")
    if any((r["metric"], r["k"], r.get("better", "higher")) != (metric, k, better)
           for r in A + B):
        raise SystemExit("error: the results to compare use different metrics or label sets")
    for side in (A, B):
        if any(r["id"] != side[0]["id"] for r in side):
            raise SystemExit(f"error: {side[0]['path']} and its siblings were scored on "
                             f"different examples")
    paired_examples = sorted(A[0]["id"]) == sorted(B[0]["id"])
    if paired_examples:  # put B's examples in A's order
        where = {e: i for i, e in enumerate(B[0]["id"])}
        order = np.array([where[e] for e in A[0]["id"]])
        B = [{**r, "label": r["label"][order], "pred": r["pred"][:, order]} for r in B]
    seeds_a, seeds_b = [r["seed"] for r in A], [r["seed"] for r in B]
    distinct = None not in seeds_a and len(set(seeds_a)) == len(seeds_a)
    paired_seeds = distinct and sorted(seeds_a) == sorted(seeds_b)
    if paired_seeds:
        B = sorted(B, key=lambda r: seeds_a.index(r["seed"]))
    fn = METRICS.get(metric)

    def indicators(r):  # (F * k*k, N): one row per (fine-tuning seed, confusion cell)
        if fn is None:  # "mean": (F, N), the values themselves
            return r["pred"].astype(np.float64)
        cells = r["label"][None, :] * k + r["pred"]                               # (F, N)
        hits = cells[:, None, :] == np.arange(k * k)[None, :, None]               # (F, k*k, N)
        return hits.reshape(-1, cells.shape[1]).astype(np.float32)

    def per_seed(rows, U):  # U (N, b) example counts -> (S, b): each seed's mean over F
        if fn is None:
            return np.stack([(R @ U / U.sum(0)).mean(0) for R in rows])
        cms = [np.moveaxis((R @ U).reshape(-1, k, k, U.shape[1]), -1, 0) for R in rows]
        return np.stack([fn(cm).mean(1) for cm in cms])

    def stat(side, rows, U, W):  # U (N, b) example counts, W (S, b) seed counts -> (b,)
        return (W * per_seed(rows, U)).sum(0) / len(side)

    rows_a, rows_b = [indicators(r) for r in A], [indicators(r) for r in B]
    n_a, n_b = len(A[0]["id"]), len(B[0]["id"])
    ones = lambda n: np.ones((n, 1), np.float32)
    values_a = per_seed(rows_a, ones(n_a))[:, 0].astype(np.float64)      # (S_a,)
    values_b = per_seed(rows_b, ones(n_b))[:, 0].astype(np.float64)      # (S_b,)
    mean_a, mean_b = float(values_a.mean()), float(values_b.mean())
    rng = np.random.default_rng(seed)
    diffs = []
    for start in bar(range(0, nboot, block), desc="bootstrap", disable=None):
        b = min(block, nboot - start)
        U_a = bootstrap_counts(rng, n_a, b).T
        U_b = U_a if paired_examples else bootstrap_counts(rng, n_b, b).T
        W_a = bootstrap_counts(rng, len(A), b).T
        W_b = W_a if paired_seeds else bootstrap_counts(rng, len(B), b).T
        diffs.append(stat(B, rows_b, U_b, W_b) - stat(A, rows_a, U_a, W_a))
    diffs = np.concatenate(diffs)
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    worse = diffs < 0 if better == "higher" else diffs > 0
    p = float(worse.mean() + 0.5 * (diffs == 0).mean())
    return {"metric": metric, "mean_a": mean_a, "mean_b": mean_b, "diff": mean_b - mean_a,
            "values_a": values_a.tolist(), "values_b": values_b.tolist(),
            "seed_level": seed_interval(values_a, values_b, paired_seeds),
            # the Multi-Bootstrap's 2.5-97.5 percentiles: a 95% interval from about 25 seeds on
            "ci95": [float(lo), float(hi)],
            "at_level": min(len(A), len(B)) >= MULTIBOOTSTRAP_SEEDS,
            # one-sided: how often B is not better than A; exact ties count half (mid-p), so
            # identical inputs give 0.5 rather than 1. No resample the other way does not make
            # p 0: it is below 1/nboot, and reported as 1/nboot with p_floored
            "p": max(p, 1 / nboot), "p_floored": p < 1 / nboot, "better": better,
            "nboot": nboot,
            "paired_seeds": paired_seeds, "paired_examples": paired_examples,
            "seeds_a": seeds_a, "seeds_b": seeds_b}


def expand(patterns, key: str = "examples") -> list[list[tuple[Path, dict]]]:
    """Two groups of result files, each file with its section `key` (load_examples), each file
    read once: two arguments, each a file, folder or quoted glob; or the shell's expansion of two
    globs, split by parent folder. A folder gives its files that hold the section (a run's eval/
    also holds weights.json), all of one kind: a folder of one run's evaluations (blimp.json,
    mlm.json, rte.json) is refused, its files named."""
    def one(p):
        path = Path(p)
        if not path.is_dir():
            files = sorted(map(Path, glob.glob(p)))
            if not files:
                raise SystemExit(f"error: no result files match {p}")
            return [(f, load_examples(f, key)) for f in files]
        kinds, held = {}, {}  # {the section's name: its (file, examples)}, all sections seen
        for f in sorted([*path.glob("*.json"), *path.glob("*.json.gz")]):
            r = read_result(f)
            held.update((k, 1) for k, v in r.items() if isinstance(v, dict) and "pred" in v)
            if key in r:
                examples = examples_of(r, key, f)
                kinds.setdefault(examples["name"], []).append((f, examples))
        if not kinds:
            raise SystemExit(f"error: no result file in {p} has a '{key}' section" + (
                f"; theirs: {', '.join(held)} (--examples NAME)" if held else ""))
        first = [fs[0][0] for fs in kinds.values()]
        if len(kinds) > 1:
            raise SystemExit(f"error: {p} holds results of {len(kinds)} kinds ("
                             f"{', '.join(f.name for f in first)}): give one file or quoted glob "
                             f"a side, e.g. {first[0]}")
        return next(iter(kinds.values()))
    if len(patterns) == 2:
        return [one(p) for p in patterns]
    groups = {}
    for p in patterns:
        groups.setdefault(Path(p).parent, []).append(Path(p))
    if len(groups) != 2:
        raise SystemExit("error: give two groups of results: `compare 'A/*.json' 'B/*.json'` "
                         "(quoted globs) or two folders")
    return [[(f, load_examples(f, key)) for f in files] for files in groups.values()]


def twice(side: list[dict]) -> list[str]:
    """Warnings for a group holding one pretraining seed more than once: two files of one seed
    are one pretraining run's worth of evidence, not two."""
    seen, out = {}, []
    for r in side:
        if r["seed"] is not None and r["seed"] in seen:
            out.append(f"warning: pretraining seed {r['seed']} appears twice ({seen[r['seed']]} "
                       f"and {r['path']}); its two results count as two seeds here")
        seen.setdefault(r["seed"], r["path"])
    return out


def compare(args):
    a, b = expand(args.results, args.examples)
    if both := sorted({Path(f).resolve() for f, _ in a} & {Path(f).resolve() for f, _ in b}):
        raise SystemExit(f"error: {len(both)} result file(s) in both groups (first {both[0]}): "
                         f"compare two procedures' results, A and B apart")
    A, B = [examples for _, examples in a], [examples for _, examples in b]
    r = multibootstrap(A, B, args.nboot, args.seed)
    for line in twice(A) + twice(B):
        print(line, file=sys.stderr)
    paired = lambda key: "paired" if r[key] else "unpaired"
    name = A[0]["name"]
    print(f"A: {len(A)} seeds {r['seeds_a']}, B: {len(B)} seeds {r['seeds_b']}; {name}; "
          f"seeds {paired('paired_seeds')}, examples {paired('paired_examples')}")
    show, sign = (lambda x: in_units(x, r["better"])), (lambda x: signed(x, r["better"]))
    seeds = r["seed_level"]
    print(f"per seed: A {' '.join(map(show, r['values_a']))} | "
          f"B {' '.join(map(show, r['values_b']))}")
    said = (f"95% interval {sign(seeds['ci95'][0])} .. {sign(seeds['ci95'][1])}, p = "
            f"{seeds['p']:.3g} (two-sided {seeds['test']} over {seeds['n']} seeds)"
            if seeds["ci95"] else "no interval: one seed a side is a demo, not a verdict")
    print(f"{name}: mean A {show(r['mean_a'])} | mean B {show(r['mean_b'])} | "
          f"B - A {sign(r['diff'])}: {said}  [{r['better']} is better]")
    print(f"verdict, B against A (the sentence a page quotes): "
          f"{verdict(seeds, r['better'], len(A), len(B))}")
    level = ("95% interval" if r["at_level"] else
             f"spread (a 95% interval from {MULTIBOOTSTRAP_SEEDS} seeds a side)")
    print(f"Multi-Bootstrap, seeds and examples resampled {r['nboot']} times: {level} "
          f"{sign(r['ci95'][0])} .. {sign(r['ci95'][1])}" + (
              f" | p = P(B - A {'<=' if r['better'] == 'higher' else '>='} 0) "
              f"{'<' if r['p_floored'] else '='} {r['p']:.4g}" if r["at_level"] else ""))
    if args.out:
        # what it compared, so that a page's quote of it can be recomputed (studies/pages.py)
        files = {"a": [str(f) for f, _ in a], "b": [str(f) for f, _ in b],
                 "examples": args.examples}
        Path(args.out).write_text(json.dumps({**r, **files}, indent=1))
