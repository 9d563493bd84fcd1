"""Training runs that can be advanced a slice at a time, each on its own clock, and the held-out
sample they are all scored on: what lets `bench quality --interleave` train several models in
alternating blocks, so that a drift of the machine's speed hits all of them alike, while each
is charged only its own time."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch


@dataclass
class Budget:
    """How long a model trains: `seconds` of its own wall-clock, or `steps` optimizer steps if set."""
    seconds: float = 300.0
    steps: int = 0

    def progress(self, step: int, elapsed: float) -> float:
        return step / self.steps if self.steps else elapsed / self.seconds

    def describe(self) -> str:
        return f"{self.steps} steps" if self.steps else f"{self.seconds:g} s"


class Run:
    """One model's training: linear warmup over `warmup` steps, then cosine down to min_frac over
    the rest of its budget. With a time budget the schedule follows the run's own clock (the
    time spent inside advance(), nothing else), so neither a slow neighbour nor the pauses
    between slices cut it short or make it idle."""

    def __init__(self, name, budget: Budget, step_fn, set_factor, warmup: int, min_frac: float, log):
        self.name, self.budget, self.step_fn, self.set_factor = name, budget, step_fn, set_factor
        self.warmup, self.min_frac, self.log = warmup, min_frac, log
        self.step, self.elapsed, self.loss, self.p_warm = 0, 0.0, float("nan"), 0.0

    @property
    def done(self) -> bool:
        return self.budget.progress(self.step, self.elapsed) >= 1.0

    def advance(self, seconds: float = math.inf) -> None:
        """Train until `seconds` more of this run's clock have passed or its budget is spent."""
        t0 = time.perf_counter()
        start = self.elapsed
        while not self.done and self.elapsed - start < seconds:
            self._one_step()
            self.elapsed = start + time.perf_counter() - t0

    def _one_step(self) -> None:
        p = self.budget.progress(self.step, self.elapsed)
        if self.step < self.warmup:
            self.set_factor((self.step + 1) / self.warmup)
            self.p_warm = p
        else:
            progress = (p - self.p_warm) / max(1e-9, 1.0 - self.p_warm)
            self.set_factor(self.min_frac + (1 - self.min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        self.loss = self.step_fn()
        self.step += 1
        if self.step % 500 == 0:
            self.log(f"  {self.name}: step {self.step}, loss {self.loss:.3f}, {self.elapsed:.0f} s")


def interleave(runs: list[Run], block: float, log) -> None:
    """Advance every unfinished run by `block` seconds of its own clock, in turn, until all are
    done. Each round starts one run later than the last, so no run always follows the same one."""
    r = 0
    while pending := [run for run in runs if not run.done]:
        k = r % len(pending)
        for run in pending[k:] + pending[:k]:
            run.advance(block)
        r += 1
        if r % 10 == 0:
            log("  interleaved round {}: {}".format(r, ", ".join(
                f"{run.name} {run.elapsed:.0f}/{run.budget.describe()}" for run in runs)))


def heldout_sample(held: torch.Tensor, n_bytes: int, chunk: int = 4096) -> list[torch.Tensor]:
    """n_bytes of the held-out split in chunks of `chunk` bytes at evenly spaced offsets over its
    whole length (so over every held-out file, not only the first), the same for every model.
    The whole split when it is shorter than n_bytes."""
    n = held.numel()
    if n <= n_bytes:
        return [held]
    count = max(1, n_bytes // chunk)
    size = n_bytes // count
    starts = torch.linspace(0, n - size, count).long().tolist()
    return [held[s:s + size] for s in starts]


def score(bits_per_byte, model, chunks: list[torch.Tensor], context: int) -> float:
    """Bits per byte over the chunks, each chunk's bytes counted once (its first bytes see only the
    chunk's own context)."""
    total = sum(bits_per_byte(model, c, context) * c.numel() for c in chunks)
    return total / sum(c.numel() for c in chunks)
