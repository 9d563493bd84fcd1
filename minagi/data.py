"""Corpora as bytes: the default (the Python standard library's own source, which every Python
install has) or --data PATH (a text file or a folder of them), split into train and held-out by
file, and random chunks drawn from one uint8 tensor.

Legend: B batch, T context (bytes per chunk).
"""
from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch


class DataError(ValueError):
    """A corpus that cannot be used; the message says why and what to do."""


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [bytes]
    heldout: torch.Tensor  # uint8 [bytes]
    source: str
    n_files: int
    n_heldout_files: int

    def describe(self) -> str:
        return (f"{self.source}: {self.n_files} files, {self.train.numel():,} train bytes, "
                f"{self.heldout.numel():,} held-out bytes ({self.n_heldout_files} files)")


def stdlib_files() -> tuple[Path, list[Path]]:
    """The running interpreter's standard-library .py files, in a deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def folder_files(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files += [Path(dirpath) / f for f in sorted(filenames) if not f.startswith(".")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(relpath: str, every: int) -> bool:
    """Every `every`-th file by a stable hash of its relative path (the same on every machine)."""
    return zlib.crc32(relpath.encode("utf-8")) % every == 0


def _concat(paths: list[Path]) -> torch.Tensor:
    chunks = [p.read_bytes() for p in paths]
    data = b"".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def load_corpus(path: str = "", heldout_every: int = 20) -> Corpus:
    """Train / held-out split by file. A single file (or a folder whose hash split leaves one side
    empty) holds out its last 1 / heldout_every of bytes instead."""
    if not path:
        root, files = stdlib_files()
        source = f"Python {'.'.join(map(str, __import__('sys').version_info[:3]))} standard library ({root})"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise DataError(f"--data {path}: no such file or folder")
        if p.is_file():
            root, files = p.parent, [p]
        else:
            root, files = p, folder_files(p)
        source = str(p)
    if not files:
        raise DataError(f"{source}: no files to read (an empty folder?)")
    held = [f for f in files if is_heldout(f.relative_to(root).as_posix(), heldout_every)]
    kept = [f for f in files if f not in set(held)]
    train, heldout = _concat(kept), _concat(held)
    if train.numel() == 0 or heldout.numel() == 0:
        everything = _concat(files)
        cut = everything.numel() - everything.numel() // heldout_every
        train, heldout, held = everything[:cut], everything[cut:], []
    if train.numel() == 0:
        raise DataError(f"{source}: the corpus is empty (0 bytes)")
    return Corpus(train=train, heldout=heldout, source=source, n_files=len(files), n_heldout_files=len(held))


def check_fits(corpus: Corpus, context: int) -> None:
    need = context + 1
    for name, data in (("training", corpus.train), ("held-out", corpus.heldout)):
        if data.numel() < need:
            total = corpus.train.numel() + corpus.heldout.numel()
            raise DataError(
                f"{corpus.source}: {data.numel():,} bytes of {name} text, but one chunk needs "
                f"data.context + 1 = {need:,} bytes; give at least {need * 21:,} bytes of text in all "
                f"(this corpus has {total:,}), or lower data.context")


class Batches:
    """Random chunks of context + 1 bytes drawn with the run's own generator, whose state is the
    data position a checkpoint saves."""

    def __init__(self, data: torch.Tensor, context: int, batch: int, seed: int):
        self.data, self.context, self.batch = data, context, batch
        self.generator = torch.Generator().manual_seed(seed)
        self._span = torch.arange(context + 1)

    def next(self):
        start_B = torch.randint(0, self.data.numel() - self.context, (self.batch,), generator=self.generator)
        chunk_BT = self.data[start_B.unsqueeze(1) + self._span].long()
        return chunk_BT[:, :-1], chunk_BT[:, 1:]

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def fixed_chunks(data: torch.Tensor, context: int, n: int, seed: int):
    """The same n held-out chunks for every evaluation of a run: (inputs, targets), [n, T]."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, data.numel() - context, (n,), generator=g)
    chunk = data[start.unsqueeze(1) + torch.arange(context + 1)].long()
    return chunk[:, :-1], chunk[:, 1:]
