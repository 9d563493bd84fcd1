"""python -m minagi.bench shared: training's char/s on a machine that other work shares.

Each condition (--conditions): "quiet" (nothing beside the run), "busy1" and "busy2" (one or two
busy processes, each a Python loop spinning on one core, started before the run and stopped
after it), "late1" (one busy process started --late seconds into each run: the watch's looks
during training, not its look at the start-up). In each, every kind of run (--runs), each a
fresh process training the profile for --steps steps (char/s over the steps after the first
--skip; training steps only, the held-out scoring is not in it):
  new      train.threads = 0 as it is now: the threads follow the free cores (minagi/lm/cores.py)
  old      train.threads = 0 as it was: every core, whatever else runs (MINAGI_WATCH_CORES=0)
  one      train.threads = 1
  passive  as old, with OMP_WAIT_POLICY=passive (waiting threads sleep instead of spinning)
Prints a table of char/s with each run's threads at its end, and the ratios new/one, old/one and
new/old per condition; the median over --rounds, the kinds interleaved within a round. --json
writes every run. Measure on an otherwise quiet machine: other work is a load the bench does not
count.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..lm.prog import ListHelpFormatter

CONDITIONS = {"quiet": 0, "busy1": 1, "busy2": 2, "late1": 1}
RUNS = {  # what it is, train.threads, the environment
    "new": ("threads follow the free cores", "0", {"MINAGI_WATCH_CORES": "1"}),
    "old": ("every core (before minagi/lm/cores.py)", "0", {"MINAGI_WATCH_CORES": "0"}),
    "one": ("1 thread", "1", {"MINAGI_WATCH_CORES": "1"}),
    "passive": ("every core, OMP_WAIT_POLICY=passive", "0", {"MINAGI_WATCH_CORES": "0", "OMP_WAIT_POLICY": "passive"}),
}
BUSY = "while True:\n    pass\n"
NOTICE = "minagi: other work is using"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minagi.bench shared", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=ListHelpFormatter)
    p.add_argument("--profile", default="cpu-tiny", help="a packaged profile or a .toml path")
    p.add_argument("--steps", type=int, default=150, help="steps of every run")
    p.add_argument("--skip", type=int, default=20, help="first steps left out of char/s")
    p.add_argument("--conditions", default="quiet,busy1,busy2", help=f"of {', '.join(CONDITIONS)}")
    p.add_argument("--runs", default="new,old,one", help=f"of {', '.join(RUNS)}")
    p.add_argument("--rounds", type=int, default=1, help="rounds (median)")
    p.add_argument("--late", type=float, default=8.0, help="seconds into a late1 run when its busy process starts")
    p.add_argument("--json", default=None, help="also write every run here")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a profile value (repeatable)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run, in its own process
    return p


def child(args) -> int:
    """One run: train, then print its char/s and threads as JSON (the last line of stdout)."""
    import torch

    from ..lm.config import load
    from ..lm.trainer import train

    seen = []
    cfg = load(args.profile, [*args.overrides, f"train.steps={args.steps}", f"train.threads={args.child}",
                              f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}"])
    with tempfile.TemporaryDirectory() as out:
        train(cfg, out, progress=False, callbacks=[lambda info: seen.append((info.step, info.chars, info.step_s))])
    timed = [s for s in seen if s[0] > args.skip] or seen
    print(json.dumps({"char_per_s": sum(s[1] for s in timed) / sum(s[2] for s in timed),
                      "threads": torch.get_num_threads(), "steps_timed": len(timed)}))
    return 0


def one_run(args, kind: str, late: float | None = None) -> dict:
    """One run of this kind in its own process; late: one busy process started this many seconds
    after the run (and stopped after it)."""
    _, threads, env = RUNS[kind]
    cmd = [sys.executable, "-m", "minagi.bench", "shared", "--child", threads, "--profile", args.profile,
           "--steps", str(args.steps), "--skip", str(args.skip), *sum((["--set", kv] for kv in args.overrides), [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, **env))
    procs = []
    try:
        if late is not None:
            try:
                proc.wait(timeout=late)
            except subprocess.TimeoutExpired:
                procs = beside(1, settle=0)
        out, err = proc.communicate()
    finally:
        stop(procs)
    r = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if r.returncode != 0:
        raise RuntimeError(f"the {kind} run failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    result["notice"] = next((line for line in r.stderr.splitlines() if line.startswith(NOTICE)), None)
    return result


def beside(n: int, settle: float = 0.5):
    """n busy processes, started now (settle: seconds to get going); stop them with stop()."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
    time.sleep(settle if n else 0)
    return procs


def stop(procs) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.child is not None:
        return child(args)
    conditions, kinds = args.conditions.split(","), args.runs.split(",")
    bad = [c for c in conditions if c not in CONDITIONS] + [k for k in kinds if k not in RUNS]
    if bad:
        print(f"unknown condition or run: {', '.join(bad)}", file=sys.stderr)
        return 2
    from ..lm.cores import cpus

    print(f"shared: {args.profile}, {args.steps} steps a run (char/s over the steps after {args.skip}), "
          f"{len(cpus())} cores, {args.rounds} round(s); " + "; ".join(f"{k}: {RUNS[k][0]}" for k in kinds), flush=True)
    runs = []
    for r in range(args.rounds):
        for cond in conditions:
            late = args.late if cond == "late1" else None
            procs = beside(CONDITIONS[cond] if late is None else 0)
            try:
                for kind in kinds:
                    res = {"round": r, "condition": cond, "run": kind, **one_run(args, kind, late)}
                    runs.append(res)
                    print(f"  round {r} {cond:<6} {kind:<4} {res['char_per_s']:>9,.0f} char/s, {res['threads']} "
                          f"thread(s) at the end" + (f"; said: {res['notice']}" if res["notice"] else ""), flush=True)
            finally:
                stop(procs)
    report(runs, conditions, kinds)
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "steps": args.steps, "skip": args.skip,
                                               "cores": len(cpus()), "runs": runs}, indent=1))
    return 0


def medians(runs, conditions, kinds) -> dict:
    """{(condition, kind): median char/s}."""
    return {(c, k): statistics.median(r["char_per_s"] for r in runs if r["condition"] == c and r["run"] == k)
            for c in conditions for k in kinds if any(r["condition"] == c and r["run"] == k for r in runs)}


def report(runs, conditions, kinds) -> None:
    med = medians(runs, conditions, kinds)
    pairs = [(a, b) for a, b in (("new", "one"), ("old", "one"), ("new", "old"), ("passive", "one"))
             if a in kinds and b in kinds]
    width = {k: len(k) + 9 for k in kinds}
    ratio = {(a, b): len(a) + len(b) + 3 for a, b in pairs}
    print(f"\n{'condition':<10}" + "".join(f"{k + ' char/s':>{width[k]}}" for k in kinds)
          + "".join(f"{a + '/' + b:>{ratio[(a, b)]}}" for a, b in pairs))
    for c in conditions:
        print(f"{c:<10}" + "".join(f"{med[(c, k)]:>{width[k]},.0f}" for k in kinds)
              + "".join(f"{med[(c, a)] / med[(c, b)]:>{ratio[(a, b)]}.2f}" for a, b in pairs))


if __name__ == "__main__":
    sys.exit(main())
