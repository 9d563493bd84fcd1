"""minagi as a transformers experts backend: any MoE model whose experts module carries
transformers' `@use_experts_implementation` runs its experts through minagi's grouped dispatch.

    import minagi.hf
    minagi.hf.register()                        # adds the experts implementation "minagi"
    model.set_experts_implementation("minagi")  # or from_pretrained(..., experts_implementation="minagi")

The model routes; the backend reads the experts module's weights and the decorator's flags and
calls `minagi.expert_mlp`:
  - weights stored [E, out, in] (is_transposed False, nn.Linear's layout) are passed as .mT views:
    nothing is copied per call;
  - a gated module whose gate is transformers' default (`act_fn(gate) * up` on the two halves) with
    a SiLU act_fn takes the fused "swiglu" form; GPT-OSS's clamped interleaved gate takes
    "swiglu_oai"; a non-gated module whose act_fn is exact GELU, tanh GELU, SiLU or relu^2 takes
    that form;
  - any other gate or activation (a model's own `_apply_gate`, another act_fn) and a post-expert
    norm go through the same plan and grouped GEMMs with the module's own function between them;
  - expert parallelism's sentinel ids (>= num_experts) add nothing (out_of_range_slots="skip").
Where it cannot honour a module (weights that are neither plain floating tensors of one dtype nor
minagi.quant's, a flag of a newer transformers that it does not know), it warns once, naming the
model and the flag, and runs transformers' grouped_mm instead.

    minagi.hf.quantize(model, bits=4, group_size=32)  # the experts' weights in int4, in place (inference)

`import minagi.hf` works without transformers; `register()` then says how to install it.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass

import torch

from .dispatch import expert_mlp
from .quant import QuantizedWeight
from .quant import quantize as _quantize

NAME = "minagi"
INSTALL = 'pip install --no-build-isolation -e ".[hf]"  (or: pip install "transformers>=5.0")'

# The decorator's flags this backend honours (any other one set on a module means a fallback).
KNOWN_FLAGS = ("is_concatenated", "is_transposed", "has_bias", "has_gate", "has_post_expert_norm")
_warned: set[tuple[str, str]] = set()


def register(name: str = NAME) -> None:
    """Add minagi's experts implementation to transformers under `name` (again: nothing changes)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError("minagi.hf.register() needs transformers 5 or newer (its experts interface): "
                          f"{INSTALL}") from e
    ExpertsInterface.register(name, experts_forward)


@dataclass(frozen=True)
class _Call:
    """How one experts module maps onto expert_mlp."""
    w_in: torch.Tensor  # [E, H, I or 2I]
    w_out: torch.Tensor  # [E, I, H]
    b_in: torch.Tensor | None
    b_out: torch.Tensor | None
    activation: object  # a form's name, or the module's own function
    alpha: float = 1.702
    limit: float = 7.0
    post: object = None


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts implementation: hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]
    -> [T, H] in hidden_states' dtype."""
    call = _call(self)
    if isinstance(call, str):
        _warn_once(self, call)
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    # Each .to() is a dispatched op even where nothing changes: decoding pays for it per layer and
    # token, after its weights have pushed everything else out of the cache.
    dtype = call.w_in.dtype
    x = hidden_states if hidden_states.dtype == dtype else hidden_states.to(dtype)  # autocast: fp32 states
    idx = top_k_index if top_k_index.dtype == torch.long else top_k_index.long()
    skip = "skip" if getattr(self, "_is_expert_parallel", False) else "error"
    y = expert_mlp(x, idx, top_k_weights, call.w_in, call.w_out, activation=call.activation, b_in=call.b_in,
                   b_out=call.b_out, alpha=call.alpha, limit=call.limit, post=call.post, out_of_range_slots=skip)
    return y if y.dtype == hidden_states.dtype else y.to(hidden_states.dtype)


def _call(m) -> _Call | str:
    """The module's expert_mlp call, or why it cannot be made ("flag: reason")."""
    unknown = [f for f in _decorator_flags() if f not in KNOWN_FLAGS and getattr(m, f, None)]
    if unknown:
        return f"{unknown[0]}: a flag this version of minagi does not know"
    gated, transposed = getattr(m, "has_gate", True), getattr(m, "is_transposed", False)
    names = ("gate_up_proj" if gated else "up_proj", "down_proj")
    if getattr(m, "has_bias", False):
        names += tuple(f"{n}_bias" for n in names)
    tensors = [getattr(m, n, None) for n in names]
    for i, (n, t) in enumerate(zip(names, tensors)):
        if i < 2 and isinstance(t, QuantizedWeight):  # minagi's own (quantize() below), stored [S, in, out]
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or not t.is_floating_point():
            what = type(t).__name__ if type(t) not in (torch.Tensor, torch.nn.Parameter) else t.dtype
            return f"{n}: a {what}, not a plain floating-point tensor (another library's quantized or sharded weights)"
        if t.dtype != tensors[0].dtype:
            return f"{n}: {t.dtype}, not {names[0]}'s {tensors[0].dtype} (minagi's experts take one dtype)"
    w_in, w_out = (_logical(t, transposed) for t in tensors[:2])
    b_in, b_out = tensors[2:] if len(tensors) == 4 else (None, None)
    post = m.post_expert_norm if getattr(m, "has_post_expert_norm", False) else None
    activation, alpha, limit = _activation(m, gated)
    return _Call(w_in, w_out, b_in, b_out, activation, alpha, limit, post)


