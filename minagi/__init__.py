"""minagi: a byte-level language model on a pool of expert MLPs, with grouped expert dispatch.

Importing minagi loads its compiled extension (minagi._C) when it is built, and otherwise says
once why it runs on the pure-torch ops. Nothing here touches a device.
"""
from . import _backend
from .dispatch import PATHS, DispatchStats, expert_mlp
from .pool import PooledMLP

__version__ = "0.1.0"
__all__ = ["DispatchStats", "PATHS", "PooledMLP", "expert_mlp", "extension_loaded", "__version__"]

_backend.state()


def extension_loaded() -> bool:
    """Whether the compiled ops (torch.ops.minagi.*) are registered."""
    return _backend.loaded()
