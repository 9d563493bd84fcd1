"""minagi.moe: the mixture-of-experts library. expert_mlp (dispatch.py) runs a pool of expert MLPs
over routed tokens as a short pipeline of registered ops (ops.py, with their pure-torch twins in
reference.py); hf.py makes it a transformers experts implementation; expert_parallel.py splits the
experts over processes. It imports nothing from the byte model (minagi.lm)."""
from .dispatch import PATHS, DispatchStats, expert_mlp

__all__ = ["DispatchStats", "PATHS", "expert_mlp"]
