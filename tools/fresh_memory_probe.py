"""What faulting in fresh memory costs on this machine: a 134 MiB tensor made and filled, against
the same fill of a kept buffer (ms, median of 7). A training step's weight gradients are fresh
memory under zero_grad(set_to_none=True); run it under THP_MEM_ALLOC_ENABLE=1 (2 MiB pages) or
glibc's MALLOC_MMAP_MAX_=0 to compare (docs/log/2026-12-05-the-bench-floor.md).

--cycles N: instead, the same tensor made, filled and freed N times, with the page faults of each
fill and the size of glibc's heap after it: whether freed memory is found again. --keep first
turns on minagi's cache of large blocks (MINAGI_ALLOCATOR=keep).

    python tools/fresh_memory_probe.py [--mib 134] [--cycles N] [--keep]
"""
import argparse
import resource
import statistics
import time

import torch


def median_ms(fn, n: int = 7) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def heap_mib() -> int:
    with open("/proc/self/maps") as f:
        for line in f:
            if "[heap]" in line:
                lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                return (hi - lo) >> 20
    return 0


def cycles(n: int, count: int) -> None:
    for i in range(count):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(n)
        t.fill_(1.0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del t
        print(f"cycle {i}: {faults:,} page faults in the fill; glibc's heap {heap_mib():,} MiB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=134)
    p.add_argument("--cycles", type=int, default=0)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(2)
    if a.keep:
        from minagi import allocator

        if not allocator.keep_freed_memory():
            p.error("--keep: minagi's extension is not loaded")
    n = int(a.mib * 2**20) // 4
    if a.cycles:
        cycles(n, a.cycles)
        return
    kept = torch.zeros(n)
    print(f"fresh: torch.empty + fill_, {n * 4 / 2**20:.0f} MiB: {median_ms(lambda: torch.empty(n).fill_(1.0)):.1f} ms")
    print(f"kept:  fill_ of a buffer made once:       {median_ms(lambda: kept.fill_(1.0)):.1f} ms")


if __name__ == "__main__":
    main()
