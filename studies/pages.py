r"""The figures a page quotes, made from the records they come from: on README.md and docs/, each
figure taken from a result file sits in a span that names where it comes from,

    <!-- fig KIND ARGS... -->TEXT<!-- /fig -->

and TEXT is what that source gives today (`python -m studies.pages` writes every span anew from
the committed records; tests/test_claims.py rebuilds the study reports from their results/ and
checks every span against them, and that no verdict sentence or decimal figure stands outside
one unless its paragraph says what it is). The kinds:

    verdict DIR METRIC ARM        the sentence DIR/report.json gives for ARM against the baseline
                                  (DIR: a study's folder under docs/studies, e.g. gpt_bert_cpu)
    compare FILE                  the sentence of a saved `evaluate.py compare --out FILE`,
                                  recomputed from the result files it names
    report DIR PATH [FORMAT]      a value of DIR/report.json
    results DIR ARM PATH REDUCE [FORMAT]
                                  PATH in each seed's result file of ARM, reduced over the seeds
    files GLOB PATH REDUCE [FORMAT]
                                  PATH in each JSON record GLOB matches, reduced over them
    value FILE PATH [FORMAT]      a value of any JSON record (a .json.gz too)
    text FILE REGEX               group 1 of REGEX's first match in a text file (no spaces in
                                  REGEX: \s for them), e.g. the date of a GPU run's env.txt
    table FILE                    bench.py's table of a saved bench.json, whole
    headline DIR...               the table of `gpu_check.sh headline` runs, one column each, from
                                  what each DIR keeps (summary.json, env.txt, the logs)

A page may name a file or folder once, `<!-- fig-let NAME PATH -->`, and its spans then say
NAME (or NAME/file) for it.

PATH is dotted: a key, a list index, `k=v` (the first item of a list whose k is v), or at the end
min, max, mean, median, sd (the sample's), len, range (two values: "lo–hi") or meansd ("m ± sd")
of a list. REDUCE is one of those, over the seeds or files. FORMAT is a format spec (.2f,
,.0f), `%` before it for a rate shown in percent (%.1f: 0.5459 -> 54.6), `k` after it for
thousands (.0fk: 437093 -> 437k).

A span that starts a line would begin an HTML block in Markdown: keep a word before it on its
line, or give a block span (a table) its two comments lines of their own.

A paragraph whose figures were typed, not taken from a kept record (a paper's figure, a setting,
a run whose files were not kept), says so in a comment the checks read, `<!-- typed: WHY -->`;
a page of such figures throughout opens with one.
"""
import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from benchmarks.timing import table
from evaluation.multibootstrap import examples_of, multibootstrap, verdict
from evaluation.results import read_result

REPO = Path(__file__).resolve().parent.parent
STUDIES = REPO / "docs" / "studies"
SPAN = re.compile(r"<!-- fig (?P<key>[^>]*?) -->(?P<text>.*?)<!-- /fig -->", re.S)
LET = re.compile(r"<!-- fig-let (\S+) (\S+) -->")
TYPED = re.compile(r"<!-- typed: [^>]+-->")
REDUCERS = {"min": min, "max": max, "mean": statistics.fmean, "median": statistics.median,
            "sd": statistics.stdev, "len": len, "range": lambda xs: (min(xs), max(xs), "–"),
            "meansd": lambda xs: (statistics.fmean(xs), statistics.stdev(xs), " ± ")}


def pages() -> list[Path]:
    """Every page whose figures are checked: the README, docs/*.md, the studies' pages and
    reports, the recipe cards."""
    docs = REPO / "docs"
    return [REPO / "README.md", *sorted(docs.glob("*.md")), *sorted(STUDIES.glob("*.md")),
            *sorted(STUDIES.glob("*/REPORT.md")), *sorted((docs / "objectives").glob("*.md"))]


def walk(record, path: str):
    """The value at a dotted PATH of a JSON record (the module's docstring says its parts)."""
    value = record
    for part in path.split("."):
        if part in REDUCERS and isinstance(value, list):
            value = REDUCERS[part](value)
        elif isinstance(value, list) and "=" in part:
            k, v = part.split("=", 1)
            value = next(x for x in value if str(x.get(k)) == v)
        elif isinstance(value, list):
            value = value[int(part)]
        else:
            value = value[part]
    return value


def formatted(value, spec: str | None) -> str:
    """A value as a page prints it (FORMAT in the docstring); a pair (range, meansd) joined."""
    if isinstance(value, tuple):
        return value[2].join(formatted(v, spec) for v in value[:2])
    if spec is None:
        return str(value)
    scale, suffix = 1, ""
    if spec.startswith("%"):
        spec, scale = spec[1:], 100
    if spec.endswith("k"):
        spec, scale, suffix = spec[:-1], scale / 1000, "k"
    return format(value * scale, spec) + suffix


