"""python -m minagi.bench data [--gb 2] [--data PATH] [--steps 200] [--out DIR]: corpora of any size.

Builds a synthetic text corpus of --gb gigabytes in a temporary folder (files of the Python
standard library's source, repeated; or takes --data), prepares it (python train.py prepare) in
a fresh process and reports prepare's MB/s and peak resident memory; then trains --steps steps
of the default profile on the prepared corpus and on the default corpus, each in a fresh
process, and reports both runs' peak resident memory, char/s and startup (process start to the
end of the first step); and once more on the default corpus prepared, whose batches are the raw
default run's, so that the two differ only in where the bytes come from. Targets (this project's 2-core machine, 2 GB): prepare <= 300 MB peak
and >= 100 MB/s; training on the prepared corpus within 150 MB and 5% char/s of the default
corpus's run, and its startup within 2 s of it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..lm.memory import peak_resident_bytes
from ..lm.prog import ListHelpFormatter

TARGETS = {"prepare_peak_mb": 300, "prepare_mb_per_s": 100, "rss_over_default_mb": 150, "char_per_s_loss": 0.05,
           "startup_over_default_s": 2.0}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minagi.bench data", description=__doc__.split("\n\n")[0],
                                formatter_class=ListHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="size of the synthetic corpus (default 2)")
    p.add_argument("--data", default=None, help="a corpus of your own instead of the synthetic one")
    p.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    p.add_argument("--out", default=None, help="folder for the corpus, the runs and bench_data.json "
                                               "(default: a temporary folder, removed at the end)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a profile value (repeatable)")
    p.add_argument("--child", choices=("prepare", "train"), help=argparse.SUPPRESS)
    p.add_argument("--args", nargs="*", default=[], help=argparse.SUPPRESS)
    return p


def synthesize(folder: Path, nbytes: int, log) -> int:
    """Files of the standard library's source, repeated (each copy under its own name, so the
    hash split holds some out), until nbytes are written."""
    from ..lm.data import stdlib_files

    _, files = stdlib_files()
    text = b"".join(f.read_bytes() for f in files)
    folder.mkdir(parents=True, exist_ok=True)
    written, i = 0, 0
    while written < nbytes:
        piece = text[: nbytes - written] if nbytes - written < len(text) else text
        (folder / f"part{i:04d}.py").write_bytes(piece)
        written += len(piece)
        i += 1
        log(f"synthetic corpus: {written / 2**20:,.0f} of {nbytes / 2**20:,.0f} MB")
    return written


def child_prepare(src: str, out: str) -> dict:
    from ..lm.data import prepare

    t0 = time.perf_counter()
    meta = prepare(src, out, force=True)
    secs = time.perf_counter() - t0
    total = meta["train_bytes"] + meta["heldout_bytes"]
    return {"bytes": total, "seconds": secs, "mb_per_s": total / 2**20 / secs, "peak_rss_mb": peak_resident_bytes() / 2**20}


def child_train(data: str, out: str, steps: int, overrides: list[str], t_spawn: float) -> dict:
    from ..lm.config import load
    from ..lm.trainer import train

    first, chars, train_s = [], [0], [0.0]

    def watch(info) -> None:
        if not first:
            first.append(time.time())
        elif info.step > 5:  # char/s after the first steps' warm-up
            chars[0] += info.chars
            train_s[0] += info.step_s

    cfg = load("cpu-tiny", [*overrides, f"train.steps={steps}", f"train.checkpoint_every={steps}",
                            f"train.eval_every={steps}", *([f"data.path={data}"] if data else [])])
    train(cfg, out, progress=False, callbacks=[watch])
    return {"startup_s": first[0] - t_spawn, "char_per_s": chars[0] / train_s[0], "peak_rss_mb": peak_resident_bytes() / 2**20}


def _child(kind: str, *args) -> dict:
    cmd = [sys.executable, "-m", "minagi.bench", "data", "--child", kind, "--args", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench data: the {kind} process failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.child == "prepare":
        print(json.dumps(child_prepare(*a.args)))
        return 0
    if a.child == "train":
        data, out, steps, t_spawn, *overrides = a.args
        print(json.dumps(child_train(data, out, int(steps), overrides, float(t_spawn))))
        return 0
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="minagi-bench-data-"))
    try:
        root.mkdir(parents=True, exist_ok=True)
        src = a.data
        if src is None:
            src = str(root / "raw")
            synthesize(Path(src), int(a.gb * 2**30), lambda m: None)
            log(f"synthetic corpus of {a.gb:g} GB in {src}")
        prep = _child("prepare", src, root / "prepared")
        log(f"prepare: {prep['bytes'] / 2**20:,.0f} MB in {prep['seconds']:.1f} s = {prep['mb_per_s']:,.0f} MB/s, "
            f"peak resident {prep['peak_rss_mb']:,.0f} MB")
        # The default corpus prepared too: the same batches as the raw default run (same bytes,
        # same generator), so the two differ only in where the bytes come from.
        _child("prepare", "", root / "prepared-default")
        runs = {}
        for name, data in (("default corpus", ""), ("prepared corpus", str(root / "prepared")),
                           ("default corpus prepared", str(root / "prepared-default"))):
            runs[name] = _child("train", data, root / f"run-{name.replace(' ', '-')}", a.steps, time.time(), *a.overrides)
            r = runs[name]
            log(f"{name}: startup {r['startup_s']:.2f} s, {r['char_per_s']:,.0f} char/s, "
                f"peak resident {r['peak_rss_mb']:,.0f} MB")
        d, p = runs["default corpus"], runs["prepared corpus"]
        result = {"corpus_bytes": prep["bytes"], "prepare": prep, "runs": runs, "targets": TARGETS,
                  "rss_over_default_mb": p["peak_rss_mb"] - d["peak_rss_mb"],
                  "char_per_s_ratio": p["char_per_s"] / d["char_per_s"],
                  "startup_over_default_s": p["startup_s"] - d["startup_s"],
                  "same_batches_char_per_s_ratio": runs["default corpus prepared"]["char_per_s"] / d["char_per_s"]}
        print(f"prepare {prep['mb_per_s']:,.0f} MB/s at {prep['peak_rss_mb']:,.0f} MB peak; training on the prepared "
              f"corpus: {result['rss_over_default_mb']:+,.0f} MB resident, char/s x{result['char_per_s_ratio']:.3f}, "
              f"startup {result['startup_over_default_s']:+.2f} s against the default corpus; the default corpus "
              f"prepared (the same batches): char/s x{result['same_batches_char_per_s_ratio']:.3f}")
        path = (Path(a.out) if a.out else Path.cwd()) / "bench_data.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    finally:
        if not a.out:
            shutil.rmtree(root, ignore_errors=True)
    return 0
