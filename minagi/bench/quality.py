"""python -m minagi.bench quality: does the pool pay? The profile against three dense models
at equal wall-clock.

  dense          nanoGPT's CPU configuration (4 layers, 4 heads, width 128, context 64, batch 12,
                 AdamW lr 1e-3, no dropout), written here as a plain dense byte-level GPT
  dense-ngram    the same GPT with the profile's hashed n-gram inputs (the same orders and
                 buckets, zero-initialised): how much of the lead is that input feature
  minagi-dense   minagi's own model with the pool replaced by one dense MLP of the same active
                 width (one expert, top_k = 1, d_hidden = top_k x the profile's): the same
                 rows, inputs and multiply-adds per character; what the pool itself is worth
  minagi         the profile
  minagi-wide    (only when named in --models) minagi's model with one dense MLP as wide as the
                 whole pool (d_hidden = n_pool x the profile's): every character uses all of the
                 pool's parameters, at n_pool / top_k times the MLP's multiply-adds. Per step, a
                 ceiling on what the pool's parameters can hold; with --steps it shows whether
                 more MLP capacity helps at all

Each trains for the same seconds on the corpus's training split (warmup, then cosine over the
rest of the time budget), then all are scored on the same held-out bytes, every byte predicted
with as much context as the model's window allows. --steps N trains each for N optimizer steps
instead (warmup, then cosine over the steps): equal steps measure what a step learns, apart
from its speed; the targets are for equal wall-clock and are not judged then. Figures are bits
per byte (minagi models bytes: not comparable with a character-level model's bits per
character).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Config, ModelConfig, load
from ..data import Batches, load_corpus
from ..evaluate import bits_per_byte
from ..model import NO_BYTE, VOCAB, ngram_codes
from ..reference import GATED
from ..run import build

MODELS = ("dense", "dense-ngram", "minagi-dense", "minagi", "minagi-wide")
DEFAULT_MODELS = MODELS[:4]  # minagi-wide costs n_pool / top_k times the MLP: only on request
# How far ahead of each the profile must be, in bits per byte.
TARGETS = {"dense": 0.15, "dense-ngram": 0.10, "minagi-dense": 0.10}


class DenseGPT(nn.Module):
    """nanoGPT's model, byte-level: learned positions, pre-LayerNorm blocks, tied embeddings.
    ngram > 1 adds minagi's hashed 2- to ngram-gram inputs (ngram_codes, the bytes before the
    window unknown as in ByteModel.embed_bytes), one table per order, zero-initialised."""

    def __init__(self, n_layer=4, n_head=4, d=128, context=64, vocab=VOCAB, ngram=0, ngram_buckets=0):
        super().__init__()
        self.context, self.n_head, self.n_layer, self.d = context, n_head, n_layer, d
        self.ngram, self.ngram_buckets = ngram, ngram_buckets
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
        # Made last, so the same seed gives the plain GPT's weights; as minagi's they start at
        # zero (the twin starts as the plain GPT) and learn what the byte alone lacks.
        self.ngram_embed = nn.ModuleList(nn.Embedding(ngram_buckets, d) for _ in range(max(0, ngram - 1)))
        for e in self.ngram_embed:
            nn.init.zeros_(e.weight)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        if len(self.ngram_embed):
            prev = idx.new_full((B, self.ngram - 1), NO_BYTE)
            for order, table in enumerate(self.ngram_embed, start=2):
                x = x + table(ngram_codes(idx, prev, order, self.ngram_buckets))
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b["proj"](y.transpose(1, 2).reshape(B, T, -1))
            x = x + b["out"](F.gelu(b["fc"](b["ln2"](x))))
        return self.head(self.ln_f(x))

    @torch.no_grad()
    def score(self, idx):
        return torch.log_softmax(self(idx).float(), dim=-1)


def dense_macs(model: DenseGPT) -> float:
    """Multiply-adds per character of a forward pass, from the shapes: per block the qkv,
    projection and MLP matmuls (12 d^2) and causal attention's scores and values (2 d per
    position seen, (context + 1) / 2 of them on average); then the head. Lookups count nothing."""
    d, T = model.d, model.context
    return model.n_layer * (12 * d * d + d * (T + 1)) + d * VOCAB


def minagi_macs(m: ModelConfig, context: int) -> float:
    """The same count for minagi at every row (halting only lowers it): per row qkv and
    projection (4 d^2), attention, the router over the card, top_k experts' two matmuls, the
    halting unit; once per character the admission affinity over the pool and the head."""
    D = m.d_model
    mlp = (3 if m.expert_activation in GATED else 2) * D * m.d_hidden  # a gated form's w_in is 2h wide
    per_row = 4 * D * D + D * (context + 1) + m.n_slots * D + m.top_k * mlp + D
    return m.max_rows * per_row + m.n_pool * D + D * VOCAB


def _one_mlp(cfg: Config, d_hidden: int) -> Config:
    """The profile with its pool replaced by one dense MLP d_hidden wide: one expert always
    chosen (top_k = 1); no balance term (one expert has nothing to balance)."""
    model = replace(cfg.model, n_pool=1, n_slots=1, top_k=1, d_hidden=d_hidden, capacity_factor=0.0,
                    balance="none")
    return replace(cfg, model=model)


def dense_twin(cfg: Config) -> Config:
    """One dense MLP of the pool's active width: d_hidden = top_k x the profile's."""
    return _one_mlp(cfg, cfg.model.top_k * cfg.model.d_hidden)


def wide_twin(cfg: Config) -> Config:
    """One dense MLP as wide as the whole pool (d_hidden = n_pool x the profile's): the pool's
    parameters, every one used by every character."""
    return _one_mlp(cfg, cfg.model.n_pool * cfg.model.d_hidden)


@dataclass
class Budget:
    """How long each model trains: `seconds` of wall-clock, or `steps` optimizer steps if set."""
    seconds: float = 300.0
    steps: int = 0

    def progress(self, step: int, elapsed: float) -> float:
        return step / self.steps if self.steps else elapsed / self.seconds

    def describe(self) -> str:
        return f"{self.steps} steps" if self.steps else f"{self.seconds:.0f} s"


def _train_for(budget: Budget, step_fn, set_factor, warmup, min_frac, log, name):
    """Train until the budget is spent: linear warmup over `warmup` steps, then cosine over the
    rest of the budget (with a time budget the schedule follows the clock, so neither model's
    is cut short or idles)."""
    t0 = time.perf_counter()
    step, loss, p_warm = 0, float("nan"), 0.0
    while (p := budget.progress(step, time.perf_counter() - t0)) < 1.0:
        if step < warmup:
            set_factor((step + 1) / warmup)
            p_warm = p
        else:
            progress = (p - p_warm) / max(1e-9, 1.0 - p_warm)
            set_factor(min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        loss = step_fn()
        step += 1
        if step % 500 == 0:
            log(f"  {name}: step {step}, loss {loss:.3f}, {time.perf_counter() - t0:.0f} s")
    return step, time.perf_counter() - t0


def run_dense(corpus, budget, seed, log, ngram=0, ngram_buckets=0, name="dense"):
    torch.manual_seed(seed)
    model = DenseGPT(ngram=ngram, ngram_buckets=ngram_buckets)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("ngram_embed")]
    other = [p for n, p in model.named_parameters() if p.dim() < 2 or n.startswith("ngram_embed")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))
    batches = Batches(corpus.train, 64, 12, seed)

    def step_fn():
        x, y = batches.next()
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def set_factor(f):
        for g in opt.param_groups:
            g["lr"] = 1e-3 * f

    steps, secs = _train_for(budget, step_fn, set_factor, 100, 0.1, log, name)
    return model.eval(), steps, secs, model.context


def run_minagi(corpus, budget, cfg: Config, log, name="minagi"):
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
            g["lr"] = g["initial_lr"] * f  # the pool group's base lr may differ (train.pool_lr_scale)

    steps, secs = _train_for(budget, step_fn, set_factor, cfg.train.warmup, cfg.train.min_lr_frac, log, name)
    return model.eval(), steps, secs, cfg.data.context


def models(cfg: Config) -> dict:
    """Each model's configuration and multiply-adds per character: name -> (runner, macs, what)."""
    m, twin, wide = cfg.model, dense_twin(cfg), wide_twin(cfg)
    return {
        "dense": (lambda c, s, log: run_dense(c, s, 1337, log), dense_macs(DenseGPT()), "nanoGPT CPU config"),
        "dense-ngram": (lambda c, s, log: run_dense(c, s, 1337, log, m.ngram, m.ngram_buckets, "dense-ngram"),
                        dense_macs(DenseGPT(ngram=m.ngram, ngram_buckets=m.ngram_buckets)),
                        f"+ 2- to {m.ngram}-gram inputs, {m.ngram_buckets} buckets" if m.ngram > 1 else "(no n-grams)"),
        "minagi-dense": (lambda c, s, log: run_minagi(c, s, twin, log, "minagi-dense"),
                         minagi_macs(twin.model, cfg.data.context),
                         f"one dense MLP, d_hidden {twin.model.d_hidden}"),
        "minagi": (lambda c, s, log: run_minagi(c, s, cfg, log), minagi_macs(m, cfg.data.context),
                   f"{m.n_pool} experts, top_k {m.top_k}, d_hidden {m.d_hidden}"),
        "minagi-wide": (lambda c, s, log: run_minagi(c, s, wide, log, "minagi-wide"),
                        minagi_macs(wide.model, cfg.data.context),
                        f"one dense MLP, d_hidden {wide.model.d_hidden} (the whole pool's width)"),
    }


def parse_models(text: str) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise SystemExit(f"minagi.bench quality: --models {text!r}: unknown {', '.join(bad) or '(none given)'}; "
                         f"choose from {', '.join(MODELS)} (comma-separated)")
    return sorted(set(names), key=MODELS.index)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minagi.bench quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=300.0, help="training wall-clock per model (default 300)")
    p.add_argument("--steps", type=int, default=0,
                   help="train each model for this many optimizer steps instead of --seconds (equal steps)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"any of {', '.join(MODELS)}, comma-separated (default: all but minagi-wide)")
    p.add_argument("--data", default="", metavar="PATH",
                   help="a text file, folder or prepared corpus (default: the Python standard library's source)")
    p.add_argument("--profile", default="cpu-tiny")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="profile overrides")
    p.add_argument("--eval-bytes", type=int, default=65536, help="held-out bytes scored (from the split's start)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    a = p.parse_args(argv)
    names = parse_models(a.models)
    if a.seconds <= 0 or a.eval_bytes <= 0 or a.steps < 0:
        p.error("--seconds and --eval-bytes must be positive, --steps >= 0 (0: train for --seconds)")
    budget = Budget(a.seconds, a.steps)
    cfg = load(a.profile, a.overrides)
    torch.set_num_threads(a.threads or torch.get_num_threads())
    corpus = load_corpus(a.data)
    held = corpus.heldout.read() if hasattr(corpus.heldout, "read") else corpus.heldout  # a prepared corpus's
    heldout = held[: a.eval_bytes].long()
    if not heldout.numel():
        p.error(f"--data {a.data}: the corpus has no held-out bytes to score")
    log = lambda m: print(m, flush=True)  # noqa: E731
    log(f"minagi.bench quality: {budget.describe()} each, {torch.get_num_threads()} threads; {corpus.describe()}")
    table = models(cfg)
    results = {}
    for name in names:
        run, macs, what = table[name]
        model, steps, secs, context = run(corpus, budget, log)
        bpb = bits_per_byte(model, heldout, context)
        results[name] = {"heldout_bits_per_byte": bpb, "steps": steps, "seconds": secs, "context": context,
                         "macs_per_char": macs, "config": what}
        log(f"{name}: {steps} steps in {secs:.0f} s, held-out {bpb:.3f} bits per byte")
    log(f"\nheld-out bits per byte on {heldout.numel():,} bytes, {budget.describe()} each ({a.profile}):")
    gaps = {}
    for name, r in results.items():
        line = f"  {name:<13} {r['heldout_bits_per_byte']:.3f}  {r['macs_per_char'] / 1e3:,.0f}k MACs/char  {r['config']}"
        if name != "minagi" and "minagi" in results:
            gaps[name] = r["heldout_bits_per_byte"] - results["minagi"]["heldout_bits_per_byte"]
            line += f"  minagi ahead by {gaps[name]:.3f}"
            if name in TARGETS and not budget.steps:  # the targets are for equal wall-clock
                line += f" (target >= {TARGETS[name]:.2f}: {'met' if gaps[name] >= TARGETS[name] else 'NOT MET'})"
        log(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "gaps": gaps, "targets": TARGETS,
                       "seconds": None if budget.steps else a.seconds, "steps": budget.steps or None,
                       "profile": a.profile, "overrides": a.overrides, "data": corpus.describe(),
                       "eval_bytes": heldout.numel(), "threads": torch.get_num_threads()}, f, indent=2)
    return 0
