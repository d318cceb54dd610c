"""Every figure a page quotes is made by the code from the record it comes from. The study
reports are rebuilt from their committed results/ (REPORT.md must be what the rebuild writes);
on every page (studies/pages.pages(): README.md, docs/, the studies' pages, the recipe cards)
each `<!-- fig ... -->` span must hold what its source gives today (a verdict recomputed from
its own comparison: the study, the two arms, the metric and the scale its key names), each
verdict-shaped sentence must sit in such a span with its two arms and metric named just before
it, and a decimal figure outside a span must stand in a paragraph that says it was typed
(`<!-- typed: WHY -->`). A number retyped by hand, a sentence moved to another comparison, or a
figure left behind when results change fails here, naming the page.

The tests that check claims have `claim` in their names: `pytest -k claim` runs them alone."""
import argparse
import re
import shlex
import shutil

import pytest

import study
from conftest import REPO
from studies import pages as P
from studies.plan import load_study

# the three shapes multibootstrap.verdict gives, up to the end of the sentence
NUMBER = r"[+-]?\d+\.\d+"
SEEDS = r"over (?:\d+ paired seeds|\d+ and \d+ seeds \(Welch's t, approximate\))"
INTERVAL = rf"95% t interval {NUMBER}\.\.{NUMBER} {SEEDS}, p (?:= \d\.\d+|< 0\.001)"
VERDICT = re.compile(
    rf"(?:(?:higher|lower) by {NUMBER} (?:points|nats), {INTERVAL}"
    rf"|not distinguishable: {NUMBER} (?:points|nats), {INTERVAL}"
    rf"|{NUMBER} (?:points|nats) from one seed a side: a demo, no verdict)")
BUILT = re.compile(r"Built by `python study.py (\S+) --scale (\S+) --report(?: --out (\S+))?`")
# a decimal figure (a version such as 2.13.0 is none), or a percentage
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?![.\d])|(?<![\w.])\d+%")
GENERATED = re.compile(r"<!-- (first_screen(?: evaluation)?): begin -->.*?<!-- \1: end -->",
                       re.S)  # tests/test_readme.py checks these against their record


def rel(page) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> dict:
    """{DIR: folder}: each committed study report rebuilt from a copy of its results/ (the
    verdicts stand on the seed-level t alone, so a small --nboot changes none of them)."""
    out = {}
    reports = sorted(P.STUDIES.glob("*/REPORT.md"))
    assert len(reports) >= 3
    for report in reports:
        path, scale, _ = BUILT.search(report.read_text()).groups()
        folder = tmp_path_factory.mktemp(report.parent.name)
        shutil.copytree(report.parent / "results", folder / "results")
        study.main([str(REPO / path), "--scale", scale, "--report", "--out", str(folder),
                    "--no-figures", "--nboot", "20"])
        out[report.parent.name] = folder
    return out


