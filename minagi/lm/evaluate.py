"""Scoring a checkpoint on a user's own text (every byte of a file or a folder's text files) or on
its run's own held-out split: each byte predicted with as much context as the model's window
allows (windows of the model's context, advanced by half a context; the first byte is predicted
from a newline, as an empty prompt starts)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .data import META, DataError, FileBytes, Skipped, check_text, folder_files, open_prepared, run_corpus


def read_bytes(path: str, binary: bool = False) -> tuple[torch.Tensor, Skipped]:
    """Every byte of a file or of a folder's text files (files in path order), and what the
    folder skipped (data.folder_files); of a prepared folder, its held-out bytes. binary: read
    files that are not text too (a file given alone is otherwise refused)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if (p / META).exists():
        held = open_prepared(p).heldout
        if not held.numel():
            raise DataError(f"--data {path}: the prepared corpus has no held-out bytes to score")
        return held.read().long(), Skipped()
    if p.is_file():
        check_text(p, binary)
        files, skipped = [p], Skipped()
    else:
        files, skipped = folder_files(p, binary)
    data = b"".join(f.read_bytes() for f in files)
    if not data:
        why = f" ({skipped.summary()})" if skipped.total else ""
        raise DataError(f"--data {path}: no bytes to score{why}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), skipped


def scored_bytes(cfg, path: str | None = None, binary: bool = False) -> tuple[torch.Tensor, str, str | None]:
    """What eval scores: PATH's bytes (read_bytes), else the run's own held-out split, the
    chunks routes takes theirs from (data.run_corpus). Returns the bytes, what they are, and a
    line on what a folder skipped (None: nothing)."""
    if path is not None:
        data, skipped = read_bytes(path, binary)
        return data, path, skipped.note(path)
    cfg.data.binary = cfg.data.binary or binary
    corpus = run_corpus(cfg.data)
    held = corpus.heldout.read() if isinstance(corpus.heldout, FileBytes) else corpus.heldout
    return held.long(), f"the run's held-out split of {corpus.source}", corpus.skipped.note(corpus.source)


@torch.no_grad()
def bits_per_byte(model, data: torch.Tensor, context: int, batch: int = 16) -> float:
    """Mean bits per byte of `data` [n] under the model."""
    device = next(model.parameters()).device
    seq = torch.cat([torch.tensor([ord("\n")]), data])  # seq[i] predicts seq[i + 1]
    n = data.numel()
    stride = max(1, context // 2)
    windows = []  # (start, first target index within the window to score)
    start = 0
    while True:
        end = min(start + context, n)
        windows.append((start, 0 if start == 0 else context - stride))
        if end >= n:
            break
        start += stride
    total = 0.0
    for i in range(0, len(windows), batch):
        group = windows[i:i + batch]
        length = min(context, n - group[0][0])
        lens = [min(context, n - s) for s, _ in group]
        x = torch.stack([torch.nn.functional.pad(seq[s:s + L], (0, length - L)) for (s, _), L in zip(group, lens)])
        logp = model.score(x.to(device)).cpu()
        for row, ((s, first), L) in enumerate(zip(group, lens)):
            tgt = seq[s + 1 + first:s + 1 + L]
            total -= float(logp[row, first:L].gather(1, tgt.unsqueeze(1)).sum())
    return total / n / math.log(2)
