"""Checkpoints: written atomically (temporary file, fsync, rename), so a crash mid-write never
corrupts the last good one; loaded with torch.load's weights_only default (dicts, tensors and
plain types only).

An expert-parallel run's checkpoint is two parts: checkpoint.pt (everything but the expert
shards, and the name of their folder) and that folder, written by every rank through
torch.distributed.checkpoint (DCP). The folder is new at every save and checkpoint.pt, renamed
into place after it, is what commits it: a crash mid-write leaves the last good pair. load()
reads the shards back whole, so such a checkpoint loads in one process and at any world size.
Under expert parallelism each rank writes and reads its own part: save_shards, rest_state and
local_state, given the run's ExpertParallel (its groups and which parameters are the experts).
"""
from __future__ import annotations

import os
import shutil
import uuid
import warnings
import zipfile
from pathlib import Path

import torch

CHECKPOINT = "checkpoint.pt"
EXPERTS = "experts-"  # the shard folders' prefix: experts-<step>-<tag>


class CheckpointError(RuntimeError):
    """A checkpoint that is missing or cannot be read; the message says which and what to do."""


def save(obj: dict, path: Path) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX and Windows: readers see the old file or the new one


def check_writable(out_dir) -> None:
    """Make out_dir (and its parents) and prove a file can be written there, before any training:
    a run that cannot save must not find out after its first checkpoint_every steps."""
    out_dir = Path(out_dir)
    probe = out_dir / f".minagi-write-test-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"cannot write to the run folder {out_dir} ({type(exc).__name__}: "
                              f"{exc.strerror or exc}); choose another --out, or fix its permissions") from None


def placed(ckpt: dict, tensors: dict) -> dict:
    """A copy of the checkpoint with a shard folder's tensors in place (the input is left as it
    was): "model/NAME" is a model state entry, "optimizer/I/NAME" the entry NAME of the optimizer
    state of parameter I."""
    ckpt = dict(ckpt, model=dict(ckpt["model"]), optimizer=dict(ckpt["optimizer"], state=dict(ckpt["optimizer"]["state"])))
    for key, t in tensors.items():
        part, *rest = key.split("/")
        if part == "model":
            ckpt["model"][rest[0]] = t
        else:
            ckpt["optimizer"]["state"].setdefault(int(rest[0]), {})[rest[1]] = t
    return ckpt


def nonfinite_error(where, bad: list) -> CheckpointError:
    return CheckpointError(f"{where} holds non-finite weights ({len(bad)} tensors with NaN or inf, e.g. "
                           f"{', '.join(bad[:3])}): it was saved by a run that diverged. Train again "
                           "(with a lower train.lr), or use an earlier checkpoint")


def shard_folder(path: Path, ckpt: dict) -> Path:
    folder = path.parent / ckpt["experts"]["folder"]
    if not (folder / ".metadata").exists():
        raise CheckpointError(f"{path} keeps its expert shards in {folder}, which is missing or incomplete; "
                              "copy a run folder whole (checkpoint.pt with its experts-* folder)")
    return folder


def read_experts(path: Path, ckpt: dict) -> dict:
    """The expert shards of an expert-parallel run's checkpoint, read whole into it (in this
    process alone, at any world size): then it is an ordinary checkpoint."""
    import torch.distributed.checkpoint as dcp

    folder = shard_folder(path, ckpt)
    whole = {k: torch.empty(shape, dtype=getattr(torch, dtype)) for k, (shape, dtype) in ckpt["experts"]["tensors"].items()}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(whole, checkpoint_id=folder, no_dist=True)
    except Exception as exc:
        raise CheckpointError(f"the expert shards in {folder} cannot be read ({type(exc).__name__}: {exc})") from exc
    ckpt = placed(ckpt, whole)
    del ckpt["experts"]
    return ckpt


def prune(run_dir: Path, keep: str | None) -> None:
    """Remove the shard folders the checkpoint no longer names (older saves, or a save that
    crashed before its checkpoint.pt was written)."""
    for d in Path(run_dir).glob(EXPERTS + "*"):
        if d.name != keep and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


def unreadable(path: Path, exc: Exception) -> str:
    """Why torch.load refused a file, in a few words (torch's own text runs to many lines)."""
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
        return "not a file torch.save wrote, or a truncated one"
    text = str(exc)
    if "weights_only" in text or "Weights only load failed" in text:
        return "it holds Python objects beyond tensors and plain data, which a minagi checkpoint never does"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def load(run_dir, map_location="cpu", require_finite: bool = True, experts: bool = True) -> dict:
    """A run's checkpoint. experts=False leaves an expert-parallel run's shards where they are
    (its "experts" entry names them; ExpertParallel.local_state reads each rank's part)."""
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT if run_dir.is_dir() or not run_dir.suffix else run_dir
    if not path.exists():
        from .prog import PROG

        raise CheckpointError(f"no checkpoint at {path}: train into that folder first "
                              f"({PROG['train']} --out {path.parent}), or check the path")
    try:
        ckpt = torch.load(path, map_location=map_location)
    except Exception as exc:  # truncated, not a torch file, or unpickling refused
        raise CheckpointError(f"checkpoint {path} cannot be read ({unreadable(path, exc)}); give the folder of a "
                              "minagi run, or its checkpoint.pt") from exc
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise CheckpointError(f"{path} is not a minagi checkpoint (no model state or config in it)")
    if "experts" in ckpt and experts:
        ckpt = read_experts(path, ckpt)
    if require_finite:
        from .guard import nonfinite

        bad = nonfinite(ckpt["model"].items())
        if bad:
            raise nonfinite_error(path, bad)
    return ckpt