def blocks(text: str) -> list[str]:
    """A page's paragraphs, list items (a top-level `- ` starts one; its sub-items stay in it)
    and tables, fenced code and the generated blocks left out."""
    text = GENERATED.sub("", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
    return [b for b in re.split(r"\n\s*\n|\n(?=- )", text) if b.strip()]


def spans_problems(name: str, text: str, rebuilt: dict) -> list[str]:
    """Each span's text against its source; each verdict span's arms and metric named before
    it (in backticks, in the text since the span before it)."""
    out, last, let, led = [], 0, P.names(text), []
    for m in P.SPAN.finditer(text):
        key, said = m["key"], P.said(m)
        raw, last = text[last:m.start()], m.end()
        try:
            want = P.figure(key, rebuilt, let)
        except (KeyError, ValueError, IndexError, TypeError, OSError, StopIteration,
                SystemExit) as e:
            out.append(f"{name}: <!-- fig {key} -->: its source gives nothing ({e!r})")
            continue
        if said != want:
            out.append(f"{name}: <!-- fig {key} --> says {said!r}; its record gives {want!r}")
        kind, *args = key.split()
        args = [P.let_in(a, let) for a in args]
        lead = " ".join(raw.split())  # prose may wrap anywhere
        # the comparison the prose names nearest before the span, since the span before it; or,
        # in the same paragraph, the one that led that span ("`b` against `a`, n = 10: ...;
        # n = 160: ...")
        named = re.findall(r"`([^`]+)` against `([^`]+)`", lead) or (
            led if "\n\n" not in raw else [])
        led = named
        if kind == "verdict":
            d, metric, arm = args
            base = load_study(REPO / BUILT.search((P.STUDIES / d / "REPORT.md").read_text())[
                1])["baseline"]
            if not named or named[-1] != (arm, base) or f"`{metric}`" not in lead:
                out.append(f"{name}: <!-- fig {key} -->: not led by `{arm}` against `{base}` "
                           f"and `{metric}` (its lead names {named[-1:] or 'none'})")
        elif kind == "compare":
            b, a = args[0].rsplit("/", 1)[-1].removeprefix("compare_").removesuffix(
                ".json").split("_vs_")
            a = re.sub(r"_n\d+$", "", a)  # the labelled-set size of a meta.py comparison
            plain = lambda x: re.sub(r"\W|_", "", x)
            near = lambda x, y: plain(x) in plain(y) or plain(y) in plain(x)
            if not named or not (near(named[-1][0], b) and near(named[-1][1], a)):
                out.append(f"{name}: <!-- fig {key} -->: not led by the comparison it holds, "
                           f"{b} against {a} (its lead names {named[-1:] or 'none'})")
    return out


def unbound_problems(name: str, text: str) -> list[str]:
    """Verdict sentences outside a verdict span; decimal figures outside any span, in a
    paragraph not labelled typed (a page that opens with the label is typed throughout)."""
    out = []
    bare = P.SPAN.sub("", text)
    out += [f"{name}: a verdict not bound to its comparison: {s}" for s in VERDICT.findall(
        re.sub(r"\s*\n\s*", " ", bare))]
    if P.TYPED.match(text):
        return out
    for block in blocks(bare):
        if P.TYPED.search(block):
            continue
        prose = re.sub(r"`[^`]*`|<!--.*?-->|\]\([^)]*\)", "", block, flags=re.S)
        found = FIGURE.findall(prose)
        if found:
            out.append(f"{name}: figures neither from a record nor labelled typed "
                       f"({', '.join(found[:6])}) in: {block.strip()[:160]!r}")
    return out


def page_problems(page, text: str, rebuilt: dict) -> list[str]:
    name = rel(page)
    if page.name == "REPORT.md":
        return []  # generated whole: test_each_committed_report_is_its_rebuild_claim
    return spans_problems(name, text, rebuilt) + unbound_problems(name, text)


def test_every_quoted_figure_and_verdict_is_its_records_claim(rebuilt):
    """Every page: its spans hold what their sources give, its verdicts are bound, its other
    figures are labelled typed; and the README and the study pages do quote verdicts (so that
    this cannot pass by finding none)."""
    problems, quoting = [], set()
    for page in P.pages():
        text = page.read_text()
        problems += page_problems(page, text, rebuilt)
        if any(m["key"].split()[0] in ("verdict", "compare") for m in P.SPAN.finditer(text)):
            quoting.add(rel(page))
    assert not problems, "\n".join(problems)
    assert {"README.md", "docs/studies/meta_two_moons_shen.md", "docs/studies/gpt_bert_cpu.md",
            "docs/studies/synthetic_breton_cpu.md", "docs/studies/better_together_cpu.md"
            } <= quoting


def test_each_committed_report_is_its_rebuild_claim(rebuilt):
    """REPORT.md is what study.py --report writes from results/ today (its figures section
    and the --out it was built into aside)."""
    for d, folder in rebuilt.items():
        cut = lambda text: BUILT.sub("Built by", text.split("\n## Figures\n")[0]).rstrip()
        assert cut((P.STUDIES / d / "REPORT.md").read_text()) == cut(
            (folder / "REPORT.md").read_text()), f"docs/studies/{d}/REPORT.md: rebuild it"


EDITS = {  # the edits a page must not survive, each on a copy of its text
    "two verdict sentences of one page swapped": ("docs/studies/gpt_bert_cpu.md", "swap"),
    "two verdicts swapped with their comments": ("docs/studies/gpt_bert_cpu.md", "swap spans"),
    "a verdict of one study pasted into the README": ("README.md", "paste"),
    "the same, with its comment": ("README.md", "paste span"),
    "a verdict of one study pasted into another's page": ("docs/studies/gpt_bert_cpu.md",
                                                          "paste"),
    "a figure changed on a study page": ("docs/studies/gpt_bert_cpu.md", "figure"),
    "a figure of bench.md's GPU table changed": ("docs/bench.md", "gpu table"),
    "a figure of docs/status.md changed": ("docs/status.md", "figure"),
}


def edited(text: str, how: str, other: str) -> str:
    spans = list(P.SPAN.finditer(text))
    if how.startswith("swap"):  # two verdicts of different comparisons exchanged: the
        v = [m for m in spans if m["key"].startswith("verdict")]  # sentences, or the spans
        a, b = next((x, y) for x in v for y in v if P.said(x) != P.said(y))
        first, second = sorted((a, b), key=lambda m: m.start())
        put = (lambda m, n: m.group(0).replace(m["text"], n["text"])) if how == "swap" else (
            lambda m, n: n.group(0))
        return (text[:first.start()] + put(first, second) + text[first.end():second.start()] +
                put(second, first) + text[second.end():])
    if how.startswith("paste"):  # another page's verdict, as plain text or with its comment,
        m = next(m for m in P.SPAN.finditer(other) if m["key"].startswith("verdict"))
        pasted = m.group(0) if how == "paste span" else P.said(m)  # under the README's result
        head = "\n## A result\n"                                    # or into the page's list
        at = text.index(head) + len(head) if head in text else text.index("\n- ")
        return text[:at] + f"\n- The result: {pasted}.\n" + text[at:]
    # a figure a span holds (a row of one of the GPU section's tables, for bench.md), its first
    # digit moved
    if how == "gpu table":
        start = text.index("\n## GPU\n")
        m = next(m for m in spans if m.start() > start and m["key"].split()[0] in (
            "table", "headline"))
        row = re.search(r"^\|[^\n]*?(\d)", m["text"], re.M)
        at = m.start("text") + row.start(1)
    else:
        m = next(m for m in spans if m["key"].split()[0] in ("value", "report", "results") and
                 re.search(r"\d", m["text"]))
        at = m.start("text") + re.search(r"\d", m["text"]).start()
    return text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:]


