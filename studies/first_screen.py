"""The README's first screen, measured: runs the `python ...` lines of the README's first bash
block in order, as a newcomer would (a fresh data cache, so the preparation is timed too, and
the run, its export and its curves in a scratch folder), then its Evaluation block's BLiMP and
fine-tuning lines on that checkpoint, writes what they printed and took to
docs/studies/first_screen.json, and rewrites the README's quotes of it (between the
`first_screen` markers: the first screen and the evaluation sentence) from that file, so that
no figure there is typed by hand.

    NANOMLM_RAW=../shared/data python -m studies.first_screen      # about 15 min on 2 cores
    NANOMLM_RAW=../shared/data python -m studies.first_screen --threads 1

The second line runs the same commands with OMP_NUM_THREADS=1 and writes
first_screen_threads1.json instead, a record the quote sets beside the first one: a CPU and its
thread count order the float sums differently, and the quote says by how much that moves the
figures (every other first_screen_*.json, such as a run on another CPU, is quoted the same way).

tests/test_readme.py checks that the README's quote is `quote(first_screen.json, variants())`.
"""
import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECORD = REPO / "docs" / "studies" / "first_screen.json"
BEGIN, END = "<!-- first_screen: begin -->", "<!-- first_screen: end -->"
# the evaluation section's quote: BLiMP and fine-tuning on the same checkpoint
EVAL_BEGIN = "<!-- first_screen evaluation: begin -->"
EVAL_END = "<!-- first_screen evaluation: end -->"


def demo_commands(readme: str) -> list[list[str]]:
    """The argv (script first) of each `python SCRIPT.py ...` line of the README's first bash
    block, a trailing comment cut."""
    block = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1)
    lines = [re.split(r"\s+#", line)[0].strip() for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if re.match(r"python \S+\.py\b", line)]


def evaluation_commands(readme: str) -> list[list[str]]:
    """The argv of the `evaluate.py blimp` and `finetune` lines of the README's Evaluation
    block, its shell variables (E=...; C=...) put in."""
    block = re.search(r"## Evaluation\n+```bash\n(.*?)```", readme, flags=re.S).group(1)
    variables = dict(re.findall(r"(\w+)=([^;\s]+)", block.splitlines()[0]))
    put = lambda line: re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], line)
    lines = [put(re.split(r"\s+#", line)[0].strip()) for line in block.splitlines()[1:]]
    return [shlex.split(line)[1:] for line in lines
            if re.match(r"python evaluate\.py (blimp|finetune) ", line)]


def machine() -> str:
    """The CPU's model name and count, as the README states where it was measured."""
    name = platform.processor() or "CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = re.findall(r"model name\s*:\s*(.*)", cpuinfo.read_text())
        name = names[0].strip() if names else name
    return f"{os.cpu_count()}-core {name}"


def variants() -> list[dict]:
    """The other records of the first screen (another thread count, another CPU), by name."""
    return [json.loads(p.read_text()) for p in sorted(RECORD.parent.glob("first_screen_*.json"))]


