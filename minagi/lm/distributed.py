"""Data parallelism on PyTorch's engine: torchrun starts the processes, torch.distributed joins
them (gloo on the CPU, nccl on CUDA, RCCL on ROCm), DistributedDataParallel (DDP) averages the
gradients. A plain `python train.py` never gets here: without torchrun's environment there is no
process group and nothing changes.

What DDP does not do, this module does: the sums that keep the replicas identical where the
model itself looks across characters (admission's mean affinity, the balance terms' loads), the
per-step figures every rank must agree on (the loss the divergence guard reads, a stop asked for
by a signal), the held-out score split across ranks, and a check that the replicas are still
bit-for-bit the same at every checkpoint.
"""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import time
from dataclasses import dataclass

import torch

# torchrun's variables; WORLD_SIZE alone marks a process it started.
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class DistributedError(RuntimeError):
    """A distributed setup that cannot work; the message says what to change."""


def launched() -> bool:
    """This process was started by torchrun (or anything that sets its variables)."""
    return "WORLD_SIZE" in os.environ


def rank() -> int:
    """This process's rank from torchrun's environment (0 without torchrun)."""
    return int(os.environ.get("RANK", 0))


@dataclass(frozen=True)
class Dist:
    """This process's place among the ranks; the single-process default is rank 0 of 1."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    active: bool = False  # a process group is up

    @property
    def main(self) -> bool:
        return self.rank == 0


SINGLE = Dist()


def start(device_type: str, timeout_s: float) -> Dist:
    """Join torchrun's process group (the backend from the device type), or SINGLE without
    torchrun. timeout_s bounds every collective: a rank that waits longer for its peers fails
    with torch's timeout error instead of hanging."""
    if not launched():
        return SINGLE
    if not torch.distributed.is_available():
        raise DistributedError(f"this torch build ({torch.__version__}) has no torch.distributed, which torchrun "
                               "needs; train with plain `python train.py`, or install a torch build with it")
    d = Dist(rank(), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)),
             int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])), True)
    if device_type == "cuda":
        torch.cuda.set_device(d.local_rank)
    if not torch.distributed.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        kw = {"device_id": torch.device("cuda", d.local_rank)} if device_type == "cuda" else {}
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return d


# How long stop() leaves the GIL free for gloo's worker threads (see there).
DRAIN_S = 0.25


def stop(d: Dist) -> None:
    """Ends this rank's process groups, after every collective has returned. A gloo group's
    worker threads are joined (torch 2.13) by its destructor, wherever its last reference goes:
    in destroy_process_group, or later (the DDP reducer's, when the model is freed), always with
    the GIL held; shutdown() does not join them. A worker still releasing a finished
    collective's tensors needs the GIL to drop their Python objects, so that join never returned
    (a finished run hung at exit in 2 of 4 runs on a loaded 2-core machine; at interpreter exit
    the same release aborts the process). The pause first, with the GIL free, lets the workers
    finish; nothing after it gives them new work."""
    if d.active and torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "gloo":
            time.sleep(DRAIN_S)
        torch.distributed.destroy_process_group()


def threads(setting: int, d: Dist) -> int:
    """train.threads, with 0 meaning this machine's cores shared among its ranks (torchrun's
    OMP_NUM_THREADS=1 is overridden explicitly either way)."""
    if setting:
        return setting
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // d.local_world)


class Sum:
    """Sums tensors across the data-parallel ranks, in place (all_reduce); what the model calls
    where it looks across the whole batch. world: how many ranks share a batch."""

    def __init__(self, world: int, group=None):
        self.world, self.group = world, group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(t, group=self.group)
        return t


def wrap(model: torch.nn.Module, d: Dist, device: torch.device, ignore=()):
    """The module that runs training's forward: the model itself in one process; under torchrun,
    the model in DDP (gradients averaged in backward), with the model's own sums across ranks
    switched on. Every parameter gets a gradient each step (the expert weights' backward is
    dense), so DDP runs without find_unused_parameters; the halting unit is left out of DDP when
    adaptive rows are off, as nothing uses it. Buffers are not broadcast: the only one that
    changes (the routing biases) moves by the same all-reduced loads on every rank. ignore: the
    names of parameters DDP leaves alone (expert parallelism's shards, reduced by their own group)."""
    if not d.active:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise DistributedError(f"the model's parameters are on {sorted(map(str, devices))}; under torchrun they "
                               "must share one device: leave model.pool_device empty")
    ignore = list(ignore) + ([] if model.cfg.adaptive_rows else ["halt.weight", "halt.bias"])
    if ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
    model.sync = Sum(d.world)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True,
               **_no_buffer_sync(DDP))


def _no_buffer_sync(ddp_class) -> dict:
    """DDP's switch for not broadcasting buffers every forward: forward_sync_buffers where this
    torch has it (broadcast_buffers is deprecated there), broadcast_buffers before."""
    params = inspect.signature(ddp_class.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def no_sync(engine, last: bool):
    """DDP's no_sync for every micro-batch but an optimizer step's last (gradient accumulation:
    the gradients are averaged across ranks once, after the last)."""
    if last or not hasattr(engine, "no_sync"):
        return contextlib.nullcontext()
    return engine.no_sync()


def agree(d: Dist, device: torch.device, *values: float) -> list[float]:
    """The sums over ranks of a few per-step figures (one all_reduce), so that every rank takes
    the same decisions from them: the guard's loss, a stop asked for on one rank."""
    if not d.active:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist()


def gather_objects(d: Dist, obj):
    """Every rank's obj, in rank order, on every rank (one per process in one process)."""
    if not d.active:
        return [obj]
    out = [None] * d.world
    torch.distributed.all_gather_object(out, obj)
    return out


def checksum(model: torch.nn.Module) -> torch.Tensor:
    """Per parameter and buffer, the sum of its bits read as integers: any flipped bit changes it."""
    sums = []
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        t = t.detach().contiguous().reshape(-1)
        if t.is_floating_point():
            t = t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
        sums.append(t.long().sum())
    return torch.stack(sums).cpu() if sums else torch.zeros(0, dtype=torch.long)


def check_replicas(model: torch.nn.Module, d: Dist, step: int, sharded=(), ep: int = 1) -> None:
    """Raise if the ranks' models differ in any bit: data parallelism's promise, checked at every
    checkpoint (a mismatch means a rank took a different decision, and the run cannot go on).
    sharded: expert parallelism's shards, which differ by design within a group of ep ranks;
    each is compared with the first group's rank that holds the same experts (rank % ep)."""
    if not d.active:
        return
    sums = [s.tolist() for s in gather_objects(d, checksum(model))]
    names = [k for k, t in model.state_dict().items() if isinstance(t, torch.Tensor) and t.numel()]
    for r in range(1, d.world):
        which = [n for i, n in enumerate(names)
                 if sums[r][i] != sums[r % ep if n in sharded else 0][i]]
        if which:
            raise DistributedError(f"at step {step} the model on rank {r} differs from its replica's ({', '.join(which[:4])}"
                                   f"{' ...' if len(which) > 4 else ''}): the replicas drifted apart. This is a bug; "
                                   "please report it with the run's config")
