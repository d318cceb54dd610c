"""Every verdict a page quotes is one the code makes from the committed result files: the study
reports rebuilt from their results/ (study.py --report), and the comparisons saved beside them
(evaluate.py compare --out), each give their sentences (evaluation/multibootstrap.verdict); every
verdict-shaped sentence in README.md, docs/studies/ and docs/objectives/ must be one of them,
word for word. A number retyped by hand, or left behind when results change, fails here."""
import json
import re
import shlex
import shutil

import pytest

import study
from conftest import REPO
from machinery import flags
from evaluation.multibootstrap import verdict
from studies.plan import load_study

# the three shapes multibootstrap.verdict gives, up to the end of the sentence
NUMBER = r"[+-]?\d+\.\d+"
SEEDS = r"over (?:\d+ paired seeds|\d+ and \d+ seeds \(Welch's t, approximate\))"
INTERVAL = rf"95% t interval {NUMBER}\.\.{NUMBER} {SEEDS}, p (?:= \d\.\d+|< 0\.001)"
VERDICT = re.compile(
    rf"(?:(?:higher|lower) by {NUMBER} (?:points|nats), {INTERVAL}"
    rf"|not distinguishable: {NUMBER} (?:points|nats), {INTERVAL}"
    rf"|{NUMBER} (?:points|nats) from one seed a side: a demo, no verdict)")
BUILT = re.compile(r"Built by `python study.py (\S+) --scale (\S+) --report --out (\S+)`")


def pages() -> list:
    return [REPO / "README.md", *sorted((REPO / "docs" / "studies").glob("*.md")),
            *sorted((REPO / "docs" / "studies").glob("*/REPORT.md")),
            *sorted((REPO / "docs" / "objectives").glob("*.md"))]


def quoted() -> dict:
    """{sentence: [page, ...]}: every verdict-shaped sentence of the pages (line breaks read as
    spaces: a pasted sentence may wrap)."""
    out = {}
    for page in pages():
        text = re.sub(r"\s*\n\s*", " ", page.read_text())
        for sentence in VERDICT.findall(text):
            out.setdefault(sentence, []).append(page.relative_to(REPO).as_posix())
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> set:
    """Every sentence the code makes from the committed results: each committed study report
    rebuilt from a copy of its results/ (the verdicts stand on the seed-level t alone, so a small
    --nboot changes none of them), and each saved comparison's."""
    sentences = set()
    reports = sorted((REPO / "docs" / "studies").glob("*/REPORT.md"))
    assert len(reports) >= 3
    for report in reports:
        path, scale, _ = BUILT.search(report.read_text()).groups()
        out = tmp_path_factory.mktemp(report.parent.name)
        shutil.copytree(report.parent / "results", out / "results")
        study.main([str(REPO / path), "--scale", scale, "--report", "--out", str(out),
                    "--no-figures", "--nboot", "20"])
        for by_arm in json.loads((out / "report.json").read_text())["verdicts"].values():
            sentences |= set(by_arm.values())
    compared = sorted((REPO / "docs" / "studies").glob("**/compare_*.json"))
    assert len(compared) >= 20
    for path in compared:
        r = json.loads(path.read_text())
        sentences.add(verdict(r["seed_level"], r["better"], len(r["seeds_a"]),
                              len(r["seeds_b"])))
    return sentences


def test_every_quoted_verdict_is_made_by_the_code_from_the_committed_results(made):
    """Each verdict sentence on a page, word for word, among those the results give today; the
    README and the study pages quote some (so that this cannot pass by finding none)."""
    said = quoted()
    stray = {s: where for s, where in said.items() if s not in made}
    assert not stray, "\n".join(f"{where}: {s}" for s, where in stray.items())
    where = {page for pages_ in said.values() for page in pages_}
    assert {"README.md", "docs/studies/meta_two_moons_shen.md",
            "docs/studies/gpt_bert_cpu.md", "docs/studies/synthetic_breton_cpu.md"} <= where


def test_a_number_changed_by_hand_is_caught(made):
    """The check itself: one digit of a quoted sentence changed is no longer made."""
    sentence = next(iter(quoted()))
    changed = re.sub(r"\d(?=\.\d)", lambda m: str((int(m.group()) + 1) % 10), sentence, count=1)
    assert changed != sentence and VERDICT.fullmatch(changed) and changed not in made


def test_each_report_shows_commands_that_train_its_arms():
    """In every committed report, the first train.py command under each arm's first seed,
    parsed by train.py's own parser, has every setting the study file gives that arm (its
    objective, its flags and the scale's flags for it): run as printed, it trains that arm, not
    another recipe (the gpt-bert-house runs were made as `gpt-bert` under older defaults; the
    report shows today's command first, and theirs after)."""
    import train
    checked = 0
    for report in sorted((REPO / "docs" / "studies").glob("*/REPORT.md")):
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
            parser = train.build_parser()
            # the arm's flags given again after the command's own: argparse keeps the last, so
            # a setting the command lacks or gives otherwise shows as a difference
            got, want = train.get_args(argv, parser), train.get_args(argv + arm_flags, parser)
            assert got.objective == conf["objective"], (report.name, arm)
            for dest in flags.typed(parser, arm_flags):
                assert getattr(got, dest) == getattr(want, dest), (report.name, arm, dest)
            checked += 1
    assert checked >= 10