def run_demo(scratch: Path, threads: int | None) -> dict:
    """Each command run (runs/ and hf/ under scratch, plot's PNG there too): its argv as the
    README has it, its seconds and what it printed; then the figures read from the run."""
    env = {**os.environ, "NANOMLM_DATA": str(scratch / "prepared")}  # first use: prepared
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    done = []
    readme = (REPO / "README.md").read_text()
    for argv in demo_commands(readme) + evaluation_commands(readme):
        given = [a.replace("runs/", f"{scratch}/runs/").replace("hf/", f"{scratch}/hf/")
                 for a in argv]
        if argv[0] == "train.py":  # its default folder is the checkout's runs/: not there
            given += ["--out-dir", f"{scratch}/runs/mlm_babylm_10m_tiny"]
        if argv[0] == "plot.py":
            given += ["--out", str(scratch / "curves.png")]
        t0 = time.time()
        p = subprocess.run([sys.executable, *given], cwd=REPO, env=env, capture_output=True,
                           text=True)
        if p.returncode:
            raise SystemExit(f"error: `python {shlex.join(argv)}` exited {p.returncode}:\n"
                             f"{p.stderr[-2000:]}")
        done.append({"argv": argv, "seconds": round(time.time() - t0, 1), "stdout": p.stdout})
        print(f"{shlex.join(argv)}: {done[-1]['seconds']:.0f} s", file=sys.stderr)
    run = scratch / "runs" / "mlm_babylm_10m_tiny"
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    val = [r for r in log if "val_loss" in r]
    rates = [r["tok_per_s"] for r in log if "tok_per_s" in r]
    result = lambda name: json.loads((run / "eval" / f"{name}.json").read_text())
    mlm, blimp, rte = result("mlm"), result("blimp"), result("rte")
    return {"commands": done, "val": [{k: r[k] for k in ("step", "val_loss", "val_acc")}
                                      for r in val],
            "tok_per_s": sorted(rates)[len(rates) // 2],
            "mlm": {"read_at": mlm["read_at"], "maskings": mlm["maskings"]},
            # over paradigms, all pairs, T=1: what evaluate.py blimp prints "to quote"
            "blimp": {"sentences": 2 * len(blimp["pairs"]),
                      "sentences_per_s": blimp["sentences_per_s"],
                      "macro": {g: s["macro_paradigms"][0] for g, s in blimp["summary"].items()}},
            "rte": {"seeds": len(rte["runs"]), **{k: rte["aggregate"]["accuracy"][k]
                                                  for k in ("mean", "std")}}}


def seconds(record: dict, script: str, first: str | None = None) -> float:
    """The seconds of the record's first command of `script` (and first argument `first`)."""
    return next(c["seconds"] for c in record["commands"] if c["argv"][0] == script
                and (first is None or c["argv"][1] == first))


def fill_output(record: dict) -> str:
    """What the record's `evaluate.py fill` printed."""
    return next(c["stdout"] for c in record["commands"] if c["argv"][1:2] == ["fill"])


def figures(record: dict, word: str) -> dict[str, tuple[float, str]]:
    """The record's figures a reader of the first screen compares, each with its unit: nats,
    points, or tokens/s (`word`: the fill-in whose probability is compared)."""
    fill = fill_output(record)
    m, last = record["mlm"]["maskings"], record["val"][-1]
    return {"val_loss": (last["val_loss"], "nats"), "val_acc": (100 * last["val_acc"], "points"),
            "fill": (float(re.search(rf"'{re.escape(word)}' ([\d.]+)%", fill)[1]), "points"),
            **{masking: (m[masking]["loss"], "nats") for masking in ("uniform", "span")},
            **{g: (100 * v, "points") for g, v in record["blimp"]["macro"].items()},
            "rte": (100 * record["rte"]["mean"], "points"),
            "tok_per_s": (record["tok_per_s"], "tokens/s")}


def spread(record: dict, others: list[dict]) -> str:
    """The sentence on how far the figures move with the CPU and its thread count: the largest
    difference of each unit over the record and the others (other threads, other CPUs)."""
    fill = fill_output(record)
    word = re.search(r"\[MASK\] 1: '(.*?)'", fill)[1]
    runs = [figures(r, word) for r in (record, *others)]
    far = lambda unit: max(max(r[k][0] for r in runs) - min(r[k][0] for r in runs)
                           for k, (_, u) in runs[0].items() if u == unit)
    rates = [r["tok_per_s"][0] for r in runs]
    how = lambda r: (f"{r['threads']} thread{'s' * (r['threads'] > 1)}" if "threads" in r
                     else "torch's default threads")
    on = lambda r: "here" if r["machine"] == record["machine"] else f"on a {r['machine']}"
    where = " and ".join(f"{on(r)} at {how(r)} (commit {r['commit']})" for r in others)
    return (f"The figures move with the CPU and its thread count (the order of float sums): run "
            f"again {where}, against {how(record)} above, the losses moved by at most "
            f"{far('nats'):.3f} nats, the percentages (accuracy, `fill`, BLiMP, RTE) by at most "
            f"{far('points'):.1f} points, the rate from {min(rates) / 1e3:.1f}k to "
            f"{max(rates) / 1e3:.1f}k tokens/s.")


def quote(record: dict, others: list[dict] = ()) -> str:
    """The README's paragraph on the demo, made from the record alone (its prose wrapped at 100
    columns, fill's output verbatim), and the spread of its figures over the others."""
    fill = fill_output(record)
    block = [c for c in record["commands"] if c["argv"][1:2] not in (["blimp"], ["finetune"])]
    total = sum(c["seconds"] for c in block) / 60  # the first block's, not the evaluations'
    first, last = record["val"][0], record["val"][-1]
    wrap = lambda text: textwrap.fill(text, 100)
    m = record["mlm"]["maskings"]
    floor = lambda masking, name: f"{m[masking]['floors'][name]:.2f}"
    return (wrap(f"On a {record['machine']} ({record['date']}, torch {record['torch']}, commit "
                 f"{record['commit']}) these commands took {total:.1f} minutes in all, the `pip "
                 f"install` lines aside. The training line took "
                 f"{seconds(record, 'train.py'):.0f} s (the data prepared on first use "
                 f"included) at about {record['tok_per_s'] / 1e3:.1f}k tokens/s; its validation "
                 f"loss went from {first['val_loss']:.2f} at step {first['step']} to "
                 f"{last['val_loss']:.2f} at step {last['step']}, accuracy "
                 f"{100 * last['val_acc']:.1f}% (its own span masking). `fill` then printed, in "
                 f"{seconds(record, 'evaluate.py', 'fill'):.0f} s:")
            + f"\n\n```\n{fill.rstrip()}\n```\n\n"
            + wrap(f"`evaluate.py mlm` took {seconds(record, 'evaluate.py', 'mlm'):.0f} s: "
                   f"held-out masked-token loss {m['uniform']['loss']:.2f} with isolated tokens "
                   f"hidden and {m['span']['loss']:.2f} with spans hidden, where counts of the "
                   f"training split score {floor('uniform', 'unigram')} and "
                   f"{floor('span', 'unigram')} (unigram), {floor('uniform', 'bigram')} and "
                   f"{floor('span', 'bigram')} (bigram) on the same tokens. `plot.py` "
                   f"{seconds(record, 'plot.py'):.0f} s, `export.py` "
                   f"{seconds(record, 'export.py'):.0f} s.")
            + (f"\n\n{wrap(spread(record, others))}" if others else ""))


def quote_evaluation(record: dict) -> str:
    """The README's sentence on BLiMP and fine-tuning, on the first screen's checkpoint."""
    b, rte = record["blimp"], record["rte"]
    return textwrap.fill(
        f"On the first screen's checkpoint (the same machine and day): `blimp` on the fast sets "
        f"took {seconds(record, 'evaluate.py', 'blimp') / 60:.1f} min ({b['sentences']:,} "
        f"sentences at {b['sentences_per_s']:.0f} sentences/s; "
        + ", ".join(f"{g} {100 * v:.2f}" for g, v in b["macro"].items())
        + " over paradigms, all pairs, T=1: near chance for a model this small), `finetune` on "
        f"RTE with {rte['seeds']} seeds {seconds(record, 'evaluate.py', 'finetune') / 60:.1f} "
        f"min (accuracy {100 * rte['mean']:.1f} ± {100 * rte['std']:.1f} over the seeds).", 100)


def readme_with(readme: str, text: str, begin=BEGIN, end=END) -> str:
    """The README with its quote between the markers replaced by `text`."""
    head, rest = readme.split(begin)
    return f"{head}{begin}\n{text}\n{end}{rest.split(end)[1]}"


def quoted(readme: str, begin=BEGIN, end=END) -> str:
    """What the README has between the markers."""
    return readme.split(begin)[1].split(end)[0].strip("\n")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m studies.first_screen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quote-only", action="store_true",
                    help="rewrite the README's quote from the committed record, run nothing")
    ap.add_argument("--threads", type=int, default=None,
                    help="run every command with OMP_NUM_THREADS set to this, and write the "
                         "record to first_screen_threadsN.json, beside the first screen's")
    args = ap.parse_args(argv)
    if not args.quote_only:
        if not os.environ.get("NANOMLM_RAW"):
            raise SystemExit("error: set NANOMLM_RAW to the folder that holds babylm_10m/, as "
                             "the README's block does")
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()
        import torch  # only here: --quote-only needs none of it
        out = RECORD.with_stem(f"first_screen_threads{args.threads}") if args.threads else RECORD
        with tempfile.TemporaryDirectory() as scratch:
            record = {"machine": machine(), "date": str(datetime.date.today()),
                      "torch": torch.__version__, "commit": commit,
                      "threads": args.threads or torch.get_num_threads(),  # torch's default
                      **run_demo(Path(scratch), args.threads)}
        out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}")
    readme = REPO / "README.md"
    record = json.loads(RECORD.read_text())
    text = readme_with(readme.read_text(), quote(record, variants()))
    readme.write_text(readme_with(text, quote_evaluation(record), EVAL_BEGIN, EVAL_END))
    print(f"rewrote the quote in {readme}")


if __name__ == "__main__":
    main()
