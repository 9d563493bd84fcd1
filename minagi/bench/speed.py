"""python -m minagi.bench train --profile P | write DIR: char/s with grouped against rectangle
dispatch in one run, on the same weights, with the model's own routing and with routing forced
into the seed's sink shape (one slot chosen by 94% of characters, the rest spread evenly).
Targets under sink routing: training >= 2x the rectangle's char/s (the seed got 1.7x), writing
>= 10x (the seed got 3.7x)."""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from ..lm.config import load
from ..lm.pool import PooledMLP
from ..lm.prog import ListHelpFormatter
from ..lm.run import build
from ..lm.writer import load_model, write
from .routings import sink_routing

SINK_SHARE = 1960 / 2081  # the seed's sink: 1,960 of 2,081 characters at a typical row


def sink_router(x_ND, n_slots, top_k):
    return _sink_route(x_ND.shape[0], n_slots, top_k, x_ND.dtype, x_ND.device)


@functools.lru_cache(maxsize=64)
def _sink_route(N, n_slots, top_k, dtype, device):
    """Made once per shape: the harness's routing should cost neither dispatch anything (writing
    asks for it on every row, where building it took ~50 us of a ~2 ms row overhead)."""
    idx = sink_routing(N, n_slots, top_k, round(SINK_SHARE * N)).to(device)
    return idx, torch.full((N, top_k), 1.0 / top_k, dtype=dtype, device=device)


def _modes(model, fn, reps):
    """Median of fn()'s seconds for each (dispatch, routing), interleaved, after a warm-up each."""
    times = {}
    for _ in range(reps):
        for routing in ("model", "sink"):
            for grouped in (True, False):
                model.mlp.force_routing = sink_router if routing == "sink" else None
                PooledMLP.grouped_dispatch = grouped
                fn()  # untimed: the allocator state of this mode, not the last one's
                times.setdefault((routing, "grouped" if grouped else "rectangle"), []).append(fn())
    PooledMLP.grouped_dispatch = True
    model.mlp.force_routing = None
    return {k: statistics.median(v) for k, v in times.items()}


def _report(what, chars, times, target):
    print(f"\n{what}: char/s (median), grouped vs rectangle dispatch")
    print(f"{'routing':<10}{'grouped':>12}{'rectangle':>12}{'ratio':>8}")
    ratios = {}
    for routing in ("model", "sink"):
        g, r = chars / times[(routing, "grouped")], chars / times[(routing, "rectangle")]
        ratios[routing] = g / r
        print(f"{routing:<10}{g:>12,.1f}{r:>12,.1f}{g / r:>8.2f}")
    print(f"under sink routing: {ratios['sink']:.2f}x (design: >= {target}x)")
    return ratios


def main_train(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minagi.bench train", description=__doc__,
                                formatter_class=ListHelpFormatter)
    p.add_argument("--profile", default="cpu-tiny", help="a packaged profile or a .toml path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a profile value (repeatable)")
    p.add_argument("--steps", type=int, default=3, help="training steps per timed sample")
    p.add_argument("--reps", type=int, default=3, help="timed samples per mode (median kept)")
    a = p.parse_args(argv)
    cfg = load(a.profile, a.overrides)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, opt, _ = build(cfg, device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (cfg.train.batch, cfg.data.context), generator=g).to(device)
    y = torch.randint(0, 256, (cfg.train.batch, cfg.data.context), generator=g).to(device)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def fn():
        model.load_state_dict(state)  # the same weights for every mode
        t0 = time.perf_counter()
        for _ in range(a.steps):
            model(x, y).loss.backward()
            opt.zero_grad(set_to_none=True)  # no optimizer step: the weights stay the same
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    print(f"minagi.bench train: profile {cfg.profile}, {device}, batch {cfg.train.batch} x context "
          f"{cfg.data.context}, {cfg.model.n_slots} slots, top_k {cfg.model.top_k}, {a.steps} steps per sample")
    _report("training (forward + backward)", a.steps * x.numel(), _modes(model, fn, a.reps), 2.0)
    return 0


def main_write(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minagi.bench write", description=__doc__,
                                formatter_class=ListHelpFormatter)
    p.add_argument("run", metavar="DIR", help="run folder (or checkpoint file)")
    p.add_argument("--chars", type=int, default=200, help="characters written per timed sample")
    p.add_argument("--reps", type=int, default=3, help="timed samples per mode (median kept)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (decoding on the GPU: the in-place decode kernel)")
    a = p.parse_args(argv)
    model, cfg = load_model(a.run, a.device)

    def fn():  # the written characters only: a stream's first character admits its card
        return write(model, b"\n", a.chars, seed=0).seconds

    print(f"minagi.bench write: {a.run}, {cfg.model.n_slots} slots, top_k {cfg.model.top_k}, "
          f"{cfg.model.max_rows} rows, {a.chars} chars per sample")
    _report("writing", a.chars, _modes(model, fn, a.reps), 10.0)
    return 0
