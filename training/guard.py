"""The training loop's guard: a NaN/inf loss or gradient, a run diverging, and the save that
waits while the run is suspect, beside the stop signals that finish the step and save it.
train.py's loop hands one SafetyNet every step's loss and gradient norm (kept on the device) and
asks it at its log and save steps, the only places it reads from the device. A run it stops
leaves the last good state it kept (docs/robustness.md).
"""
import math
import signal
import sys

import torch
import torch.distributed as dist

from machinery.plumbing import catch_stop_signals

# The divergence rule (docs/robustness.md). The loss and gradient norm are judged as averages over
# about WINDOW steps (exponential, so at any --log-every alike), from WINDOW steps into a phase.
WINDOW = 20           # steps: the smoothed loss and gradient norm, judged
SLOW = 1000           # steps: the gradient norm's slow average, what it is measured against
BEST = 200            # steps: the loss's slow average, whose lowest value the loss is
FIRST = 10            # steps: ... counted from here (a run bad from the start is caught)
MARGIN = 1.0          # nats: the least rise of the smoothed loss above that best that counts
NOISE = 8.0           # ... or this many times the smoothed loss's own noise, when larger
SNAPSHOT_EVERY = 100  # steps: how often a state is kept in memory, to go back to
CONFIRM = 4 * WINDOW  # steps: a kept state counts as good once the run is judged well this long
#                       after it (the smoothing lags: a state just after a jump is judged well)


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
    """The loop's guard, read at the loop's sync points only (its log, validation and save
    steps): the loop appends each step's (loss, gradient norm), left on the device, to `recent`,
    and reads the plain attributes `stopping` and `deferred`; nothing of it runs inside a step.
    At a sync point `check_finite` reads the steps since the last one, stops a run that went
    non-finite and brings the smoothed loss and gradient norm up to date (judged); at a log step
    `judge` stops one that diverges (judged: suspect, and still so WINDOW // 2 steps later) and
    says when a good state is due to be kept in memory (`keep`, every SNAPSHOT_EVERY steps while
    the run is judged well; it counts once the run is still judged well CONFIRM steps later, and
    is built only then: the loop's log steps stay cheap); `save` writes the
    checkpoint, or holds back that of a suspect state (`deferred`: saved at a later log step,
    once the run is judged well again). A run stopped for a NaN or a divergence writes the last
    good state kept as its checkpoint when it is newer than the last one saved. `stopping`: a
    stop signal has arrived (under DDP: any process's, agreed at a sync point, so that all stop
    at the same step). `last_saved`: the step of the last good checkpoint, which every message
    that stops the run names."""

    def __init__(self, folder, device, ddp: bool, spike: float, log_every: int,
                 last_saved: int | None):
        self.folder, self.device, self.ddp, self.spike = folder, device, ddp, spike
        self.log_every, self.last_saved = log_every, last_saved
        self.got = catch_stop_signals(self.signalled)
        self.stopping = False
        self.recent = []  # (loss, gradient norm) of each step since the last sync point, 0-dim
        self.kept = self.pending = None  # (step, state): the last good state; one to confirm
        self.deferred = False
        b, bs, bb = 1 - 1 / WINDOW, 1 - 1 / SLOW, 1 - 1 / BEST
        self.decay = torch.tensor([b, b, b, b, bs, bs, bb, bb], dtype=torch.double)
        self.new_phase()

    def signalled(self) -> None:
        """A stop signal arrived (the handler's call): alone, this process stops after its step;
        under DDP the processes agree on it at the next sync point."""
        self.stopping = self.stopping or not self.ddp

    def new_phase(self) -> None:
        """Each phase is judged on its own: its smoothing and best loss start afresh."""
        self.trace = torch.zeros(8, dtype=torch.double)  # judged()'s sums, on the host
        self.best = math.inf    # the lowest BEST-step loss
        self.recent, self.steps, self.suspect_since, self.norm_ref = [], 0, None, None

    def read_recent(self) -> int | None:
        """Fold the steps in `recent` into the smoothed sums, in their order (a step whose loss or
        gradient is not finite is left out of them); -> the index of the first such step, or
        None. One copy from the device for all of them."""
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

    def last_good(self) -> str:
        """Where the last good checkpoint is, in words; the last good state kept in memory is
        written there first when it is newer."""
        if self.kept is not None and (self.last_saved is None or self.kept[0] > self.last_saved):
            self.folder.save(self.kept[1])
            self.last_saved = self.kept[0]
        if self.last_saved is None:
            return "no checkpoint had been saved yet"
        return (f"the last good checkpoint (step {self.last_saved}) is kept at "
                f"{self.folder.path / 'ckpt.pt'}")

    def go_on(self) -> str:
        """How the command that --resume's the run goes on, said after last_good(): from the
        checkpoint, or with none from step 0 (resumed_args begins such a run again)."""
        return ("Go on from there" if self.last_saved is not None else
                "Begin it again (with no checkpoint, --resume starts from step 0)")

    def check_finite(self, step: int) -> None:
        """At a sync point, `step` the last step taken: read the steps since the last one; stop
        the run if one of them went NaN/inf (on any process). Under DDP, also agree on a stop
        signal (one all-reduce for both)."""
        n, first_bad = len(self.recent), self.read_recent()
        nonfinite = -1 if first_bad is None else step - n + 1 + first_bad
        if self.ddp:
            flags = torch.tensor([nonfinite, len(self.got)], device=self.device)
            dist.all_reduce(flags, dist.ReduceOp.MAX)
            nonfinite, signals = flags.tolist()
            self.stopping = self.stopping or signals > 0
        if nonfinite >= 0:
            self.folder.log({"step": nonfinite, "error": "non-finite loss or gradient"})
            raise SystemExit(f"error: the loss or gradient became NaN/inf at step {nonfinite}; "
                             f"stopped, {self.last_good()}. {self.go_on()} with a lower --lr "
                             f"or --clip: python train.py --out-dir {self.folder.path} --resume "
                             f"--lr LOWER")

    def judge(self, step: int, lr: float) -> bool:
        """At a log step: stop a diverging run (suspect here, and still WINDOW // 2 steps
        later); note whether it is suspect. Returns whether the state now is good and due to be
        kept (keep), so that the loop builds it only then. Under DDP the processes judge the
        same numbers (their sums' mean)."""
        if self.steps < WINDOW:  # the averages have not filled yet
            return False
        trace = [*self.trace.tolist(), self.best]
        if self.ddp:
            trace = torch.tensor(trace, dtype=torch.float64, device=self.device)
            dist.all_reduce(trace)
            trace = (trace / dist.get_world_size()).tolist()
        spike, loss = judged(trace, self.spike, self.norm_ref)
        if not spike:
            self.suspect_since, self.norm_ref = None, trace[5] / trace[4]
            if self.pending is not None and step - self.pending[0] >= CONFIRM:
                self.kept, self.pending = self.pending, None
            last = max(x[0] for x in (self.kept, self.pending, (-SNAPSHOT_EVERY, None)) if x)
            return self.pending is None and step - last >= SNAPSHOT_EVERY and self.folder.master
        self.pending = None  # taken while the run was going bad, maybe
        self.suspect_since = step if self.suspect_since is None else self.suspect_since
        if step - self.suspect_since >= WINDOW // 2:
            self.folder.log({"step": step, "error": "diverging: " + spike})
            raise SystemExit(
                f"error: the run is diverging at step {step}: {spike}; stopped, "
                f"{self.last_good()}. {self.go_on()} with a lower --lr (this run: {lr:g}): "
                f"python train.py --out-dir {self.folder.path} --resume --lr {lr / 2:g}; or "
                f"--resume --spike 0 to train on as it was.")
        return False

    def keep(self, state: dict, step: int) -> None:
        """A state judged good (references to the live tensors: the checkpoint's), to go back to
        once CONFIRM steps later the run is still judged well: every tensor copied off the
        device."""
        copy = lambda x: (x.detach().to("cpu", copy=True) if torch.is_tensor(x) else
                          {k: copy(v) for k, v in x.items()} if isinstance(x, dict) else
                          [copy(v) for v in x] if isinstance(x, list) else x)
        self.pending = (step, copy(state))

    def save(self, state: dict, step: int, must: bool) -> None:
        """The checkpoint `state` of `step`, written as ckpt.pt (by the master process) unless
        the run is suspect: then it waits (`deferred`: the loop asks again at its next log
        steps) until the run is judged well again, or it `must` be saved now (a phase's end,
        --stop-at, a stop signal)."""
        self.deferred = self.suspect_since is not None and not must
        if not self.deferred:
            self.folder.save(state)
            self.last_saved = step

    def stop(self, step: int, rank: int, out_dir) -> None:
        """Exit after a stop signal, with the command that resumes the run."""
        name = signal.Signals(self.got["signal"]).name
        if self.ddp:
            dist.barrier()  # the others wait for rank 0's save: torchrun ends them all next
        if rank == 0:
            where = self.last_good()
            verb = "Continue" if self.last_saved is not None else "Begin it again"
            print(f"{name}: stopped after step {step}; {where}. {verb} with: python train.py "
                  f"--out-dir {out_dir} --resume", file=sys.stderr)
        raise SystemExit(128 + self.got["signal"])  # the shell's code for a signalled process

    def release(self) -> None:
        """The signal handlers are the caller's again."""
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
