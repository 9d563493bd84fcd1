"""What faulting in fresh memory costs on this machine: a 134 MiB tensor made and filled, against
the same fill of a kept buffer (ms, median of 7). A training step's weight gradients are fresh
memory under zero_grad(set_to_none=True); run it under THP_MEM_ALLOC_ENABLE=1 (2 MiB pages) or
glibc's MALLOC_MMAP_MAX_=0 to compare (docs/transformers.md, "The floor").

    python tools/fresh_memory_probe.py [MiB]
"""
import statistics
import sys
import time

import torch


def median_ms(fn, n: int = 7) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    n = int(float(sys.argv[1]) if len(sys.argv) > 1 else 134) * 2**20 // 4
    kept = torch.zeros(n)
    print(f"fresh: torch.empty + fill_, {n * 4 / 2**20:.0f} MiB: {median_ms(lambda: torch.empty(n).fill_(1.0)):.1f} ms")
    print(f"kept:  fill_ of a buffer made once:       {median_ms(lambda: kept.fill_(1.0)):.1f} ms")


if __name__ == "__main__":
    main()