def _logical(w, transposed: bool):
    """An experts weight as expert_mlp takes it, [E, in, out]: a QuantizedWeight already is; a
    tensor stored [E, out, in] (nn.Linear's layout) is passed as its .mT view."""
    return w if transposed or isinstance(w, QuantizedWeight) else w.mT


def _is_experts(m) -> bool:
    """A module made by transformers' @use_experts_implementation (its __init__ sets these)."""
    return all(hasattr(m, a) for a in ("has_gate", "is_transposed", "is_concatenated", "_is_expert_parallel"))


@dataclass(frozen=True)
class QuantizeReport:
    """What minagi.hf.quantize converted: modules, weights, and the bytes before and after."""
    modules: int
    weights: int
    bytes_before: int
    bytes_after: int
    skipped: tuple[str, ...] = ()

    def __str__(self) -> str:
        saved = self.bytes_before - self.bytes_after
        line = (f"minagi.hf.quantize: {self.weights} expert weights in {self.modules} experts modules, "
                f"{self.bytes_before / 2**20:,.1f} MiB -> {self.bytes_after / 2**20:,.1f} MiB "
                f"({saved / 2**20:,.1f} MiB saved); attention and dense layers untouched")
        return line + "".join(f"\n  left as they were: {s}" for s in self.skipped)


def quantize(model: torch.nn.Module, bits: int = 8, group_size: int | None = None,
             scale_dtype: torch.dtype = torch.bfloat16, verbose: bool = True) -> QuantizeReport:
    """Quantize every experts module's expert weights in place (minagi.moe.quant: int8 per output
    channel, or int4 in groups of group_size inputs), and set the model's experts implementation
    to "minagi", the one that runs them. Biases, routers, attention and dense layers are left to
    the user's quantizer of choice. Inference only. Quantize after moving the model to its
    device: the quantized weights are plain attributes, not parameters, so model.to() and
    state_dict() do not see them (each has its own .to(); torch.save stores it).
    Returns (and with verbose, prints) what it converted and the bytes saved."""
    modules = weights = before = after = 0
    skipped = []
    for name, m in model.named_modules():
        if not _is_experts(m):
            continue
        names = ("gate_up_proj" if getattr(m, "has_gate", True) else "up_proj", "down_proj")
        done = 0
        for n in names:
            w = getattr(m, n, None)
            if isinstance(w, QuantizedWeight):
                continue
            if type(w) not in (torch.Tensor, torch.nn.Parameter) or not w.is_floating_point():
                skipped.append(f"{name}.{n} ({type(w).__name__})")
                continue
            qw = _quantize(_logical(w.detach(), m.is_transposed), bits=bits, group_size=group_size,
                           scale_dtype=scale_dtype)
            before, after, done = before + w.nbytes, after + qw.nbytes, done + 1
            if n in m._parameters:
                del m._parameters[n]
            setattr(m, n, qw)
        modules, weights = modules + (done > 0), weights + done
    if weights and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(NAME)
    report = QuantizeReport(modules, weights, before, after, tuple(skipped))
    if verbose:
        print(report)
    return report


def _activation(m, gated: bool):
    """The fused form matching the module's gate or act_fn, else the module's own function."""
    act = getattr(m, "act_fn", None)
    if gated:
        gate = type(m)._apply_gate
        if gate is _default_gate() and _plain_activation(act) == "silu":
            return "swiglu", 1.702, 7.0
        if gate is _gpt_oss_gate():
            return "swiglu_oai", float(m.alpha), float(m.limit)
        return m._apply_gate, 1.702, 7.0
    return _plain_activation(act) or act, 1.702, 7.0


def _plain_activation(act) -> str | None:
    """The form whose math an act_fn module computes exactly, by its type (not a subclass, which
    may compute something else)."""
    A = _activations()
    kind = type(act)
    if kind in (A.SiLUActivation, torch.nn.SiLU):
        return "silu"
    if kind is A.GELUActivation and act.act is torch.nn.functional.gelu:
        return "gelu"
    if kind is torch.nn.GELU:
        return {"none": "gelu", "tanh": "gelu_tanh"}[act.approximate]
    if kind is A.GELUTanh and isinstance(act.act, functools.partial):
        return "gelu_tanh"
    if kind is A.ReLUSquaredActivation:
        return "relu2"
    return None


_FOUND: dict = {}


def _found_once(fn):
    """fn() the first time, its result after: a plain dict, which torch.compile reads as it is
    (it warns at functools' caches, which it traces through)."""
    def once():
        if fn not in _FOUND:
            _FOUND[fn] = fn()
        return _FOUND[fn]
    once.__doc__ = fn.__doc__
    return once


@_found_once
def _activations():
    """transformers.activations, found once: every decode call asks which form its act_fn is."""
    from transformers import activations

    return activations


@_found_once
def _default_gate():
    from transformers.integrations.moe import _default_apply_gate

    return _default_apply_gate


@_found_once
def _gpt_oss_gate():
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return None
    return GptOssExperts._apply_gate


@_found_once
def _decorator_flags() -> tuple[str, ...]:
    """The flags of the installed transformers' @use_experts_implementation."""
    from transformers.integrations.moe import use_experts_implementation

    params = inspect.signature(use_experts_implementation).parameters
    return tuple(p for p in params if p not in ("experts_class", "experts_interface"))


def _warn_once(m, why: str) -> None:
    model = getattr(getattr(m, "config", None), "model_type", None) or "?"
    key = (f"{model}.{type(m).__name__}", why)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"minagi experts backend: {type(m).__name__} of the {model!r} model runs on transformers' "
                  f"grouped_mm instead: {why}", stacklevel=3)