def recomputed(path: Path) -> str:
    """A saved comparison's verdict, recomputed from the result files it names (their paths as
    it was run: from the repository, or from a folder above the file). The section it compared is
    its `examples`, or, in files saved before compare recorded it, the one whose per-seed values
    are the file's."""
    saved = json.loads(path.read_text())
    find = lambda f: next(p / f for p in [REPO, *path.parents] if (p / f).exists())
    sides = [[read_result(find(f)) for f in saved[side]] for side in ("a", "b")]
    keys = [saved["examples"]] if "examples" in saved else [
        k for k, v in sides[0][0].items() if isinstance(v, dict) and "pred" in v]
    for key in keys:
        if not all(key in r for side in sides for r in side):
            continue
        A, B = ([examples_of(r, key) for r in side] for side in sides)
        r = multibootstrap(A, B, nboot=20)
        if "examples" in saved or all(
                abs(x - y) < 1e-9 for x, y in zip(r["values_a"] + r["values_b"],
                                                  saved["values_a"] + saved["values_b"])):
            return verdict(r["seed_level"], r["better"], len(A), len(B))
    raise KeyError(f"{path.relative_to(REPO)}: no section of its result files gives its values")


def headline(dirs: list[str]) -> str:
    """docs/bench.md's table of `gpu_check.sh headline` runs, each column read from the files
    its folder keeps: summary.json, env.txt (date, commit), log.jsonl (the loop's tokens/s every
    50 steps), train.log (the seconds to the end of step 1 and of the last, tqdm's), and
    blimp_summary.json (the pairs scored)."""
    cols = []
    for d in dirs:
        d = REPO / d
        s = json.loads((d / "summary.json").read_text())
        env = (d / "env.txt").read_text()
        log = (d / "train.log").read_text()
        rates = [r["tok_per_s"] for r in map(json.loads, (d / "log.jsonl").read_text()
                                              .splitlines()) if "tok_per_s" in r]
        rows, seq = map(int, re.search(r"(\d+) seqs x (\d+) tokens per step", log).groups())
        first = float(re.search(r"\| *1/\d+ \[[^\]]*?, ([\d.]+)s/step\]", log)[1])
        m, sec = map(int, re.findall(rf"{s['steps']}/{s['max_steps']} \[(\d+):(\d+)<", log)[-1])
        blimp = json.loads((d / "blimp_summary.json").read_text())
        pairs = sum(p[-1] for by in blimp["paradigms"].values() for p in by.values())
        date, commit = re.search(r"date: (\S+)", env)[1], re.search(r"commit: (\w{7})", env)[1]
        cols.append({
            "head": f"{date}, H200, {commit}",
            "done": "finished" if s["finished"] else f"stopped at step {s['steps']:,}",
            "wall": f"{s['train_wall_s']:.0f} s ({s['train_wall_s'] / 60:.1f} min)",
            "first": f"{first:.0f} s",
            "speed": f"{statistics.median(rates) / 1000:.0f}k tokens/s, "
                     f"{1000 * s['step_s']:.1f} ms a step",
            "whole": f"{s['steps'] * rows * seq / (60 * m + sec) / 1000:.0f}k tokens/s",
            "val": f"**{s['val']['val_loss']:.3f}, {100 * s['val']['val_acc']:.1f}%**",
            "filtered": f"**{s['blimp']['blimp_filtered']['over_paradigms']:.1f}%** "
                        f"({s['blimp']['blimp_filtered']['pipeline_average']:.1f})",
            "supplement": f"**{s['blimp']['supplement_filtered']['over_paradigms']:.1f}%** "
                          f"({s['blimp']['supplement_filtered']['pipeline_average']:.1f})",
            "blimp": f"{2 * pairs / s['blimp_sentences_per_s']:.0f} s "
                     f"({s['blimp_sentences_per_s']:,.0f} sentences/s), "
                     f"{s['blimp_wall_s']:.0f} s with the start",
            "steps": s["max_steps"], "rows": rows, "seq": seq, "sentences": 2 * pairs,
            "val_step": s["val"]["step"]})
    c = cols[0]
    what = [("done", f"`train.py --objective mlm` defaults: `small`, 10 epochs, {c['steps']:,} "
                     f"steps of {c['rows']} × {c['seq']}"),
            ("wall", "wall time of the run, start to saved checkpoint"),
            ("first", "of it up to the end of step 1 (start, `torch.compile`)"),
            ("speed", "steps' speed (median of 50-step intervals)"),
            ("whole", "the whole run, with its validations and saves"),
            ("val", f"validation loss, accuracy (step {c['val_step']:,})"),
            ("filtered", "BLiMP filtered (mean over paradigms; pipeline average)"),
            ("supplement", "BLiMP supplement"),
            ("blimp", f"BLiMP scoring: {c['sentences']:,} sentences, PLL, float32")]
    lines = ["| what | " + " | ".join(x["head"] for x in cols) + " |",
             "|---|" + "---|" * len(cols)]
    lines += [f"| {label} | " + " | ".join(x[key] for x in cols) + " |" for key, label in what]
    return "\n".join(lines)


