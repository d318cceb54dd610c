"""The run plumbing every stage shares, in one place: the command line (argparse, with errors
in one line and ranges as types), files written safely (atomic replacement, checkpoints with a
checksum verified when read, an OS error as one line naming the file, a lock that keeps a second
process out), the device (--device, bf16 autocast, torch.compile, TF32, deterministic kernels,
peak memory), the stop signals (exit at once, or finish the step and save it), the training
loop's guard (a NaN/inf or a diverging run stopped, its last good checkpoint kept), progress (a
tqdm bar in a terminal, a line every QUIET_SECONDS without one; durations in words; heartbeats)
and the run folder:

    runs/NAME/  args.json config.json data.json  the settings, the model, the corpus' meta.json
                log.jsonl    every logged figure, one JSON record a line
                ckpt.pt ...  checkpoints (train.py: phase1.pt, dict.pt, chck_*.pt too)
                code/        every source file of the repository the run imported, at its path
                lock         held by the one process writing there
                eval/        evaluate.py's results, next to the checkpoint

    from machinery.plumbing import save_checkpoint, read_checkpoint
    save_checkpoint({"model": model.state_dict(), ...}, "runs/x/ckpt.pt")
    ckpt = read_checkpoint("runs/x/ckpt.pt")        # or one line saying what is wrong with it
"""
import argparse
import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]  # the repository's root


# ---------------------------------------------------------------------------------------------
# The command line as every script builds it: argparse, with errors in one line, help that shows
# each flag's default, numeric flags whose type is their range (refused in one line as the
# command line is parsed), and comma-separated lists:
#
#     p = Parser(description=__doc__)
#     p.add_argument("--lr", type=above(float, 0), default=1e-3, help="learning rate")
#     p.add_argument("--seeds", type=numbers(at_least(int, 0)), default="0,1")
#     args = p.parse_args()  # --lr 0: "error: argument --lr: must be > 0, not 0; see --help"


