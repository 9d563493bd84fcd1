"""The training loop: AdamW (off-card experts untouched), warmup + cosine, gradient clipping,
gradient accumulation, bfloat16 autocast on GPUs, held-out bits per byte, atomic checkpoints,
exact resume, and the history file (one JSON record per held-out evaluation). Under torchrun
the same loop trains one model on every rank (minagi/lm/distributed.py): rank 0 writes the
checkpoints, the history and the progress.

The pieces it is made of: run.py (the Run, how it is built, started and resumed), step.py (one
optimizer step; the held-out score), history.py (the window between records; the history file),
progress.py (what it prints), guard.py (divergence, finiteness, signals), checkpoint.py."""
from __future__ import annotations

import functools
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import allocator, checkpoint, cores, distributed, history
from .config import Config, TrainConfig
from .guard import ADVICE, Diverged, DivergenceGuard, GracefulStop, Interrupted, nonfinite, state_tensors
from .history import Window
from .memory import memory_stats
from .progress import Progress, SinkWatch, describe, world_note
from .run import Run, start
from .step import heldout_bpc, train_step


@dataclass
class StepInfo:
    """What a callback sees after each optimizer step."""
    step: int
    loss: float
    chars: int  # characters trained on in this step
    step_s: float  # seconds of this step (forward, backward, update)
    out_dir: Path
    skipped: bool = False  # the divergence guard skipped it
    rows_used: list = field(default_factory=list, repr=False)  # the micro-batches' rows per character

    @functools.cached_property
    def rows_mean(self) -> float:
        """Rows per character (adaptive rows: fewer as the model learns), read from the device
        when first asked for."""
        return float(sum(r.float().mean() for r in self.rows_used) / len(self.rows_used)) if self.rows_used else 0.0


def train(cfg: Config, out_dir, resume: bool = False, progress: bool = True, callbacks=(),
          steps: int | None = None, named=None) -> dict:
    """Train (or resume) into out_dir; returns the last history record. callbacks: functions
    called with a StepInfo after every step; one that returns True ends the run there, with a
    checkpoint at that step (as a finished run has). Raises guard.Diverged when the run
    diverges, guard.Interrupted after the checkpoint of a run stopped by SIGTERM or SIGINT.
    Under torchrun (minagi/lm/distributed.py) every rank runs this; the ranks stop together.
    steps (with resume): train the resumed run to this step instead of its saved length (its
    schedule re-planned over it); below the checkpoint's step it is a ConfigError. named (with
    resume): the settings ("section.key") the command gave, the only ones a resume reports as
    ignored where they differ from the checkpoint's (None: every setting of cfg)."""
    out_dir = Path(out_dir)
    # From here a signal means "stop after the current step", during the start too: it then
    # stops after the first step, with that step's checkpoint.
    with GracefulStop() as signals:
        machine = cores.read()  # the start-up's share of the machine: the threads for its free cores
        run, window, heldout, corpus, notes = start(cfg, out_dir, resume, steps, named)
        try:
            t = run.cfg.train
            bar = Progress(t.steps, run.step, progress and run.dist.main, lambda step: evaluations_left(t, step),
                           (run.step, run.last_bpc) if resume else None)
            # What a resume changed or ignores, and what the corpus's folder skipped: even with --quiet.
            for note in (*notes, world_note(run), corpus.skipped.note(corpus.source)):
                if note and run.dist.main:
                    bar.write(note, always=True)
            watch = cores.start(machine, run.device.type, run.dist.active, t.threads,
                                lambda line: bar.write(line, always=True))
            bar.write(describe(run, corpus, resume))
            return _loop(run, window, heldout, bar, callbacks, signals, watch)
        finally:
            distributed.stop(run.dist)


