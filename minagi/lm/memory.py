"""Memory figures for the history file and the samplers. On CUDA and ROCm the caching
allocator's mem_allocated / mem_reserved / mem_peak (peak allocated); on the CPU the process's
resident memory now (mem_rss) and its peak resident memory (mem_peak): the CPU has no caching
allocator whose figures would say more than the resident set does."""
from __future__ import annotations

import csv
import os
import sys
import threading
import time
from datetime import datetime, timezone

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
    """The history file's memory fields (bytes): GPUs {mem_allocated, mem_reserved, mem_peak};
    the CPU {mem_rss, mem_peak}."""
    if device.type == "cuda":
        return {"mem_allocated": torch.cuda.memory_allocated(device),
                "mem_reserved": torch.cuda.memory_reserved(device),
                "mem_peak": torch.cuda.max_memory_allocated(device)}
    rss = resident_bytes()
    return {"mem_rss": rss, "mem_peak": max(rss, peak_resident_bytes())}


# The samplers' CSV (tools/mem_sampler.py here, tools/gpu_mem_sampler.ps1 on Windows): one
# header, one row per sample; a column a sampler cannot see is left empty.
SAMPLE_FIELDS = ("time_utc", "elapsed_s", "pid", "rss_bytes", "gpu_dedicated_bytes", "gpu_shared_bytes",
                 "device_allocated_bytes", "device_reserved_bytes")


def _nvml_used_bytes(pid: int):
    """GPU memory the driver says this PID holds (NVIDIA, with pynvml installed), else None."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        total = None
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    total = (total or 0) + proc.usedGpuMemory
        return total
    except Exception:
        return None


def sample(pid: int, t0: float) -> dict:
    """One row of the samplers' CSV for `pid`. The caching allocator's figures are only visible
    from inside the process, so they are filled when `pid` is this process and it uses a GPU."""
    row = dict.fromkeys(SAMPLE_FIELDS, "")
    row.update(time_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
               elapsed_s=f"{time.monotonic() - t0:.1f}", pid=pid, rss_bytes=resident_bytes(pid))
    used = _nvml_used_bytes(pid)
    if used is not None:
        row["gpu_dedicated_bytes"] = used
    if pid == os.getpid() and torch.cuda.is_initialized():
        row["device_allocated_bytes"] = torch.cuda.memory_allocated()
        row["device_reserved_bytes"] = torch.cuda.memory_reserved()
    return row


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
        except (OSError, IndexError):
            return False
    try:
        import psutil

        return psutil.pid_exists(pid)
    except ImportError:
        return True  # no way to tell: sample until stopped


class MemSampler:
    """Appends a sample of `pid` (this process by default) to a CSV every `every` seconds, from a
    daemon thread, until stop() or the process exits. Inside a training script it also records
    the caching allocator's allocated and reserved bytes:

        sampler = MemSampler("mem.csv", every=30).start()
        ...
        sampler.stop()
    """

    def __init__(self, path, every: float = 30.0, pid: int | None = None):
        if every <= 0:
            raise ValueError(f"MemSampler: every must be > 0 seconds, got {every}")
        self.path, self.every, self.pid = str(path), float(every), pid or os.getpid()
        self._stop = threading.Event()
        self._thread = None

    def _header(self, f) -> None:
        f.write(f"# mem_sampler: pid {self.pid} every {self.every:g} s. start: python tools/mem_sampler.py "
                f"{self.pid} --out {self.path} (or MemSampler in-process); stop: Ctrl-C, or it stops when "
                "the process exits\n")
        csv.writer(f).writerow(SAMPLE_FIELDS)

    def run(self, count: int | None = None) -> int:
        """Sample in this thread until stopped, the process exits or `count` rows; returns rows."""
        t0, rows = time.monotonic(), 0
        new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        with open(self.path, "a", newline="") as f:
            if new:
                self._header(f)
            writer = csv.DictWriter(f, SAMPLE_FIELDS)
            while pid_alive(self.pid) and (count is None or rows < count):
                writer.writerow(sample(self.pid, t0))
                f.flush()
                rows += 1
                if (count is not None and rows >= count) or self._stop.wait(self.every):
                    break
        return rows

    def start(self) -> "MemSampler":
        self._thread = threading.Thread(target=self.run, name="minagi-mem-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
