"""python -m minagi.bench <benchmark> [options]; `python -m minagi.bench dispatch --help`."""
from __future__ import annotations

import argparse
import sys

from .. import allocator
from ..prog import ListHelpFormatter
from . import data, ddp, dispatch, hf, quality, repro, soak, speed

# Every benchmark: its entry and what it measures, in one line. The bench runner, its --help and
# the minagi command's help (minagi.cli.command_list) all read this table.
BENCHES = {
    "dispatch": (dispatch.main, "forward+backward time of expert_mlp per dispatch path, uniform and sink routings"),
    "quality": (quality.main, "does the pool pay? the profile against dense models at equal wall-clock"),
    "train": (speed.main_train, "training char/s, grouped against rectangle dispatch"),
    "write": (speed.main_write, "writing char/s of a checkpoint, grouped against rectangle dispatch"),
    "soak": (soak.main, "a long training run watched for memory growth and slowdown"),
    "data": (data.main, "training on a prepared corpus of any size: resident memory"),
    "ddp": (ddp.main, "data (and expert) parallelism on one machine"),
    "repro": (repro.main, "bit-reproducible training beside other work, exact resume after a signal"),
    "hf": (hf.main, "transformers' experts backends against minagi's"),
}


def bench_list(how: str = "NAME --help: its options") -> str:
    return f"benchmarks ({how}):\n" + "\n".join(f"  {name:<9} {summary}" for name, (_, summary) in BENCHES.items())


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
    return BENCHES[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
