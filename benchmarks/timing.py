"""How bench.py measures: rates after warm-up calls (CUDA synchronised around each call), two
functions timed in turn so that a slow spell of the machine hits both, a table row (or a failed
one, with its error), and torch.profiler's top operators per step (--profile).
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
