#!/usr/bin/env python3
"""Train a minagi byte model: python train.py [--profile cpu-tiny] [--data PATH] [--out DIR]
[--steps N] [--set section.key=value]... [--resume]. The loop lives in minagi/trainer.py."""
import sys

from minagi.cli import main

if __name__ == "__main__":
    sys.exit(main())
