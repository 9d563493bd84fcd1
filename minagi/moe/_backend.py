"""Loads the compiled extension minagi._C once and remembers why it did not load.

MINAGI_DISABLE_EXT=1 forces the pure-torch ops; MINAGI_REQUIRE_EXT=1 makes a missing or broken
extension an error. Loading registers the ops (torch.ops.minagi.*); it touches no device.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import struct
from importlib import metadata
from pathlib import Path
import warnings
from dataclasses import dataclass

OP_NAMES = (
    "routing",
    "routing_backward",
    "group_plan",
    "bucketed_gather",
    "weighted_scatter",
    "gate_grad",
    "grouped_mm",
    "grouped_mm_wgrad",
    "grouped_mm_act",
    "expert_act_backward",
)
# Ops with CPU kernels only (the fused ones, and the quantized grouped GEMM): used where they have
# a kernel for the device, the ops above elsewhere (where they compute the same: qgrouped_mm's twin
# dequantizes and runs grouped_mm); a build without them loses nothing but speed.
FUSED_OP_NAMES = ("scatter_mm_backward", "grouped_mm_scatter", "gather_mm_act", "decode_experts", "qgrouped_mm",
                  "qdecode_experts")


class ExtensionFallbackWarning(UserWarning):
    """minagi._C could not be loaded; minagi runs on its pure-torch ops."""


@dataclass(frozen=True)
class BackendState:
    loaded: bool
    reason: str  # why it is not loaded ("" when loaded)


_STATE: BackendState | None = None


def _flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={os.environ[name]!r}: use 1 or 0")


def _try_load() -> BackendState:
    if _flag("MINAGI_DISABLE_EXT"):
        if _flag("MINAGI_REQUIRE_EXT"):
            raise RuntimeError("MINAGI_DISABLE_EXT=1 and MINAGI_REQUIRE_EXT=1 contradict each other; unset one")
        return BackendState(False, "disabled by MINAGI_DISABLE_EXT=1")
    try:
        import torch  # noqa: F401  (the extension links against torch's libraries)

        importlib.import_module("minagi._C")
    except ImportError as exc:
        shadowed = installed_build_elsewhere()
        if shadowed is not None:
            here = Path(__file__).resolve().parent
            return BackendState(False, f"minagi._C did not load ({exc}): the minagi imported here is {here} "
                                       f"(a source tree without a working build), which shadows the installed build in {shadowed.parent}; "
                                       "run from another directory, or build this tree with "
                                       "`pip install --no-build-isolation -e .`")
        return BackendState(False, f"minagi._C did not load ({exc}); rebuild with "
                                   "`pip install --no-build-isolation -e .`")
    except OSError as exc:  # a stale build against another torch: undefined symbols
        return BackendState(False, f"minagi._C is broken ({exc}); rebuild it against this torch "
                                   "with `pip install --no-build-isolation -e .`")
    global _BUILD_ID  # the code now loaded, before a rebuild in place can change the file
    _BUILD_ID = "extension " + code_digest(Path(importlib.import_module("minagi._C").__file__))
    return BackendState(True, "")


def installed_build_elsewhere() -> Path | None:
    """The compiled extension of an installed minagi distribution, when the minagi package
    imported is another copy (a checkout on sys.path ahead of site-packages), else None."""
    try:
        dist = metadata.distribution("minagi")
    except Exception:  # not installed, or metadata unreadable
        return None
    here = Path(__file__).resolve().parent
    for f in dist.files or ():
        if len(f.parts) == 2 and f.parts[0] == "minagi" and f.name.startswith("_C.") and f.suffix in (".so", ".pyd"):
            path = Path(dist.locate_file(f)).resolve()
            if path.exists() and path.parent != here:
                return path
    return None


def state() -> BackendState:
    """The extension's state, loading it on the first call."""
    global _STATE
    if _STATE is None:
        _STATE = _try_load()
        if not _STATE.loaded:
            if _flag("MINAGI_REQUIRE_EXT"):
                raise RuntimeError(f"MINAGI_REQUIRE_EXT=1 but {_STATE.reason}")
            if not _flag("MINAGI_DISABLE_EXT"):
                warnings.warn(f"minagi: {_STATE.reason}; running on the pure-torch ops",
                              ExtensionFallbackWarning, stacklevel=3)
    return _STATE


def loaded() -> bool:
    return state().loaded


_BUILD_ID: str | None = None


def build_id() -> str:
    """What computes the ops in this process: "extension <digest of minagi._C's code>", taken as
    it loads (a rebuild in place while the process runs changes the file, not the code already
    loaded), or "pure-torch"."""
    return (_BUILD_ID or "extension (no digest)") if loaded() else "pure-torch"


def code_digest(path: Path) -> str:
    """A digest of what a shared library loads: its ELF sections that are mapped into memory,
    less the build-id note. Its debug information and build-id name the build's directory, so
    two builds of the same sources with the same compiler (`pip install -e .` twice) differ as
    files but not as code. A file that is not 64-bit little-endian ELF is digested whole."""
    data = path.read_bytes()
    if data[:6] == b"\x7fELF\x02\x01":
        try:
            return _elf_code_digest(data)
        except (struct.error, IndexError, ValueError):  # no or damaged section headers
            pass
    return hashlib.sha256(data).hexdigest()[:16]


def _elf_code_digest(data: bytes) -> str:
    h = hashlib.sha256(b"elf-code ")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]  # sh_offset of the section-name table
    for name_off, kind, flags, _addr, offset, size in sections:
        name = data[names_at + name_off:data.index(b"\0", names_at + name_off)]
        if flags & 0x2 and kind != 8 and name != b".note.gnu.build-id":  # SHF_ALLOC, not SHT_NOBITS
            if offset + size > len(data):
                raise ValueError("section past the end of the file")
            h.update(struct.pack("<QQ", len(name), size) + name + data[offset:offset + size])
    return h.hexdigest()[:16]


def has_kernel(op: str, device_type: str) -> bool:
    """Whether minagi::op has a compiled kernel for this device type ('cpu' or 'cuda')."""
    if not loaded():
        return False
    import torch

    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None or not hasattr(torch.ops.minagi, op):  # a build from before the op has no schema for it
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"minagi::{op}", key)
