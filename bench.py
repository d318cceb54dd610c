"""Side-by-side timings, one table per benchmark, measured on the machine that runs them.

    python bench.py ema                                  # fused vs per-tensor EMA update, per model size
    python bench.py steps --size tiny --data babylm_10m  # each objective's training speed vs mlm

`steps` runs train.py itself (short runs in a temporary folder) and reads tokens/s from its
log.jsonl, skipping the first log interval (start-up, allocator warm-up), so it times exactly
what a user runs.
"""
import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from model import PRESETS, Encoder, ModelConfig, ema_update

HERE = Path(__file__).resolve().parent


def timed(fn, device, repeat):
    """Median seconds of fn() over `repeat` calls, after two warm-up calls."""
    times = []
    for i in range(repeat + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_ema(args):
    device = torch.device(args.device)
    print(f"EMA update of a whole encoder (vocab {args.vocab_size}) on {device}: median of {args.repeat}")
    print(f"{'size':<6} {'params':>8} {'tensors':>8} {'loop ms':>9} {'fused ms':>9} {'speed-up':>9}")
    for size in args.sizes:
        student = Encoder(ModelConfig(**PRESETS[size], vocab_size=args.vocab_size)).to(device)
        teacher = copy.deepcopy(student)
        loop = timed(lambda: ema_update(teacher, student, 0.999, fused=False), device, args.repeat)
        fused = timed(lambda: ema_update(teacher, student, 0.999, fused=True), device, args.repeat)
        n = sum(1 for _ in student.parameters())
        print(f"{size:<6} {student.num_params() / 1e6:7.1f}M {n:>8} {1e3 * loop:9.3f} {1e3 * fused:9.3f} {loop / fused:8.2f}x")


def bench_steps(args):
    flags = ["--data", args.data, "--size", args.size, "--batch-size", str(args.batch_size), "--seq-len", "128",
             "--max-steps", str(2 * args.steps), "--log-every", str(args.steps), "--eval-every", "100000",
             "--save-every", "100000", "--device", args.device]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for objective in args.objectives:
            extra = ["--teacher", str(Path(tmp) / "mlm" / "ckpt.pt")] if objective.startswith("kd") else []
            if extra and "mlm" not in args.objectives:
                raise SystemExit("error: kd needs the mlm run's checkpoint as its teacher; keep mlm in --objectives")
            r = subprocess.run([sys.executable, str(HERE / "train.py"), "--objective", objective, *flags, *extra,
                                "--out-dir", str(Path(tmp) / objective)], capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"error: train.py --objective {objective} failed:\n{r.stderr[-2000:]}")
            log = [json.loads(line) for line in (Path(tmp) / objective / "log.jsonl").read_text().splitlines()]
            rows.append((objective, [e["tok_per_s"] for e in log if "tok_per_s" in e][-1]))
    base = dict(rows).get("mlm")
    print(f"training speed, {args.size} model, {args.batch_size} x 128 tokens per step, on {args.device} "
          f"(tokens/s over steps {args.steps + 1}-{2 * args.steps})")
    print(f"{'objective':<10} {'tokens/s':>10} {'step time vs mlm':>17}")
    for objective, tps in rows:
        print(f"{objective:<10} {tps:10.0f} {f'{base / tps:.2f}x' if base else '-':>17}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="bench", required=True)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    e = sub.add_parser("ema", help="fused (torch._foreach_lerp_) vs per-tensor EMA update")
    e.add_argument("--sizes", nargs="+", default=list(PRESETS), choices=list(PRESETS), help="model presets (default all)")
    e.add_argument("--vocab-size", type=int, default=16384, help="(default 16384)")
    e.add_argument("--repeat", type=int, default=50, help="timed calls per variant (default 50)")
    e.add_argument("--device", default=auto, help=f"(default {auto})")
    e.set_defaults(func=bench_ema)
    s = sub.add_parser("steps", help="tokens/s of each objective, and its step time relative to mlm")
    s.add_argument("--objectives", nargs="+", default=["mlm", "boot", "kd"], help="(default mlm boot kd)")
    s.add_argument("--data", default="babylm_10m", help="as train.py --data (default babylm_10m)")
    s.add_argument("--size", default="tiny", choices=list(PRESETS), help="(default tiny)")
    s.add_argument("--batch-size", type=int, default=32, help="(default 32)")
    s.add_argument("--steps", type=int, default=30, help="steps per timed interval; each run takes twice this (default 30)")
    s.add_argument("--device", default=auto, help=f"(default {auto})")
    s.set_defaults(func=bench_steps)
    args = ap.parse_args()
    args.func(args)
