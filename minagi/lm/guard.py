"""What keeps a run from losing good work: a divergence guard that skips non-finite steps, a
finiteness check of the whole state before it is saved, and a graceful stop on SIGTERM / SIGINT.

Exit statuses (minagi/lm/cli.py): 3 for a run stopped by the guard; 143 (SIGTERM) and 130 (SIGINT),
as shells report them, for a run stopped by a signal after its checkpoint was written.
"""
from __future__ import annotations

import os
import signal
import threading

import torch


class Diverged(RuntimeError):
    """The run stopped because its loss, gradients or state are not finite; the message names
    the step, the last good checkpoint and what to try."""

    exit_status = 3


class Interrupted(Exception):
    """The run stopped on a signal after writing a checkpoint at `step`."""

    def __init__(self, signum: int, step: int, out_dir):
        self.signum, self.step, self.out_dir = signum, step, out_dir
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} at step {step}; checkpoint written.")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # 143 for SIGTERM, 130 for SIGINT


def nonfinite(named_tensors) -> list[str]:
    """Names of the floating-point tensors holding a NaN or an infinity: one max-abs reduction
    per device over all of them (torch's foreach norm), then one look at the flags."""
    by_device: dict = {}
    for name, t in named_tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).append((name, t))
    bad = []
    for items in by_device.values():
        norms = torch._foreach_norm([t.detach() for _, t in items], float("inf"))
        flags = torch.stack([n.float() for n in norms]).isfinite().cpu()
        bad += [name for (name, _), ok in zip(items, flags.tolist()) if not ok]
    return bad


def state_tensors(model, opt=None):
    """(name, tensor) of the model's state and, with opt, the optimizer's moments."""
    yield from model.state_dict().items()
    if opt is not None:
        for i, st in opt.state_dict()["state"].items():
            for key, t in st.items():
                yield f"optimizer.state.{i}.{key}", t


ADVICE = "Try a lower train.lr (--set train.lr=...) or a smaller train.grad_clip"


class DivergenceGuard:
    """Skips a step whose loss or gradient norm is not finite (the caller leaves the optimizer
    alone); after max_bad consecutive skips, the run stops (0 = never skip, never stop)."""

    def __init__(self, max_bad: int):
        self.max_bad, self.consecutive, self.skipped = max_bad, 0, 0

    def step_ok(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        if not self.max_bad:
            return True
        ok = bool(torch.isfinite(loss.detach()) & torch.isfinite(grad_norm))  # one host sync
        self.consecutive = 0 if ok else self.consecutive + 1
        self.skipped += not ok
        return ok

    def check(self, step: int, last_good: str) -> None:
        if self.max_bad and self.consecutive >= self.max_bad:
            raise Diverged(f"training diverged: {self.consecutive} steps in a row up to step {step} had a "
                           f"non-finite loss or gradient, and were skipped (train.max_bad_steps = {self.max_bad}). "
                           f"The last good checkpoint is {last_good}. {ADVICE}, then train again or --resume.")


_DEFAULT = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}


def early_signal() -> int | None:
    """The signal train.py's keeper caught while torch loaded, if any."""
    for sig in _DEFAULT:
        caught = getattr(signal.getsignal(sig), "caught", None)
        if caught:
            return caught
    return None


def release_early_signals() -> None:
    """For commands other than training: give SIGTERM / SIGINT their usual meaning back from
    train.py's keeper (which holds them while torch loads); one it caught ends the command with
    the shell's status for it (143, 130)."""
    caught = early_signal()
    for sig, default in _DEFAULT.items():
        if hasattr(signal.getsignal(sig), "caught"):
            signal.signal(sig, default)
    if caught:
        raise SystemExit(128 + caught)


class GracefulStop:
    """While active, SIGTERM and SIGINT ask the run to stop after its current step (`requested`
    holds the signal); a second SIGINT stops at once (KeyboardInterrupt). Outside the main
    thread signals cannot be caught, and nothing is installed."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: int | None = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: now; the last checkpoint stays intact
        self.requested = self.requested or signum

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                previous = signal.signal(sig, self._handle)
                if hasattr(previous, "caught"):  # train.py's keeper: what it caught while torch loaded is ours
                    self.requested = self.requested or previous.caught
                    previous = _DEFAULT[sig]
                self._previous[sig] = previous
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
