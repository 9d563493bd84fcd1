#!/usr/bin/env python3
"""Train a minagi byte model, and write from it, score it, plot it:

    python train.py [--profile cpu-tiny] [--data PATH] [--data-binary] [--out DIR] [--steps N] [--set k=v]... [--resume]
    python train.py write DIR --prompt TEXT --chars N [--temperature T] [--top-p P] [--seed S] [--no-repeat-ngram N]
    python train.py eval DIR [--data PATH] [--data-binary]
    python train.py plot DIR
    python train.py routes DIR [--data PATH] [--data-binary] [--chunks N] [--json]
    python train.py prepare SRC OUT [--heldout-every N] [--force] [--data-binary]

Every command's --help lists its options with their defaults; python train.py --help lists the
commands and the benchmarks.

The library does the work (minagi/lm/cli.py, minagi/lm/trainer.py, minagi/lm/writer.py)."""
import os
import signal
import sys


def _keep(signum, frame):
    """SIGTERM / SIGINT while torch loads: kept for the trainer, which then stops after its first
    step with a checkpoint (minagi.lm.guard.GracefulStop takes it over), instead of a kill that
    saves nothing."""
    _keep.caught = _keep.caught or signum


# A command that re-executed itself (MINAGI_ALLOCATOR) hands over what the keeper had caught.
_keep.caught = int(os.environ.pop("MINAGI_EARLY_SIGNAL", "0")) or None
for _sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(_sig, _keep)

from minagi.lm.cli import main  # noqa: E402  (after the keeper: this import takes seconds)

if __name__ == "__main__":
    sys.exit(main())
