"""What a training run says while it runs: the progress bar or lines (Progress) with the time
left (Pace) and the held-out figure's trend, the start-up line (describe), the line about a
resume at another world size (world_note), and the one warning of a sink (SinkWatch)."""
from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

import torch

from ..moe import _backend
from . import allocator
from .run import Run

SINK_WARNING = 0.5  # first-row sink_share past which the run warns (once)


def _value(x) -> float:
    return x() if callable(x) else x


PACE_WINDOW = 50  # the steps whose mean time paces the time left
PACE_MIN = 3  # steps seen before the time left is shown


def duration(seconds: float) -> str:
    """42s, 3m05s, 1h02m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Pace:
    """The time left from the recent steps' pace: the mean seconds of the last `window` steps
    (not the whole run's: a run slowed or sped up by other work on the machine, by a change of
    threads, or by rows that halt sooner shows its present pace within `window` steps), times
    the steps left, plus the held-out evaluations left times the last one's seconds."""

    def __init__(self, window: int = PACE_WINDOW):
        self.recent: deque[float] = deque(maxlen=window)
        self.eval_s = 0.0

    def step(self, seconds: float) -> None:
        self.recent.append(seconds)

    def evaluated(self, seconds: float) -> None:
        """An evaluation (and the history record, the checkpoint where one was due) took this long."""
        self.eval_s = seconds

    def left(self, steps_left: int, evals_left: int = 0) -> float | None:
        """Seconds left, or None before PACE_MIN steps were seen."""
        if len(self.recent) < min(PACE_MIN, self.recent.maxlen):
            return None
        return steps_left * sum(self.recent) / len(self.recent) + evals_left * self.eval_s


def trend(step: int, bpc: float, last: tuple[int, float] | None) -> str:
    """The held-out line: "step 500: held-out 2.310 bits per byte (-0.080 since step 250)"."""
    since = f" ({bpc - last[1]:+.3f} since step {last[0]})" if last and last[1] == last[1] else ""  # NaN: none
    return f"step {step}: held-out {bpc:.3f} bits per byte{since}"


class Progress:
    """tqdm on a terminal; on anything else a plain line every ~5% of the run. Each shows the
    loss, the char/s, the rows, and the time left (Pace); the held-out lines (heldout) show the
    change since the last one. evals_left(step): the held-out evaluations after this step, for
    the time left. last_heldout: (step, bits per byte) of a resumed run's last evaluation."""

    def __init__(self, total: int, start: int, enabled: bool = True, evals_left=None,
                 last_heldout: tuple[int, float] | None = None):
        self.total, self.bar, self.enabled = total, None, enabled
        self.every = max(1, total // 20)
        self.pace, self.evals_left, self.last_heldout = Pace(), evals_left or (lambda step: 0), last_heldout
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            # tqdm's own estimate (its rate's moving average, evaluations included) is left out: ours is shown.
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    def left(self, step: int) -> str:
        """"  1m05s left", or nothing before the pace is known and at the end."""
        seconds = self.pace.left(self.total - step, self.evals_left(step)) if step < self.total else None
        return "" if seconds is None else f"  {duration(seconds)} left"

    def update(self, step: int, loss: float, cps: float, rows, seconds: float | None = None) -> None:
        """rows: rows per character, or a function that reads it (from the device: only when shown).
        seconds: this step's time, for the pace."""
        if seconds is not None:
            self.pace.step(seconds)
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.3f}  {cps:,.0f} char/s  rows {_value(rows):.2f}{self.left(step)}")
        elif step % self.every == 0 or step == self.total:
            print(f"step {step}/{self.total}  loss {loss:.3f}  {cps:,.0f} char/s  rows {_value(rows):.2f}"
                  f"{self.left(step)}", file=sys.stderr, flush=True)

    def heldout(self, step: int, bpc: float) -> None:
        """The held-out line, with the change since the last evaluation."""
        self.write(trend(step, bpc, self.last_heldout))
        self.last_heldout = (step, bpc)

    def write(self, msg: str, always: bool = False) -> None:
        """One line to stderr; with always, even when progress output is off (a warning)."""
        if not (self.enabled or always):
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class SinkWatch:
    """Warns once per run when a record's first-row sink_share passes SINK_WARNING."""

    def __init__(self, bar: Progress, out_dir: Path):
        self.bar, self.out_dir, self.warned = bar, out_dir, False

    def check(self, record: dict) -> None:
        if record["sink_share"] > SINK_WARNING and not self.warned:
            self.warned = True
            self.bar.write(f"minagi: warning: at step {record['step']} one slot takes {record['sink_share']:.0%} of "
                           f"the characters at the first row (a sink); the routes command shows it row by row "
                           f"(routes {self.out_dir}); see model.balance")


def describe(run: Run, corpus, resume: bool) -> str:
    cfg, t, d = run.cfg, run.cfg.train, run.dist
    scale = (f"; {d.world} ranks (torchrun, DDP over {torch.distributed.get_backend()}), global batch "
             f"{t.batch} x {t.grad_accum} x {d.world} = {t.batch * t.grad_accum * d.world} chunks" if d.active
             else f"; batch {t.batch} x {t.grad_accum} micro-batches" if t.grad_accum > 1 else "")
    return (f"minagi: profile {cfg.profile}, {sum(p.numel() for p in run.model.parameters()):,} parameters, "
            f"{run.device}, dispatch {run.path}{'' if _backend.loaded() else ' (pure torch)'}, "
            f"allocator {allocator.describe()}, {torch.get_num_threads()} threads{scale}; {corpus.describe()}"
            + (f"; resuming at step {run.step}" if resume else ""))


def world_note(run: Run) -> str | None:
    """One line when a run resumes at another world size than the checkpoint's."""
    if run.saved_world in (None, run.dist.world):
        return None
    t = run.cfg.train
    return (f"minagi: the checkpoint was saved by {run.saved_world} rank(s), this run has {run.dist.world}: the model, "
            f"optimizer and schedule go on from step {run.step}; the data stream goes on from its saved position "
            f"with the new global batch ({t.batch * t.grad_accum * run.dist.world} chunks), so the chunks differ "
            "from an uninterrupted run's")