# --- An expert-parallel run's shards, every rank's part ---------------------------------------
# ep: the run's expert_parallel.ExpertParallel (its groups, its rank in the expert-parallel
# group, ep.ep ranks per group, ep.expert_names the sharded parameters).

def new_tag() -> str:
    """A shard folder's tag; every rank uses rank 0's, so a save at a step already saved gets a
    folder of its own."""
    return uuid.uuid4().hex[:8]


def _shard_tensors(ep, model, opt) -> dict:
    """This rank's expert tensors by checkpoint key (placed): the weights, and their optimizer
    state (moments, and the per-expert step counts)."""
    out = {f"model/{k}": t for k, t in model.state_dict().items() if k in ep.expert_names}
    flat = [p for g in opt.param_groups for p in g["params"]]
    for i in ep.opt_indices(model, opt):
        for name, v in opt.state.get(flat[i], {}).items():
            if v.dim() and v.shape[0] == flat[i].shape[0]:
                out[f"optimizer/{i}/{name}"] = v
    return out


def _as_dtensor(ep, local: torch.Tensor):
    """One shard as its part of the whole: split over the expert-parallel ranks (dim 0),
    replicated over the data-parallel ones, so DCP writes each expert once."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole = (local.shape[0] * ep.ep, *local.shape[1:])
    return DTensor.from_local(local, ep.device_mesh(local.device), [Replicate(), Shard(0)], run_check=False,
                              shape=torch.Size(whole), stride=torch.empty(whole, device="meta").stride())


def save_shards(ep, model, opt, run_dir: Path, step: int, tag: str) -> dict:
    """Every rank: the expert shards into a new DCP folder of run_dir. Returns the checkpoint's
    entry for them (the folder; each tensor's whole shape and dtype). tag: the same on every rank
    (rank 0's new_tag())."""
    import torch.distributed.checkpoint as dcp

    name = f"{EXPERTS}{step:08d}-{tag}"
    shards = {k: _as_dtensor(ep, v) for k, v in _shard_tensors(ep, model, opt).items()}
    dcp.save(shards, checkpoint_id=Path(run_dir) / name)
    tensors = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in shards.items()}
    return {"folder": name, "tensors": tensors}


def rest_state(ep, model, opt) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts without the expert shards (the same on every
    rank: what checkpoint.pt keeps beside the shard folder)."""
    shards = _shard_tensors(ep, model, opt)
    msd = {k: v for k, v in model.state_dict().items() if f"model/{k}" not in shards}
    osd = opt.state_dict()
    osd["state"] = {i: {n: v for n, v in st.items() if f"optimizer/{i}/{n}" not in shards}
                    for i, st in osd["state"].items()}
    return msd, osd


def local_state(ep, ckpt: dict, path: Path, model, opt) -> dict:
    """The checkpoint with this rank's part of the experts: read from its DCP folder (only this
    rank's rows), or cut from a checkpoint that holds the whole pool."""
    if "experts" not in ckpt:
        return _cut(ep, ckpt, model, opt)
    import torch.distributed.checkpoint as dcp

    folder = shard_folder(path, ckpt)
    n = model.pool.w_in.shape[0]
    mine = {k: _as_dtensor(ep, torch.empty((n, *shape[1:]), dtype=getattr(torch, dtype), device=model.pool.w_in.device))
            for k, (shape, dtype) in ckpt["experts"]["tensors"].items()}
    dcp.load(mine, checkpoint_id=folder)
    local = {k: t.to_local() for k, t in mine.items()}
    _check_finite(folder, local)
    return placed(ckpt, local)


def _check_finite(folder: Path, local: dict) -> None:
    """Every rank hears of a non-finite shard (a rank that raised alone would leave the others
    waiting in their next collective)."""
    import torch.distributed as dist

    from .guard import nonfinite

    bad = nonfinite(local.items())
    count = torch.tensor([float(len(bad))], device=next(iter(local.values())).device)
    dist.all_reduce(count)
    if count.item():
        raise nonfinite_error(folder, bad or ["a shard read by another rank"])


def _cut(ep, ckpt: dict, model, opt) -> dict:
    """A checkpoint of the whole pool cut down to this rank's shard."""
    n = model.pool.w_in.shape[0]
    mine = slice(ep.rank * n, (ep.rank + 1) * n)
    ckpt = dict(ckpt, model=dict(ckpt["model"]))
    for k in ep.expert_names:
        ckpt["model"][k] = ckpt["model"][k][mine]
    osd = dict(ckpt["optimizer"], state=dict(ckpt["optimizer"]["state"]))
    for i in ep.opt_indices(model, opt):
        if i in osd["state"]:
            osd["state"][i] = {k: v[mine] if v.dim() else v for k, v in osd["state"][i].items()}
    ckpt["optimizer"] = osd
    return ckpt
