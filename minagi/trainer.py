"""The training loop: AdamW (off-card experts untouched), warmup + cosine, gradient clipping,
gradient accumulation, bfloat16 autocast on GPUs, held-out bits per byte, atomic
checkpoints, exact resume, and the history file (one JSON record per checkpoint). Under torchrun
the same loop trains one model on every rank (minagi/distributed.py): rank 0 writes the
checkpoints, the history and the progress."""
from __future__ import annotations

import json
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import _backend, allocator, checkpoint, distributed
from .config import Config, ConfigError, validate
from .data import Batches, check_fits, fixed_chunks, load_corpus
from .dispatch import resolve_path
from .expert_parallel import ExpertParallel
from .guard import ADVICE, Diverged, DivergenceGuard, GracefulStop, Interrupted, nonfinite, state_tensors
from .memory import memory_stats
from .model import ByteModel
from .ops import check_card_fits
from .optim import PoolAdamW

HISTORY = "history.jsonl"
# Settings of the run's layout over processes, not of the model or its training: on --resume the
# command's own values hold (a checkpoint of an expert-parallel run resumes in one process).
LAYOUT = ("threads", "expert_parallel", "dist_timeout")
SINK_WARNING = 0.5  # first-row sink_share past which the run warns (once)
LN2 = math.log(2)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device={name} but torch sees no GPU ({torch.__version__}); use train.device=cpu")
    return dev


