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
  minagi-tables  (only when named in --models) minagi-dense with its n-gram tables enlarged by
                 the parameters the pool has beyond the dense MLP: the profile's total
                 parameters, the dense twin's multiply-adds. Is the pool or a bigger table the
                 better use of the same memory?
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
import statistics
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..lm.config import Config, ModelConfig, load
from ..lm.data import Batches, load_corpus
from ..lm.evaluate import bits_per_byte
from ..lm.model import NO_BYTE, VOCAB, ByteModel, ngram_codes
from ..lm.prog import ListHelpFormatter
from ..lm.run import build
from ..moe.reference import GATED
from .slices import Budget, Run, heldout_sample, interleave, score

MODELS = ("dense", "dense-ngram", "minagi-dense", "minagi", "minagi-wide", "minagi-tables")
DEFAULT_MODELS = MODELS[:4]  # the others on request (minagi-wide costs n_pool / top_k times the MLP)
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


def n_params(cfg: Config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in ByteModel(cfg.model, cfg.data.context).parameters())


def tables_twin(cfg: Config) -> Config:
    """The dense twin with every n-gram table grown by the same number of buckets, as many as
    the pool's parameters beyond the twin's MLP fill: the profile's total parameters (to within
    one bucket per table) at the twin's multiply-adds (a lookup costs none)."""
    twin = dense_twin(cfg)
    m = twin.model
    per_bucket = (m.ngram - 1) * m.d_model
    extra = max(0, n_params(cfg) - n_params(twin)) // per_bucket
    return replace(twin, model=replace(m, ngram_buckets=m.ngram_buckets + extra))


def run_dense(corpus, budget, seed, log, ngram=0, ngram_buckets=0, name="dense"):
    """The dense GPT and its training Run (not yet advanced)."""
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

    return model, Run(name, budget, step_fn, set_factor, 100, 0.1, log), model.context


def run_minagi(corpus, budget, cfg: Config, log, name="minagi"):
    """minagi's model for cfg and its training Run (not yet advanced)."""
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

    return model, Run(name, budget, step_fn, set_factor, cfg.train.warmup, cfg.train.min_lr_frac, log), \
        cfg.data.context


def _seeded(cfg: Config, seed: int) -> Config:
    return replace(cfg, train=replace(cfg.train, seed=cfg.train.seed + seed))


def models(cfg: Config) -> dict:
    """Each model's configuration and multiply-adds per character: name -> (maker, macs, what);
    maker(corpus, budget, seed, log, label) -> (model, Run, context); seed 0 is the model's own."""
    m, twin, wide = cfg.model, dense_twin(cfg), wide_twin(cfg)
    table = {
        "dense": (lambda c, b, s, log, n: run_dense(c, b, 1337 + s, log, name=n), dense_macs(DenseGPT()),
                  "nanoGPT CPU config"),
        "dense-ngram": (lambda c, b, s, log, n: run_dense(c, b, 1337 + s, log, m.ngram, m.ngram_buckets, n),
                        dense_macs(DenseGPT(ngram=m.ngram, ngram_buckets=m.ngram_buckets)),
                        f"+ 2- to {m.ngram}-gram inputs, {m.ngram_buckets} buckets" if m.ngram > 1 else "(no n-grams)"),
        "minagi-dense": (lambda c, b, s, log, n: run_minagi(c, b, _seeded(twin, s), log, n),
                         minagi_macs(twin.model, cfg.data.context),
                         f"one dense MLP, d_hidden {twin.model.d_hidden}"),
        "minagi": (lambda c, b, s, log, n: run_minagi(c, b, _seeded(cfg, s), log, n), minagi_macs(m, cfg.data.context),
                   f"{m.n_pool} experts, top_k {m.top_k}, d_hidden {m.d_hidden}"),
        "minagi-wide": (lambda c, b, s, log, n: run_minagi(c, b, _seeded(wide, s), log, n),
                        minagi_macs(wide.model, cfg.data.context),
                        f"one dense MLP, d_hidden {wide.model.d_hidden} (the whole pool's width)"),
    }
    if m.ngram > 1:
        tw = tables_twin(cfg)
        table["minagi-tables"] = (lambda c, b, s, log, n: run_minagi(c, b, _seeded(tw, s), log, n),
                                  minagi_macs(tw.model, cfg.data.context),
                                  f"one dense MLP, d_hidden {tw.model.d_hidden}, n-gram tables of "
                                  f"{tw.model.ngram_buckets} buckets ({n_params(tw):,} parameters against the "
                                  f"profile's {n_params(cfg):,})")
    return table


