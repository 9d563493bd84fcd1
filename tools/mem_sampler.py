"""Watch a process's memory from outside, into a CSV: one row every --every seconds (30 by
default) until the process exits or Ctrl-C.

    python tools/mem_sampler.py PID --out mem.csv [--every 30] [--count N]

Columns (shared with tools/gpu_mem_sampler.ps1): time_utc, elapsed_s, pid, rss_bytes,
gpu_dedicated_bytes, gpu_shared_bytes, device_allocated_bytes, device_reserved_bytes. Resident
memory is always there (Linux /proc; Windows and macOS through psutil); GPU memory held by the
PID where the driver says (NVIDIA with pynvml); the caching allocator's allocated / reserved
bytes only from inside the process: use minagi.lm.memory.MemSampler there. On Windows,
tools/gpu_mem_sampler.ps1 adds dedicated and shared GPU memory from the performance counters.
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/mem_sampler.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pid", type=int, help="the process to watch")
    p.add_argument("--out", default="mem.csv", help="CSV to append to (default mem.csv)")
    p.add_argument("--every", type=float, default=30.0, help="seconds between samples (default 30)")
    p.add_argument("--count", type=int, default=None, help="stop after this many samples")
    a = p.parse_args(argv)
    try:
        from minagi.lm.memory import MemSampler, pid_alive
    except ImportError:
        print("mem_sampler: minagi is not importable; install it first (pip install --no-build-isolation -e .)",
              file=sys.stderr)
        return 2
    if a.every <= 0:
        p.error(f"--every must be > 0 seconds, got {a.every}")
    if not pid_alive(a.pid):
        print(f"mem_sampler: no process with PID {a.pid}", file=sys.stderr)
        return 1
    print(f"mem_sampler: PID {a.pid} every {a.every:g} s into {a.out}; Ctrl-C stops", file=sys.stderr)
    try:
        rows = MemSampler(a.out, a.every, pid=a.pid).run(count=a.count)
    except KeyboardInterrupt:
        print("mem_sampler: stopped", file=sys.stderr)
        return 0
    print(f"mem_sampler: {rows} samples written to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
