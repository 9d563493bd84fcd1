"""The command line behind train.py:

    python train.py [--profile cpu-tiny] [--data PATH] [--out DIR] [--steps N] [--set k=v]... [--resume]

Errors a user can fix (an unknown profile or key, a bad value, missing data, a corpus too small,
a missing checkpoint) end with one line saying what to do, and exit status 2.
"""
from __future__ import annotations

import argparse
import sys

from .checkpoint import CheckpointError
from .config import DEFAULT_PROFILE, ConfigError, load
from .data import DataError

USER_ERRORS = (ConfigError, DataError, CheckpointError)


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python train.py", description="Train a minagi byte model.")
    p.add_argument("--profile", default=DEFAULT_PROFILE, help=f"profile name in profiles/ or a .toml path (default {DEFAULT_PROFILE})")
    p.add_argument("--data", default=None, help="a text file or a folder of text files (default: the Python standard library's source)")
    p.add_argument("--out", default=None, help="run folder for checkpoint.pt and history.jsonl (default runs/PROFILE)")
    p.add_argument("--steps", type=int, default=None, help="length of the whole run, schedule included (= --set train.steps=N)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a profile value, e.g. --set model.top_k=4 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt with the settings saved there")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def run_train(argv) -> int:
    args = train_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.data is not None:
        overrides.append(f"data.path={args.data}")
    cfg = load(args.profile, overrides)
    out = args.out or f"runs/{cfg.profile}"
    from .trainer import train

    record = train(cfg, out, resume=args.resume, progress=not args.quiet)
    if record:
        print(f"done: step {record['step']}, held-out {record['heldout_bpc']:.3f} bits/char, "
              f"{record['char_per_s']:,.0f} char/s; checkpoint and history in {out}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return run_train(argv)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the last checkpoint is intact; continue with --resume", file=sys.stderr)
        return 130