def parse_models(text: str, seconds: float, known=MODELS) -> list[tuple[str, str, float]]:
    """--models: names, each optionally with its own training seconds (`minagi-dense@600`), ->
    [(label, name, seconds)] in `known`'s order (MODELS, then the variants), then by seconds."""
    entries, bad = {}, []
    for item in (n.strip() for n in text.split(",")):
        if not item:
            continue
        name, _, secs = item.partition("@")
        try:
            t = float(secs) if secs else seconds
        except ValueError:
            t = -1.0
        if name not in known or not t > 0:
            bad.append(item)
            continue
        entries[item if secs else name] = (name, t)
    if bad or not entries:
        raise SystemExit(f"minagi.bench quality: --models {text!r}: unknown {', '.join(bad) or '(none given)'}; "
                         f"choose from {', '.join(known)}, comma-separated, each optionally @SECONDS "
                         "(e.g. minagi-dense@600)")
    return sorted(((label, n, t) for label, (n, t) in entries.items()), key=lambda e: (known.index(e[1]), e[2]))


def parse_variant(text: str) -> tuple[str, list[str]]:
    """--variant NAME:key=value[,key=value...] -> (NAME, overrides): the profile with those
    settings too, trained and reported as NAME."""
    name, sep, sets = text.partition(":")
    overrides = [o.strip() for o in sets.split(",") if o.strip()]
    if not sep or not name or name in MODELS or "@" in name or not overrides or any("=" not in o for o in overrides):
        raise SystemExit(f"minagi.bench quality: --variant {text!r}: write NAME:key=value[,key=value], NAME new "
                         f"(not one of {', '.join(MODELS)}), e.g. swiglu:model.expert_activation=swiglu,"
                         "model.d_hidden=171")
    return name, overrides


def add_variant(table: dict, cfg_v: Config, name: str, overrides: list[str]) -> None:
    m = cfg_v.model
    table[name] = (lambda c, b, s, log, n: run_minagi(c, b, _seeded(cfg_v, s), log, n),
                   minagi_macs(m, cfg_v.data.context), f"the profile with {', '.join(overrides)}")


def _train_all(specs, table, corpus, budget_of, seeds, block, log, scored):
    """Every (model, seed): sequentially (each built, trained, scored, dropped in turn) or, with
    block > 0, all built first and trained in alternating blocks of `block` seconds of their own
    clocks. scored(label, seed, model, run, context) takes each one's result."""
    jobs = [(label, name, seed) for label, name, _ in specs for seed in range(seeds)]
    if block <= 0:
        for label, name, seed in jobs:
            model, run, context = table[name][0](corpus, budget_of(label), seed, log, _tag(label, seed, seeds))
            run.advance()
            scored(label, seed, model, run, context)
        return
    made = [(label, seed, *table[name][0](corpus, budget_of(label), seed, log, _tag(label, seed, seeds)))
            for label, name, seed in jobs]
    interleave([run for *_, run, _ in made], block, log)
    for label, seed, model, run, context in made:
        scored(label, seed, model, run, context)


def _tag(label: str, seed: int, seeds: int) -> str:
    return f"{label} seed {seed}" if seeds > 1 else label


def _summary(values: list[float]) -> tuple[float, float]:
    """The mean and the half-range ((max - min) / 2) of the seeds' figures."""
    return statistics.fmean(values), (max(values) - min(values)) / 2


