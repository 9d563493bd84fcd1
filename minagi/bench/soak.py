"""python -m minagi.bench soak: a long training run watched for memory growth and slowdown.

The seed's large run slowed to half speed and crashed as its buffers grew; this is its 45-minute
check, here. A fresh process trains the profile for --minutes (the run's schedule is set long
enough that the soak, not the step count, ends it), sampling its resident memory (on GPUs also
the caching allocator's allocated and reserved bytes) and its step time every --every steps.
The report: peak resident memory; its slope after warm-up (MB per 1,000 steps, least squares
over the last 80% of samples: the first 20% are warm-up); throughput drift (char/s of the last
20% of samples against the first 20% after warm-up), and the same drift in character-rows per
second (characters times the rows they used: with adaptive rows a model that learns halts sooner,
so its char/s rises while the work per row stays the same; this one sees a slowdown of the work
itself); char/s after warm-up. Written to
OUT/soak.json, drawn to OUT/soak.png, summed up on stdout. MINAGI_ALLOCATOR applies to the
training process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..lm.memory import peak_resident_bytes, resident_bytes
from ..lm.prog import ListHelpFormatter

SAMPLES = "soak_samples.jsonl"
WARMUP_FRAC = 0.2
TARGETS = {"peak_rss_mb": 1000.0, "slope_mb_per_kstep": 5.0, "drift": 0.05}  # the default profile's, on the CPU


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minagi.bench soak", description=__doc__.split("\n\n")[0],
                                formatter_class=ListHelpFormatter)
    p.add_argument("--profile", default="cpu-tiny", help="a packaged profile or a .toml path")
    p.add_argument("--minutes", type=float, default=20.0, help="how long to train (default 20)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--out", default="runs/soak", help="folder for the run, soak.json and soak.png")
    p.add_argument("--every", type=int, default=20, help="steps between samples (default 20)")
    p.add_argument("--data", default=None, help="corpus (default: the profile's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a profile value (repeatable)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the training process
    return p


# --- the arithmetic (pure functions, tested on synthetic samples) ---------------------------

def after_warmup(samples: list[dict]) -> list[dict]:
    return samples[int(len(samples) * WARMUP_FRAC):]


def slope_per_kstep(steps, values) -> float:
    """Least-squares slope of values against steps, per 1,000 steps (0 for fewer than 2 points)."""
    n = len(steps)
    if n < 2:
        return 0.0
    ms, mv = sum(steps) / n, sum(values) / n
    var = sum((s - ms) ** 2 for s in steps)
    if var == 0:
        return 0.0
    return 1000.0 * sum((s - ms) * (v - mv) for s, v in zip(steps, values)) / var


def span_char_per_s(samples: list[dict], key: str = "chars") -> float:
    """char/s (or key/s) over a run of consecutive samples, from their cumulative count and step time."""
    if len(samples) < 2:
        return 0.0
    dt = samples[-1]["train_s"] - samples[0]["train_s"]
    return (samples[-1][key] - samples[0][key]) / dt if dt > 0 else 0.0


def drift(samples: list[dict], key: str = "chars") -> float:
    """key/s of the last 20% of samples over that of the first 20% after warm-up, minus 1."""
    n = len(samples)
    fifth = max(2, n // 5)
    lo = int(n * WARMUP_FRAC)
    first, last = samples[lo:lo + fifth], samples[n - fifth:]
    a, b = span_char_per_s(first, key), span_char_per_s(last, key)
    return b / a - 1.0 if a > 0 and b > 0 else 0.0


def _rows_between(samples: list[dict]) -> float:
    chars = samples[-1]["chars"] - samples[0]["chars"]
    return (samples[-1]["row_chars"] - samples[0]["row_chars"]) / chars if chars else 0.0


def report(samples: list[dict]) -> dict:
    if len(samples) < 5:
        raise RuntimeError(f"the soak took {len(samples)} samples; it needs at least 5 (more --minutes or a "
                           "smaller --every)")
    mb = 1 / 2 ** 20
    post = after_warmup(samples)
    out = {
        "samples": len(samples),
        "steps": samples[-1]["step"],
        "minutes": samples[-1]["elapsed_s"] / 60,
        "peak_rss_mb": max(max(s["rss"], s.get("peak_rss", 0)) for s in samples) * mb,
        "final_rss_mb": samples[-1]["rss"] * mb,
        "slope_mb_per_kstep": slope_per_kstep([s["step"] for s in post], [s["rss"] * mb for s in post]),
        "drift": drift(samples),
        "char_per_s": span_char_per_s(post),
    }
    if all("row_chars" in s for s in samples):
        out["work_drift"] = drift(samples, "row_chars")
        out["rows_first"] = _rows_between(samples[int(len(samples) * WARMUP_FRAC):][:max(2, len(samples) // 5)])
        out["rows_last"] = _rows_between(samples[-max(2, len(samples) // 5):])
    if all(s.get("reserved") is not None for s in samples):
        out["peak_reserved_mb"] = max(s["reserved"] for s in samples) * mb
        out["reserved_slope_mb_per_kstep"] = slope_per_kstep([s["step"] for s in post],
                                                             [s["reserved"] * mb for s in post])
    return out


def summary(r: dict) -> str:
    parts = [f"steps {r['steps']:,} in {r['minutes']:.1f} min", f"peak resident {r['peak_rss_mb']:,.0f} MB",
             f"slope after warm-up {r['slope_mb_per_kstep']:+.2f} MB / 1,000 steps", f"drift {r['drift']:+.1%}"]
    if "work_drift" in r:
        parts[-1] += f" (per character-row {r['work_drift']:+.1%}; rows {r['rows_first']:.2f} -> {r['rows_last']:.2f})"
    parts.append(f"{r['char_per_s']:,.0f} char/s")
    if "peak_reserved_mb" in r:
        parts.append(f"peak reserved {r['peak_reserved_mb']:,.0f} MB, slope {r['reserved_slope_mb_per_kstep']:+.2f}")
    return "; ".join(parts)


# --- the training process -------------------------------------------------------------------

class Sampler:
    """The trainer's callback: a sample every `every` steps, and the end of the soak."""

    def __init__(self, path: Path, every: int, seconds: float, device):
        self.path, self.every, self.seconds, self.device = path, every, seconds, device
        self.t0, self.chars, self.row_chars, self.train_s = None, 0, 0.0, 0.0  # the clock starts at the first step
        self.file = open(path, "w")

    def __call__(self, info) -> bool:
        if self.t0 is None:
            self.t0 = time.perf_counter() - info.step_s
        self.chars += info.chars
        self.row_chars += info.chars * info.rows_mean
        self.train_s += info.step_s
        elapsed = time.perf_counter() - self.t0
        done = elapsed >= self.seconds
        if info.step % self.every == 0 or done:
            rec = {"step": info.step, "elapsed_s": elapsed, "chars": self.chars, "row_chars": self.row_chars,
                   "train_s": self.train_s,
                   "rss": resident_bytes(), "peak_rss": peak_resident_bytes()}
            if self.device.type == "cuda":
                import torch

                rec.update(allocated=torch.cuda.memory_allocated(self.device),
                           reserved=torch.cuda.memory_reserved(self.device))
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
        return done


