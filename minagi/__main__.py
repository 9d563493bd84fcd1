"""python -m minagi COMMAND (the minagi command): train | write | eval | plot | routes | prepare |
doctor | bench. `minagi --help` lists every command and benchmark; `minagi COMMAND --help`, its
options with their defaults (eval DIR [--data PATH]: without --data, the run's held-out split).

doctor: what this install runs on: torch, build flavour, whether minagi._C loaded (and why not),
which ops have CPU / GPU kernels, threads.
"""
from __future__ import annotations

import os
import sys


def doctor() -> int:
    """what this install runs on: extension, ops, threads, allocator"""
    import torch

    from .moe import _backend
    from .lm import allocator

    flavour = "rocm" if getattr(torch.version, "hip", None) else "cuda" if torch.version.cuda else "cpu"
    st = _backend.state()
    lines = [
        f"torch            {torch.__version__} ({flavour} build)",
        f"python           {sys.version.split()[0]}",
        f"extension        {'loaded' if st.loaded else 'NOT loaded: ' + st.reason}",
    ]
    if st.loaded:
        lines.append(f"  build          {torch.ops.minagi.build_info()}")
        if hasattr(torch.ops.minagi, "cpu_isa"):
            lines.append(f"  cpu isa        {torch.ops.minagi.cpu_isa()} (the quantized kernels' x86 level; "
                         f"MINAGI_CPU_ISA={os.environ.get('MINAGI_CPU_ISA', '')} caps it)")
        for op in _backend.OP_NAMES + _backend.FUSED_OP_NAMES:
            kernels = [k for k in ("cpu", "cuda") if _backend.has_kernel(op, k)]
            fused = (" (elsewhere: dequantized, then grouped_mm)" if op == "qgrouped_mm" else
                     " (fused; the ops above elsewhere)" if op in _backend.FUSED_OP_NAMES else "")
            if not hasattr(torch.ops.minagi, op):  # a stale build: it runs, without this op's speed
                kernels, fused = ["not in this build (rebuild: pip install --no-build-isolation -e .)"], ""
            lines.append(f"  minagi::{op:<19} {', '.join(kernels) or 'none'}{fused}")
    gpu = "none visible"
    if torch.cuda.is_available():  # only here, on request: import never touches a device
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    lines += [
        f"GPU              {gpu}",
        f"threads          torch {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
        f"parallel         {torch.__config__.parallel_info().splitlines()[-1].strip()}",
        f"allocator        {allocator.describe()}; for training, MINAGI_ALLOCATOR=jemalloc "
        f"({allocator.find('jemalloc') or 'not found'}), tcmalloc ({allocator.find('tcmalloc') or 'not found'}) "
        "or keep (minagi's cache of large blocks)",
        f"dispatch (auto)  {'compiled' if st.loaded else 'grouped (pure torch)'}",
        f"env              MINAGI_DISABLE_EXT={os.environ.get('MINAGI_DISABLE_EXT', '')!s} "
        f"MINAGI_REQUIRE_EXT={os.environ.get('MINAGI_REQUIRE_EXT', '')!s}",
    ]
    print("\n".join(lines))
    return 0


def commands() -> tuple[str, ...]:
    from .lm import cli

    return ("train", *cli.COMMANDS, "doctor", "bench")


def usage(prog: str) -> str:
    """Every command and every benchmark, a line each (from minagi.lm.cli's and minagi.bench's tables)."""
    from .lm.cli import command_list

    more = {"doctor": doctor.__doc__, "bench": "a benchmark, from the list below"}
    also = "   (or python -m minagi COMMAND)" if prog == "minagi" else ""
    return f"usage: {prog} COMMAND [options]{also}\n\n{command_list(prog, more)}"


def main(argv=None, prog: str = "python -m minagi") -> int:
    command_line, argv = argv is None, sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog), file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "doctor":
        return doctor()
    if cmd == "bench":
        from .bench.__main__ import main as bench_main

        return bench_main(rest, command_line=command_line)
    if cmd not in commands():
        import difflib

        near = difflib.get_close_matches(cmd, commands(), n=1)
        print(f"{prog}: unknown command {cmd!r}{f' (did you mean {near[0]}?)' if near else ''}; "
              f"the commands are {', '.join(commands())}", file=sys.stderr)
        return 2
    from .lm.cli import main as cli_main

    if cmd == "train":
        return cli_main(rest, prog=prog, train_prog=f"{prog} train")
    return cli_main(argv, prog=prog)


def entry() -> None:
    """The minagi console command."""
    sys.exit(main(prog="minagi"))


if __name__ == "__main__":
    sys.exit(main())
