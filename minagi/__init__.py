"""minagi: grouped mixture-of-experts dispatch (the library, minagi.moe) and a byte-level language
model on a pool of expert MLPs built with it (the application, minagi.lm).

Importing minagi loads its compiled extension (minagi._C) when it is built, and otherwise says
once why it runs on the pure-torch ops. Nothing here touches a device. `minagi.hf` is the library's
transformers backend (minagi.moe.hf) and `minagi.quant` its quantized weights (minagi.moe.quant)
under their public names.
"""
import sys

from .moe import _backend, hf, quant
from .moe.dispatch import PATHS, DispatchStats, expert_mlp

__version__ = "0.1.0"
__all__ = ["DispatchStats", "PATHS", "PooledMLP", "expert_mlp", "extension_loaded", "__version__"]

# `import minagi.hf` and `import minagi.quant` are the library's modules themselves, not copies.
sys.modules[__name__ + ".hf"] = hf
sys.modules[__name__ + ".quant"] = quant
_backend.state()


def extension_loaded() -> bool:
    """Whether the compiled ops (torch.ops.minagi.*) are registered."""
    return _backend.loaded()


def __getattr__(name: str):
    # The byte model's pool loads only when asked for: a library user never imports the application.
    if name == "PooledMLP":
        from .lm.pool import PooledMLP

        return PooledMLP
    raise AttributeError(f"module 'minagi' has no attribute {name!r}")