def _config(a):
    from ..lm.config import load

    overrides = [*a.overrides, f"train.device={a.device}", "train.steps=100000000"]
    if a.data:
        overrides.append(f"data.path={a.data}")
    return load(a.profile, overrides)


def child(a) -> int:
    from ..lm import allocator
    from ..lm.cli import USER_ERRORS
    from ..lm.guard import Diverged, Interrupted
    from ..lm.run import resolve_device
    from ..lm.trainer import train

    try:
        allocator.ensure()
        cfg = _config(a)
        out = Path(a.out)
        sampler = Sampler(out / SAMPLES, a.every, a.minutes * 60, resolve_device(cfg.train.device))
        train(cfg, out / "run", progress=False, callbacks=[sampler])
    except (*USER_ERRORS, Diverged, Interrupted) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return getattr(exc, "exit_status", 2)
    except RuntimeError as exc:  # no GPU for --device cuda, and the like
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    return 0


# --- the command ----------------------------------------------------------------------------

def plot(samples: list[dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ..lm.plot import install_hint

        print(f"soak: no PNG (matplotlib is not installed: {install_hint()})", file=sys.stderr)
        return None
    t = [s["elapsed_s"] / 60 for s in samples]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    ax0.plot(t, [s["rss"] / 2 ** 20 for s in samples], label="resident")
    for key in ("allocated", "reserved"):
        if all(s.get(key) is not None for s in samples):
            ax0.plot(t, [s[key] / 2 ** 20 for s in samples], label=f"GPU {key}")
    ax0.set(title="memory (MB)", xlabel="minutes", ylim=(0, None))
    ax0.legend()
    cps = [span_char_per_s(samples[i - 1:i + 1]) for i in range(1, len(samples))]
    ax1.plot(t[1:], cps)
    ax1.set(title="char/s between samples", xlabel="minutes", ylim=(0, None))
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _wait(proc: subprocess.Popen) -> int:
    """The child's exit status. Ctrl-C reaches the child too (one process group), which
    checkpoints and stops; the parent keeps waiting for it instead of killing it mid-write."""
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            continue


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.child:
        return child(a)
    if a.minutes <= 0 or a.every < 1:
        print("error: --minutes must be > 0 and --every >= 1", file=sys.stderr)
        return 2
    from ..lm.cli import USER_ERRORS

    try:
        _config(a)  # a bad profile or --set is one line here, before a process is started
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "minagi.bench", "soak", "--child", *(argv if argv is not None else sys.argv[1:])]
    print(f"soak: {a.profile} on {a.device} for {a.minutes:g} min in a fresh process "
          f"(allocator: {os.environ.get('MINAGI_ALLOCATOR', 'system')}), samples every {a.every} steps",
          file=sys.stderr, flush=True)
    rc = _wait(subprocess.Popen(cmd))
    if rc != 0:
        print(f"soak: the training process stopped with exit status {rc}", file=sys.stderr)
        return rc
    samples = [json.loads(line) for line in (out / SAMPLES).read_text().splitlines() if line.strip()]
    try:
        measured = report(samples)
    except RuntimeError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    result = {"profile": a.profile, "device": a.device, "minutes_asked": a.minutes,
              "allocator": os.environ.get("MINAGI_ALLOCATOR", "system"), "overrides": a.overrides,
              **measured, "targets": TARGETS}
    png = plot(samples, out / "soak.png", f"soak: {a.profile}, {result['allocator']} allocator")
    (out / "soak.json").write_text(json.dumps({**result, "series": samples}, indent=1))
    print(summary(result))
    print(f"wrote {out / 'soak.json'}" + (f" and {png}" if png else ""))
    return 0