def let_in(arg: str, let: dict) -> str:
    """An argument with a page's name for a file or folder put in (NAME, or NAME/rest)."""
    head, sep, rest = arg.partition("/")
    return let[head] + sep + rest if head in let else arg


def names(text: str) -> dict:
    """{NAME: FILE} of a page's `fig-let` comments."""
    return dict(LET.findall(text))


def figure(key: str, rebuilt: dict | None = None, let: dict | None = None) -> str:
    """The text of a span's KEY (the module's docstring). rebuilt: {DIR: folder} where a study's
    report was rebuilt from its results/ (the checks read those, not the committed report);
    let: the page's names for files."""
    kind, *args = key.split()
    args = [let_in(a, let or {}) for a in args]
    report = lambda d: json.loads(((rebuilt or {}).get(d, STUDIES / d) / "report.json")
                                  .read_text())
    if kind == "verdict":
        d, metric, arm = args
        return report(d)["verdicts"][metric][arm]
    if kind == "compare":
        return recomputed(REPO / args[0])
    if kind == "report":
        return formatted(walk(report(args[0]), args[1]), args[2] if len(args) > 2 else None)
    if kind == "results":
        d, arm, path, reduce = args[:4]
        files = sorted((STUDIES / d / "results" / arm).glob("s*.json.gz"))
        values = [walk(read_result(f), path) for f in files]
        return formatted(REDUCERS[reduce](values), args[4] if len(args) > 4 else None)
    if kind == "files":
        files = sorted(REPO.glob(args[0]))
        if not files:
            raise KeyError(f"no file matches {args[0]}")
        values = [walk(read_result(f), args[1]) for f in files]
        return formatted(REDUCERS[args[2]](values), args[3] if len(args) > 3 else None)
    if kind == "value":
        return formatted(walk(read_result(REPO / args[0]), args[1]),
                         args[2] if len(args) > 2 else None)
    if kind == "text":
        return re.search(args[1], (REPO / args[0]).read_text())[1]
    if kind == "headline":
        return headline(args)
    if kind == "table":
        return table(json.loads((REPO / args[0]).read_text()))
    raise KeyError(f"no figure kind {kind!r}")


def said(m: re.Match) -> str:
    """A span's text as its figure is compared: a block span (a table, its comments on lines of
    their own) as it stands, an inline one with its line breaks read as spaces (it may wrap)."""
    if m["text"].startswith("\n"):
        return m["text"].removeprefix("\n").removesuffix("\n")
    return " ".join(m["text"].split())


def rewritten(text: str, rebuilt: dict | None = None) -> tuple[str, list[str]]:
    """The page with every span's text made anew from its source, and the spans whose source
    gave nothing (left as they were): a span that already says it is left as it is wrapped; a
    changed inline one is written on one line (wrap it again)."""
    let, failed = names(text), []

    def one(m):
        try:
            new = figure(m["key"], rebuilt, let)
        except (KeyError, ValueError, IndexError, TypeError, OSError, StopIteration,
                SystemExit) as e:
            failed.append(f"<!-- fig {m['key']} -->: {e}")
            return m.group(0)
        if said(m) == new:
            return m.group(0)
        nl = "\n" if m["text"].startswith("\n") else ""
        return f"<!-- fig {m['key']} -->{nl}{new}{nl}<!-- /fig -->"
    return SPAN.sub(one, text), failed


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m studies.pages", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="say which pages differ from their records, and change none")
    args = ap.parse_args(argv)
    stale, failed = [], []
    for page in pages():
        text = page.read_text()
        new, bad = rewritten(text)
        failed += [f"{page.relative_to(REPO)}: {b}" for b in bad]
        if new != text:
            stale.append(page.relative_to(REPO).as_posix())
            if not args.check:
                page.write_text(new)
    verb = "differ from their records" if args.check else "rewritten from their records"
    print(f"{len(stale)} pages {verb}" + (": " + ", ".join(stale) if stale else ""))
    for line in failed:
        print(f"no figure: {line}", file=sys.stderr)
    if (args.check and stale) or failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
