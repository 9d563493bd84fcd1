"""python -m minagi.bench ddp [--profile P] [--ranks 2] [--steps 200] [--rounds 2] [--expert-parallel E]
[--out DIR]: data (and expert) parallelism on one machine, honest either way.

Trains the same global batch two ways, alternated --rounds times in one run: one process with
every core's threads and train.batch x ranks chunks per step, and `torchrun --nproc-per-node
ranks` with the cores split among the ranks (train.threads = 0) and train.batch chunks per rank.
Reports each run's char/s (the whole batch's characters over the training time, from the
history), the ratio, and the bytes DDP all-reduces per step (every parameter's float32
gradient, once per optimizer step) with the ring all-reduce's traffic per rank.

With --expert-parallel E (E > 1) each round adds a third run: the torchrun one with
train.expert_parallel = E (the pool sharded over groups of E ranks). It reports its char/s
against DDP's, the bytes its all_to_alls send per rank and step (from the history) and what it
still all-reduces: the replicated parameters' gradients, and the expert shards' over the
data-parallel groups when there are several.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..lm.prog import ListHelpFormatter


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minagi.bench ddp", description=__doc__.split("\n\n")[0],
                                formatter_class=ListHelpFormatter)
    p.add_argument("--profile", default="cpu-tiny", help="a packaged profile or a .toml path")
    p.add_argument("--ranks", type=int, default=2, help="processes of the torchrun runs (default 2)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run (default 200)")
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs, alternated (default 2)")
    p.add_argument("--expert-parallel", type=int, default=1, metavar="E",
                   help="also run torchrun with train.expert_parallel = E (default 1: no)")
    p.add_argument("--out", default=None, help="folder for the runs and bench_ddp.json (default: a temporary one)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a profile value (repeatable)")
    return p


def gradient_bytes(profile: str, overrides, ranks: int = 1, ep: int = 1) -> int:
    """What a rank all-reduces per optimizer step, in float32: every parameter's gradient (DDP);
    under expert parallelism (ep > 1) the replicated parameters', plus the expert shards' when
    several groups hold the same shard."""
    import torch

    from ..lm.config import load
    from ..moe.expert_parallel import SHARDED
    from ..lm.model import ByteModel

    cfg = load(profile, overrides)
    with torch.device("meta"):
        model = ByteModel(cfg.model, cfg.data.context)
    sizes = {name: p.numel() * 4 for name, p in model.named_parameters()}
    experts = sum(sizes[k] for k in SHARDED)
    if ep == 1:
        return sum(sizes.values())
    return sum(sizes.values()) - experts + (experts // ep if ranks // ep > 1 else 0)


def _run(cmd: list, out: Path) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if r.returncode != 0:
        raise RuntimeError(f"bench ddp: {' '.join(cmd[:6])} ... failed:\n{r.stderr[-3000:]}")
    return json.loads((out / "history.jsonl").read_text().splitlines()[-1])


def main(argv=None) -> int:
    from ..lm.config import load

    a = parser().parse_args(argv)
    cfg = load(a.profile, a.overrides)
    if a.ranks < 2:
        raise SystemExit("bench ddp: --ranks must be >= 2")
    if a.expert_parallel < 1 or a.ranks % a.expert_parallel:
        raise SystemExit(f"bench ddp: --expert-parallel {a.expert_parallel} must divide --ranks {a.ranks}")
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="minagi-bench-ddp-"))
    root.mkdir(parents=True, exist_ok=True)
    b = cfg.train.batch
    common = ["--profile", a.profile, "--quiet", "--steps", str(a.steps), *sum((["--set", s] for s in a.overrides), []),
              "--set", f"train.checkpoint_every={a.steps}", "--set", f"train.eval_every={a.steps}"]
    script = Path(__file__).resolve().parents[2] / "train.py"  # a checkout; an installed package has the minagi command
    train_py = [str(script)] if script.exists() else ["-m", "minagi", "train"]
    runs = {"one": [], "ranks": [], **({"ep": []} if a.expert_parallel > 1 else {})}
    a2a = []
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.ranks)]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    log(f"bench ddp: {a.profile}, global batch {b * a.ranks} chunks: 1 process x {os.cpu_count()} threads against "
        f"{a.ranks} processes (torchrun) x {max(1, (os.cpu_count() or 1) // a.ranks)} threads, {a.steps} steps, "
        f"{a.rounds} rounds")
    for i in range(a.rounds):
        out = root / f"one-{i}"
        runs["one"].append(_run([sys.executable, *train_py, *common, "--set", f"train.batch={b * a.ranks}",
                                 "--out", str(out)], out)["char_per_s"])
        out = root / f"ranks-{i}"
        runs["ranks"].append(_run([*torchrun, *train_py, *common, "--set", f"train.batch={b}", "--out", str(out)],
                                  out)["char_per_s"])
        line = f"round {i + 1}: one process {runs['one'][-1]:,.0f} char/s, {a.ranks} ranks {runs['ranks'][-1]:,.0f} char/s"
        if a.expert_parallel > 1:
            out = root / f"ep-{i}"
            rec = _run([*torchrun, *train_py, *common, "--set", f"train.batch={b}", "--set",
                        f"train.expert_parallel={a.expert_parallel}", "--out", str(out)], out)
            runs["ep"].append(rec["char_per_s"])
            a2a.append(rec["a2a_bytes_per_step"])
            line += f", expert_parallel {a.expert_parallel} {runs['ep'][-1]:,.0f} char/s"
        log(line)
    mean = {k: sum(v) / len(v) for k, v in runs.items()}
    one, ranks = mean["one"], mean["ranks"]
    grad = gradient_bytes(a.profile, a.overrides)
    result = {"profile": a.profile, "ranks": a.ranks, "global_batch": b * a.ranks, "steps": a.steps, "runs": runs,
              "char_per_s_one": one, "char_per_s_ranks": ranks, "ratio": ranks / one,
              "allreduce_bytes_per_step": grad, "ring_bytes_per_rank": 2 * (a.ranks - 1) / a.ranks * grad}
    print(f"{a.ranks} ranks: {ranks:,.0f} char/s against one process {one:,.0f} char/s (x{ranks / one:.3f}); DDP "
          f"all-reduces {grad / 2**20:,.1f} MB of gradients per step ({result['ring_bytes_per_rank'] / 2**20:,.1f} MB "
          f"sent and received per rank by a ring)")
    if a.expert_parallel > 1:
        ep_grad = gradient_bytes(a.profile, a.overrides, a.ranks, a.expert_parallel)
        result.update(expert_parallel=a.expert_parallel, char_per_s_ep=mean["ep"], ep_ratio=mean["ep"] / ranks,
                      a2a_bytes_per_step=sum(a2a) / len(a2a), ep_allreduce_bytes_per_step=ep_grad)
        print(f"expert_parallel {a.expert_parallel}: {mean['ep']:,.0f} char/s against DDP's {ranks:,.0f} "
              f"(x{mean['ep'] / ranks:.3f}); per rank and step its all_to_alls send {result['a2a_bytes_per_step'] / 2**20:,.1f} "
              f"MB and it all-reduces {ep_grad / 2**20:,.1f} MB (DDP: {grad / 2**20:,.1f} MB)")
    (root / "bench_ddp.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {root / 'bench_ddp.json'}")
    return 0