def lr_factor(step: int, cfg: Config) -> float:
    """Linear warmup, then cosine down to min_lr_frac, over the whole run (train.steps)."""
    t = cfg.train
    if step < t.warmup:
        return (step + 1) / t.warmup
    progress = (step - t.warmup) / max(1, t.steps - t.warmup)
    return t.min_lr_frac + (1 - t.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build(cfg: Config, device: torch.device, ep: ExpertParallel | None = None):
    """Model, optimizer and schedule; with expert parallelism the model keeps its rank's experts
    (every rank makes the whole pool from the seed first, so the shards are one process's)."""
    torch.manual_seed(cfg.train.seed)
    model = ByteModel(cfg.model, cfg.data.context).to(device)
    if ep is not None:
        ep.shard(model)
    if cfg.model.pool_device:
        model.pool.to(torch.device(cfg.model.pool_device))
    pool_lr = cfg.train.lr * cfg.train.pool_lr_scale
    opt = PoolAdamW(model.param_groups(cfg.train.weight_decay, pool_lr), model.pool, lr=cfg.train.lr,
                    betas=(cfg.train.beta1, cfg.train.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return model, opt, sched


def autocast(cfg: Config, device: torch.device):
    enabled = device.type == "cuda" and cfg.model.dtype == "bfloat16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def heldout_bpc(model, inputs, targets, batch: int, cfg: Config, device, dist=distributed.SINGLE) -> float:
    """Mean bits per byte over fixed held-out chunks. Under data parallelism each rank
    scores every world-th batch of them and the sums are added up: the same batches (so the same
    admitted cards) and the same figure as one process."""
    model.eval()
    total, count = 0.0, 0
    for b, i in enumerate(range(0, inputs.shape[0], batch)):
        if b % dist.world != dist.rank:
            continue
        x, y = inputs[i:i + batch].to(device), targets[i:i + batch].to(device)
        with autocast(cfg, device):
            logits = model(x).logits
        total += float(torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1), reduction="sum"))
        count += y.numel()
    model.train()
    total, count = distributed.agree(dist, device, total, count)
    return total / count / LN2


@dataclass
class Window:
    """What happened since the last history record."""
    loss_sum: float = 0.0
    ce_sum: float = 0.0
    steps: int = 0
    chars: int = 0
    train_s: float = 0.0
    rows: list = field(default_factory=list)  # rows-used histograms, one per step
    routed: int = 0
    dropped: int = 0
    executed: int = 0
    groups: int = 0
    calls: int = 0
    max_load_ratio: float = 0.0  # over calls with at least n_slots characters
    skipped: int = 0  # steps the divergence guard skipped
    # The first row's routing (every character active), summed over the window's steps.
    first_rows: int = 0
    sink_share: float = 0.0
    load_ratio: float = 0.0
    load_entropy: float = 0.0
    slot_load: list = field(default_factory=list)  # pairs per card slot, every row of every step

    def add(self, outs, loss: float, ce: float, chars: int, seconds: float, max_rows: int, skipped=False) -> None:
        """One optimizer step: outs, the model's outputs of its micro-batches (this rank's); chars,
        the characters of the whole step (every rank's)."""
        self.chars += chars
        self.train_s += seconds
        if skipped:  # its loss is not finite: no figure of it would mean anything
            self.skipped += 1
            return
        self.loss_sum += loss
        self.ce_sum += ce
        self.steps += 1
        self.rows.append(sum(torch.bincount(out.rows_used.reshape(-1).long().cpu(), minlength=max_rows + 1)[1:]
                             for out in outs))
        for out in outs:
            self._add_routing(out)

    def _add_routing(self, out) -> None:
        for st in out.dispatch:
            self.routed += st.routed_pairs
            self.dropped += st.dropped_pairs
            self.executed += st.executed_rows
            self.groups += st.groups
            self.calls += 1
            # A call of a handful of characters says nothing of the load: one character alone
            # is always at n_slots / top_k times the fair share.
            if st.n_chars >= len(st.slot_load):
                self.max_load_ratio = max(self.max_load_ratio, st.max_load_ratio)
            self.slot_load = [a + b for a, b in zip(self.slot_load, st.slot_load)] if self.slot_load else list(st.slot_load)
        if out.dispatch:
            first = out.dispatch[0]
            self.first_rows += 1
            self.sink_share += first.sink_share
            self.load_ratio += first.max_load_ratio
            self.load_entropy += first.load_entropy

    def record(self) -> dict:
        hist = torch.stack(self.rows).sum(0).double() if self.rows else torch.zeros(1)
        n = float(hist.sum()) or 1.0
        firsts = max(1, self.first_rows)
        return {
            "train_loss": self.loss_sum / max(1, self.steps),  # nats, ponder and balance included
            "train_bpc": self.ce_sum / max(1, self.steps) / LN2,
            "char_per_s": self.chars / self.train_s if self.train_s else 0.0,
            "rows_mean": float((hist * torch.arange(1, hist.numel() + 1)).sum() / n),
            "rows_hist": [round(float(c) / n, 4) for c in hist],  # share of characters using 1, 2, ... rows
            "sink_share": self.sink_share / firsts,
            "load_ratio": self.load_ratio / firsts,
            "load_entropy": self.load_entropy / firsts,
            "dead_slots": sum(1 for c in self.slot_load if c == 0),
            "max_load_ratio": self.max_load_ratio,
            "dropped_frac": self.dropped / self.routed if self.routed else 0.0,
            "executed_ratio": self.executed / self.routed if self.routed else 0.0,
            "groups_mean": self.groups / self.calls if self.calls else 0.0,
            "skipped_steps": self.skipped,
        }


class Progress:
    """tqdm on a terminal; on anything else a plain line every ~5% of the run."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.total, self.bar, self.enabled = total, None, enabled
        self.every = max(1, total // 20)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, cps: float, rows: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.3f}  {cps:,.0f} char/s  rows {rows:.2f}")
        elif step % self.every == 0 or step == self.total:
            print(f"step {step}/{self.total}  loss {loss:.3f}  {cps:,.0f} char/s  rows {rows:.2f}",
                  file=sys.stderr, flush=True)

    def write(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _rewrite_history(path: Path, upto: int, record: dict | None) -> None:
    """On resume: drop records past the checkpoint; restore the checkpoint's own if it is missing."""
    kept = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a crash mid-write
                continue
            if rec["step"] <= upto:
                kept.append(rec)
    if record is not None and not any(r["step"] == record["step"] for r in kept):
        kept.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


@dataclass
class StepInfo:
    """What a callback sees after each optimizer step."""
    step: int
    loss: float
    chars: int  # characters trained on in this step
    step_s: float  # seconds of this step (forward, backward, update)
    out_dir: Path
    skipped: bool = False  # the divergence guard skipped it
    rows_mean: float = 0.0  # rows per character (adaptive rows: fewer as the model learns)


@dataclass
class Run:
    """Everything a training run carries from step to step, and what a checkpoint saves of it."""
    cfg: Config
    out_dir: Path
    device: torch.device
    model: ByteModel
    opt: PoolAdamW
    sched: torch.optim.lr_scheduler.LambdaLR
    batches: Batches
    path: str  # the dispatch path
    dist: distributed.Dist = distributed.SINGLE
    engine: torch.nn.Module | None = None  # what runs training's forward: the model, or the model in DDP
    ep: ExpertParallel | None = None  # expert parallelism (train.expert_parallel > 1)
    step: int = 0
    elapsed0: float = 0.0  # seconds of the run before this process
    last_bpc: float = float("nan")
    saved_step: int | None = None  # the step of the checkpoint on disk
    saved_record: dict | None = None  # its history record
    saved_world: int | None = None  # the ranks of the run that wrote the checkpoint resumed from

    def rng_state(self) -> dict:
        return {"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}

    def state(self, record: dict, window: Window, rngs: list, experts: dict | None = None) -> dict:
        """The checkpoint. rngs: every rank's random state, in rank order (the data position is
        one generator, the same on every rank); experts: under expert parallelism, the entry
        naming the shard folder just written (the expert shards are left out of this part)."""
        model_sd, opt_sd = (checkpoint.rest_state(self.ep, self.model, self.opt) if experts
                            else (self.model.state_dict(), self.opt.state_dict()))
        return {
            "model": model_sd, "optimizer": opt_sd, "scheduler": self.sched.state_dict(),
            "step": self.step, "data": self.batches.state(), "config": self.cfg.to_dict(), "record": record,
            "rng": {**rngs[0], "ranks": rngs},
            "world": self.dist.world,
            "dispatch": {"path": self.path, "extension": _backend.loaded()},
            "elapsed_s": record["time_s"],
            "window": asdict(window),  # empty unless the run stopped between records (a signal)
            **({"experts": experts} if experts else {}),
        }

    def restore(self, ckpt: dict) -> Window:
        if self.ep is not None:  # this rank's experts, from the shard folder or the whole pool
            ckpt = checkpoint.local_state(self.ep, ckpt, self.out_dir / checkpoint.CHECKPOINT, self.model, self.opt)
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.batches.set_state(ckpt["data"])
        rngs = ckpt["rng"].get("ranks") or [ckpt["rng"]]
        rng = rngs[self.dist.rank] if ckpt.get("world", 1) == self.dist.world else rngs[0]
        torch.set_rng_state(rng["torch"])
        if self.device.type == "cuda" and rng.get("cuda") is not None:
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        self.step = self.saved_step = ckpt["step"]
        self.saved_world = ckpt.get("world", 1)
        self.elapsed0 = ckpt["elapsed_s"]
        self.saved_record = ckpt.get("record")
        if self.saved_record:
            self.last_bpc = self.saved_record["heldout_bpc"]
        return Window(**ckpt["window"]) if ckpt.get("window") else Window()

    def last_good(self) -> str:
        return (f"{self.out_dir / checkpoint.CHECKPOINT} (step {self.saved_step})" if self.saved_step is not None
                else "none: no checkpoint was written yet")


def _resumed_config(cfg: Config, ckpt: dict, steps: int | None):
    """The checkpoint's settings with this command's layout (and, where given, its length): the
    config to go on with, the one-line notes on what changed, and the settings ignored."""
    saved = Config.from_dict(ckpt["config"])
    for key in LAYOUT:  # how this run spreads over processes is this command's to say
        setattr(saved.train, key, getattr(cfg.train, key))
    notes = []
    if steps is not None and steps != saved.train.steps:
        if steps < ckpt["step"]:
            raise ConfigError(f"--steps {steps} is below the checkpoint's step {ckpt['step']}: a resumed run can "
                              f"only go on; give --steps {ckpt['step']} or more (the run was planned for "
                              f"{saved.train.steps})")
        notes.append(f"minagi: resuming at step {ckpt['step']} and training to step {steps} (planned: "
                     f"{saved.train.steps}); the learning-rate schedule is re-planned over {steps} steps")
        saved.train.steps = steps
    validate(saved)  # the command's layout against the saved model (expert parallelism's needs)
    ignored = [f"{sec}.{k}={v} (saved: {getattr(getattr(saved, sec), k)})"
               for sec, table in cfg.to_dict().items() if isinstance(table, dict)
               for k, v in table.items() if getattr(getattr(saved, sec), k) != v]
    return saved, notes, ignored


def _start(cfg: Config, out_dir: Path, resume: bool, steps: int | None = None):
    """The run, its window and corpus-derived held-out chunks, and the lines to say about the
    settings of a resumed run. A start that fails once the process groups exist ends them."""
    checkpoint.check_writable(out_dir)
    # Under expert parallelism each rank reads only its experts (Run.restore).
    ckpt = checkpoint.load(out_dir, require_finite=True, experts=cfg.train.expert_parallel == 1) if resume else None
    notes = []
    if ckpt is not None:  # the saved settings win (but the layout's, and a named length)
        cfg, notes, ignored = _resumed_config(cfg, ckpt, steps)
        if ignored:
            notes.append("minagi: resuming with the checkpoint's settings; ignoring " + ", ".join(ignored))
    device = resolve_device(cfg.train.device)
    dist = distributed.start(device.type, cfg.train.dist_timeout)
    try:
        return (*_build_run(cfg, out_dir, ckpt, device, dist), notes)
    except BaseException:
        distributed.stop(dist)
        raise


def _build_run(cfg: Config, out_dir: Path, ckpt: dict | None, device: torch.device, dist):
    """The run on this device and ranks (restored from ckpt where there is one), its window, its
    held-out chunks and the corpus."""
    if dist.active and device.type == "cuda":
        device = torch.device("cuda", dist.local_rank)
    torch.set_num_threads(distributed.threads(cfg.train.threads, dist))
    corpus = load_corpus(cfg.data.path, cfg.data.heldout_every, cfg.data.max_in_memory)
    check_fits(corpus, cfg.data.context)
    path = resolve_path(cfg.model.dispatch, device)
    check_card_fits(cfg.model.n_slots, device)
    ep = _expert_parallel(cfg, dist)
    model, opt, sched = build(cfg, device, ep)
    batches = Batches(corpus.train, cfg.data.context, cfg.train.batch, cfg.train.seed, rank=dist.rank,
                      world=dist.world, accum=cfg.train.grad_accum)
    run = Run(cfg, out_dir, device, model, opt, sched, batches, path, dist, ep=ep)
    history = out_dir / HISTORY
    window = Window()
    if ckpt is not None:
        window = run.restore(ckpt)
        if ckpt["config"]["train"]["steps"] != cfg.train.steps:  # a new length: the schedule's lr at this step
            for group, base in zip(opt.param_groups, sched.base_lrs):
                group["lr"] = base * lr_factor(sched.last_epoch, cfg)
        if dist.main:
            _rewrite_history(history, run.step, ckpt.get("record"))
    elif history.exists() and dist.main:
        history.unlink()  # a fresh run owns its folder's history
    # After the restore: DDP starts from these weights. The expert shards stay out of it.
    run.engine = distributed.wrap(model, dist, device, ignore=ep.expert_names if ep else ())
    heldout = fixed_chunks(corpus.heldout, cfg.data.context, cfg.train.eval_chunks, cfg.train.seed + 1)
    return run, window, heldout, corpus


def _expert_parallel(cfg: Config, dist) -> ExpertParallel | None:
    E = cfg.train.expert_parallel
    if E == 1:
        return None
    if not dist.active or dist.world % E:
        raise distributed.DistributedError(
            f"train.expert_parallel = {E} needs a multiple of {E} ranks under torchrun (this run has "
            f"{dist.world if dist.active else 'no torchrun and 1'}); start it with torchrun --nproc-per-node {E}, "
            "or set train.expert_parallel = 1")
    return ExpertParallel(dist.world, E)


def _train_step(run: Run, guard: DivergenceGuard):
    """One optimizer step over grad_accum micro-batches; returns (outputs, characters of every
    rank, loss, ce, skipped), the loss and ce averaged over the micro-batches and the ranks. A
    step the guard rejects leaves the parameters and the optimizer (moments, step counts) as they
    were; the schedule moves on."""
    micro = [(x.to(run.device), y.to(run.device)) for x, y in run.batches.next_step()]
    # Several batches make this step (micro-batches, ranks): one card for them all, as one batch would admit.
    card = run.model.choose_card([x for x, _ in micro]) if len(micro) * run.dist.world > 1 else None
    outs = []
    for a, (x, y) in enumerate(micro):
        with distributed.no_sync(run.engine, last=a == len(micro) - 1), autocast(run.cfg, run.device):
            out = run.engine(x, y, card)
            (out.loss / len(micro)).backward()
        outs.append(out)
    if run.ep is not None:  # the expert shards' gradients, summed where DDP does not reach
        run.ep.reduce_grads(run.model)
        grad_norm = run.ep.clip_grad_norm_(run.model, run.cfg.train.grad_clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.train.grad_clip)
    n = len(micro) * run.dist.world
    loss, ce = (v / n for v in distributed.agree(run.dist, run.device, *(
        sum(float(getattr(o, k).detach()) for o in outs) for k in ("loss", "ce"))))
    ok = guard.step_ok(torch.tensor(loss), grad_norm)  # the same loss and norm on every rank
    if ok:
        run.opt.step()
    run.model.balance_step(applied=ok)
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    run.step += 1
    return outs, sum(x.numel() for x, _ in micro) * run.dist.world, loss, ce, not ok


def _save(run: Run, window: Window, record: dict) -> None:
    """Checkpoint and history record, unless the state is not finite: then the checkpoint on disk
    (the last good one) stays, and the run stops. Every rank comes here (the replicas are checked
    and the random states gathered); rank 0 writes, the others wait for it."""
    distributed.check_replicas(run.model, run.dist, run.step, *((run.ep.expert_names, run.ep.ep) if run.ep else ()))
    bad = nonfinite(state_tensors(run.model, run.opt))
    if distributed.agree(run.dist, run.device, float(len(bad)))[0] and not bad:  # another rank's shard
        bad = ["an expert shard on another rank"]
    if bad:
        raise Diverged(f"at step {run.step} the model or optimizer state is not finite ({len(bad)} tensors, "
                       f"e.g. {', '.join(bad[:3])}); it was not saved. The last good checkpoint is "
                       f"{run.last_good()}. {ADVICE}.")
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
            with open(run.out_dir / HISTORY, "a") as f:
                f.write(json.dumps(record) + "\n")
        except Exception as exc:  # the other ranks must hear of it, not wait for it
            failed = exc
    # The barrier, and what rank 0 says of its write.
    if distributed.agree(run.dist, run.device, float(failed is not None))[0]:
        if failed is not None:
            raise failed
        raise checkpoint.CheckpointError(f"rank 0 could not write the checkpoint at step {run.step} (its error is "
                                         f"above); the last good one is {run.last_good()}")
    run.saved_step = run.step


def _checkpoint(run: Run, window: Window, t_start: float):
    """The history record and checkpoint at this step; returns (record, the window to go on
    with). A run stopped between records keeps its window in the checkpoint, so the record after
    a resume covers the same steps as an uninterrupted run's."""
    between = run.step % run.cfg.train.checkpoint_every != 0 and run.step != run.cfg.train.steps
    record = {"step": run.step, **window.record(), "heldout_bpc": run.last_bpc, **memory_stats(run.device),
              "time_s": run.elapsed0 + time.perf_counter() - t_start}
    if run.ep is not None:  # rank 0's all-to-all traffic per step, forward and backward
        record["a2a_bytes_per_step"] = run.ep.take_sent()
    window = window if between else Window()
    _save(run, window, record)
    return record, window


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


def _describe(run: Run, corpus, resume: bool) -> str:
    cfg, t, d = run.cfg, run.cfg.train, run.dist
    scale = (f"; {d.world} ranks (torchrun, DDP over {torch.distributed.get_backend()}), global batch "
             f"{t.batch} x {t.grad_accum} x {d.world} = {t.batch * t.grad_accum * d.world} chunks" if d.active
             else f"; batch {t.batch} x {t.grad_accum} micro-batches" if t.grad_accum > 1 else "")
    return (f"minagi: profile {cfg.profile}, {sum(p.numel() for p in run.model.parameters()):,} parameters, "
            f"{run.device}, dispatch {run.path}{'' if _backend.loaded() else ' (pure torch)'}, "
            f"allocator {allocator.describe()}, {torch.get_num_threads()} threads{scale}; {corpus.describe()}"
            + (f"; resuming at step {run.step}" if resume else ""))


def _world_note(run: Run) -> str | None:
    """One line when a run resumes at another world size than the checkpoint's."""
    if run.saved_world in (None, run.dist.world):
        return None
    t = run.cfg.train
    return (f"minagi: the checkpoint was saved by {run.saved_world} rank(s), this run has {run.dist.world}: the model, "
            f"optimizer and schedule go on from step {run.step}; the data stream goes on from its saved position "
            f"with the new global batch ({t.batch * t.grad_accum * run.dist.world} chunks), so the chunks differ "
            "from an uninterrupted run's")


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


def train(cfg: Config, out_dir, resume: bool = False, progress: bool = True, callbacks=(),
          steps: int | None = None) -> dict:
    """Train (or resume) into out_dir; returns the last history record. callbacks: functions
    called with a StepInfo after every step; one that returns True ends the run there, with a
    checkpoint at that step (as a finished run has). Raises guard.Diverged when the run
    diverges, guard.Interrupted after the checkpoint of a run stopped by SIGTERM or SIGINT.
    Under torchrun (minagi/distributed.py) every rank runs this; the ranks stop together.
    steps (with resume): train the resumed run to this step instead of its saved length (its
    schedule re-planned over it); below the checkpoint's step it is a ConfigError."""
    out_dir = Path(out_dir)
    # From here a signal means "stop after the current step", during the start too: it then
    # stops after the first step, with that step's checkpoint.
    with GracefulStop() as signals:
        run, window, heldout, corpus, notes = _start(cfg, out_dir, resume, steps)
        try:
            bar = Progress(run.cfg.train.steps, run.step, progress and run.dist.main)
            for note in notes:
                bar.write(note)
            bar.write(_describe(run, corpus, resume))
            if _world_note(run):
                bar.write(_world_note(run))
            return _loop(run, window, heldout, bar, callbacks, signals)
        finally:
            distributed.stop(run.dist)


def _loop(run: Run, window: Window, heldout, bar: Progress, callbacks, signals: GracefulStop) -> dict:
    cfg, device, t, out_dir = run.cfg, run.device, run.cfg.train, run.out_dir
    eval_x, eval_y = heldout
    guard, sinks, t_start, record = DivergenceGuard(t.max_bad_steps), SinkWatch(bar, out_dir), time.perf_counter(), None
    trim = allocator.HeapTrim(t.malloc_trim_every if device.type == "cpu" else 0)
    run.model.train()
    while run.step < t.steps:
        t0 = time.perf_counter()
        outs, chars, loss, ce, skipped = _train_step(run, guard)
        trim(run.step)  # counted in the step's time: its cost is the trim and the pages faulted back
        seconds = time.perf_counter() - t0
        window.add(outs, loss, ce, chars, seconds, cfg.model.max_rows, skipped)
        guard.check(run.step, run.last_good())
        rows_mean = float(sum(o.rows_used.mean() for o in outs) / len(outs))
        bar.update(run.step, loss, window.chars / window.train_s, rows_mean)
        info = StepInfo(run.step, loss, chars, seconds, out_dir, skipped, rows_mean)
        stop = any([bool(cb(info)) for cb in callbacks])
        if run.dist.active:  # only what every rank agreed on: a signal caught later counts next step
            stop = _agree_stop(run, signals, stop)
        else:
            stop = stop or signals.requested is not None
        last = run.step == t.steps or stop
        if run.step % t.eval_every == 0 or run.step % t.checkpoint_every == 0 or last:
            # Expert parallelism: every rank scores every chunk (a group's ranks take part in
            # each other's all_to_alls, so they must run the same batches).
            run.last_bpc = heldout_bpc(run.model, eval_x, eval_y, t.batch, cfg, device,
                                       run.dist if run.ep is None else distributed.SINGLE)
            bar.write(f"step {run.step}: held-out {run.last_bpc:.3f} bits per byte")
        if run.step % t.checkpoint_every == 0 or last:
            record, window = _checkpoint(run, window, t_start)
            sinks.check(record)
        if stop:
            break
    bar.close()
    if signals.requested is not None and run.step < t.steps:  # a run that finished anyway is done
        raise Interrupted(signals.requested, run.step, out_dir)
    return record if record is not None else (run.saved_record or {})
