"""Progress: every long job says what it is doing, in a terminal or not (batch jobs, nohup, CI):
a tqdm bar, or a line every QUIET_SECONDS without a terminal; the training loop's bar and ETA;
durations in words; heartbeats for one long call with nothing to count.
"""
import contextlib
import io
import re
import sys
import threading
import time

from tqdm import tqdm


QUIET_SECONDS = 30  # with no terminal, a progress line at most this often


class _Lines:
    """tqdm's file when there is no terminal: each refresh, which tqdm writes as '\\r' + the
    status, becomes one line of its own."""

    def __init__(self, f):
        self.f = f

    def write(self, s):
        for part in re.split(r"[\r\n]", s):
            if part.strip():
                self.f.write(part.rstrip() + "\n")
                self.f.flush()

    def flush(self):
        self.f.flush()


def bar(iterable=None, **kw) -> tqdm:
    """A tqdm bar in a terminal. With none (tqdm alone would fall silent), a line with the count,
    rate and ETA every QUIET_SECONDS once it has run that long. disable=True silences it."""
    if kw.get("disable") is True or sys.stderr.isatty():
        return tqdm(iterable, **{"dynamic_ncols": True, **kw})
    return tqdm(iterable, **{**kw, "disable": False, "file": _Lines(sys.stderr), "ascii": True,
                             "ncols": 100, "mininterval": QUIET_SECONDS,
                             "maxinterval": QUIET_SECONDS, "delay": QUIET_SECONDS})


class StepProgress:
    """The training loop's progress: its bar, and the rate its log lines' ETAs read. Both count
    from the end of each phase's first step in this sitting, the one that compiles the step: a
    compile can take a large share of a short run, and a rate that held it would promise hours
    for minutes (docs/bench.md). The rate keeps the evaluations and saves since then: they recur
    until the end."""

    def __init__(self, step: int, total: int, shown: bool):
        self.bar = bar(total=total, initial=step, disable=None if shown else True, unit="step",
                       desc="train")
        self.update = self.bar.update  # tqdm's own: none of this file runs at every step
        self.total, self.timed_from, self.t = total, step, time.time()

    def restart(self, step: int) -> None:
        """At the end of a phase's first step in this sitting (`step`: the steps done then),
        before the bar counts it (counted first, a bar without a terminal would print its line
        with that step's rate: "1/7246 [00:54<110:16:28, 54.79s/step]")."""
        self.timed_from, self.t = step, time.time()
        self.bar.unpause()  # the bar's elapsed time, rate and ETA leave that step out too

    def eta(self, step: int) -> float | None:
        """Seconds left at this phase's rate since its first step here; None at that step."""
        timed = step - self.timed_from
        return (self.total - step) * (time.time() - self.t) / timed if timed else None

    def close(self) -> None:
        self.bar.close()


def duration(seconds: float) -> str:
    """45s, 2m30s, 12m, 3h05m: an ETA or an elapsed time in a log line; to the second below ten
    minutes, so that lines half a minute apart never read the same."""
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 10 * 60:
        return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def line_buffered() -> None:
    """Print's lines reach stdout at once even when it is a file (a batch job's log), not in
    blocks of 8 kB; a stream that cannot be reconfigured (a notebook's) is left as it is."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)


@contextlib.contextmanager
def heartbeat(what: str, every: float = QUIET_SECONDS):
    """A line every `every` seconds while the block runs: for one long call that has no progress
    to count (sentencepiece's trainer)."""
    done, t0 = threading.Event(), time.time()

    def beat():
        while not done.wait(every):
            print(f"{what}: still running, {duration(time.time() - t0)} so far",
                  file=sys.stderr, flush=True)
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
