"""A training run: what it carries from step to step (Run) and what a checkpoint saves of it,
how it is built (model, AdamW, warmup + cosine) and how it starts or resumes (start). The loop
that drives it is trainer.py's."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..moe import _backend
from ..moe import ops as _ops
from ..moe.dispatch import resolve_path
from ..moe.expert_parallel import ExpertParallel
from . import checkpoint, distributed, history
from .config import Config, ConfigError, validate
from .data import Batches, check_fits, fixed_chunks, load_corpus
from .history import Window
from .model import ByteModel
from .optim import PoolAdamW

# Settings of the run's layout over processes, not of the model or its training: on --resume the
# command's own values hold (a checkpoint of an expert-parallel run resumes in one process).
LAYOUT = ("threads", "expert_parallel", "dist_timeout")


def check_card_fits(n_slots: int, device: torch.device, gpu_kernels: bool | None = None) -> None:
    """Before a run: a card the GPU kernels cannot take is an error now, not after the first step.
    Routing runs on the compiled kernels wherever they exist for the device (whatever
    model.dispatch says), so their presence decides; gpu_kernels overrides the look (tests)."""
    has = _ops.supports(device) if gpu_kernels is None else gpu_kernels
    if device.type == "cuda" and has and n_slots > _ops.GPU_MAX_SLOTS:
        raise ConfigError(f"model.n_slots = {n_slots}: the GPU kernels take at most {_ops.GPU_MAX_SLOTS} card slots; "
                          f"use a smaller card (model.n_slots; the pool can stay larger, admission picks the card), "
                          f"or train on the CPU")


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
    groups = model.param_groups(cfg.train.weight_decay, pool_lr, cfg.train.ngram_decay)
    opt = PoolAdamW(groups, model.pool, lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return model, opt, sched


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
            "dispatch": {"path": self.path, "extension": _backend.loaded(), "software": software()},
            "elapsed_s": record["time_s"],
            "window": window.state(),  # empty unless the run stopped between records (a signal)
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


def software() -> dict:
    """What a run's numbers depend on besides its settings and data: the ops' build, torch, and the
    threads the kernels split their work over (docs/reliability.md)."""
    return {"build": _backend.build_id(), "torch": str(torch.__version__), "threads": torch.get_num_threads()}


def software_note(ckpt: dict) -> str | None:
    """A line for a resume on other software than the checkpoint's, which goes on correctly but
    not bit for bit as the run would have without the stop."""
    saved = (ckpt.get("dispatch") or {}).get("software")
    if not saved:
        return None
    now = software()
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in now if k in saved and saved[k] != now[k]]
    if not changed:
        return None
    return ("minagi: the checkpoint was written by other software (" + "; ".join(changed) + "): the run goes on "
            "from it, but not bit for bit as it would have without the stop")


def resumed_config(cfg: Config, ckpt: dict, steps: int | None, named=None):
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
               for k, v in table.items() if getattr(getattr(saved, sec), k) != v
               and (named is None or f"{sec}.{k}" in named)]
    return saved, notes, ignored


def start(cfg: Config, out_dir: Path, resume: bool, steps: int | None = None, named=None):
    """The run, its window and corpus-derived held-out chunks, the corpus, and the lines to say
    about the settings of a resumed run. A start that fails once the process groups exist ends
    them."""
    checkpoint.check_writable(out_dir)
    # Under expert parallelism each rank reads only its experts (Run.restore).
    ckpt = checkpoint.load(out_dir, require_finite=True, experts=cfg.train.expert_parallel == 1) if resume else None
    notes = []
    if ckpt is not None:  # the saved settings win (but the layout's, and a named length)
        cfg, notes, ignored = resumed_config(cfg, ckpt, steps, named)
        if ignored:
            notes.append("minagi: resuming with the checkpoint's settings; ignoring " + ", ".join(ignored))
    device = resolve_device(cfg.train.device)
    dist = distributed.start(device.type, cfg.train.dist_timeout)
    try:
        built = _build_run(cfg, out_dir, ckpt, device, dist)  # sets the threads
        if ckpt is not None and (note := software_note(ckpt)):
            notes.append(note)
        return (*built, notes)
    except BaseException:
        distributed.stop(dist)
        raise


def _build_run(cfg: Config, out_dir: Path, ckpt: dict | None, device: torch.device, dist):
    """The run on this device and ranks (restored from ckpt where there is one), its window, its
    held-out chunks and the corpus."""
    if dist.active and device.type == "cuda":
        device = torch.device("cuda", dist.local_rank)
    torch.set_num_threads(distributed.threads(cfg.train.threads, dist))
    d = cfg.data
    corpus = load_corpus(d.path, d.heldout_every, d.max_in_memory, d.binary, d.context)
    check_fits(corpus, d.context, d.heldout_every)
    path = resolve_path(cfg.model.dispatch, device)
    check_card_fits(cfg.model.n_slots, device)
    ep = _expert_parallel(cfg, dist)
    model, opt, sched = build(cfg, device, ep)
    batches = Batches(corpus.train, cfg.data.context, cfg.train.batch, cfg.train.seed, rank=dist.rank,
                      world=dist.world, accum=cfg.train.grad_accum)
    run = Run(cfg, out_dir, device, model, opt, sched, batches, path, dist, ep=ep)
    window = _restore(run, ckpt)
    # After the restore: DDP starts from these weights. The expert shards stay out of it.
    run.engine = distributed.wrap(model, dist, device, ignore=ep.expert_names if ep else ())
    if cfg.train.compile:  # the experts compile whole; the model's per-row host reads (halting) break the graph
        run.engine = torch.compile(run.engine, dynamic=True)
    heldout = fixed_chunks(corpus.heldout, cfg.data.context, cfg.train.eval_chunks, cfg.train.seed + 1)
    return run, window, heldout, corpus


def _restore(run: Run, ckpt: dict | None) -> Window:
    """The run from its checkpoint (where there is one) and the history file to match: the
    window to go on with."""
    path = run.out_dir / history.HISTORY
    if ckpt is None:
        if path.exists() and run.dist.main:
            path.unlink()  # a fresh run owns its folder's history
        return Window()
    window = run.restore(ckpt)
    if ckpt["config"]["train"]["steps"] != run.cfg.train.steps:  # a new length: the schedule's lr at this step
        for group, base in zip(run.opt.param_groups, run.sched.base_lrs):
            group["lr"] = base * lr_factor(run.sched.last_epoch, run.cfg)
    if run.dist.main:
        history.rewrite(path, run.step, ckpt.get("record"))
    return window


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
