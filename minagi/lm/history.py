"""The history file, DIR/history.jsonl: one JSON record per held-out evaluation (train.eval_every,
and at every checkpoint; "checkpoint": whether one was written there). Window gathers what
happened between two records (losses, characters, time, rows used, the routing's statistics and
health); rewrite() trims the file to a resumed checkpoint; append() adds one record."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..moe import dispatch

HISTORY = "history.jsonl"
LN2 = math.log(2)


@dataclass
class Window:
    """What happened since the last history record. The fields are plain numbers (a stopped run
    keeps them in its checkpoint); what the model measures per row and step is summed on its
    device and read into them by settle(), when a record is written or the window saved."""
    loss_sum: float = 0.0
    ce_sum: float = 0.0
    steps: int = 0
    chars: int = 0
    train_s: float = 0.0
    rows: list = field(default_factory=list)  # characters using 1, 2, ... rows
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

    def __post_init__(self):
        self._dev: dict[str, torch.Tensor] = {}  # device sums not yet read into the fields
        if self.rows and isinstance(self.rows[0], torch.Tensor):  # a checkpoint's window before 2026-12-07
            self.rows = torch.stack(self.rows).sum(0).tolist()

    def add(self, outs, loss: float, ce: float, chars: int, seconds: float, max_rows: int, skipped=False) -> None:
        """One optimizer step: outs, the model's outputs of its micro-batches (this rank's); chars,
        the characters of the whole step (every rank's). Reads nothing from the device."""
        self.chars += chars
        self.train_s += seconds
        if skipped:  # its loss is not finite: no figure of it would mean anything
            self.skipped += 1
            return
        self.loss_sum += loss
        self.ce_sum += ce
        self.steps += 1
        for out in outs:
            used = out.rows_used.detach().reshape(-1).long().clamp(0, max_rows)
            self._sum("rows", torch.zeros(max_rows + 1, dtype=torch.long, device=used.device).index_add_(
                0, used, torch.ones_like(used))[1:])
            self._add_routing(out)

    def _sum(self, key: str, value) -> None:
        value = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
        held = self._dev.get(key)
        if value.is_floating_point():  # kept per step, added on the host in step order by settle():
            self._dev[key] = [*(held or []), value]  # a resumed run's sums then equal an unbroken run's
        else:
            self._dev[key] = value if held is None else held + value.to(held.device, held.dtype)

    def _max(self, key: str, value) -> None:
        value = torch.as_tensor(value, dtype=torch.float64)
        held = self._dev.get(key)
        self._dev[key] = value if held is None else torch.maximum(held, value.to(held.device))

    def _add_routing(self, out) -> None:
        for st in out.dispatch:
            load = torch.as_tensor(st.peek("slot_load"))
            for key, name in (("routed", "routed_pairs"), ("dropped", "dropped_pairs"),
                              ("executed", "executed_rows"), ("groups", "groups")):
                self._sum(key, torch.as_tensor(st.peek(name), dtype=torch.long))
            self.calls += 1
            # A call of a handful of characters says nothing of the load: one character alone
            # is always at n_slots / top_k times the fair share.
            if st.n_chars >= load.numel():
                self._max("max_load_ratio", st.peek("max_load_ratio"))
            self._sum("slot_load", load.long())
        if out.dispatch:
            first = out.dispatch[0]
            self.first_rows += 1
            self._sum("sink_share", dispatch.sink_share_of(first.peek("slot_load"), first.n_chars))
            self._sum("load_ratio", torch.as_tensor(first.peek("max_load_ratio"), dtype=torch.float64))
            self._sum("load_entropy", dispatch.load_entropy_of(first.peek("slot_load")))

    def settle(self) -> None:
        """Reads the device sums into the fields (one copy each): at log time, never per step."""
        dev, self._dev = self._dev, {}
        for key, value in dev.items():
            if isinstance(value, list):  # floats, one a step
                total = getattr(self, key)
                for v in torch.stack(value).tolist():
                    total += v
                setattr(self, key, total)
                continue
            value = value.tolist()
            if key == "max_load_ratio":
                self.max_load_ratio = max(self.max_load_ratio, value)
            elif isinstance(value, list):
                held = getattr(self, key)
                setattr(self, key, [a + b for a, b in zip(held, value)] if held else value)
            else:
                setattr(self, key, getattr(self, key) + value)

    def state(self) -> dict:
        """Plain numbers for a checkpoint (Window(**state) restores it)."""
        self.settle()
        return asdict(self)

    def record(self) -> dict:
        self.settle()
        hist = torch.tensor(self.rows, dtype=torch.float64) if self.rows else torch.zeros(1, dtype=torch.float64)
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
