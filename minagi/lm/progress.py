"""What a training run says while it runs: the progress bar or lines (Progress), the start-up
line (describe), the line about a resume at another world size (world_note), and the one
warning of a sink (SinkWatch)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..moe import _backend
from . import allocator
from .run import Run

SINK_WARNING = 0.5  # first-row sink_share past which the run warns (once)


def _value(x) -> float:
    return x() if callable(x) else x


class Progress:
    """tqdm on a terminal; on anything else a plain line every ~5% of the run."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.total, self.bar, self.enabled = total, None, enabled
        self.every = max(1, total // 20)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, cps: float, rows) -> None:
        """rows: rows per character, or a function that reads it (from the device: only when shown)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.3f}  {cps:,.0f} char/s  rows {_value(rows):.2f}")
        elif step % self.every == 0 or step == self.total:
            print(f"step {step}/{self.total}  loss {loss:.3f}  {cps:,.0f} char/s  rows {_value(rows):.2f}",
                  file=sys.stderr, flush=True)

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
