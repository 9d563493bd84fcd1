"""python -m minagi.bench <benchmark> [options]; `python -m minagi.bench dispatch --help`."""
from __future__ import annotations

import argparse
import sys

from .. import allocator
from . import data, ddp, dispatch, hf, quality, repro, soak, speed

BENCHES = {"dispatch": dispatch.main, "quality": quality.main, "train": speed.main_train, "write": speed.main_write,
           "soak": soak.main, "data": data.main, "ddp": ddp.main,
           "repro": repro.main, "hf": hf.main}


def main(argv=None, command_line: bool | None = None) -> int:
    """command_line (default: argv is None): MINAGI_ALLOCATOR applies to this process."""
    command_line = argv is None if command_line is None else command_line
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        parser = argparse.ArgumentParser(prog="python -m minagi.bench")
        parser.add_argument("benchmark", choices=sorted(BENCHES))
        parser.parse_args(argv[:1])
    if command_line:  # MINAGI_ALLOCATOR applies to a benchmark as to training (never to a caller's process)
        try:
            allocator.ensure()
        except allocator.AllocatorError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return BENCHES[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
