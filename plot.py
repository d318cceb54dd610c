"""Runs' curves in one picture: every figure a run logs (the loss, accuracy, each objective's own
stats, the gradient norm), its training values as lines and its validation values as dots, the
runs overlaid, one panel a figure, against steps or tokens. Reads log.jsonl and args.json.
`loss` is each objective's own (boot's is 1 x LB + 0.1 x MLM); objectives compare on `acc` and,
for the two-phase and boot ones, on their `mlm` term.

    python plot.py runs/mlm_babylm_10m_tiny runs/boot_babylm_10m_tiny          # curves.png
    python plot.py runs/mlm_* --x tokens --out docs/figures/mlm.png

Needs matplotlib (pip install -r requirements-figures.txt); training never does.
"""
import json
from pathlib import Path

from machinery.plumbing import Parser, RunFolder, one_line_os_errors


NOT_FIGURES = {"step", "lr", "tok_per_s", "peak_mem_gb", "error"}  # logged, but not curves
# what each logged figure is (train.py's objectives' stats), as its panel's y-axis says
LABELS = {"loss": "the objective's loss", "acc": "masked-token accuracy",
          "grad_norm": "gradient norm, before clipping", "mlm": "MLM cross-entropy (nats)",
          "kd": "KL(teacher || student) (nats)", "kl": "KL(sparse code || prediction) (nats)",
          "lb": "latent bootstrap, smooth L1", "target_std": "teacher targets' spread",
          "nnz": "nonzero code entries per token", "zero_rate": "share of all-zero codes"}


def read_run(folder: Path) -> tuple[list[dict], dict]:
    """(the run's log records, its settings), or one line saying what is missing."""
    if not folder.is_dir():
        raise SystemExit(f"error: no run folder at {folder}")
    run = RunFolder(folder, master=False)  # read only
    settings = folder / "args.json"
    if not run.log_path.is_file() or not settings.is_file():
        raise SystemExit(f"error: {folder} is not a run folder (no log.jsonl or args.json)")
    records = run.records()
    if run.skipped:  # a torn or garbled line: the curves are drawn without it, and it is said
        print(f"note: {run.log_path}: {run.skipped} line{'s' * (run.skipped > 1)} not a log "
              f"record (torn by a kill, or edited?) left out")
    return records, json.loads(settings.read_text())


def curves(records: list[dict]) -> dict[str, dict[str, list]]:
    """{figure: {"train": [(step, value)], "val": [(step, value)]}}: a training record's figures
    and a validation record's val_ ones under the same name."""
    out = {}
    for r in records:
        split = "val" if any(k.startswith("val_") for k in r) else "train"
        for k, v in r.items():
            name = k[4:] if split == "val" and k.startswith("val_") else k
            if name not in NOT_FIGURES and isinstance(v, (int, float)):
                out.setdefault(name, {"train": [], "val": []})[split].append((r["step"], v))
    return out


FORMATS = (".png", ".pdf", ".svg")  # what --out may be


def plot(folders: list[Path], out: Path, x: str = "step") -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")  # a file, no window
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: plot.py needs matplotlib: pip install -r "
                         "requirements-figures.txt") from None
    runs = {}
    for folder in folders:
        records, args = read_run(folder)
        # tokens per step: sequences per step (per process; DDP's processes are not in
        # args.json) times the tokens of a sequence
        per_step = args["batch_size"] * args["grad_accum"] * args["seq_len"]
        # a folder's name, or its path where two runs share a name (runs/a/s0, runs/b/s0)
        label = folder.name if [f.name for f in folders].count(folder.name) == 1 else str(folder)
        runs[label] = (curves(records), per_step if x == "tokens" else 1)
    names = sorted({n for c, _ in runs.values() for n in c}, key=lambda n: (n != "loss", n))
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for i, (run, (c, scale)) in enumerate(runs.items()):
            color = f"C{i % 10}"
            for split, style in (("train", dict(lw=1.2)), ("val", dict(ls="", marker="o", ms=4))):
                points = c.get(name, {}).get(split, [])
                if points:
                    steps, values = zip(*points)
                    # a line through one point draws nothing: mark it
                    one = dict(marker="x") if len(points) == 1 and split == "train" else {}
                    ax.plot([s * scale for s in steps], values, color=color, **style, **one,
                            label=f"{run} ({split})")
        ax.set_title(name)
        ax.set_ylabel(LABELS.get(name, name))
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    with one_line_os_errors(out):  # an unwritable --out is one line, not a traceback
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None):
    p = Parser(prog="plot.py", description=__doc__)
    p.add_argument("runs", nargs="+", type=Path, help="run folders (train.py's --out-dir)")
    p.add_argument("--x", default="step", choices=["step", "tokens"],
                   help="the horizontal axis: optimizer steps, or tokens seen (per process)")
    p.add_argument("--out", type=Path, default=Path("curves.png"), help="the PNG to write")
    args = p.parse_args(argv)
    if args.out.suffix.lower() not in FORMATS:  # matplotlib would add .png, unsaid
        p.error(f"--out {args.out}: name the file with its kind, one of {', '.join(FORMATS)}")
    if len({r.resolve() for r in args.runs}) < len(args.runs):
        p.error("a run folder is given twice: each curve once")
    print(f"wrote {plot(args.runs, args.out, args.x)}")


if __name__ == "__main__":
    main()
