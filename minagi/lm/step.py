"""What the loop does at a step: one optimizer step over the step's micro-batches (train_step),
and the held-out score (heldout_bpc), both under the run's autocast."""
from __future__ import annotations

import torch

from . import distributed
from .config import Config
from .guard import DivergenceGuard
from .history import LN2
from .run import Run


def autocast(cfg: Config, device: torch.device):
    enabled = device.type == "cuda" and cfg.model.dtype == "bfloat16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.no_grad()
def heldout_bpc(model, inputs, targets, batch: int, cfg: Config, device, dist=distributed.SINGLE) -> float:
    """Mean bits per byte over fixed held-out chunks. Under data parallelism each rank
    scores every world-th batch of them and the sums are added up: the same batches (so the same
    admitted cards) and the same figure as one process."""
    model.eval()
    total, count = 0.0, 0
    for b, i in enumerate(range(0, inputs.shape[0], batch)):
        if b % dist.world != dist.rank:
            continue
        x, y = inputs[i:i + batch].to(device), targets[i:i + batch].to(device)
        with autocast(cfg, device):
            logits = model(x).logits
        total += float(torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1), reduction="sum"))
        count += y.numel()
    model.train()
    total, count = distributed.agree(dist, device, total, count)
    return total / count / LN2


def train_step(run: Run, guard: DivergenceGuard):
    """One optimizer step over grad_accum micro-batches; returns (outputs, characters of every
    rank, loss, ce, skipped), the loss and ce averaged over the micro-batches and the ranks. A
    step the guard rejects leaves the parameters and the optimizer (moments, step counts) as they
    were; the schedule moves on."""
    micro = [(x.to(run.device), y.to(run.device)) for x, y in run.batches.next_step()]
    outs = _forward_backward(run, micro)
    grad_norm = _clip(run)
    n = len(micro) * run.dist.world
    loss, ce = (v / n for v in distributed.agree(run.dist, run.device, *(
        sum(float(getattr(o, k).detach()) for o in outs) for k in ("loss", "ce"))))
    ok = guard.step_ok(torch.tensor(loss), grad_norm)  # the same loss and norm on every rank
    if ok:
        run.opt.step()
    run.model.balance_step(applied=ok)
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    run.step += 1
    return outs, sum(x.numel() for x, _ in micro) * run.dist.world, loss, ce, not ok


def _forward_backward(run: Run, micro: list) -> list:
    """Forward and backward of every micro-batch, gradients synchronised on the last; returns
    their outputs."""
    # Several batches make this step (micro-batches, ranks): one card for them all, as one batch would admit.
    card = run.model.choose_card([x for x, _ in micro]) if len(micro) * run.dist.world > 1 else None
    outs = []
    for a, (x, y) in enumerate(micro):
        with distributed.no_sync(run.engine, last=a == len(micro) - 1), autocast(run.cfg, run.device):
            out = run.engine(x, y, card)
            (out.loss / len(micro)).backward()
        outs.append(out)
    return outs


def _clip(run: Run) -> torch.Tensor:
    """Gradient clipping over the whole model; returns the norm before it."""
    if run.ep is not None:  # the expert shards' gradients, summed where DDP does not reach
        run.ep.reduce_grads(run.model)
        return run.ep.clip_grad_norm_(run.model, run.cfg.train.grad_clip)
    return torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.cfg.train.grad_clip)
