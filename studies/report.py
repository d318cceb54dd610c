"""A study's report from its results/ alone: each arm against the baseline, by a seed-level
Student's t (its 95% holds at the few seeds a study runs) and by the Multi-Bootstrap over
pretraining seeds and examples (report.json; a spread below 25 seeds), REPORT.md with the exact
commands, report.json, and the figures (matplotlib, when installed).

    python study.py studies/better_together.toml --report
"""
import json
import os
import shlex
from pathlib import Path

import numpy as np

from evaluation.multibootstrap import examples_of, in_units, multibootstrap, signed, verdict
from evaluation.results import read_result
from machinery.plumbing import REPO
from studies.plan import diagnostic_metrics, metric_names, plan, scale_arms, shown


def read_results(folder: Path, jobs_by_arm: dict) -> tuple[dict, list, list, list]:
    """({arm: [result, ...] by seed}, stale files, failures, partial results). A result whose
    fingerprint is not the plan's (the study file changed since) is stale, and a partial one
    (training stopped by study.py --train-until) stopped short of its steps: listed, never
    compared."""
    results, stale, failed = {}, [], []
    partial = [{"file": str(path.relative_to(folder)), **read_result(path)["stopped"]}
               for path in sorted((folder / "results").glob("*/partial-s*.json.gz"))]
    for path in sorted((folder / "results").glob("*/s*.json.gz")):
        r = read_result(path)
        if r.get("fingerprint") != jobs_by_arm.get((r.get("arm"), r.get("seed"))):
            stale.append(str(path.relative_to(folder)))
            continue
        results.setdefault(r["arm"], []).append(r)
    for path in sorted((folder / "results").glob("*/s*.failed")):
        failed.append(json.loads(path.read_text()))
    return ({a: sorted(rs, key=lambda r: r["seed"]) for a, rs in results.items()}, stale, failed,
            partial)


def subset(ex: dict, keep: np.ndarray) -> dict:
    return {**ex, "id": [ex["id"][i] for i in keep], "label": ex["label"][keep],
            "pred": ex["pred"][:, keep]}


def compare_arms(study, scale_name, results, nboot) -> dict:
    """{metric: {arm: multibootstrap(baseline, arm)}}, per BLiMP phenomenon, and each arm's
    verdict sentence against the baseline ({metric: {arm: sentence}})."""
    base = study["baseline"]
    out, phen = {}, {}
    if base not in results:
        return {"metrics": out, "phenomena": phen, "verdicts": {}}
    names = study.get("metrics") or metric_names(study["scales"][scale_name])
    for m in names:
        A = [examples_of(r, m, f"{base} s{r['seed']}") for r in results[base] if m in r]
        for arm, rs in results.items():
            B = [examples_of(r, m, f"{arm} s{r['seed']}") for r in rs if m in r]
            if A and B:
                out.setdefault(m, {})[arm] = multibootstrap(A, B, nboot)
            if A and B and "phenomenon" in results[base][0].get(m, {}):
                labels = np.array(results[base][0][m]["phenomenon"])
                for p in np.unique(labels):
                    keep = np.flatnonzero(labels == p)
                    phen.setdefault(m, {}).setdefault(str(p), {})[arm] = multibootstrap(
                        [subset(a, keep) for a in A], [subset(b, keep) for b in B], nboot)
    verdicts = {m: {arm: verdict(r["seed_level"], r["better"], len(r["seeds_a"]),
                                 len(r["seeds_b"])) for arm, r in by_arm.items() if arm != base}
                for m, by_arm in out.items()}
    return {"metrics": out, "phenomena": phen, "verdicts": verdicts}


