"""What stops a training run, and when its state may be saved: stop signals (SIGINT, SIGTERM)
that finish the step and save it, a NaN/inf loss or gradient, a run diverging, and the save
that waits while a log line is suspect. train.py's loop asks one SafetyNet at its log and save
steps, the only places it reads from the device.
"""
import signal
import sys

import torch
import torch.distributed as dist


def diverging(history: list[dict], record: dict, factor: float) -> tuple[str, bool]:
    """(what spiked in this log line, or ''; whether the line is suspect). history: the phase's
    earlier log records (5 at least before anything is judged). A spike is a mean gradient norm
    (before clipping) above `factor` times its median so far, or a training loss 1 nat above the
    lowest so far in this line and the one before (one noisy line is not enough: a line with
    only this one above is suspect, and its state is not saved until the next line clears it).
    It is the failure seen at `small` on a GPU (docs/objectives/mlm.md): with LAMB at lr 1e-2
    the gradient norm went 0.8 -> 38 -> 446 within 500 steps and the loss rose from 4.7 to 6.6,
    for good."""
    if factor <= 0 or len(history) < 5:
        return "", False
    norms = sorted(h["grad_norm"] for h in history)
    median, best = norms[len(norms) // 2], min(h["loss"] for h in history[:-1])
    if record["grad_norm"] > factor * median:
        return (f"the gradient norm is {record['grad_norm']:.3g}, "
                f"{record['grad_norm'] / median:.0f}x its median {median:.3g} so far"), True
    if min(record["loss"], history[-1]["loss"]) > best + 1.0:
        return f"the loss is {record['loss']:.3f}, up from {best:.3f}", True
    return "", record["loss"] > min(best, history[-1]["loss"]) + 1.0


def on_stop_signals(handler) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def exit_now(signum, frame):
    """Before the loop (and at a second signal) there is nothing to save: exit at once, through
    the `finally`s that remove temp files."""
    raise SystemExit(f"{signal.Signals(signum).name}: stopped; nothing more was saved")


def catch_stop_signals() -> dict:
    """Ctrl-C (SIGINT) and SIGTERM, the signal a cluster preempts a job with (SIGKILL follows
    after a grace period), set got["signal"]: the loop finishes the step it is in, saves it and
    exits with the command that resumes it. A second signal exits at once."""
    got = {}

    def handler(signum, frame):
        if got:
            exit_now(signum, frame)
        got["signal"] = signum
    on_stop_signals(handler)
    return got


class SafetyNet:
    """The loop's guard. Inside the step, `watch` records the first step whose loss or gradient
    is not finite, on the device (no sync). At log and save steps: `check_finite` stops a run
    that went non-finite, `judge` one that diverges (diverging), and `may_save` holds back the
    save of a state that a suspect log line may yet condemn (it is saved once a line clears it).
    `stop_requested`: whether a stop signal has arrived; under DDP the processes agree on it at
    log steps, so that all stop at the same step. `last_saved`: the step of the last good
    checkpoint, which every message that stops the run names."""

    def __init__(self, folder, device, ddp: bool, spike: float, log_every: int,
                 last_saved: int | None):
        self.folder, self.device, self.ddp, self.spike = folder, device, ddp, spike
        self.log_every, self.last_saved = log_every, last_saved
        self.got = catch_stop_signals()
        self.nonfinite = torch.tensor(-1, device=device)  # the first step with a NaN/inf
        self.history = []  # this phase's log records, for diverging()
        self.suspect = self.deferred = False

    def new_phase(self) -> None:
        self.history = []

    def watch(self, step: int, loss, grad_norm) -> None:
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        self.nonfinite = torch.where(bad & (self.nonfinite < 0), step + 1, self.nonfinite)

    def stop_requested(self, step: int, max_steps: int) -> bool:
        """A signal stops every process at the same step (at the last step the run just ends)."""
        if not self.ddp:
            return bool(self.got) and step < max_steps
        if step % self.log_every == 0 and step < max_steps:
            flag = torch.tensor(len(self.got), device=self.device)
            dist.all_reduce(flag, dist.ReduceOp.MAX)
            return flag.item() > 0
        return False

    def save_pending(self, step: int) -> bool:
        """A deferred save is tried again at every log step."""
        return self.deferred and step % self.log_every == 0

    def last_good(self) -> str:
        """Where the last good checkpoint is, in words."""
        if self.last_saved is None:
            return "no checkpoint had been saved yet"
        return (f"the last good checkpoint (step {self.last_saved}) is kept at "
                f"{self.folder.path / 'ckpt.pt'}")

    def check_finite(self) -> None:
        if self.ddp:
            dist.all_reduce(self.nonfinite, dist.ReduceOp.MAX)
        if self.nonfinite.item() >= 0:
            step = int(self.nonfinite)
            self.folder.log({"step": step, "error": "non-finite loss or gradient"})
            raise SystemExit(f"error: the loss or gradient became NaN/inf at step {step}; "
                             f"stopped, {self.last_good()}. Try a lower --lr or --clip.")

    def judge(self, record: dict, stopping: bool, lr: float) -> None:
        """Stop a diverging run; note whether this line is suspect. (A line cut short by a
        signal is too noisy to judge.)"""
        spike, self.suspect = (diverging(self.history, record, self.spike) if not stopping
                               else ("", False))
        if spike:
            step = record["step"]
            self.folder.log({"step": step, "error": "diverging: " + spike})
            raise SystemExit(
                f"error: the run is diverging at step {step}: {spike}; stopped, "
                f"{self.last_good()}. Start again with a lower --lr (this run: {lr:g}), or "
                f"--resume --spike 0 to train on.")
        self.history.append(record)

    def may_save(self, must: bool) -> bool:
        """Whether the state may be saved now; a suspect one waits for the next log line, unless
        it `must` be saved now (a phase's end, --stop-at, a stop signal)."""
        self.deferred = self.suspect and not must
        return not self.deferred

    def stop(self, step: int, rank: int, out_dir) -> None:
        """Exit after a stop signal, with the command that resumes the run."""
        name = signal.Signals(self.got["signal"]).name
        if self.ddp:
            dist.barrier()  # the others wait for rank 0's save: torchrun ends them all next
        if rank == 0:
            print(f"{name}: stopped after step {step}; {self.last_good()}. "
                  f"Continue with: python train.py --out-dir {out_dir} --resume", file=sys.stderr)
        raise SystemExit(128 + self.got["signal"])  # the shell's code for a signalled process

    def release(self) -> None:
        """The signal handlers are the caller's again."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
