"""Checkpoints: written atomically (temporary file, fsync, rename), so a crash mid-write never
corrupts the last good one; loaded with torch.load's weights_only default (dicts, tensors and
plain types only)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

CHECKPOINT = "checkpoint.pt"


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


def load(run_dir, map_location="cpu", require_finite: bool = True) -> dict:
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT if run_dir.is_dir() or not run_dir.suffix else run_dir
    if not path.exists():
        from .cli import PROG

        raise CheckpointError(f"no checkpoint at {path}: train into that folder first "
                              f"({PROG['train']} --out {path.parent}), or check the path")
    try:
        ckpt = torch.load(path, map_location=map_location)
    except Exception as exc:  # truncated, not a torch file, or unpickling refused
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc}); "
                              "it may be truncated or not a minagi checkpoint") from exc
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise CheckpointError(f"{path} is not a minagi checkpoint (no model state or config in it)")
    if require_finite:
        from .guard import nonfinite

        bad = nonfinite(ckpt["model"].items())
        if bad:
            raise CheckpointError(f"{path} holds non-finite weights ({len(bad)} tensors with NaN or inf, e.g. "
                                  f"{', '.join(bad[:3])}): it was saved by a run that diverged. Train again "
                                  "(with a lower train.lr), or use an earlier checkpoint")
    return ckpt
