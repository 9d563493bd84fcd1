"""The training loop: AdamW (off-card experts untouched), warmup + cosine, gradient clipping,
bfloat16 autocast on GPUs, held-out bits per character, atomic checkpoints, exact resume, and the
history file (one JSON record per checkpoint)."""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import _backend, checkpoint
from .config import Config
from .data import Batches, check_fits, fixed_chunks, load_corpus
from .dispatch import resolve_path
from .memory import memory_stats
from .model import ByteModel
from .optim import PoolAdamW

HISTORY = "history.jsonl"
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


def build(cfg: Config, device: torch.device):
    torch.manual_seed(cfg.train.seed)
    model = ByteModel(cfg.model, cfg.data.context).to(device)
    if cfg.model.pool_device:
        model.pool.to(torch.device(cfg.model.pool_device))
    opt = PoolAdamW(model.param_groups(cfg.train.weight_decay), model.pool, lr=cfg.train.lr,
                    betas=(cfg.train.beta1, cfg.train.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return model, opt, sched


def autocast(cfg: Config, device: torch.device):
    enabled = device.type == "cuda" and cfg.model.dtype == "bfloat16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def heldout_bpc(model, inputs, targets, batch: int, cfg: Config, device) -> float:
    """Mean bits per character over fixed held-out chunks."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, inputs.shape[0], batch):
        x, y = inputs[i:i + batch].to(device), targets[i:i + batch].to(device)
        with autocast(cfg, device):
            logits = model(x).logits
        total += float(torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1), reduction="sum"))
        count += y.numel()
    model.train()
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
    max_load_ratio: float = 0.0

    def add(self, out, loss: float, ce: float, chars: int, seconds: float, max_rows: int) -> None:
        self.loss_sum += loss
        self.ce_sum += ce
        self.steps += 1
        self.chars += chars
        self.train_s += seconds
        self.rows.append(torch.bincount(out.rows_used.reshape(-1).long().cpu(), minlength=max_rows + 1)[1:])
        for st in out.dispatch:
            self.routed += st.routed_pairs
            self.dropped += st.dropped_pairs
            self.executed += st.executed_rows
            self.groups += st.groups
            self.calls += 1
            self.max_load_ratio = max(self.max_load_ratio, st.max_load_ratio)

    def record(self) -> dict:
        hist = torch.stack(self.rows).sum(0).double() if self.rows else torch.zeros(1)
        n = float(hist.sum()) or 1.0
        return {
            "train_loss": self.loss_sum / max(1, self.steps),  # nats, ponder and balance included
            "train_bpc": self.ce_sum / max(1, self.steps) / LN2,
            "char_per_s": self.chars / self.train_s if self.train_s else 0.0,
            "rows_mean": float((hist * torch.arange(1, hist.numel() + 1)).sum() / n),
            "rows_hist": [round(float(c) / n, 4) for c in hist],  # share of characters using 1, 2, ... rows
            "max_load_ratio": self.max_load_ratio,
            "dropped_frac": self.dropped / self.routed if self.routed else 0.0,
            "executed_ratio": self.executed / self.routed if self.routed else 0.0,
            "groups_mean": self.groups / self.calls if self.calls else 0.0,
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
            if line.strip():
                rec = json.loads(line)
                if rec["step"] <= upto:
                    kept.append(rec)
    if record is not None and not any(r["step"] == record["step"] for r in kept):
        kept.append(record)
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _maybe_test_kill(step: int) -> None:
    """Tests kill a run at a chosen step (SIGKILL: no cleanup, as a crash or a power cut)."""
    at = os.environ.get("MINAGI_TEST_KILL_AT_STEP")
    if at and int(at) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def train(cfg: Config, out_dir, resume: bool = False, progress: bool = True) -> dict:
    """Train (or resume) into out_dir; returns the last history record."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint.load(out_dir) if resume else None
    ignored = []
    if ckpt is not None:  # the saved settings win; say which of this command's differ
        saved = Config.from_dict(ckpt["config"])
        ignored = [f"{sec}.{k}={v} (saved: {getattr(getattr(saved, sec), k)})"
                   for sec, table in cfg.to_dict().items() if isinstance(table, dict)
                   for k, v in table.items() if getattr(getattr(saved, sec), k) != v]
        cfg = saved
    torch.set_num_threads(cfg.train.threads or os.cpu_count() or 1)
    device = resolve_device(cfg.train.device)
    corpus = load_corpus(cfg.data.path, cfg.data.heldout_every)
    check_fits(corpus, cfg.data.context)
    model, opt, sched = build(cfg, device)
    batches = Batches(corpus.train, cfg.data.context, cfg.train.batch, cfg.train.seed)
    eval_x, eval_y = fixed_chunks(corpus.heldout, cfg.data.context, cfg.train.eval_chunks, cfg.train.seed + 1)
    path = resolve_path(cfg.model.dispatch, device)
    step, elapsed0, last_bpc = 0, 0.0, float("nan")
    history = out_dir / HISTORY
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        batches.set_state(ckpt["data"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
        step, elapsed0 = ckpt["step"], ckpt["elapsed_s"]
        last_bpc = ckpt["record"]["heldout_bpc"] if ckpt.get("record") else last_bpc
        _rewrite_history(history, step, ckpt.get("record"))
    elif history.exists():
        history.unlink()  # a fresh run owns its folder's history
    bar = Progress(cfg.train.steps, step, progress)
    if ignored:
        bar.write("minagi: resuming with the checkpoint's settings; ignoring " + ", ".join(ignored))
    bar.write(f"minagi: profile {cfg.profile}, {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{device}, dispatch {path}{'' if _backend.loaded() else ' (pure torch)'}; {corpus.describe()}"
              + (f"; resuming at step {step}" if ckpt is not None else ""))
    window, t_start, record = Window(), time.perf_counter(), None
    model.train()
    while step < cfg.train.steps:
        t0 = time.perf_counter()
        x, y = batches.next()
        x, y = x.to(device), y.to(device)
        with autocast(cfg, device):
            out = model(x, y)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss = float(out.loss.detach())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step += 1
        window.add(out, loss, float(out.ce.detach()), x.numel(), time.perf_counter() - t0, cfg.model.max_rows)
        bar.update(step, loss, window.chars / window.train_s, float(out.rows_used.mean()))
        if step % cfg.train.eval_every == 0 or step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
            last_bpc = heldout_bpc(model, eval_x, eval_y, cfg.train.batch, cfg, device)
            bar.write(f"step {step}: held-out {last_bpc:.3f} bits/char")
        if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
            record = {"step": step, **window.record(), "heldout_bpc": last_bpc, **memory_stats(device),
                      "time_s": elapsed0 + time.perf_counter() - t_start}
            checkpoint.save({
                "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": step, "data": batches.state(), "config": cfg.to_dict(), "record": record,
                "rng": {"torch": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None},
                "dispatch": {"path": path, "extension": _backend.loaded()},
                "elapsed_s": record["time_s"],
            }, out_dir / checkpoint.CHECKPOINT)
            with open(history, "a") as f:
                f.write(json.dumps(record) + "\n")
            window = Window()
        _maybe_test_kill(step)
    bar.close()
    return record if record is not None else (ckpt or {}).get("record", {})
