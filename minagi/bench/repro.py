"""python -m minagi.bench repro: training is bit-reproducible whatever else the machine runs, and
a run stopped by a real signal from outside resumes exactly.

1. A reference run of the profile, alone.
2. The same command again beside each of --loads: "quiet" (nothing), "busy" (a busy process per
   core), "train" (a second training of the profile), "build" (the C++ compiler on the
   extension's largest source, over and over).
3. --signals runs stopped from outside by SIGTERM (every fourth by SIGINT) at a seeded random
   moment, then resumed with --resume to the end. The moments, in turn: a random time in the
   run; while torch loads (before the trainer's first step); as an evaluation begins (the
   progress line of a scoring step); as a checkpoint write begins (its .tmp file appears). Every
   other one runs beside a load (busy, train, build in turn).
Each run's end is compared with the reference's: every tensor of the checkpoint (model, optimizer,
schedule, data position, random states) bit for bit, and each of the reference's history records
(losses, held-out bits per byte, routing figures; not times, speeds or memory). With --nproc 2
every run is a torchrun of two ranks (gloo), and the signal goes to one rank or to torchrun.
Every run of one process pins train.threads (to the machine's cores, unless --set names it): the
bits depend on the thread count, and auto threads follow the free cores (minagi/lm/cores.py), which
the loads take.
Prints one line per run and a summary; --json writes them all. Exit status 1 on any difference.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..lm.cores import cpus
from ..lm.prog import ListHelpFormatter

ROOT = Path(__file__).resolve().parents[2]
LOADS = ("quiet", "busy", "train", "build")
MOMENTS = ("time", "start", "eval", "checkpoint")
# History fields that measure the machine rather than the training.
# How a run went, not what it computed: its pace, and whether a record's step was checkpointed
# (a run stopped at a held-out evaluation checkpoints there; an uninterrupted one may not).
MACHINE_FIELDS = {"char_per_s", "time_s", "checkpoint"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minagi.bench repro", description=__doc__.split("\n\n")[0],
                                formatter_class=ListHelpFormatter)
    p.add_argument("--profile", default="cpu-tiny", help="a packaged profile or a .toml path")
    p.add_argument("--steps", type=int, default=300, help="steps of every run (default 300)")
    p.add_argument("--every", type=int, default=30, help="train.eval_every (default 30); checkpoints every 3x")
    p.add_argument("--signals", type=int, default=20, help="runs stopped by a signal and resumed (default 20)")
    p.add_argument("--loads", default="busy,train,build", help="loads to repeat the run beside (default busy,train,build)")
    p.add_argument("--nproc", type=int, default=1, help="ranks per run (torchrun when > 1)")
    p.add_argument("--seed", type=int, default=0, help="seeds the signals' moments")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a profile value (repeatable)")
    return p


# --- what differs between two runs -----------------------------------------------------------

def _walk(a, b, where: str, out: list) -> None:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        if not same:
            out.append(where)
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            _walk(a.get(k), b.get(k), f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{where}[{i}]", out)
    elif a != b and not (a != a and b != b):  # NaN equals NaN here
        out.append(where)


def _history(run: Path) -> dict:
    recs = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in recs}


def differences(ref: Path, run: Path) -> list[str]:
    """Where run's end differs from ref's: checkpoint entries and history records (by step)."""
    from ..lm import checkpoint

    a, b = checkpoint.load(ref), checkpoint.load(run)
    out: list[str] = []
    for key in sorted(set(a) | set(b)):
        if key in ("elapsed_s", "dispatch"):  # the machine's time; how it ran, not what it computed
            continue
        if key == "record":
            _walk({k: v for k, v in a[key].items() if k not in MACHINE_FIELDS and not k.startswith("mem_")},
                  {k: v for k, v in b[key].items() if k not in MACHINE_FIELDS and not k.startswith("mem_")},
                  key, out)
            continue
        _walk(a.get(key), b.get(key), key, out)
    ha, hb = _history(ref), _history(run)
    for step, rec in ha.items():
        if step not in hb:
            out.append(f"history: no record at step {step}")
            continue
        keep = lambda r: {k: v for k, v in r.items() if k not in MACHINE_FIELDS and not k.startswith("mem_")}  # noqa: E731
        _walk(keep(rec), keep(hb[step]), f"history[{step}]", out)
    return out


# --- loads beside a run ----------------------------------------------------------------------

class Load:
    """Processes that keep the machine busy while a run trains."""

    def __init__(self, kind: str, work: Path, cfg_args: list[str]):
        self.kind, self.procs = kind, []
        if kind == "busy":
            self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                          for _ in range(os.cpu_count() or 1)]
        elif kind == "train":
            self.procs = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--quiet", *cfg_args, "--steps",
                                            "1000000", "--out", str(work / "beside-train")],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        elif kind == "build":
            from torch.utils.cpp_extension import include_paths

            inc = " ".join(f"-I{p}" for p in include_paths())
            src = ROOT / "csrc" / "cpu" / "grouped_gemm_backward.cpp"
            self.procs = [subprocess.Popen(["sh", "-c", f"while true; do c++ -std=c++17 -O2 {inc} -c {src} "
                                                        f"-o {work / 'beside-build.o'}; done"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True)]
        elif kind != "quiet":
            raise SystemExit(f"repro: unknown load {kind!r}; choose from {', '.join(LOADS)}")

    def stop(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL) if self.kind == "build" else p.kill()
            except ProcessLookupError:
                pass
            p.wait()


# --- one run ---------------------------------------------------------------------------------

def _command(args, out: Path, cfg_args: list[str], resume: bool) -> list[str]:
    script = [str(ROOT / "train.py"), *cfg_args, "--steps", str(args.steps), "--out", str(out)]
    if resume:
        script.append("--resume")
    if args.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
                *script]
    return [sys.executable, *script]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _wait_for(proc, moment: str, rng: random.Random, out: Path, args, duration: float) -> None:
    """Returns at the run's chosen moment (or when it ends)."""
    if moment == "start":
        time.sleep(rng.uniform(0.05, 1.0))
        return
    if moment == "time":
        time.sleep(rng.uniform(0.05, 0.9) * duration)
        return
    if moment == "checkpoint":
        time.sleep(rng.uniform(0.0, 0.6) * duration)
        tmp = out / "checkpoint.pt.tmp"
        while proc.poll() is None and not tmp.exists():
            time.sleep(0.0005)
        return
    # eval: the progress line of a step that is scored is printed just before its evaluation
    first = rng.randrange(1, max(2, args.steps // args.every)) * args.every
    for line in proc.stderr:
        parts = line.split()
        if parts and parts[0] == "step" and "/" in parts[1] and int(parts[1].split("/")[0]) >= first:
            if int(parts[1].split("/")[0]) % args.every == 0:
                return


def _signal(proc, sig: int, rng: random.Random, nproc: int) -> str:
    target = proc.pid
    if nproc > 1 and rng.random() < 0.5:
        ranks = _children(proc.pid)
        if ranks:
            target = rng.choice(ranks)
    try:
        os.kill(target, sig)
    except ProcessLookupError:
        return "ended first"
    return "torchrun" if target == proc.pid else ("rank" if nproc > 1 else "process")


def _run(cmd, env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)


def _finish(args, out: Path, cfg_args, env) -> str | None:
    """Resume until the run is done (a run stopped before its first checkpoint starts over)."""
    for _ in range(3):
        resume = (out / "checkpoint.pt").exists()
        r = _run(_command(args, out, cfg_args, resume), env)
        if r.returncode == 0:
            return None
        last = r.stderr.strip().splitlines()[-1:] or ["(no output)"]
        if r.returncode not in (130, 143):
            return f"resume failed ({r.returncode}): {last[0]}"
    return "did not finish in 3 resumes"


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="minagi-repro-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg_args = ["--profile", args.profile, "--set", f"train.eval_every={args.every}",
                "--set", f"train.checkpoint_every={3 * args.every}", *sum((["--set", kv] for kv in args.overrides), [])]
    if args.nproc == 1 and not any(kv.startswith("train.threads=") for kv in args.overrides):
        cfg_args += ["--set", f"train.threads={len(cpus())}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    rng = random.Random(args.seed)
    results = []

    def report(res: dict) -> None:
        results.append(res)
        diff = res["differences"]
        verdict = "identical" if not diff and not res.get("error") else res.get("error") or f"{len(diff)} differences: {', '.join(diff[:4])}"
        print(f"{res['run']:<10} {res['load']:<6} {res.get('signal', ''):<8} {res.get('moment', ''):<11} "
              f"{str(res.get('stopped_at', '')):<8} {verdict}", flush=True)

    ref = work / "ref"
    t0 = time.perf_counter()
    r = _run(_command(args, ref, cfg_args, False), env)
    duration = time.perf_counter() - t0
    if r.returncode != 0:
        print(r.stderr[-2000:], file=sys.stderr)
        return 1
    print(f"repro: reference run of {args.profile}, {args.steps} steps, {args.nproc} rank(s): {duration:.0f} s; "
          f"runs in {work}", flush=True)
    print(f"{'run':<10} {'load':<6} {'signal':<8} {'moment':<11} {'stopped':<8} verdict", flush=True)
    for i, kind in enumerate(args.loads.split(",") if args.loads else []):
        out = work / f"again-{kind}"
        load = Load(kind, work, cfg_args)
        try:
            r = _run(_command(args, out, cfg_args, False), env)
        finally:
            load.stop()
        report({"run": f"again-{i}", "load": kind, "error": None if r.returncode == 0 else r.stderr[-300:],
                "differences": differences(ref, out) if r.returncode == 0 else []})
    loads = [k for k in LOADS if k != "quiet"]
    for i in range(args.signals):
        out = work / f"signal-{i}"
        sig = signal.SIGINT if i % 4 == 3 else signal.SIGTERM
        moment = MOMENTS[i % len(MOMENTS)]
        kind = loads[(i // 2) % len(loads)] if i % 2 else "quiet"
        load = Load(kind, work, cfg_args)
        try:
            proc = subprocess.Popen(_command(args, out, cfg_args, False), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
            _wait_for(proc, moment, rng, out, args, duration)
            target = _signal(proc, sig, rng, args.nproc)
            proc.communicate()
            stopped = proc.returncode
            ckpt_step = None
            if (out / "checkpoint.pt").exists():
                import torch

                ckpt_step = torch.load(out / "checkpoint.pt", weights_only=True)["step"]
            error = _finish(args, out, cfg_args, env)
        finally:
            load.stop()
        report({"run": f"signal-{i}", "load": kind, "signal": signal.Signals(sig).name, "moment": moment,
                "target": target, "status": stopped, "stopped_at": ckpt_step, "error": error,
                "differences": differences(ref, out) if error is None else []})
    bad = [r for r in results if r["differences"] or r.get("error")]
    print(f"repro: {len(results) - len(bad)} of {len(results)} runs identical to the reference "
          f"(bit for bit: every checkpoint tensor; every history record's figures)")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "steps": args.steps, "nproc": args.nproc,
                                               "reference_s": duration, "runs": results}, indent=1))
    return 1 if bad else 0
