"""python -m minagi.bench quality: the default profile against a dense GPT at equal wall-clock.

The anchor is nanoGPT's CPU configuration (4 layers, 4 heads, width 128, context 64, batch 12,
AdamW lr 1e-3, no dropout), written here as a plain dense byte-level GPT. Both train for the same
seconds on the default corpus's training split (each with warmup, then cosine over the rest of
the time budget), then both are scored on the same held-out bytes, every byte predicted
with as much context as each model's window allows.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..config import load
from ..data import Batches, load_corpus
from ..evaluate import bits_per_char
from ..trainer import build


class DenseGPT(nn.Module):
    """nanoGPT's model, byte-level: learned positions, pre-LayerNorm blocks, tied embeddings."""

    def __init__(self, n_layer=4, n_head=4, d=128, context=64, vocab=256):
        super().__init__()
        self.context, self.n_head = context, n_head
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(d, bias=False), "qkv": nn.Linear(d, 3 * d, bias=False),
            "proj": nn.Linear(d, d, bias=False), "ln2": nn.LayerNorm(d, bias=False),
            "fc": nn.Linear(d, 4 * d, bias=False), "out": nn.Linear(4 * d, d, bias=False)}) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b["proj"](y.transpose(1, 2).reshape(B, T, -1))
            x = x + b["out"](F.gelu(b["fc"](b["ln2"](x))))
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def score(self, idx):
        return torch.log_softmax(self(idx).float(), dim=-1)


def _train_for(seconds, step_fn, set_factor, warmup, min_frac, log, name):
    """Train until the time is up: linear warmup over `warmup` steps, then cosine over the
    remaining time (the schedule follows the clock, so neither model's is cut short or idles)."""
    t0 = time.perf_counter()
    step, loss = 0, float("nan")
    while (elapsed := time.perf_counter() - t0) < seconds:
        if step < warmup:
            set_factor((step + 1) / warmup)
            t_warm = elapsed
        else:
            progress = (elapsed - t_warm) / max(1e-9, seconds - t_warm)
            set_factor(min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        loss = step_fn()
        step += 1
        if step % 500 == 0:
            log(f"  {name}: step {step}, loss {loss:.3f}, {time.perf_counter() - t0:.0f} s")
    return step, time.perf_counter() - t0


def run_dense(corpus, seconds, seed, log):
    torch.manual_seed(seed)
    model = DenseGPT()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))
    batches = Batches(corpus.train, 64, 12, seed)

    def step_fn():
        x, y = batches.next()
        loss = F.cross_entropy(model(x).view(-1, 256), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def set_factor(f):
        for g in opt.param_groups:
            g["lr"] = 1e-3 * f

    steps, secs = _train_for(seconds, step_fn, set_factor, 100, 0.1, log, "dense")
    return model.eval(), steps, secs, 64


def run_minagi(corpus, seconds, profile, overrides, log):
    cfg = load(profile, overrides)
    model, opt, _ = build(cfg, torch.device("cpu"))
    batches = Batches(corpus.train, cfg.data.context, cfg.train.batch, cfg.train.seed)

    def step_fn():
        x, y = batches.next()
        out = model(x, y)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        model.balance_step()  # bias balancing moves its biases here
        opt.zero_grad(set_to_none=True)
        return float(out.ce.detach())

    def set_factor(f):
        for g in opt.param_groups:
            g["lr"] = cfg.train.lr * f

    steps, secs = _train_for(seconds, step_fn, set_factor, cfg.train.warmup, cfg.train.min_lr_frac, log, "minagi")
    return model.eval(), steps, secs, cfg.data.context


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minagi.bench quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=300.0, help="training wall-clock per model")
    p.add_argument("--profile", default="cpu-tiny")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="profile overrides")
    p.add_argument("--eval-bytes", type=int, default=65536, help="held-out bytes scored (from the split's start)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--models", default="dense,minagi", help="which to train (e.g. minagi alone when tuning)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads or torch.get_num_threads())
    corpus = load_corpus("")
    heldout = corpus.heldout[: a.eval_bytes].long()
    log = lambda m: print(m, flush=True)  # noqa: E731
    log(f"minagi.bench quality: {a.seconds:.0f} s each, {torch.get_num_threads()} threads; {corpus.describe()}")
    results = {}
    runners = {"dense": lambda: run_dense(corpus, a.seconds, 1337, log),
               "minagi": lambda: run_minagi(corpus, a.seconds, a.profile, a.overrides, log)}
    for name in a.models.split(","):
        model, steps, secs, context = runners[name]()
        bpc = bits_per_char(model, heldout, context)
        results[name] = {"heldout_bpc": bpc, "steps": steps, "seconds": secs, "context": context}
        log(f"{name}: {steps} steps in {secs:.0f} s, held-out {bpc:.3f} bits/char")
    if set(results) != {"dense", "minagi"}:
        return 0
    gap = results["dense"]["heldout_bpc"] - results["minagi"]["heldout_bpc"]
    log(f"\nheld-out bits/char on {heldout.numel():,} bytes: dense GPT {results['dense']['heldout_bpc']:.3f}, "
        f"minagi ({a.profile}) {results['minagi']['heldout_bpc']:.3f}; minagi ahead by {gap:.3f} "
        f"(target >= 0.15: {'met' if gap >= 0.15 else 'NOT MET'})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "gap": gap, "profile": a.profile, "overrides": a.overrides}, f, indent=2)
    return 0