def metric_table(m: str, comp: dict, arms: list, base: str, diagnostic=False) -> list[str]:
    """One metric's table (each arm's seeds, mean, B - A, interval, p) and its verdicts."""
    by_arm = comp["metrics"][m]
    better = next(iter(by_arm.values()))["better"]
    lines = [("### " if diagnostic else "## ") + m + (" (lower is better)" if better == "lower"
                                                       else ""), "",
             "| arm | seeds | per seed | mean | B - A | 95% interval | p |",
             "|---|---|---|---|---|---|---|"]
    for arm in arms:
        if arm not in by_arm:
            continue
        r = by_arm[arm]
        each = " ".join(in_units(v, better) for v in r["values_b"])
        if arm == base:
            lines.append(f"| **{arm}** (baseline) | {len(r['seeds_b'])} | {each} | "
                         f"{in_units(r['mean_b'], better)} | | | |")
        else:
            t = r["seed_level"]
            ci = (f"{signed(t['ci95'][0], better)} .. {signed(t['ci95'][1], better)}"
                  if t["ci95"] else "- (one seed)")
            p = "-" if t["p"] is None else "< 0.001" if t["p"] < 0.001 else f"{t['p']:.3f}"
            lines.append(f"| {arm} | {len(r['seeds_b'])} | {each} | "
                         f"{in_units(r['mean_b'], better)} | {signed(r['diff'], better)} | "
                         f"{ci} | {p} |")
    lines.append("")
    for arm in (a for a in arms if a in comp["verdicts"].get(m, {})):
        lines.append(f"- `{arm}` against `{base}`" + (" (a diagnostic)" if diagnostic else "")
                     + f": {comp['verdicts'][m][arm]}.")
    return lines + [""]


def trained_on(r: dict) -> str:
    """How a run's result says it trained: its masking and mask rate."""
    t = r.get("trained")
    if not t:
        return "not recorded"
    rate = f"{t['mask_p']:g}" + (f" to {t['mask_p_end']:g}" if t.get("mask_p_end") is not None
                                 else "")
    return f"{t['masking']}, {rate}"


def held_out(results: dict, arms: list, base: str, comp: dict, metrics: list) -> list[str]:
    """The diagnostics' section: each arm's held-out loss and accuracy under each masking, with
    how it trained and where it is read; the count floors on the same tokens; the loss where the
    input shows the previous piece and where it does not; then each metric's comparison."""
    maskings = [m.removeprefix("loss_") for m in metrics if m.startswith("loss_")]
    mean = lambda xs: float(np.mean(xs)) if xs else None
    show = lambda x, f: "-" if x is None else f(x)
    loss = lambda x: show(x, lambda v: f"{v:.4f}")
    pct = lambda x: show(x, lambda v: f"{100 * v:.2f}")
    lines = ["## Diagnostics: held-out masked-token loss (`evaluate.py mlm`)", "",
             "Not verdicts. Each masking asks every arm the same question on the same hidden "
             "tokens, every one `[MASK]`: `uniform` hides isolated tokens (int(p T) a "
             "segment), `span` LTG-BERT's spans of mean 3. An arm that trained on a masking "
             "is favoured on it, and one read at t - 1 (the position before the hidden token) "
             "sees the real previous piece wherever it is not hidden too. Means over seeds; "
             "the unigram and bigram rows are counts of the training split scored on the same "
             "tokens (the same for every arm: one corpus, one draw), the floor a model that "
             "learnt anything is below.", "",
             "| arm | trained on | read at | " + " | ".join(
                 f"loss {m} | acc. {m}" for m in maskings) + " |",
             "|---|---|---|" + "---|---|" * len(maskings)]
    info = lambda r: r.get("mlm", {})
    for arm in arms:
        rs = results.get(arm, [])
        if not rs:
            continue
        cells = []
        for m in maskings:
            for metric, fmt in ((f"loss_{m}", loss), (f"acc_{m}", pct)):
                r = comp["metrics"].get(metric, {}).get(arm)
                cells.append(fmt(r["mean_b"]) if r else "-")
        read = sorted({info(r).get("read_at", "not recorded") for r in rs})
        lines.append(f"| {arm} | {', '.join(sorted({trained_on(r) for r in rs}))} | "
                     f"{', '.join(read)} | " + " | ".join(cells) + " |")
    floors = [info(r)["maskings"] for rs in results.values() for r in rs if info(r)]
    for name in ("unigram", "bigram"):
        cells = []
        for m in maskings:
            got = {round(f[m]["floors"][name], 6) for f in floors if m in f}
            cells += [loss(next(iter(got))) if len(got) == 1 else
                      "differs by arm" if got else "not recorded", ""]
        lines.append(f"| {name} count | | | " + " | ".join(cells) + " |")
    lines.append("")
    if floors:
        lines += ["Where the input shows the piece before a hidden token, and where it does not "
                  "(token means over seeds; the bigram's own loss where it is shown beside it):",
                  "", "| arm | masking | previous shown | loss there | loss elsewhere | "
                  "bigram there |", "|---|---|---|---|---|---|"]
        for arm in arms:
            for m in maskings:
                got = [info(r)["maskings"][m] for r in results.get(arm, [])
                       if m in info(r).get("maskings", {})]
                if got:
                    pick = lambda k: mean([g[k] for g in got if g[k] is not None])
                    lines.append(f"| {arm} | {m} | {pct(pick('previous_shown'))}% | "
                                 f"{loss(pick('loss_previous_shown'))} | "
                                 f"{loss(pick('loss_previous_hidden'))} | "
                                 f"{loss(pick('bigram_previous_shown'))} |")
        lines.append("")
    else:
        lines += ["These results were made before `evaluate.py mlm` recorded the floors and the "
                  "previous piece; their one masking is `uniform`.", ""]
    for m in metrics:
        lines += metric_table(m, comp, arms, base, diagnostic=True)
    return lines