def _report(results, specs, reference, budget, profile, n_bytes, seeds, log) -> dict:
    log(f"\nheld-out bits per byte on {n_bytes:,} bytes, {budget.describe()} each unless named ({profile})"
        + (f"; mean +- half-range of {seeds} seeds" if seeds > 1 else "") + ":")
    gaps = {}
    ref = results.get(reference)
    for label, name, _ in specs:
        r = results[label]
        spread = f" +- {r['half_range']:.3f}" if seeds > 1 else ""
        line = (f"  {label:<18} {r['heldout_bits_per_byte']:.3f}{spread}  {r['macs_per_char'] / 1e3:,.0f}k MACs/char"
                f"  {r['config']}")
        if ref is not None and label != reference:
            gaps[label] = r["heldout_bits_per_byte"] - ref["heldout_bits_per_byte"]
            line += f"  {reference} ahead by {gaps[label]:.3f}"
            same_time = r["seconds_budget"] == ref["seconds_budget"]
            if reference == "minagi" and label in TARGETS and not budget.steps and same_time:
                line += f" (design: >= {TARGETS[label]:.2f})"
        log(line)
    return gaps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minagi.bench quality", description=__doc__,
                                formatter_class=ListHelpFormatter)
    p.add_argument("--seconds", type=float, default=300.0, help="training wall-clock per model (default 300)")
    p.add_argument("--steps", type=int, default=0,
                   help="train each model for this many optimizer steps instead of --seconds (equal steps)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"any of {', '.join(MODELS)}, comma-separated (default: all but minagi-wide and minagi-tables); "
                        "NAME@SECONDS trains that one for its own seconds (e.g. minagi-dense@600)")
    p.add_argument("--interleave", type=float, default=0.0, metavar="SECONDS",
                   help="train all models at once in alternating blocks of this many seconds of their own "
                        "clocks, so a drift of the machine's speed hits all alike (default 0: one after another)")
    p.add_argument("--seeds", type=int, default=1, help="runs per model (seeds 0..N-1): mean and half-range")
    p.add_argument("--reference", default="minagi", help="the label the others are compared with")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...",
                   help="another minagi model: the profile with these settings too, named NAME in --models "
                        "(repeatable)")
    p.add_argument("--data", default="", metavar="PATH",
                   help="a text file, folder or prepared corpus (default: the Python standard library's source)")
    p.add_argument("--profile", default="cpu-tiny", help="the profile of the minagi models")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="profile overrides")
    p.add_argument("--eval-bytes", type=int, default=262144,
                   help="held-out bytes scored, in 4 KiB chunks spread evenly over the whole held-out split")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = every core)")
    p.add_argument("--json", metavar="PATH", help="write every figure here")
    a = p.parse_args(argv)
    variants = dict(parse_variant(v) for v in a.variant)
    specs = parse_models(a.models, a.seconds, MODELS + tuple(variants))
    if a.seconds <= 0 or a.eval_bytes <= 0 or a.steps < 0 or a.seeds < 1 or a.interleave < 0:
        p.error("--seconds and --eval-bytes must be positive, --steps >= 0 (0: train for --seconds), --seeds >= 1, "
                "--interleave >= 0")
    if a.steps and any("@" in label for label, *_ in specs):
        p.error("NAME@SECONDS sets a model's seconds; with --steps every model trains for the same steps")
    labels = [label for label, *_ in specs]
    if a.reference not in labels:
        p.error(f"--reference {a.reference!r} is not among the models' labels ({', '.join(labels)}); name one of them")
    budget = Budget(a.seconds, a.steps)
    cfg = load(a.profile, a.overrides)
    if cfg.model.ngram < 2 and "minagi-tables" in (name for _, name, _ in specs):
        p.error("minagi-tables grows the profile's n-gram tables, and it has none (model.ngram = 1)")
    torch.set_num_threads(a.threads or torch.get_num_threads())
    corpus = load_corpus(a.data)
    held = corpus.heldout.read() if hasattr(corpus.heldout, "read") else corpus.heldout  # a prepared corpus's
    chunks = heldout_sample(held.long(), a.eval_bytes)
    n_bytes = sum(c.numel() for c in chunks)
    if not n_bytes:
        p.error(f"--data {a.data}: the corpus has no held-out bytes to score")
    log = lambda m: print(m, flush=True)  # noqa: E731
    mode = f"interleaved in {a.interleave:g} s blocks" if a.interleave else "one after another"
    log(f"minagi.bench quality: {budget.describe()} each unless named, {mode}, {a.seeds} seed(s), "
        f"{torch.get_num_threads()} threads; {corpus.describe()}")
    table = models(cfg)
    for name, overrides in variants.items():
        add_variant(table, load(a.profile, a.overrides + overrides), name, overrides)
    per_seed = {label: [] for label, *_ in specs}
    budgets = {label: Budget(secs, a.steps) for label, _, secs in specs}

    def scored(label, seed, model, run, context):
        bpb = score(bits_per_byte, model.eval(), chunks, context)
        per_seed[label].append({"seed": seed, "heldout_bits_per_byte": bpb, "steps": run.step, "seconds": run.elapsed})
        log(f"{_tag(label, seed, a.seeds)}: {run.step} steps in {run.elapsed:.0f} s, held-out {bpb:.3f} bits per byte")

    _train_all(specs, table, corpus, budgets.__getitem__, a.seeds, a.interleave, log, scored)
    results = {}
    for label, name, secs in specs:
        runs = per_seed[label]
        mean, half = _summary([r["heldout_bits_per_byte"] for r in runs])
        results[label] = {"model": name, "heldout_bits_per_byte": mean, "half_range": half, "runs": runs,
                          "steps": statistics.fmean(r["steps"] for r in runs),
                          "seconds": statistics.fmean(r["seconds"] for r in runs),
                          "seconds_budget": None if a.steps else secs,
                          "context": DenseGPT().context if name.startswith("dense") else cfg.data.context,
                          "macs_per_char": table[name][1], "config": table[name][2]}
    gaps = _report(results, specs, a.reference, budget, a.profile, n_bytes, a.seeds, log)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "gaps": gaps, "targets": TARGETS, "reference": a.reference,
                       "seconds": None if budget.steps else a.seconds, "steps": budget.steps or None,
                       "interleave": a.interleave or None, "seeds": a.seeds,
                       "profile": a.profile, "overrides": a.overrides, "variants": variants, "data": corpus.describe(),
                       "eval_bytes": n_bytes, "eval_chunks": len(chunks), "threads": torch.get_num_threads()},
                      f, indent=2)
    return 0