def test_pages_that_hold_no_typed_figure_claim():
    """The pages whose every figure comes from a record: no paragraph of theirs says typed, so
    any figure changed there is one of a span, and found; and bench.md's GPU measurements, each
    saved bench.json and each `headline` folder, stand there as spans of their records."""
    for page in ("docs/studies/gpt_bert_cpu.md", "docs/status.md"):
        assert not P.TYPED.search((REPO / page).read_text()), page
    bench = (REPO / "docs/bench.md").read_text()
    gpu = bench[bench.index("\n## GPU\n"):]
    keys = {m["key"] for m in P.SPAN.finditer(gpu)}
    for f in sorted((REPO / "docs/bench").glob("gpu_*.json")):
        assert f"table {rel(f)}" in keys, f.name
    headlines = [k.split()[1:] for k in keys if k.startswith("headline")]
    assert sorted(sum(headlines, [])) == sorted(
        rel(d) for d in (REPO / "docs/bench").glob("gpu_*headline*") if d.is_dir())


@pytest.mark.parametrize("what", EDITS)
def test_each_edit_a_page_must_not_survive_fails_the_claim_checks(rebuilt, what):
    """The check itself, on copies: the page as committed passes, and each edit of it is found,
    the problem naming the page."""
    page, how = EDITS[what]
    text = (REPO / page).read_text()
    assert not page_problems(REPO / page, text, rebuilt)
    other = (REPO / "docs/studies/better_together_cpu.md").read_text()
    changed = edited(text, how, other)
    assert changed != text
    problems = page_problems(REPO / page, changed, rebuilt)
    assert problems and all(p.startswith(page) for p in problems), problems


def test_each_report_shows_commands_that_train_its_arms_claim():
    """In every committed report, the first train.py command under each arm's first seed,
    parsed by train.py's own parser, has every setting the study file gives that arm (its
    objective, its flags and the scale's flags for it): run as printed, it trains that arm, not
    another recipe (the gpt-bert-house runs were made as `gpt-bert` under older defaults; the
    report shows today's command first, and theirs after)."""
    import train
    checked = 0
    for report in sorted(P.STUDIES.glob("*/REPORT.md")):
        path, scale_name, _ = BUILT.search(report.read_text()).groups()
        spec = load_study(REPO / path)
        scale = spec["scales"][scale_name]
        text = report.read_text()
        for arm, conf in spec["arms"].items():
            head = re.search(rf"^`{re.escape(arm)} s{scale['seeds'][0]}`[^\n]*\n```bash\n(.*?)```",
                             text, flags=re.S | re.M)
            assert head, (report, arm)
            line = next(x for x in head.group(1).splitlines() if x.startswith("python train.py"))
            argv = shlex.split(line)[2:]
            arm_flags = shlex.split(conf.get("flags", "") + " " + scale.get(
                "arm_flags", {}).get(arm, ""))
            unset = argparse.Namespace(**dict.fromkeys(train.DEFAULTS, train.UNSET))
            typed = [k for k, v in vars(train.parser.parse_args(arm_flags, unset)).items()
                     if v is not train.UNSET]  # the dests the arm's flags set
            # the arm's flags given again after the command's own: argparse keeps the last, so
            # a setting the command lacks or gives otherwise shows as a difference
            got, want = train.get_args(argv), train.get_args(argv + arm_flags)
            assert got.objective == conf["objective"], (report.name, arm)
            for dest in typed:
                assert getattr(got, dest) == getattr(want, dest), (report.name, arm, dest)
            checked += 1
    assert checked >= 10
