"""The history file, DIR/history.jsonl: one JSON record per checkpoint. Window gathers what
happened between two records (losses, characters, time, rows used, the routing's statistics and
health); rewrite() trims the file to a resumed checkpoint; append() adds one record."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

HISTORY = "history.jsonl"
LN2 = math.log(2)


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


def rewrite(path: Path, upto: int, record: dict | None) -> None:
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


def append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
