"""MINAGI_ALLOCATOR=keep|jemalloc|tcmalloc|system: an optional faster host allocator for training.

The default (system: glibc on Linux) keeps resident memory flat because the model pads its
routing-dependent sizes to _bucket sizes (model.bucket_rows). jemalloc or tcmalloc return freed
memory to the system on their own and need no such care; asking for one makes the train command
re-execute itself once with the library in LD_PRELOAD (an allocator cannot be swapped inside a
running process), then check that it really is loaded. A library that is not there is one line
on stderr, and the run goes on with the system allocator.

MINAGI_ALLOCATOR_LIB=PATH names the library file instead of looking in the usual folders.

keep (no library, no re-execution; needs minagi's extension): minagi's cache of large blocks
(csrc/cpu/block_cache.cpp) becomes torch's CPU allocator. A tensor of 1 MiB or more made again
(an activation, a weight gradient: every step) reuses a block already faulted in instead of a
fresh mapping that the kernel zeroes page by page. Library users call keep_freed_memory(). Idle
blocks are capped (2 GiB by default); resident memory stays near its high-water mark.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

CHOICES = ("system", "keep", "jemalloc", "tcmalloc")
# File names, most specific first: Debian's libjemalloc2 and libtcmalloc-minimal4 packages.
LIBRARIES = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so"),
}
PACKAGES = {"jemalloc": "libjemalloc2", "tcmalloc": "libtcmalloc-minimal4"}
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
            "/usr/local/lib", "/opt/homebrew/lib")
# jemalloc as measured for this project: return memory eagerly, purge from a background thread.
JEMALLOC_CONF = "oversize_threshold:1,background_thread:true,metadata_thp:auto"
_REEXEC = "MINAGI_ALLOCATOR_REEXEC"  # set in the re-executed process: never loop
KEEP_MAX_IDLE = 2 << 30  # bytes of idle blocks keep_freed_memory() holds by default
_kept = False


class HeapTrim:
    """glibc's malloc_trim(0) every `every` steps (0 = never; only with the system allocator on
    glibc): it hands the free pages inside the heap back to the system. Between trims the heap
    may grow again; a trim bounds how far."""

    def __init__(self, every: int):
        self.every, self._trim = every, None
        if every and loaded() == "system" and sys.platform.startswith("linux"):
            try:
                self._trim = ctypes.CDLL("libc.so.6").malloc_trim
            except (OSError, AttributeError):  # not glibc (musl): nothing to trim
                self._trim = None

    def __call__(self, step: int) -> None:
        if self._trim is not None and step % self.every == 0:
            self._trim(0)


def keep_freed_memory(max_idle_bytes: int = KEEP_MAX_IDLE) -> bool:
    """Make minagi's cache of large blocks torch's CPU allocator (see the module's docstring), or
    set its cap on idle bytes again. Call it before the work starts: it is process-wide, for the
    process's life (tensors made before keep their own allocator). 0 keeps nothing from then on
    and hands the idle blocks back; before the cache is installed, 0 installs nothing. Returns
    whether the cache is installed: False, changing nothing, where minagi's extension is not
    loaded, has no cache on this system or predates it, or torch keeps another CPU allocator."""
    global _kept
    if max_idle_bytes < 0:
        raise ValueError(f"keep_freed_memory: max_idle_bytes must be >= 0, got {max_idle_bytes}")
    import torch

    from ..moe import _backend

    if not _backend.loaded() or not hasattr(torch.ops.minagi, "cpu_block_cache"):
        return False
    try:
        _kept = bool(torch.ops.minagi.cpu_block_cache(int(max_idle_bytes))[0])
    except RuntimeError:  # torch keeps a CPU allocator of higher priority: nothing changed
        return False
    return _kept


def keeping() -> bool:
    """Whether keep_freed_memory() took effect in this process."""
    return _kept


def keep_stats() -> dict:
    """The cache's figures: idle_bytes, reused (blocks handed out again), mapped (blocks made);
    zeros where it is not installed."""
    import torch

    if not _kept:
        return {"idle_bytes": 0, "reused": 0, "mapped": 0}
    _, idle, reused, mapped = torch.ops.minagi.cpu_block_cache(-1)
    return {"idle_bytes": idle, "reused": reused, "mapped": mapped}


class AllocatorError(ValueError):
    """MINAGI_ALLOCATOR holds a value that is not an allocator minagi knows."""


def requested() -> str:
    value = os.environ.get("MINAGI_ALLOCATOR", "").strip().lower() or "system"
    if value not in CHOICES:
        raise AllocatorError(f"MINAGI_ALLOCATOR={os.environ['MINAGI_ALLOCATOR']!r}: use one of {', '.join(CHOICES)}")
    return value


def find(name: str) -> str | None:
    """Path of the named allocator's library, or None."""
    explicit = os.environ.get("MINAGI_ALLOCATOR_LIB", "").strip()
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for folder in LIB_DIRS:
        for lib in LIBRARIES[name]:
            if (Path(folder) / lib).is_file():
                return str(Path(folder) / lib)
    found = ctypes.util.find_library(name if name == "jemalloc" else "tcmalloc_minimal")
    return found or None  # a soname: the dynamic loader finds it in its own paths


def loaded() -> str:
    """The allocator in this process: jemalloc or tcmalloc when mapped in, else system."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    for name in ("jemalloc", "tcmalloc"):
        if f"lib{name}" in maps:
            return name
    return "system"


def describe() -> str:
    """For the startup line and doctor: the allocator in use, and what was asked for if it differs."""
    have = loaded()
    try:
        want = requested()
    except AllocatorError:
        want = "invalid"
    name = "system (glibc)" if have == "system" and sys.platform.startswith("linux") else have
    if want not in (have, "system") and not (want == "keep" and _kept):
        return f"{name} (MINAGI_ALLOCATOR={want} is not in effect in this process)"
    return f"{name} with minagi's block cache (keep)" if _kept else name


def ensure() -> None:
    """Re-execute this command once with the requested allocator preloaded (Linux only); on any
    obstacle say so in one line and go on with the system allocator."""
    want = requested()
    tag = f"minagi: MINAGI_ALLOCATOR={want}:"
    if want == "keep":
        if not keep_freed_memory():
            from ..moe import _backend

            why = _backend.state().reason or "no block cache in this build or on this system"
            print(f"{tag} needs minagi's extension ({why}); using the system allocator", file=sys.stderr)
        return
    if want == "system" or loaded() == want:
        return
    if not sys.platform.startswith("linux"):
        print(f"{tag} preloading works on Linux only; using the system allocator", file=sys.stderr)
        return
    if os.environ.get(_REEXEC):
        print(f"{tag} preloaded {os.environ.get('LD_PRELOAD', '')} but it is not in the process; "
              "using the system allocator", file=sys.stderr)
        return
    path = find(want)
    if path is None:
        where = os.environ.get("MINAGI_ALLOCATOR_LIB") or f"{LIBRARIES[want][0]} in {', '.join(LIB_DIRS[:2])}"
        print(f"{tag} {where} not found (Debian/Ubuntu: apt-get install {PACKAGES[want]}); "
              "using the system allocator", file=sys.stderr)
        return
    env = dict(os.environ, **{_REEXEC: "1"})
    env["LD_PRELOAD"] = ":".join(p for p in (path, os.environ.get("LD_PRELOAD", "")) if p)
    if want == "jemalloc":
        env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]
    from .guard import early_signal

    if early_signal():  # caught by train.py's keeper while torch loaded: the new process keeps it
        env["MINAGI_EARLY_SIGNAL"] = str(int(early_signal()))
    os.execve(sys.executable, argv, env)