def _loop(run: Run, window: Window, heldout, bar: Progress, callbacks, signals: GracefulStop, watch=None) -> dict:
    """Steps until the run's length or a stop; each step trained, counted and shown (and given to
    the watch of the machine's cores, where there is one), then (when due) scored on the held-out
    chunks, recorded in the history, and checkpointed."""
    t = run.cfg.train
    guard, sinks, t_start, record = DivergenceGuard(t.max_bad_steps), SinkWatch(bar, run.out_dir), time.perf_counter(), None
    trim = allocator.HeapTrim(t.malloc_trim_every if run.device.type == "cpu" else 0)
    run.model.train()
    while run.step < t.steps:
        info = _step(run, window, guard, trim, bar)
        if watch is not None:
            watch.step(info.chars, info.step_s)
        stop = _stop_asked(run, signals, callbacks, info)
        last = run.step == t.steps or stop
        if evaluates(t, run.step, last):
            t_eval = time.perf_counter()
            _evaluate(run, heldout, bar)
            record, window = _record(run, window, t_start, checkpoints(t, run.step, last))
            bar.pace.evaluated(time.perf_counter() - t_eval)
            sinks.check(record)
        if stop:
            break
    bar.close()
    if signals.requested is not None and run.step < t.steps:  # a run that finished anyway is done
        raise Interrupted(signals.requested, run.step, run.out_dir)
    return record if record is not None else (run.saved_record or {})


def evaluates(t: TrainConfig, step: int, last: bool) -> bool:
    """Whether the held-out chunks are scored after this step: every eval_every steps, and
    before every checkpoint."""
    return step % t.eval_every == 0 or checkpoints(t, step, last)


def evaluations_left(t: TrainConfig, step: int) -> int:
    """How many of the steps after `step` evaluate (for the time left): the multiples of
    eval_every and of checkpoint_every, and the last step (a run not stopped early)."""
    def after(every: int) -> int:
        return t.steps // every - step // every

    last = step < t.steps and t.steps % t.eval_every != 0 and t.steps % t.checkpoint_every != 0
    return after(t.eval_every) + after(t.checkpoint_every) - after(math.lcm(t.eval_every, t.checkpoint_every)) + last


def checkpoints(t: TrainConfig, step: int, last: bool) -> bool:
    """Whether a checkpoint (and its history record) is written after this step: every
    checkpoint_every steps, and at the run's last step (its length, or a stop)."""
    return step % t.checkpoint_every == 0 or last


def _step(run: Run, window: Window, guard: DivergenceGuard, trim, bar: Progress) -> StepInfo:
    """One optimizer step, timed (the heap trim counted in it), added to the window, checked by
    the guard and shown."""
    t0 = time.perf_counter()
    outs, chars, loss, ce, skipped = train_step(run, guard)
    trim(run.step)  # counted in the step's time: its cost is the trim and the pages faulted back
    seconds = time.perf_counter() - t0
    window.add(outs, loss, ce, chars, seconds, run.cfg.model.max_rows, skipped)
    guard.check(run.step, run.last_good())
    info = StepInfo(run.step, loss, chars, seconds, run.out_dir, skipped, [o.rows_used.detach() for o in outs])
    bar.update(run.step, loss, window.chars / window.train_s, lambda: info.rows_mean, seconds)
    return info


def _stop_asked(run: Run, signals: GracefulStop, callbacks, info: StepInfo) -> bool:
    """Whether the run stops after this step: a callback asked, or a signal came (under torchrun,
    what every rank agreed on: a signal caught later counts at the next step)."""
    stop = any([bool(cb(info)) for cb in callbacks])
    if run.dist.active:
        return _agree_stop(run, signals, stop)
    return stop or signals.requested is not None


def _agree_stop(run: Run, signals: GracefulStop, stop: bool) -> bool:
    """Whether any rank's callback asked to stop; a signal caught on any rank becomes every
    rank's (SIGTERM first), so that they all checkpoint at this step and exit alike."""
    caught = signals.requested
    asked, term, intr = distributed.agree(run.dist, run.device, float(stop), float(caught == signal.SIGTERM),
                                          float(caught == signal.SIGINT))
    if term or intr:
        signals.requested = caught or (signal.SIGTERM if term else signal.SIGINT)
        return True
    return asked > 0


