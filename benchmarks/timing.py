"""How bench.py measures: rates after warm-up calls (CUDA synchronised around each call), two
functions timed in turn so that a slow spell of the machine hits both, a table row (or a failed
one, with its error), torch.profiler's top operators per step (--profile), and the markdown
table of a saved bench.json (docs/bench.md's).
"""
import statistics
import time

import torch


def rates(fn, work, device, warmup, repeat) -> list[float]:
    """work / seconds of each of `repeat` calls of fn(), after `warmup` calls."""
    out = []
    for i in range(warmup + repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            out.append(work / (time.perf_counter() - t))
    return out


def row(bench, case, unit, ours, ref_name="-", ref=None, **extra):
    """One table row: medians with min/max, and ours/reference."""
    r = {"bench": bench, "case": case, "unit": unit, "ours": statistics.median(ours),
         "min": min(ours), "max": max(ours), "reference": ref_name,
         "ref": statistics.median(ref) if ref else None, **extra}
    r["ratio"] = r["ours"] / r["ref"] if r["ref"] else None
    return r


def failed_row(bench, case, error: str):
    """A row that measured nothing: `failed` holds the last lines of what went wrong."""
    return {"bench": bench, "case": case, "unit": None, "ours": None, "min": None, "max": None,
            "reference": "-", "ref": None, "ratio": None, "failed": error}


def alternate(fn_a, fn_b, work, device, warmup, repeat):
    """rates() of two functions called in turn, so that a slow spell of the machine hits both."""
    a, b = [], []
    for i in range(warmup + repeat):
        a += rates(fn_a, work, device, int(i < warmup), int(i >= warmup))
        b += rates(fn_b, work, device, int(i < warmup), int(i >= warmup))
    return a, b


PROFILES = {}  # case -> {model: top operators per step}, with --profile; saved in bench.json


def profile_ops(fn, device, steps: int = 1, top=15) -> list[dict]:
    """The operators of `steps` calls of fn, by self time (torch.profiler; device time on a
    GPU): op, ms per call of fn, calls per call of fn, share of the total."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    ops = sorted(prof.key_averages(), key=lambda e: -getattr(e, attr))
    total = sum(getattr(e, attr) for e in ops)
    return [{"op": e.key, "ms": getattr(e, attr) / 1e3 / steps, "calls": e.count / steps,
             "share": getattr(e, attr) / total} for e in ops[:top]]


def print_profiles():
    for case, models in PROFILES.items():
        for name, ops in models.items():
            print(f"\n{case}, {name}: a step's top operators by self time")
            for o in ops:
                print(f"  {o['op'][:44]:44s} {o['ms']:9.2f} ms {o['share']:6.1%} "
                      f"{o['calls']:7.1f} calls")


MAIN = ("bench", "case", "unit", "ours", "min", "max", "reference", "ref", "ratio")  # columns


def fmt(x):
    return "-" if x is None else f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table(saved: dict) -> str:
    """The markdown table of a bench.json: a heading line and one row per measurement."""
    lines = [f"bench.py on {saved['machine']}, torch {saved['torch']}, {saved['date']}; "
             f"median [min, max] of repetitions", "",
             "| bench | case | ours | unit | reference | reference's | ours / ref | other |",
             "|---|---|---|---|---|---|---|---|"]
    for r in saved["rows"]:
        if r.get("failed"):
            lines.append(f"| {r['bench']} | {r['case']} | failed | - | - | - | - | "
                         f"{r['failed'].splitlines()[0].replace('|', '/')} |")
            continue
        other = ", ".join(f"{k} {fmt(v) if isinstance(v, float) else v}" for k, v in r.items()
                          if k not in MAIN and v is not None)
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"| {r['bench']} | {r['case']} | {fmt(r['ours'])} [{fmt(r['min'])}, "
                     f"{fmt(r['max'])}] | {r['unit']} | {r['reference']} | {fmt(r['ref'])} | "
                     f"{ratio} | {other} |")
    return "\n".join(lines)
