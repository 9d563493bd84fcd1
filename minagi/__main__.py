"""python -m minagi doctor | bench ...

doctor: what this install runs on: torch, build flavour, whether minagi._C loaded (and why not),
which ops have CPU / GPU kernels, threads.
"""
from __future__ import annotations

import os
import sys


def doctor() -> int:
    import torch

    from . import _backend, allocator

    flavour = "rocm" if getattr(torch.version, "hip", None) else "cuda" if torch.version.cuda else "cpu"
    st = _backend.state()
    lines = [
        f"torch            {torch.__version__} ({flavour} build)",
        f"python           {sys.version.split()[0]}",
        f"extension        {'loaded' if st.loaded else 'NOT loaded: ' + st.reason}",
    ]
    if st.loaded:
        lines.append(f"  build          {torch.ops.minagi.build_info()}")
        for op in _backend.OP_NAMES:
            kernels = [k for k in ("cpu", "cuda") if _backend.has_kernel(op, k)]
            lines.append(f"  minagi::{op:<18} {', '.join(kernels) or 'none'}")
    gpu = "none visible"
    if torch.cuda.is_available():  # only here, on request: import never touches a device
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    lines += [
        f"GPU              {gpu}",
        f"threads          torch {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
        f"parallel         {torch.__config__.parallel_info().splitlines()[-1].strip()}",
        f"allocator        {allocator.describe()}; for training, MINAGI_ALLOCATOR=jemalloc "
        f"({allocator.find('jemalloc') or 'not found'}) or tcmalloc ({allocator.find('tcmalloc') or 'not found'})",
        f"dispatch (auto)  {'compiled' if st.loaded else 'grouped (pure torch)'}",
        f"env              MINAGI_DISABLE_EXT={os.environ.get('MINAGI_DISABLE_EXT', '')!s} "
        f"MINAGI_REQUIRE_EXT={os.environ.get('MINAGI_REQUIRE_EXT', '')!s}",
    ]
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        return doctor()
    if argv[:1] == ["bench"]:
        from .bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    print("usage: python -m minagi doctor | bench <benchmark> [options]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