def many_intervals(tests: list[dict]) -> str:
    """What a table of many uncorrected intervals can and cannot say: how many it holds, how
    many exclude 0, how many chance alone would (1 in 20 where nothing differs), and how many
    Holm's correction at 5% family-wise keeps (Holm 1979: the k-th smallest p against
    0.05 / (m - k + 1), stopping at the first that fails)."""
    done = [t for t in tests if t["ci95"] is not None]
    if not done:
        return "No intervals: one seed a side."
    excluding = sum(t["ci95"][0] > 0 or t["ci95"][1] < 0 for t in done)
    held = 0
    for k, p in enumerate(sorted(t["p"] for t in done)):
        if p > 0.05 / (len(done) - k):
            break
        held += 1
    return (f"{len(done)} intervals, each uncorrected: where no arm differs, chance alone "
            f"excludes 0 from about {len(done) / 20:.1f} of them; {excluding} exclude it here, "
            f"and {held} {'stands' if held == 1 else 'stand'} after Holm's correction (5%, "
            f"family-wise, over the table).")


def ran_in(results: dict) -> Path | None:
    """The study folder the runs were made in, read from an arm's recorded train command (its
    --out-dir is FOLDER/ARM/sSEED): a report may be built in another (--report --out)."""
    for r in (r for rs in results.values() for r in rs):
        argv = shlex.split(r["commands"][0])
        if "--out-dir" in argv:
            return Path(argv[argv.index("--out-dir") + 1]).parent.parent
    return None


