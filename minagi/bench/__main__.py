"""python -m minagi.bench <benchmark> [options]; `python -m minagi.bench dispatch --help`."""
from __future__ import annotations

import argparse
import importlib
import sys

from ..lm import allocator
from ..lm.prog import BENCHES, ListHelpFormatter, bench_list


def entry(name: str):
    """The function that runs benchmark `name` (its module imported only now)."""
    module, function, _ = BENCHES[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def main(argv=None, command_line: bool | None = None) -> int:
    """command_line (default: argv is None): MINAGI_ALLOCATOR applies to this process."""
    command_line = argv is None if command_line is None else command_line
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        parser = argparse.ArgumentParser(prog="python -m minagi.bench", epilog=bench_list(),
                                         formatter_class=ListHelpFormatter)
        parser.add_argument("benchmark", choices=list(BENCHES), help="which one (NAME --help: its options)")
        parser.parse_args(argv[:1])
    if command_line:  # MINAGI_ALLOCATOR applies to a benchmark as to training (never to a caller's process)
        try:
            allocator.ensure()
        except allocator.AllocatorError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return entry(argv[0])(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
