"""Stop signals (SIGINT, SIGTERM), as every stage handles them: exit at once in one line, or
finish the step in progress and save it (the training loop's guard, training/guard.py, and
meta.py's loops ask after each step)."""
import contextlib
import signal
import sys

def on_stop_signals(handler) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def exit_now(signum, frame):
    """Before the loop (and at a second signal) there is nothing to save: exit at once, through
    the `finally`s that remove temp files."""
    raise SystemExit(f"{signal.Signals(signum).name}: stopped; nothing more was saved")


@contextlib.contextmanager
def exit_on_stop_signals(said: str):
    """Within the block, a stop signal exits at once with "SIGNAL: stopped `said`": for a long
    set-up between steps (a teacher's load, a dictionary learned), where the loop's handler
    would wait minutes for a step to finish. The handlers before it are back afterwards."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        raise SystemExit(f"{signal.Signals(signum).name}: stopped {said}")
    on_stop_signals(handler)
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


def catch_stop_signals(then) -> dict:
    """Ctrl-C (SIGINT) and SIGTERM, the signal a cluster preempts a job with (SIGKILL follows
    after a grace period), set got["signal"] and call `then()`: the loop finishes the step it is
    in, saves it and exits with the command that resumes it. A second signal exits at once."""
    got = {}

    def handler(signum, frame):
        if got:
            exit_now(signum, frame)
        got["signal"] = signum
        then()
        name = signal.Signals(signum).name  # said at once: a slow step may take minutes
        print(f"{name}: finishing the step in progress, then saving it (a second {name} stops "
              f"at once)", file=sys.stderr, flush=True)
    on_stop_signals(handler)
    return got


@contextlib.contextmanager
def stop_after_the_step():
    """catch_stop_signals for a loop that reads the returned `got` after each step (meta.py's):
    a signal lets the step end, a second exits at once; the handlers before it back afterwards."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield catch_stop_signals(lambda: None)
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