def build_report(study, scale_name, folder, jobs, nboot, figures=True) -> str:
    scale = study["scales"][scale_name]
    arms = scale_arms(study, scale_name)
    planned = {(j.arm, j.seed): j.fingerprint for j in jobs if j.arm}
    results, stale, failed, partial = read_results(folder, planned)
    comp = compare_arms(study, scale_name, results, nboot)
    base = study["baseline"]
    held = sum(len(v) for v in results.values())
    lines = [f"# Study `{study['name']}`, scale `{scale_name}`", ""]
    if study.get("about"):
        lines += [study["about"].strip(), ""]
    devices = sorted({r["compute"]["device"] for rs in results.values() for r in rs})
    dates = sorted({r["compute"]["date"] for rs in results.values() for r in rs})
    lines += [f"Holds {held} of the {len(planned)} runs planned ({len(arms)} arms x "
              f"{len(scale['seeds'])} seeds {scale['seeds']}); made on {', '.join(devices) or '-'}"
              f", {', '.join(dates) or '-'}. Baseline: `{base}`. Built by `python study.py "
              f"{study['path']} --scale {scale_name} --report"
              + ("" if folder == REPO / "runs" / study["name"] / scale_name else
                 f" --out {os.path.relpath(folder.resolve(), REPO)}") + "` from "
              "`results/` alone.", ""]
    if scale.get("notes"):
        lines += [scale["notes"].strip(), ""]
    diagnostics = set(diagnostic_metrics(scale))
    lines += ["B - A is each arm minus the baseline, seed by seed where they share seeds. Its "
              "95% interval and p (two-sided) are Student's t over the pretraining seeds: paired "
              "where the seeds are the same (exact for normal seed effects from 2 seeds), else "
              "Welch's (approximate); in tests/test_evaluate.py's simulated studies both cover "
              "93-97% at 3, 5 and 10 seeds a side. One seed a side gets none: a demo, not a "
              "verdict. Under each table, each arm's verdict, the sentence a page quotes "
              "(evaluation/multibootstrap.verdict). The Multi-Bootstrap (seeds and examples "
              "resampled jointly, `evaluate.py compare`) is in report.json; below 25 seeds its "
              "percentiles are about the span of the per-seed differences, not a 95% interval. "
              "The verdicts stand on the field's measures (BLiMP, fine-tuning); the held-out "
              "masked-token loss and accuracy are diagnostics, each under its masking "
              "(docs/evaluation.md: a masking favours the arms that trained on it, and a model "
              "read at t - 1 sees the previous token where the others see [MASK]). Losses are "
              "in nats, lower is better; the other metrics are percentages.", ""]
    verdicts = [m for m in comp["metrics"] if m not in diagnostics]
    if not verdicts:
        lines += ["No verdict metric: this scale evaluates no BLiMP and no fine-tuning, so its "
                  "comparisons below are diagnostics alone.", ""]
    for m in verdicts:
        lines += metric_table(m, comp, arms, base)
    for m, by_phen in comp["phenomena"].items():
        shown_arms = [a for a in arms if a in next(iter(by_phen.values()))]
        total = len(results[base][0][m]["phenomenon"])
        lines += [f"## {m} per phenomenon", "",
                  f"Accuracy (%) on the reporting half, {total} pairs (the pairs a fixed hash of "
                  f"their ids puts there: figures of another study match these only if it read "
                  f"the same files); for each arm B - A [95% interval, seed-level t] against "
                  f"`{base}`.", "",
                  "| phenomenon | pairs | " + " | ".join(shown_arms) + " |",
                  "|---|---|" + "---|" * len(shown_arms)]
        for p, by_arm in by_phen.items():
            n = sum(x == p for x in results[base][0][m]["phenomenon"])
            cells = []
            for a in shown_arms:
                r = by_arm[a]
                ci = r["seed_level"]["ci95"]
                cells.append(f"{100 * r['mean_b']:.1f}" if a == base else
                             f"{100 * r['mean_b']:.1f} ({100 * r['diff']:+.1f}" + (
                                 f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}])" if ci else ")"))
            lines.append(f"| {p} | {n} | " + " | ".join(cells) + " |")
        lines += ["", many_intervals([r["seed_level"] for by_arm in by_phen.values()
                                      for a, r in by_arm.items() if a != base]), ""]
    tasks = {t for rs in results.values() for r in rs for t in r.get("finetune", {})}
    if tasks:
        lines += ["## Fine-tuning, per task (mean +- std over pretraining x fine-tuning seeds)",
                  "", "| arm | " + " | ".join(sorted(tasks)) + " |",
                  "|---|" + "---|" * len(tasks)]
        for arm in arms:
            cells = []
            for t in sorted(tasks):
                v = [x for r in results.get(arm, []) for m in list(r.get("finetune", {}).get(
                    t, {}).values())[:1] for x in m["values"]]
                cells.append(f"{100 * np.mean(v):.2f} +- {100 * np.std(v):.2f}" if v else "-")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
    if diagnostics & set(comp["metrics"]):
        lines += held_out(results, arms, base, comp, [m for m in comp["metrics"]
                                                     if m in diagnostics])
    lines += ["## Compute", "", "| arm | runs | steps | tokens | train min (mean) | "
              "eval min (mean) | tokens/s (median) | device |", "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        rs = results.get(arm, [])
        if rs:
            c = [r["compute"] for r in rs]
            rate = [x["tok_per_s"] for x in c if x["tok_per_s"]]
            lines.append(f"| {arm} | {len(rs)} | {c[0]['steps']} | {c[0]['tokens']:,} | "
                         f"{np.mean([x['train_s'] for x in c]) / 60:.1f} | "
                         f"{np.mean([x['eval_s'] for x in c]) / 60:.1f} | "
                         f"{np.median(rate):,.0f} | {c[0]['device']} |")
    lines.append("")
    lines += ["Train time is study.py's clock around train.py (set-up, phase-1 teacher, "
              "dictionary and validation included); tokens/s is the training loop's own figure.",
              ""]
    if failed or stale or partial:
        lines += ["## Not in the comparison", ""]
        lines += [f"- `{x['file']}`: training stopped at step {x['step']} of {x['max_steps']} "
                  f"(`study.py --train-until`), evaluated there" for x in partial]
        lines += [f"- `{f['arm']}` seed {f['seed']} failed: {f['error']} (log: {f['log']})"
                  for f in failed]
        lines += [f"- `{s}`: made with other settings than the study file's now (stale)"
                  for s in stale]
        lines.append("")
    lines += ["## Commands", "", "Each run, as study.py ran it (seed "
              f"{scale['seeds'][0]}; the other seeds change `--seed` and the folders):", ""]
    # corpus and source runs keep no result file: plan them again where the arms ran
    root = ran_in(results)
    as_ran = {j.name: j for j in plan(study, scale_name, root)} if root else {}
    for j in jobs:
        if j.seed == scale["seeds"][0] or (j.arm is None and j.name.endswith(
                f"s{scale['seeds'][0]}")) or j.name.startswith("corpus"):
            today = [shown(s.argv) for s in as_ran.get(j.name, j).steps]
            ran = [r for r in results.get(j.arm, []) if r["seed"] == j.seed]  # as it was run
            if not ran or ran[0]["commands"] == today:
                lines += [f"`{j.name}`:", "```bash", *today, "```"]
            else:  # run under other defaults, or as another arm: today's reproduce this one
                lines += [f"`{j.name}`, as this study file plans it today (what reproduces the "
                          f"arm):", "```bash", *today, "```", "and as it was run (its result "
                          "file's record, under the code and defaults of its date):", "```bash",
                          *ran[0]["commands"], "```"]
    if figures:
        lines += ["", *draw_figures(folder, study, results, comp)]
    (folder / "report.json").write_text(json.dumps(
        {"study": study["name"], "scale": scale_name, "runs": held, "planned": len(planned),
         "stale": stale, "failed": failed, "partial": partial, **comp}, indent=1, default=float))
    text = "\n".join(lines) + "\n"
    (folder / "REPORT.md").write_text(text)
    return text


def mlm_curve(records) -> tuple[list, list]:
    """(steps, validation MLM losses) of a run's log: val_mlm where the objective logs it (boot,
    kd, kd+mlm, mlsm+mlm), val_loss where the loss is MLM itself (records with no other figure:
    mlm, and every phase 1); mlsm's phase 2 logs no MLM loss and is left out."""
    xs, ys = [], []
    for r in records:
        y = r.get("val_mlm", r.get("val_loss") if set(r) <= {"step", "val_loss", "val_acc"}
                  else None)
        if y is not None:
            xs.append(r["step"])
            ys.append(y)
    return xs, ys


def held_out_figure(folder, study, results, comp) -> list[str]:
    """held_out.png: each arm's held-out loss under each masking, seed by seed (dots) and their
    mean (a bar), beside the unigram and bigram counts on the same tokens (lines); none where
    the results hold one masking and no floors."""
    import matplotlib.pyplot as plt
    maskings = [m.removeprefix("loss_") for m in comp["metrics"] if m.startswith("loss_")]
    floors = next((r["mlm"]["maskings"] for rs in results.values() for r in rs if "mlm" in r),
                  None)
    if len(maskings) < 2 or floors is None:
        return []
    arms = [a for a in study["arms"] if all(a in comp["metrics"][f"loss_{m}"] for m in maskings)]
    fig, axes = plt.subplots(1, len(maskings), figsize=(4.2 * len(maskings) + 0.6, 4.0),
                             sharey=True)
    for ax, m in zip(axes, maskings):
        for i, a in enumerate(arms):
            r = comp["metrics"][f"loss_{m}"][a]
            ax.bar(i, r["mean_b"], color="C0", alpha=0.35, width=0.6)
            ax.plot([i] * len(r["values_b"]), r["values_b"], "o", color="C0", ms=4)
        for name, style in (("unigram", ":"), ("bigram", "--")):
            ax.axhline(floors[m]["floors"][name], color="k", ls=style, lw=1,
                       label=f"{name} count")
        read = {a: next((r["mlm"]["read_at"] for r in results[a] if "mlm" in r), "?")
                for a in arms}
        trained = {a: next((r["trained"]["masking"] for r in results[a] if "trained" in r), "?")
                   for a in arms}
        ax.set_xticks(range(len(arms)), [f"{a}\ntrained: {trained[a]}\nread at {read[a]}"
                                         for a in arms], fontsize=7)
        ax.set_title(f"{m} masking", fontsize=9)
    axes[0].set_ylabel("held-out masked-token loss (nats)")
    lo = min(min(r["values_b"]) for m in maskings for r in comp["metrics"][f"loss_{m}"].values())
    axes[0].set_ylim(bottom=min(lo, min(f["floors"]["bigram"] for f in floors.values())) - 0.3)
    axes[-1].legend(fontsize=7)
    fig.suptitle("The same hidden tokens for every arm, under two maskings (dots: seeds)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(folder / "held_out.png", dpi=110)
    plt.close(fig)
    return ["![held-out loss under each masking](held_out.png)", "", "Each arm's held-out "
            "masked-token loss under each masking, every seed a dot, beside what the unigram "
            "and bigram counts of the training split score on the same tokens; the labels say "
            "how each arm trained and where it is read.", ""]


def draw_figures(folder, study, results, comp) -> list[str]:
    """curves.png and blimp.png when matplotlib is there; the report's lines about them."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ["Figures: `pip install -r requirements-figures.txt`, then run study.py again with "
                "`--report`."]
    out = ["## Figures", ""]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in study["arms"]:
        curves = [mlm_curve(r["curve"]) for r in results.get(arm, [])]
        curves = [c for c in curves if len(c[0]) > 1]  # mlsm: phase 1's last point alone
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c[0]) for c in curves)))
        ys = np.array([[dict(zip(*c))[s] for s in steps] for c in curves])   # (seeds, steps)
        line, = ax.plot(steps, ys.mean(0), label=f"{arm} ({len(curves)} seeds)")
        ax.fill_between(steps, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
    ax.set(xlabel="step", ylabel="validation MLM loss (nats)",
           title="Validation MLM loss as each run logged it (band: min-max over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=110)
    plt.close(fig)
    out += ["![validation curves](curves.png)", "", "The curves are train.py's own validation: "
            "each arm under its own training masking, so not one question for every arm (the "
            "diagnostics' tables are: `evaluate.py mlm`).", ""]
    out += held_out_figure(folder, study, results, comp)
    for m, by_phen in comp["phenomena"].items():
        phens = list(by_phen)
        arms = [a for a in study["arms"] if a != study["baseline"] and a in by_phen[phens[0]]]
        if not arms:
            continue
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(phens) * max(1, len(arms)) / 2 + 1.5))
        height = 0.8 / len(arms)
        for i, a in enumerate(arms):
            d = np.array([100 * by_phen[p][a]["diff"] for p in phens])
            cis = [by_phen[p][a]["seed_level"]["ci95"] for p in phens]  # None: one seed
            lo, hi = (np.array([100 * c[i] if c else x for c, x in zip(cis, d)]) for i in (0, 1))
            y = np.arange(len(phens)) + i * height
            ax.errorbar(d, y, xerr=[d - lo, hi - d], fmt="o", ms=3, capsize=2, label=a)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_yticks(np.arange(len(phens)) + 0.4 - height / 2, phens, fontsize=7)
        ax.set(xlabel=f"accuracy B - {study['baseline']} (points), 95% seed-level t interval",
               title=f"{m} per phenomenon")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / f"{m}.png", dpi=110)
        plt.close(fig)
        out += [f"![{m} per phenomenon]({m}.png)", ""]
    return out
