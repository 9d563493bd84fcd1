"""Scoring a checkpoint on a user's own text: every byte of a file or folder, each predicted with
as much context as the model's window allows (windows of the model's context, advanced by half
a context; the first byte is predicted from a newline, as an empty prompt starts)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .data import META, DataError, folder_files, open_prepared


def read_bytes(path: str) -> torch.Tensor:
    """Every byte of a file or folder (files in path order); of a prepared folder, its held-out
    bytes."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if (p / META).exists():
        held = open_prepared(p).heldout
        if not held.numel():
            raise DataError(f"--data {path}: the prepared corpus has no held-out bytes to score")
        return held.read().long()
    files = [p] if p.is_file() else folder_files(p)
    data = b"".join(f.read_bytes() for f in files)
    if not data:
        raise DataError(f"--data {path}: no bytes to score")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


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