class Parser(argparse.ArgumentParser):
    """argparse's parser, but an error is one line naming what is wrong and pointing at --help
    (argparse prints its whole usage block first, 35 lines for train.py), and `--lr -1e-3` is a
    negative number (argparse's own pattern knows -1 and -.5 but takes -1e-3 for a flag, and
    says "expected one argument" where the range would say why)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Help)  # subcommands' parsers too
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$", re.I)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class Help(argparse.RawDescriptionHelpFormatter):
    """--help: the description as written, and each flag's default after its help, unless the
    help gives it (where an objective or a size changes it) or there is none; 100 columns wide,
    the repository's lines, whatever the terminal (argparse's own width follows it)."""

    def __init__(self, prog, **kwargs):
        super().__init__(prog, **{"width": 100, "max_help_position": 26, **kwargs})

    def _format_action_invocation(self, action):
        """--[no-]bf16 for an on/off flag: one name, so that its help starts on its line."""
        if isinstance(action, argparse.BooleanOptionalAction):
            return action.option_strings[0].replace("--", "--[no-]", 1)
        return super()._format_action_invocation(action)

    def _get_default_metavar_for_optional(self, action):
        """A value's kind, not the flag's name again: --lr X, --seed N, --data VALUE."""
        return {int: "N", float: "X"}.get(getattr(action.type, "kind", action.type), "VALUE")

    def _get_help_string(self, action):
        default = action.default
        if "default" in action.help or default is None or default is False or default == "" \
                or default == argparse.SUPPRESS:
            return action.help
        return f"{action.help} (default {default:g})" if isinstance(default, float) else \
            f"{action.help} (default {default})"


@dataclass(frozen=True)
class Range:
    """A numeric flag's type (argparse's `type=`): the text read as `kind` (int or float), then
    refused in one line unless it lies between the low and high bounds (None: none), each closed
    unless said open; `value in range` checks a value that did not come from the command line."""
    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if self.kind is int else 'a number'}") from None
        if value not in self:
            raise argparse.ArgumentTypeError(f"must be {self}, not {value:g}")
        return value

    def __contains__(self, v) -> bool:
        return ((self.low is None or v > self.low or (v == self.low and not self.low_open))
                and (self.high is None or v < self.high or (v == self.high and not self.high_open)))

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")

    def refusal(self, flag: str, value) -> str:
        """The line that refuses `value` for `flag`, where the value was not parsed (a config's)."""
        return f"{flag}: must be {self}, not {value:g}"


def at_least(kind: type, low: float) -> Range:
    return Range(kind, low)


def above(kind: type, low: float) -> Range:
    return Range(kind, low, low_open=True)


def fill_unset(args, values: dict) -> None:
    """Each flag named in `values` (a preset's, a protocol's) takes its value there where the
    user left it unset (None)."""
    for k, v in values.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def numbers(allowed: Range):
    """The type of a comma-separated list flag: its values, each read and checked by `allowed`
    (a Range: its kind, and its bounds if any)."""
    def read(text: str) -> list:
        try:
            values = [allowed.kind(x) for x in text.split(",")]
        except ValueError:
            kind = "integers" if allowed.kind is int else "numbers"
            raise argparse.ArgumentTypeError(f"{text}: give comma-separated {kind}") from None
        bad = [v for v in values if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"must be {allowed}, not {bad[0]:g}")
        return values
    return read


# ---------------------------------------------------------------------------------------------
# Files: written safely, read with their checksum checked


class one_line_os_errors:
    """`with one_line_os_errors(path):` turns an OS error (a full disk, a quota, no
    permission...) into one line naming the path and, for a full disk, the space needed (`need`
    bytes, if known) and free. It also sees an OSError that another error was raised while
    handling (torch.save reports a failed write as a RuntimeError whose context is the OSError)."""

    def __init__(self, path, need: int | None = None):
        self.path, self.need = Path(path), need

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        while isinstance(e, Exception) and not isinstance(e, OSError):  # not SystemExit
            e = e.__context__
        if not isinstance(e, OSError):
            return False
        space = ""
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            there = next(p for p in [self.path, *self.path.parents] if p.exists())
            need = f"about {size_text(self.need)} needed, " if self.need else ""
            space = f" ({need}{size_text(shutil.disk_usage(there).free)} free)"
        raise SystemExit(f"error: cannot write {self.path}: "
                         f"{e.strerror or type(e).__name__}{space}") from None


def file_to_write(path, error, what: str) -> Path:
    """An --out that names a file to write, checked before the work: a folder is refused by
    `error` (the parser's, one line: give `what`), and the file's folder is made now, so that one
    that cannot be made stops in one line too, not after hours of work."""
    out = Path(path)
    if out.is_dir():
        error(f"--out {out} is a folder; give {what}")
    with one_line_os_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
    return out


def folder_to_write(path, error, flag: str = "--out") -> Path:
    """An --out that names a folder to write, checked and made before the work: a file there
    is refused by `error` (the parser's, one line), a folder that cannot be made in one line."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        error(f"{flag} {out} is a file, not a folder")
    with one_line_os_errors(out):
        out.mkdir(parents=True, exist_ok=True)
    return out


def hold_lock(path, what: str, advice: str):
    """Hold the lock file `path` (flock) while the returned file stays open; a second process is
    refused in one line. The kernel drops a dead process' lock: a stale file is taken over."""
    path = Path(path)
    with one_line_os_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise SystemExit(f"error: {what} is in use by {holder}; {advice}") from None
    except OSError as e:  # a filesystem without flock (some Lustre, NFS or FUSE mounts)
        print(f"warning: cannot lock {path} ({e.strerror}); nothing stops a second process "
              f"from writing {what} at the same time")
    with one_line_os_errors(path):
        f.truncate(0)
        f.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
    return f


@contextlib.contextmanager
def atomic_write(path, need: int | None = None):
    """`with atomic_write(path) as tmp:` write tmp, then one rename replaces `path`: a kill leaves
    the old file or the new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with one_line_os_errors(path, need):
            yield tmp
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_checkpoint(state: dict, path) -> None:
    """torch.save's bytes of `state` beside their sha256, written atomically: torch.load never
    checks its zip's CRCs, so flipped bytes would load as silently wrong weights."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getbuffer()
    with atomic_write(path, len(data)) as tmp, open(tmp, "wb") as f:
        torch.save({"sha256": hashlib.sha256(data).hexdigest(),
                    "state": torch.frombuffer(data, dtype=torch.uint8)}, f)  # its bytes, as is
        f.flush()
        os.fsync(f.fileno())


def load_state(path, map_location="cpu") -> dict:
    """The state in a file save_checkpoint wrote, its checksum verified before it is unpickled,
    or one line saying what is wrong with the file."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"error: no checkpoint at {path}")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, random bytes, a pickle of something else...
        raise SystemExit(f"error: cannot read checkpoint {path} (corrupt or truncated file: "
                         f"{type(e).__name__})") from None
    if isinstance(saved, dict) and "checksum" in saved:
        raise SystemExit(f"error: {path} was written by an older nanoMLM, which checked its "
                         f"files another way; read it with that version, or train it again")
    if not isinstance(saved, dict) or "sha256" not in saved:
        raise SystemExit(f"error: {path} has no checksum: it was not written by nanoMLM")
    data = saved["state"].numpy()  # the bytes torch.save wrote, hashed and read in place
    if hashlib.sha256(data).hexdigest() != saved["sha256"]:
        raise SystemExit(f"error: {path} is corrupt: its content does not match the checksum "
                         f"it was saved with (damaged on disk or in a copy); use another "
                         f"checkpoint")
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)


def checkpoint_identity(path) -> dict:
    """What stands for a checkpoint's weights in the fingerprint of work kept from them (its
    resolved path, size and modification time): a retrained file gets a new one."""
    stat = Path(path).stat()
    return {"ckpt": str(Path(path).resolve()), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns}


def read_checkpoint(path) -> dict:
    """The checkpoint at `path` (or in the run folder `path`: its ckpt.pt) as a dict on the CPU,
    or a one-line error naming what is wrong with the file."""
    if Path(path).is_dir():
        path = Path(path) / "ckpt.pt"
    ckpt = load_state(path)
    if not isinstance(ckpt, dict) or not {"model", "config", "tokenizer"} <= ckpt.keys():
        raise SystemExit(f"error: {path} is not a nanoMLM checkpoint (no model/config/tokenizer)")
    return ckpt


def add_device_flag(add, what: str = "where to compute") -> None:
    """--device auto|cpu|cuda, declared here for every script (add: a parser's add_argument)."""
    add("--device", default="auto", choices=("auto", "cpu", "cuda"),
        help=f"{what}; auto = cuda if available")


def pick_device(name: str = "auto", index: int | None = None) -> torch.device:
    """--device auto|cpu|cuda -> a device (auto: CUDA if visible); `index`: a DDP process' GPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda" if index is None else f"cuda:{index}")


def use_bf16(device: torch.device, bf16: bool | None = None) -> bool:
    """Whether to autocast to bfloat16: `bf16` if given, else on with CUDA only."""
    return device.type == "cuda" if bf16 is None else bf16


def use_compile(device: torch.device, compile: bool | None = None) -> bool:
    """Whether to torch.compile: `compile` if given, else on with CUDA and off on the CPU."""
    return device.type == "cuda" if compile is None else compile


def autocast(device: torch.device, bf16: bool | None = None):
    """bf16 autocast of the forward as use_bf16 decides; weights and optimizer stay float32."""
    return torch.autocast(device.type, torch.bfloat16, enabled=use_bf16(device, bf16))


def use_tf32(device: torch.device) -> None:
    """On a GPU, float32 matmuls (outside autocast: mlsm's coder, the losses) as TF32."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


def use_deterministic():
    """Deterministic kernels only, from here on: a GPU's backward passes that add with atomics
    (in an order that varies from run to run) take their deterministic versions, at some cost
    in speed, and an operation that has none raises rather than vary. cuBLAS needs its
    workspace fixed before its first call (CUDA's reproducibility notes)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def peak_memory_gb(device) -> float:
    """Peak allocated GPU memory, or on a CPU the process' peak resident size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def on_stop_signals(handler) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def exit_now(signum, frame):
    """Before the loop (and at a second signal) there is nothing to save: exit at once, through
    the `finally`s that remove temp files."""
    raise SystemExit(f"{signal.Signals(signum).name}: stopped; nothing more was saved")


@contextlib.contextmanager
def exit_on_stop_signals(said: str):
    """In the block a stop signal exits at once, "SIGNAL: stopped `said`": for a long set-up (a
    teacher's load, a dictionary learned) where the loop's handler would wait minutes."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum, frame):
        raise SystemExit(f"{signal.Signals(signum).name}: stopped {said}")
    on_stop_signals(handler)
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


def finishing_the_step(signum, frame, got: dict) -> None:
    """A stop signal to a loop that finishes its step, saves it and exits: noted in got["signal"]
    and said at once (a slow step may take minutes); a second signal exits at once."""
    if got:
        exit_now(signum, frame)
    got["signal"] = signum
    name = signal.Signals(signum).name
    print(f"{name}: finishing the step in progress, then saving it (a second {name} stops "
          f"at once)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stop_after_the_step():
    """For a loop that reads the returned `got` after each step (meta.py's): a signal lets the
    step end (finishing_the_step); the handlers before it are back afterwards."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    got = {}
    on_stop_signals(lambda signum, frame: finishing_the_step(signum, frame, got))
    try:
        yield got
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


# ---------------------------------------------------------------------------------------------
# The training loop's guard: a NaN/inf loss or gradient, a run diverging, the save of a suspect
# state refused, and the stop signals that finish the step and save it. train.py's loop hands one
# SafetyNet every step's loss and gradient norm (kept on the device) and asks it at its log,
# validation and save steps, the only places it reads from the device. A run it stops leaves its
# last good checkpoint (docs/robustness.md).

# The divergence rule (docs/robustness.md). The loss and gradient norm are judged as averages over
# about WINDOW steps (exponential, so at any --log-every alike), from WINDOW steps into a phase.
WINDOW = 20           # steps: the smoothed loss and gradient norm, judged
SLOW = 1000           # steps: the gradient norm's slow average, what it is measured against
BEST = 200            # steps: the loss's slow average, whose lowest value the loss is
FIRST = 10            # steps: ... counted from here (a run bad from the start is caught)
MARGIN = 1.0          # nats: the least rise of the smoothed loss above that best that counts
NOISE = 8.0           # ... or this many times the smoothed loss's own noise, when larger


def judged(trace: list[float], spike: float, norm_ref: float | None = None) -> tuple[str, float]:
    """(what is wrong, or ''; the smoothed loss). trace: the guard's sums (weight, loss, loss^2,
    norm over ~WINDOW steps; weight, norm over ~SLOW; weight, loss over ~BEST) and the lowest
    BEST-step loss since the phase's FIRST steps (its noise a third of the smoothed loss's, so
    its lowest value is not far below the truth). The smoothed loss is suspect above that best
    by max(MARGIN, NOISE x its noise), its noise the per-step spread times sqrt((1 - b) /
    (1 + b)) (an average's over the window, b = 1 - 1/WINDOW); the smoothed gradient norm above
    `spike` times its slow average (or `norm_ref`, the slow average when the run was last
    judged well, which a sustained rise does not drag along). Both are what divergence looked
    like: LAMB at --lr 0.3 (the loss 7.7 -> 15 in 30 steps, tiny) and the `small` run of
    docs/objectives/mlm.md (norm 0.8 -> 38 -> 446, loss 4.7 -> 6.6). The numbers:
    docs/robustness.md."""
    z, s1, s2, g, zs, gs, _, _, best = trace
    loss, norm = s1 / z, g / z
    slow = gs / zs if norm_ref is None else norm_ref
    b = 1 - 1 / WINDOW
    noise = math.sqrt(max(s2 / z - loss * loss, 0.0) * (1 - b) / (1 + b))
    margin = max(MARGIN, NOISE * noise)
    if spike > 0 and norm > spike * slow:
        return (f"the gradient norm (a {WINDOW}-step average) is {norm:.3g}, "
                f"{norm / slow:.0f}x its {SLOW}-step average {slow:.3g}"), loss
    if spike > 0 and loss > best + margin:
        return (f"the loss (a {WINDOW}-step average) is {loss:.3f}, up from its best "
                f"{best:.3f} by more than {margin:.2f}"), loss
    return "", loss


class SafetyNet:
    """The loop's guard, asked at its sync points only (nothing of it runs inside a step): the
    loop appends each step's (loss, gradient norm), left on the device, to `recent`; `check`
    reads them at every sync point, `judge` weighs them at a log step. `save` writes ckpt.pt
    unless the run is suspect (or it must be written), so the last checkpoint is the last good
    one, which a message that stops the run names. `stopping`: a stop signal arrived (under DDP
    any process's, agreed at a sync point: all stop at one step)."""

    def __init__(self, folder, device, ddp: bool, spike: float, last_saved: int | None):
        self.folder, self.device, self.ddp, self.spike = folder, device, ddp, spike
        self.last_saved, self.start, self.suspect_since = last_saved, None, None
        self.stopping, self.got = False, {}
        on_stop_signals(self.signalled)
        self.recent = []  # (loss, gradient norm) of each step since the last sync point, 0-dim
        b, bs, bb = 1 - 1 / WINDOW, 1 - 1 / SLOW, 1 - 1 / BEST
        self.decay = torch.tensor([b, b, b, b, bs, bs, bb, bb], dtype=torch.double)

    def signalled(self, signum, frame) -> None:
        """SIGINT or SIGTERM (a cluster's preemption): alone, this process stops after its step;
        under DDP the processes agree on it at the next sync point."""
        finishing_the_step(signum, frame, self.got)
        self.stopping = self.stopping or not self.ddp

    def check(self, step: int, start: int) -> None:
        """At a sync point of the phase begun at `start`: fold in the steps since the last; stop
        on a NaN/inf (any process's; under DDP a stop signal is agreed in the same all-reduce)."""
        if start != self.start:  # each phase is judged on its own: smoothing and best afresh
            self.start, self.trace, self.best = start, torch.zeros(8, dtype=torch.double), math.inf
            self.steps, self.suspect_since, self.norm_ref = 0, None, None
        n, first_bad = len(self.recent), self.read_recent()
        nonfinite = -1 if first_bad is None else step - n + 1 + first_bad
        if self.ddp:  # a signal to any process stops them all, named by its number
            flags = torch.tensor([nonfinite, self.got.get("signal", 0)], device=self.device)
            dist.all_reduce(flags, dist.ReduceOp.MAX)
            nonfinite, signum = flags.tolist()
            if signum:
                self.stopping = True
                self.got.setdefault("signal", signum)
        if nonfinite >= 0:
            self.folder.log({"step": nonfinite, "error": "non-finite loss or gradient"})
            raise SystemExit(f"error: the loss or gradient became NaN/inf at step {nonfinite}; "
                             f"stopped, {self.last_good()} with a lower --lr or --clip: python "
                             f"train.py --out-dir {self.folder.path} --resume --lr LOWER")

    def judge(self, step: int, lr: float) -> None:
        """At a log step, after check: stop a diverging run (suspect, still so WINDOW // 2 on)."""
        if self.steps < WINDOW:  # the averages fill over the window first
            return
        trace = [*self.trace.tolist(), self.best]
        if self.ddp:  # the processes judge the mean of their sums
            trace = torch.tensor(trace, dtype=torch.float64, device=self.device)
            dist.all_reduce(trace)
            trace = (trace / dist.get_world_size()).tolist()
        spike, loss = judged(trace, self.spike, self.norm_ref)
        if not spike:
            self.suspect_since, self.norm_ref = None, trace[5] / trace[4]
            return
        self.suspect_since = step if self.suspect_since is None else self.suspect_since
        if step - self.suspect_since >= WINDOW // 2:
            self.folder.log({"step": step, "error": "diverging: " + spike})
            raise SystemExit(
                f"error: the run is diverging at step {step}: {spike}; stopped, "
                f"{self.last_good()} with a lower --lr (this run: {lr:g}): python train.py "
                f"--out-dir {self.folder.path} --resume --lr {lr / 2:g}; or --resume --spike 0 "
                f"to train on as it was.")

    def read_recent(self) -> int | None:
        """Fold `recent` into the smoothed sums in one copy from the device, non-finite steps left
        out; -> the index of the first such step, or None."""
        if not self.recent:
            return None
        losses, norms = (torch.stack([pair[i] for pair in self.recent]).double() for i in (0, 1))
        pairs = torch.stack([losses, norms], 1).cpu()                                  # (n, 2)
        loss, norm, one = pairs[:, 0], pairs[:, 1], torch.ones(len(pairs), dtype=torch.double)
        terms = torch.stack([one, loss, loss * loss, norm, one, norm, one, loss], 1)  # (n, 8)
        finite = pairs.isfinite().all(1)                                               # (n,)
        self.recent = []
        for new in terms[finite]:
            self.trace = self.trace * self.decay + new
            self.steps += 1
            if self.steps >= FIRST:  # the phase's first level counts: a run bad from the start
                self.best = min(self.best, float(self.trace[7] / self.trace[6]))
        return None if finite.all() else int((~finite).nonzero()[0])

    def last_good(self, go_on: str = "Go on from there", again: str = "Begin it again (with no "
                  "checkpoint, --resume starts from step 0)") -> str:
        """Where the last good checkpoint is; how --resume goes on (`go_on`) or begins again."""
        if self.last_saved is None:
            return f"no checkpoint had been saved yet. {again}"
        return (f"the last good checkpoint (step {self.last_saved}) is kept at "
                f"{self.folder.path / 'ckpt.pt'}. {go_on}")

    def save(self, state: dict, step: int, must: bool) -> None:
        """The checkpoint `state` of `step` as ckpt.pt (by the master process), unless the run is
        suspect and it need not be saved now (`must`: a phase's end, --stop-at, a signal)."""
        if self.suspect_since is None or must:
            self.folder.save(state)
            self.last_saved = step

    def stop(self, step: int, rank: int, out_dir) -> None:
        """Exit after a stop signal, with the command that resumes the run."""
        name = signal.Signals(self.got["signal"]).name
        if self.ddp:
            dist.barrier()  # the others wait for rank 0's save: torchrun ends them all next
        if rank == 0:
            where = self.last_good("Continue", "Begin it again")
            print(f"{name}: stopped after step {step}; {where} with: python train.py "
                  f"--out-dir {out_dir} --resume", file=sys.stderr)
        raise SystemExit(128 + self.got["signal"])  # the shell's code for a signalled process

    def release(self) -> None:
        """The signal handlers are the caller's again."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ---------------------------------------------------------------------------------------------
# Progress

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
    """A tqdm bar in a terminal; without one, a line every QUIET_SECONDS (tqdm would be silent)."""
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
    until the end. On a CPU it says when the run is starved (why it does not choose its threads
    itself instead: docs/robustness.md)."""

    def __init__(self, step: int, total: int, shown: bool, cpu: bool = False):
        self.bar = bar(total=total, initial=step, disable=None if shown else True, unit="step",
                       desc="train")
        self.update = self.bar.update  # tqdm's own: none of this file runs at every step
        self.total, self.timed_from, self.t = total, step, time.time()
        self.cpu, self.fastest, self.starving = cpu, 0.0, False

    def restart(self, step: int) -> None:
        """At the end of a phase's first step here, before the bar counts it (else its line reads
        that step's compile: "1/7246 [00:54<110:16:28, 54.79s/step]")."""
        self.timed_from, self.t = step, time.time()
        self.fastest = 0.0  # a new phase's steps have their own cost
        self.bar.unpause()  # the bar's elapsed time, rate and ETA leave that step out too

    def eta(self, step: int) -> float | None:
        """Seconds left at this phase's rate since its first step here; None at that step."""
        timed = step - self.timed_from
        return (self.total - step) * (time.time() - self.t) / timed if timed else None

    def starved(self, tok_per_s: float, out_dir) -> str | None:
        """At a log line: what to do, once as a CPU run becomes starved (starved_cpu); or None."""
        self.fastest = max(self.fastest, tok_per_s)
        threads = torch.get_num_threads()
        why = self.cpu and starved_cpu(tok_per_s, self.fastest, os.getloadavg()[0],
                                       os.cpu_count() or 1, threads)
        said, self.starving = why and not self.starving, bool(why)
        fewer = (f", or stop this run (ctrl-c saves it) and resume it on one thread: "
                 f"OMP_NUM_THREADS=1 python train.py --out-dir {out_dir} --resume (results' last "
                 f"digits move with the thread count)") if threads > 1 else ""
        return f"note: this CPU is starved ({why}): stop other work on it{fewer}" if said else None

    def close(self) -> None:
        self.bar.close()


def starved_cpu(rate: float, fastest: float, load: float, cores: int, threads: int) -> str | None:
    """Why a CPU run is starved, or None: a load a thread above the cores, or under half the
    phase's fastest rate."""
    why = []
    if load >= cores + 1:
        why.append(f"load {load:.1f} on {cores} cores, this run's {threads} thread(s) in it")
    if rate < fastest / 2:
        why.append(f"{rate / 1e3:.1f}k tokens/s against {fastest / 1e3:.1f}k earlier")
    return "; ".join(why) or None


def size_text(n: float) -> str:
    """Bytes as a person reads them: 3.2 GiB, 41 MiB, 12 KiB, 512 bytes (never 0 MiB)."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}" if n < 10 * scale else f"{n / scale:,.0f} {unit}"
    return f"{n:,.0f} bytes"


def duration(seconds: float) -> str:
    """45s, 2m30s, 12m, 3h05m: to the second below ten minutes (lines 30 s apart differ)."""
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 10 * 60:
        return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f}m"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def line_buffered() -> None:
    """Print's lines reach stdout at once, a batch job's log file too (not in 8 kB blocks)."""
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




def repo_sources() -> list[str]:
    """The repository's source files this process imported (tests aside), what decides a run's
    results: copied into its code/, hashed into its checkpoints."""
    loaded = {Path(m.__file__).resolve() for m in list(sys.modules.values())
              if getattr(m, "__file__", None) and Path(m.__file__).is_absolute()}
    return sorted(f for f in repository_files(loaded)
                  if f.endswith(".py") and not f.startswith("tests/"))


def is_repository_file(path) -> bool:
    """Whether `path` is one of the repository's own files (repository_files)."""
    return bool(repository_files([path]))


def repository_files(paths) -> list[str]:
    """Those of `paths` that are the repository's own (under its root, not in a site-packages, and
    in a git checkout tracked or not ignored), as repository paths."""
    known, out = git_files(), []
    for path in paths:
        path = Path(path).resolve()
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else None
        if rel is not None and not {"site-packages", "dist-packages"} & set(rel.parts) and (
                known is None or rel.as_posix() in known):
            out.append(rel.as_posix())
    return out


@functools.cache
def git_files() -> frozenset[str] | None:
    """The files git tracks in the checkout, and those it would (untracked, not ignored), as
    repository paths; None outside a git checkout (the GPU machine's copy has no .git)."""
    try:
        r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return frozenset(r.stdout.decode().split("\0")) - {""} if r.returncode == 0 else None


def code_version(files) -> dict:
    """The git description of the checkout and a hash of the source `files` (repository paths)."""
    digest = hashlib.sha256(b"".join((REPO / f).read_bytes() for f in files)).hexdigest()[:16]
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        git = ""
    return {"git": git or "unknown", "sha256": digest}


class RunFolder:
    """What a run leaves behind (the layout above). Only the master process writes: under DDP
    the other ranks hold one whose writes do nothing."""

    def __init__(self, path, master: bool = True):
        self.path, self.master = Path(path), master
        self.log_path = self.path / "log.jsonl"
        self._log = self._lock = None

    def lock(self) -> None:
        """Hold the folder's `lock` (hold_lock) until this process exits; clear dead saves."""
        if not self.master or self._lock is not None:
            return
        f = hold_lock(self.path / "lock", self.path, "wait for it to end or choose another "
                      "--out-dir")
        with one_line_os_errors(self.path):
            for old in self.path.glob(".*.tmp"):  # a save cut off by a kill: whose is dead now
                old.unlink(missing_ok=True)
        self._lock = f  # kept open: closing the file would release the lock

    def check_new(self, marker: str | None = None, others: bool = False) -> None:
        """Refuse a file, a folder holding a run (`marker` or args.json), or other files unless
        `others` (--force): a new run never writes over an old one."""
        p = self.path
        if p.exists() and not p.is_dir():
            raise SystemExit(f"error: --out-dir {p} is a file, not a folder")
        if run := next((p / m for m in (marker, "args.json") if m and (p / m).exists()), None):
            raise SystemExit(f"error: {run} exists; pass --resume to continue that run or "
                             f"choose another --out-dir")
        held = sorted(f.name for f in p.iterdir() if f.name != "lock") if p.is_dir() else []
        if held and not others:
            raise SystemExit(f"error: --out-dir {p} holds other files ({', '.join(held[:3])}) "
                             f"and no run; choose an empty or new folder, or pass --force to "
                             f"write beside them")

    def start(self, code, keep_log: bool = False, **files) -> None:
        """Write `files` ({name: dict}) as NAME.json, the `code` files into code/; a new log."""
        if not self.master:
            return
        with one_line_os_errors(self.path / "code"):
            (self.path / "code").mkdir(parents=True, exist_ok=True)
            for f in code:
                (self.path / "code" / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / f, self.path / "code" / f)
            if not keep_log:
                self.log_path.unlink(missing_ok=True)
        for name, content in files.items():
            self.write(name, content)

    def write(self, name: str, content: dict) -> None:
        """NAME.json in the folder."""
        if self.master:
            with one_line_os_errors(self.path / f"{name}.json"):
                (self.path / f"{name}.json").write_text(json.dumps(content, indent=1))

    def records(self) -> list[dict]:
        """log.jsonl's records; torn lines (a kill, a full disk) left out, counted in skipped."""
        records, self.skipped = [], 0
        for line in self.log_path.read_text().splitlines() if self.log_path.exists() else []:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and "step" in record:
                records.append(record)
            else:
                self.skipped += 1
        return records

    def resume(self, step: int) -> None:
        """Continuing from a checkpoint at `step`: drop the log lines that the run which was cut
        off wrote after it, so that the log reads as one uninterrupted run."""
        if self.master and self.log_path.exists():
            records = self.records()
            with one_line_os_errors(self.log_path):
                self.log_path.write_text("".join(json.dumps(r) + "\n" for r in records
                                                 if r["step"] <= step))

    def log(self, record: dict) -> None:
        """One JSON line in log.jsonl, flushed at once (a killed run keeps what it logged)."""
        if self.master:
            with one_line_os_errors(self.log_path):
                self._log = self._log or open(self.log_path, "a")
                self._log.write(json.dumps(record) + "\n")
                self._log.flush()

    def save(self, state: dict, name: str = "ckpt.pt") -> Path:
        """save_checkpoint into the folder (atomic: a kill never leaves a torn file)."""
        if self.master:
            save_checkpoint(state, self.path / name)
        return self.path / name
