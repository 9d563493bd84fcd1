"""Memory figures for the history file and the samplers: allocated / reserved / peak device
memory from torch.cuda on CUDA and ROCm; on the CPU the process's resident and peak resident
memory (allocated = reserved = resident there: the CPU allocator reserves nothing of its own)."""
from __future__ import annotations

import os
import sys

import torch


def resident_bytes(pid: int | None = None) -> int:
    """Resident set size of a process (this one by default), 0 where the OS does not say."""
    pid = pid or os.getpid()
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # optional: Windows and macOS

        return psutil.Process(pid).memory_info().rss
    except Exception:
        return 0


def peak_resident_bytes() -> int:
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux
    except ImportError:
        try:
            import psutil

            return psutil.Process().memory_info().peak_wset  # Windows
        except Exception:
            return 0


def memory_stats(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"mem_allocated": torch.cuda.memory_allocated(device),
                "mem_reserved": torch.cuda.memory_reserved(device),
                "mem_peak": torch.cuda.max_memory_allocated(device)}
    rss = resident_bytes()
    return {"mem_allocated": rss, "mem_reserved": rss, "mem_peak": max(rss, peak_resident_bytes())}