def _evaluate(run: Run, heldout, bar: Progress) -> None:
    # Expert parallelism: every rank scores every chunk (a group's ranks take part in each
    # other's all_to_alls, so they must run the same batches).
    eval_x, eval_y = heldout
    run.last_bpc = heldout_bpc(run.model, eval_x, eval_y, run.cfg.train.batch, run.cfg, run.device,
                               run.dist if run.ep is None else distributed.SINGLE)
    bar.heldout(run.step, run.last_bpc)


def _record(run: Run, window: Window, t_start: float, save: bool):
    """The history record at this held-out evaluation, with the checkpoint where one is due;
    returns (record, the window to go on with). A run stopped between records keeps its window in
    the checkpoint, so the record after a resume covers the same steps as an uninterrupted run's.
    A resume trims the history to its checkpoint's step, and its exact steps write the records
    after it again."""
    t = run.cfg.train
    between = run.step % t.eval_every != 0 and run.step % t.checkpoint_every != 0 and run.step != t.steps
    record = {"step": run.step, **window.record(), "heldout_bpc": run.last_bpc, **memory_stats(run.device),
              "time_s": run.elapsed0 + time.perf_counter() - t_start, "checkpoint": save}
    if run.ep is not None:  # rank 0's all-to-all traffic per step, forward and backward
        record["a2a_bytes_per_step"] = run.ep.take_sent()
    window = window if between else Window()
    if save:
        _save(run, window, record)
    elif run.dist.main:
        history.append(run.out_dir / history.HISTORY, record)
    return record, window


def _save(run: Run, window: Window, record: dict) -> None:
    """Checkpoint and history record, unless the state is not finite: then the checkpoint on disk
    (the last good one) stays, and the run stops. Every rank comes here (the replicas are checked
    and the random states gathered); rank 0 writes, the others wait for it."""
    _check_state(run)
    rngs = distributed.gather_objects(run.dist, run.rng_state())
    experts = None
    if run.ep:  # every rank writes its shards (DCP); checkpoint.pt, written after, commits them
        tag = distributed.gather_objects(run.dist, checkpoint.new_tag())[0]
        experts = checkpoint.save_shards(run.ep, run.model, run.opt, run.out_dir, run.step, tag)
    failed = None
    if run.dist.main:
        try:
            checkpoint.save(run.state(record, window, rngs, experts), run.out_dir / checkpoint.CHECKPOINT)
            checkpoint.prune(run.out_dir, keep=experts and experts["folder"])
            history.append(run.out_dir / history.HISTORY, record)
        except Exception as exc:  # the other ranks must hear of it, not wait for it
            failed = exc
    # The barrier, and what rank 0 says of its write.
    if distributed.agree(run.dist, run.device, float(failed is not None))[0]:
        if failed is not None:
            raise failed
        raise checkpoint.CheckpointError(f"rank 0 could not write the checkpoint at step {run.step} (its error is "
                                         f"above); the last good one is {run.last_good()}")
    run.saved_step = run.step


def _check_state(run: Run) -> None:
    """The replicas agree and every rank's state is finite; else the run stops (Diverged)."""
    distributed.check_replicas(run.model, run.dist, run.step, *((run.ep.expert_names, run.ep.ep) if run.ep else ()))
    bad = nonfinite(state_tensors(run.model, run.opt))
    if distributed.agree(run.dist, run.device, float(len(bad)))[0] and not bad:  # another rank's shard
        bad = ["an expert shard on another rank"]
    if bad:
        raise Diverged(f"at step {run.step} the model or optimizer state is not finite ({len(bad)} tensors, "
                       f"e.g. {', '.join(bad[:3])}); it was not saved. The last good checkpoint is "
                       f"{run.last_good()}. {ADVICE}.")
