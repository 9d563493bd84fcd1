"""expert_mlp: the one expert computation every caller uses, and its dispatch paths.

    y[n] = sum_j gates[n, j] * (act(x[n] @ w_in[s] + b_in[s]) @ w_out[s] + b_out[s]),   s = slot_idx[n, j]

act is one of the expert forms (reference.ACTIVATIONS): gelu (the default), gelu_tanh, silu,
relu2, or the gated swiglu, swiglu_interleaved and GPT-OSS's swiglu_oai, whose w_in is [S, d, 2h]
(gate and up). The biases are optional. act may also be any callable [rows, h_in] -> [rows, h] (a
model's own gate, such as transformers' _apply_gate): the same plan and grouped GEMMs, with the
callable between them instead of the fused activation. post (optional) maps each pair's expert
output (b_out included) before its gate, such as a post-expert norm. w_in and w_out may be
QuantizedWeights (minagi/moe/quant.py, int8 or int4): each GEMM with one is qgrouped_mm, which
dequantizes in registers or in a cache-sized tile (inference: no weight gradient).

Paths:
  rectangle  every slot padded to the busiest slot's load, one bmm: the seed's old dispatch,
             kept as the reference (S x max_load rows for N x K routed pairs).
  grouped    the seed's grouped dispatch in pure torch: slots grouped by _bucket(load), one pair
             of bmms per group at the group's capacity, weights gathered once per call.
  compiled   the same pipeline of ops from the extension (minagi._C), on an exact plan: each
             slot's row range multiplied (no padding), every size from the input's shapes, nothing
             read on the host, GPUs included (docs/dispatch.md, "How a call runs").
  auto       compiled when the extension has kernels for the input's device, else grouped.

A handful of characters (writing: one per stream) skips the plan: on the CPU's compiled path,
where no gradient is wanted and there is no callable activation, post or skip, the whole call is
one op (decode_experts; qdecode_experts where both weights are quantized); on a GPU and on the
twins each (character, k) pair is a one-row range of its slot. Under torch.compile with a symbolic
N the general pipeline serves every N.

Legend: N characters, K top_k, S card slots, D model width, H expert width, E buffer rows.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import ops as _ops
from . import reference
from .quant import QuantizedWeight
from .reference import ACTIVATIONS, GATED
from .reference import bucket as _bucket  # noqa: F401  (the seed's name for it)

PATHS = ("auto", "rectangle", "grouped", "compiled")
OUT_OF_RANGE = ("error", "skip")


CALLABLE = "callable"  # Form.activation when the activation is the caller's own function


@dataclass(frozen=True)
class Form:
    """An expert form: the activation and swiglu_oai's alpha and limit; or the caller's own
    activation fn (activation == CALLABLE), which no kernel fuses."""
    activation: str = "gelu"
    alpha: float = 1.702
    limit: float = 7.0
    fn: Callable | None = None

    @classmethod
    def of(cls, activation, alpha, limit) -> Form:
        if callable(activation):
            return cls(CALLABLE, fn=activation)
        return cls(activation, float(alpha), float(limit))

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    def act(self, h):
        if self.fn is None:
            return reference.activate(h, self.activation, self.alpha, self.limit)
        a = self.fn(h)
        if not isinstance(a, torch.Tensor) or a.shape[:-1] != h.shape[:-1]:
            raise ValueError(f"expert_mlp: the activation {self.fn!r} must map h {tuple(h.shape)} to [.., h] with "
                             f"the same leading shape, got {tuple(a.shape) if isinstance(a, torch.Tensor) else a!r}")
        return a


class _Read:
    """A statistic held as given (a tensor, or a callable that makes a value) and read when first
    asked for: one copy from the device then, none on the call's path."""

    def __set_name__(self, owner, name):
        self.key = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = obj.__dict__[self.key]
        if callable(value):
            value = value()
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        obj.__dict__[self.key] = value
        return value

    def __set__(self, obj, value):
        obj.__dict__[self.key] = value


class DispatchStats:
    """The statistics of a call. Each field may be given as a tensor (on the call's device) or a
    callable; it is read (one copy) when first asked for, so a call that returns statistics
    synchronises nothing."""
    routed_pairs = _Read()  # N * K, the real characters' (padding rows count nowhere)
    dropped_pairs = _Read()  # pairs past a slot's capacity
    executed_rows = _Read()  # rows multiplied, padding included
    groups = _Read()  # batched-matmul groups (1 for the rectangle)
    max_load_ratio = _Read()  # busiest slot's routed load / fair share N * K / S
    slot_load = _Read()  # routed pairs per slot (before the cap)

    def __init__(self, routed_pairs, dropped_pairs, executed_rows, groups, max_load_ratio, top_k: int = 1,
                 capacity: int = 0, slot_load=(), chars: int = -1):
        self.routed_pairs, self.dropped_pairs, self.executed_rows = routed_pairs, dropped_pairs, executed_rows
        self.groups, self.max_load_ratio = groups, max_load_ratio
        self.top_k = top_k
        self.capacity = capacity  # pairs a slot may keep (0 = uncapped)
        self.slot_load = slot_load if isinstance(slot_load, torch.Tensor) else list(slot_load)
        self.chars = chars  # characters of the call (-1: routed_pairs / top_k, as when no pair is skipped)

    FIELDS = ("routed_pairs", "dropped_pairs", "executed_rows", "groups", "max_load_ratio", "top_k", "capacity",
              "slot_load", "chars")

    def __repr__(self) -> str:
        return "DispatchStats(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in self.FIELDS) + ")"

    def __eq__(self, other) -> bool:
        return isinstance(other, DispatchStats) and all(getattr(self, f) == getattr(other, f) for f in self.FIELDS)

    @property
    def executed_ratio(self) -> float:
        """executed rows / routed pairs: 1.0 is no padding, ~15 is the seed's sink rectangle."""
        return self.executed_rows / self.routed_pairs if self.routed_pairs else 0.0

    @property
    def n_chars(self) -> int:
        if self.chars >= 0:
            return self.chars
        return self.routed_pairs // self.top_k if self.top_k else 0

    @property
    def sink_share(self) -> float:
        """The busiest slot's characters over all characters (a slot takes a character once):
        top_k / S when uniform, 1.0 when every character picks it."""
        return float(sink_share_of(self.peek("slot_load"), self.n_chars))

    @property
    def load_entropy(self) -> float:
        """Entropy of the load over the slots, over log(S): 1 = uniform, 0 = one slot."""
        return float(load_entropy_of(self.peek("slot_load")))

    def peek(self, name: str):
        """A field as held: a tensor stays where it is (nothing is read), a callable is made. The
        trainer sums these on the device and reads the sums when it writes a record."""
        value = self.__dict__["_" + name] if "_" + name in self.__dict__ else getattr(self, name)
        if callable(value):
            value = self.__dict__["_" + name] = value()
        return value

    @property
    def dead_slots(self) -> int:
        return sum(1 for c in self.slot_load if c == 0)

    @property
    def rectangle_rows(self) -> int:
        """Rows the rectangle dispatch would multiply for this call: every slot at the busiest
        slot's kept load."""
        top = max(self.slot_load, default=0)
        return len(self.slot_load) * (min(top, self.capacity) if self.capacity else top)

    def as_dict(self) -> dict:
        return {**{f: getattr(self, f) for f in self.FIELDS}, "executed_ratio": self.executed_ratio}


def sink_share_of(slot_load, n_chars: int) -> torch.Tensor:
    """max(load) / characters, as a float64 tensor where the load is (0 without load)."""
    load = torch.as_tensor(slot_load, dtype=torch.float64)
    if not n_chars or load.numel() == 0:
        return load.new_zeros(())
    return load.max() / n_chars


def load_entropy_of(slot_load) -> torch.Tensor:
    """The load's entropy over log(S), as a float64 tensor where the load is: 1 = uniform, 0 = one
    slot (and 0 without load or with one slot)."""
    load = torch.as_tensor(slot_load, dtype=torch.float64)
    S = load.numel()
    if S < 2:
        return load.new_zeros(())
    p = load / load.sum().clamp(min=1)
    return -torch.where(p > 0, p * p.clamp(min=1e-300).log(), 0).sum() / math.log(S)


def capacity(capacity_factor: float, n_chars: int, top_k: int, n_slots: int) -> int:
    """Pairs a slot may keep: ceil(c * N * K / S); 0 means uncapped."""
    # Plain comparisons (not math.isfinite): torch.compile traces them on a symbolic float.
    if not (isinstance(capacity_factor, (int, float)) and capacity_factor == capacity_factor
            and 0 <= capacity_factor < math.inf):
        raise ValueError(f"capacity_factor must be a finite number >= 0 (0 = uncapped), got {capacity_factor!r}")
    if capacity_factor == 0 or n_chars == 0:
        return 0
    return max(1, math.ceil(capacity_factor * n_chars * top_k / n_slots))


def _check_inputs(x, slot_idx, gates, w_in, w_out, form: Form, b_in, b_out, out_of_range: str) -> None:
    def fail(msg):
        raise ValueError(f"expert_mlp: {msg}")

    for name, t in (("x", x), ("slot_idx", slot_idx), ("gates", gates), ("w_in", w_in), ("w_out", w_out)):
        if not isinstance(t, torch.Tensor) and not (name.startswith("w_") and isinstance(t, QuantizedWeight)):
            raise TypeError(f"expert_mlp: {name} must be a torch.Tensor{' or a QuantizedWeight' if 'w_' in name else ''}"
                            f", got {type(t).__name__}")
        if isinstance(t, QuantizedWeight) and t.requires_grad:
            fail(f"{name} is a QuantizedWeight whose scale requires grad; {_ops.NO_WEIGHT_GRAD}")
    if form.fn is None and form.activation not in ACTIVATIONS:
        fail(f"activation must be one of {', '.join(ACTIVATIONS)} or a callable, got {form.activation!r}")
    if out_of_range not in OUT_OF_RANGE:
        fail(f"out_of_range_slots must be 'error' or 'skip', got {out_of_range!r}")
    if x.dim() != 2:
        fail(f"x must be [N, d], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        fail(f"x must be a floating-point tensor, got {x.dtype}")
    if w_in.dim() != 3 or w_out.dim() != 3:
        fail(f"w_in must be [S, d, h] and w_out [S, h, d], got {tuple(w_in.shape)} and {tuple(w_out.shape)}")
    S, D, H_in = w_in.shape
    if w_in.shape[1] != x.shape[1]:
        fail(f"w_in.shape[1] ({w_in.shape[1]}) must equal x.shape[1] ({x.shape[1]})")
    H = w_out.shape[1]
    if form.gated and H_in != 2 * H:
        fail(f"the gated form {form.activation!r} needs w_in [S, d, 2h] (gate and up) for w_out [S, h, d]: "
             f"w_in's width is {H_in}, w_out's h is {H} (2h = {2 * H})")
    if form.fn is None and not form.gated and H_in != H:
        fail(f"w_out must be [S, h, d] = {(S, H_in, D)} to match w_in {tuple(w_in.shape)} for the form "
             f"{form.activation!r}, got {tuple(w_out.shape)}")
    if tuple(w_out.shape) != (S, H, D):
        fail(f"w_out must be [S, h, d] = {(S, H, D)} to match w_in {tuple(w_in.shape)}, got {tuple(w_out.shape)}")
    for name, b, width in (("b_in", b_in, H_in), ("b_out", b_out, D)):
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (S, width):
            fail(f"{name} must be [S, {'2h' if name == 'b_in' and form.gated else 'h' if name == 'b_in' else 'd'}]"
                 f" = {(S, width)}, got {tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    if slot_idx.dtype != torch.long:
        fail(f"slot_idx must be int64 (torch.long), got {slot_idx.dtype}")
    if slot_idx.dim() != 2 or slot_idx.shape[0] != x.shape[0]:
        fail(f"slot_idx must be [N, k] with N = x.shape[0] = {x.shape[0]}, got {tuple(slot_idx.shape)}")
    if tuple(gates.shape) != tuple(slot_idx.shape):
        fail(f"gates must have slot_idx's shape {tuple(slot_idx.shape)}, got {tuple(gates.shape)}")
    K = slot_idx.shape[1]
    if not 1 <= K <= S and out_of_range == "error":
        fail(f"top_k (slot_idx.shape[1] = {K}) must be in [1, S = {S}]")
    if not gates.is_floating_point():
        fail(f"gates must be a floating-point tensor, got {gates.dtype}")
    for name, t in (("w_in", w_in), ("w_out", w_out), ("b_in", b_in), ("b_out", b_out)):
        if t is not None and t.dtype != x.dtype:
            fail(f"{name} is {t.dtype} but x is {x.dtype}; use one floating dtype")
    for name, t in (("slot_idx", slot_idx), ("gates", gates), ("w_in", w_in), ("w_out", w_out), ("b_in", b_in),
                    ("b_out", b_out)):
        if t is not None and t.device != x.device:
            fail(f"{name} is on {t.device} but x is on {x.device}; move them to one device")
    # The ids' values are checked by the ops that read them (the plan, the decode op; a device
    # assert on GPUs): a check here would read them on the host.


def _rectangle(x_ND, slot_idx_NK, gates_NK, w_in_SDH, w_out_SHD, cap, form: Form, b_in_SH, valid_NK, post):
    """Every slot padded to the busiest slot's (kept) load: one [S, L, D] buffer, one bmm each.
    valid_NK (out_of_range_slots='skip'): pairs outside it are dropped. post: (b_out, fn) applied
    to each pair's output, or None."""
    N, K = slot_idx_NK.shape
    S, D = w_in_SDH.shape[0], x_ND.shape[1]
    if valid_NK is None:
        reference.check_slot_ids(slot_idx_NK, S)
    flat_R = slot_idx_NK.reshape(-1)
    if valid_NK is not None:  # out-of-range ids in a bin of their own past the end, never kept
        flat_R = torch.where(valid_NK.reshape(-1), flat_R, S)
    rank_R, count_S = reference.slot_ranks(flat_R, S + 1)
    load_S = count_S[:S].clamp(max=cap) if cap > 0 else count_S[:S]
    kept_R = rank_R < torch.cat([load_S, load_S.new_zeros(1)])[flat_R]
    L = int(load_S.max()) if N else 0
    char_R = torch.arange(N, device=x_ND.device).repeat_interleave(K)
    slot_k, rank_k, char_k = flat_R[kept_R], rank_R[kept_R], char_R[kept_R]
    buf_SLD = x_ND.new_zeros(S, L, D).index_put((slot_k, rank_k), x_ND[char_k])
    h_SLH = torch.bmm(buf_SLD, w_in_SDH)
    if b_in_SH is not None:
        h_SLH = h_SLH + b_in_SH.unsqueeze(1)
    out_SLD = torch.bmm(form.act(h_SLH), w_out_SHD)
    if post is not None:
        out_SLD = _post(out_SLD, post, lambda b_SD: b_SD.unsqueeze(1))
    picked_RD = out_SLD[slot_k, rank_k] * gates_NK.reshape(-1)[kept_R].unsqueeze(1)
    y_ND = x_ND.new_zeros(N, D).index_add(0, char_k, picked_RD)
    return y_ND, kept_R.view(N, K), S * L


def bucketed_rows(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor shaped like `like`, in an allocation of _bucket(rows) rows (as the
    GPU kernels' outputs are): not a view, so nothing in autograd treats it as one."""
    with torch.no_grad():
        storage = like.new_empty((_bucket(like.shape[0]), *like.shape[1:])).untyped_storage()
        return like.new_empty(0).set_(storage, 0, like.shape)  # contiguous strides


class BucketedAct(torch.autograd.Function):
    """An expert form's activation whose output and input gradient live in _bucket(rows)
    allocations. Between the two grouped GEMMs on a GPU, exact-size activations would show the
    caching allocator one block size per routing, and its reserved memory would keep growing (the
    seed's lesson); the kernels' own outputs are bucketed already."""

    @staticmethod
    def forward(ctx, h, form: Form):
        ctx.save_for_backward(h)
        ctx.form = form
        if form.activation == "gelu":
            return torch.ops.aten.gelu.out(h, out=bucketed_rows(h))
        act = form.act(h)
        return bucketed_rows(act).copy_(act)

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # a double backward: the differentiable ops, through the saved h
            return torch.autograd.grad(ctx.form.act(h), h, grad, create_graph=True)[0], None
        if ctx.form.activation == "gelu":
            return torch.ops.aten.gelu_backward.grad_input(grad.contiguous(), h, grad_input=bucketed_rows(h)), None
        gh, _ = reference.expert_act_backward(grad, h, None, None, *_form_args(ctx.form), 1, False)
        return bucketed_rows(gh).copy_(gh), None


def _form_args(form: Form):
    return form.activation, form.alpha, form.limit


def _mm(ops, a_EI, w_SIO, order_A, rows_A):
    """grouped_mm, or with a QuantizedWeight qgrouped_mm: the device's kernel where it has one,
    else its twin (the weights dequantized, then the device's grouped_mm)."""
    if not isinstance(w_SIO, QuantizedWeight):
        return ops.grouped_mm(a_EI, w_SIO, order_A, rows_A)
    args = (a_EI, w_SIO.q, w_SIO.scale, order_A, rows_A, w_SIO.bits, w_SIO.group)
    if ops is not _ops.REFERENCE and _ops.has_fused("qgrouped_mm", a_EI.device):
        return ops.qgrouped_mm(*args)
    return reference.qgrouped_mm(*args, ops=ops)


def _gemm_bias(ops, buf_ED, w_in_SDH, b_in_SH, order_A, rows_A):
    """buf @ w_in + b_in per slot's rows, unfused (the bias added by row)."""
    h_EH = _mm(ops, buf_ED, w_in_SDH, order_A, rows_A)
    if b_in_SH is None:
        return h_EH
    return h_EH + reference.per_row(b_in_SH, order_A, rows_A, h_EH.shape[0])


def _first_layer(ops, x_ND, w_in_SDH, b_in_SH, plan, form: Form):
    """The form's activation of x's gathered rows @ w_in + b_in, per slot's rows. Without a
    gradient the compiled op gathers each slot's rows into a thread's tile (gather_mm_act, where
    the device has it): the gathered rows and h are never written out. Otherwise one op fuses the
    bias and activation into the GEMM and keeps h for its backward."""
    order_A, rows_A, row_pair_E, dest_NK = plan
    fused = ops is not _ops.REFERENCE and form.fn is None and not isinstance(w_in_SDH, QuantizedWeight)
    if fused and not _wants_grad((x_ND, w_in_SDH, b_in_SH)) and _ops.has_fused("gather_mm_act", x_ND.device):
        return ops.gather_mm_act(x_ND, w_in_SDH, b_in_SH, order_A, rows_A, row_pair_E, dest_NK, *_form_args(form))
    buf_ED = ops.bucketed_gather(x_ND, row_pair_E, dest_NK, None)
    if form.fn is not None or (not fused and ops is not _ops.REFERENCE):  # the caller's function, or quantized
        return form.act(_gemm_bias(ops, buf_ED, w_in_SDH, b_in_SH, order_A, rows_A))
    if ops is _ops.REFERENCE and buf_ED.is_cuda:
        return BucketedAct.apply(_gemm_bias(ops, buf_ED, w_in_SDH, b_in_SH, order_A, rows_A), form)
    if isinstance(w_in_SDH, QuantizedWeight):  # the twins: the same GEMM, then the form
        return form.act(_gemm_bias(ops, buf_ED, w_in_SDH, b_in_SH, order_A, rows_A))
    return ops.grouped_mm_act(buf_ED, w_in_SDH, b_in_SH, order_A, rows_A, *_form_args(form))[1]


def _post(out_ED, post, spread):
    """post = (b_out, fn): each pair's output plus its slot's b_out (spread(b_out) lines it up with
    the rows), then fn, before the gate."""
    b_out, fn = post
    if b_out is not None:
        out_ED = out_ED + spread(b_out)
    if fn is None:
        return out_ED
    y = fn(out_ED)
    if not isinstance(y, torch.Tensor) or y.shape != out_ED.shape:
        raise ValueError(f"expert_mlp: post {fn!r} must keep the shape {tuple(out_ED.shape)} of the pairs' outputs, "
                         f"got {tuple(y.shape) if isinstance(y, torch.Tensor) else y!r}")
    return y


def _second_layer(ops, a_EH, w_out_SHD, gates_NK, plan, post):
    """The second GEMM and the gated combine. Where the device has it, one op (grouped_mm_scatter),
    whose backward keeps each slot's rows of the output gradient in a thread's tile where they fit
    (the op decides), and the [E, d] outputs are not kept for it."""
    order_A, rows_A, row_pair_E, dest_NK = plan
    if (post is None and ops is not _ops.REFERENCE and not isinstance(w_out_SHD, QuantizedWeight)
            and _ops.has_fused("grouped_mm_scatter", a_EH.device)):
        return ops.grouped_mm_scatter(a_EH, w_out_SHD, gates_NK, order_A, rows_A, row_pair_E, dest_NK)
    out_ED = _mm(ops, a_EH, w_out_SHD, order_A, rows_A)
    if post is not None:
        out_ED = _post(out_ED, post, lambda b_SD: reference.per_row(b_SD, order_A, rows_A, out_ED.shape[0]))
    return ops.weighted_scatter(out_ED, dest_NK, row_pair_E, gates_NK)


def _grouped(ops, x_ND, slot_idx_NK, gates_NK, w_in_SDH, w_out_SHD, cap, bucketed, form, b_in_SH, skip, post):
    """The pipeline: plan -> first layer (gather, GEMM, activation) -> second layer (GEMM, gated
    combine). An exact plan's sizes depend on the input's shapes only."""
    _, order_A, rows_A, row_pair_E, dest_NK = ops.group_plan(slot_idx_NK, w_in_SDH.shape[0], cap, bucketed, skip)
    plan = (order_A, rows_A, row_pair_E, dest_NK)
    a_EH = _first_layer(ops, x_ND, w_in_SDH, b_in_SH, plan, form)
    return _second_layer(ops, a_EH, w_out_SHD, gates_NK, plan, post), dest_NK >= 0, rows_A


# Up to this many tokens go through the decode path (no plan): writing's one character per
# stream, or a handful of streams. N characters put at most N rows in a slot, so this is the
# CPU's few-row kernels' limit (csrc/sizes.h kSmallRows), read from the extension.
DECODE_MAX_CHARS = _ops.constant("small_rows")


def _below_autograd(wants_grad: bool):
    """Without a gradient, the ops straight to their kernels, past the Python autograd wrapper
    that registered ops pass through; under torch.compile the graph has no such wrapper."""
    if wants_grad or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()


def _wants_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _decode_size(N) -> bool:
    """A handful of tokens. Under torch.compile with a symbolic N this is False without a guard,
    so the one graph (the general pipeline) serves every N."""
    return statically_known_true(N > 0) and statically_known_true(N <= DECODE_MAX_CHARS)


def _use_decode(N, cap, wants_grad: bool, skipping: bool = False) -> bool:
    """The decode path's conditions: a handful of characters; no capacity drop (one character
    never gives a slot two pairs, so a cap cannot bite); and, where a gradient is wanted, one
    character, whose pairs have distinct slots (the weight gradient takes each slot once), none
    of them skipped (a skipped pair's empty range names slot 0, which a kept pair may name too)."""
    if not _decode_size(N) or (cap and N > 1):
        return False
    return not wants_grad or (N == 1 and not skipping)


def _fuses_decode(ops, x_ND, form: Form, valid_NK, post, wants_grad: bool, w_in=None, w_out=None) -> bool:
    """Whether a handful of characters go through the one compiled op (the CPU's decode_experts, or
    qdecode_experts where both weights are quantized): one call instead of the unfused decode's
    ten, whose dispatch cost more than the GEMMs at one character. Not with the caller's own
    activation or post, out_of_range_slots='skip', a gradient, or one weight quantized and the
    other not (the pipeline takes those, with qgrouped_mm)."""
    quantized = isinstance(w_in, QuantizedWeight), isinstance(w_out, QuantizedWeight)
    if quantized[0] != quantized[1]:
        return False
    name = "qdecode_experts" if quantized[0] else "decode_experts"
    return (ops is not _ops.REFERENCE and form.fn is None and post is None and valid_NK is None and not wants_grad
            and _ops.has_fused(name, x_ND.device))


def _fused_decode(ops, x, slot_idx, gates, w_in, w_out, b_in, b_out, form: Form):
    """The one decode op of _fuses_decode."""
    if isinstance(w_in, QuantizedWeight):
        return ops.qdecode_experts(x, slot_idx, gates, w_in.q, w_in.scale, w_in.bits, w_in.group, w_out.q,
                                   w_out.scale, w_out.bits, w_out.group, b_in, b_out, *_form_args(form))
    return ops.decode_experts(x, slot_idx, gates, w_in, w_out, b_in, b_out, *_form_args(form))


def _decode(ops, x_ND, slot_idx_NK, gates_NK, w_in_SDH, w_out_SHD, form, b_in_SH, valid_NK, post):
    """A handful of characters without the plan (on a GPU, or on the pure-torch twins): every
    (character, k) pair is its own one-row range, a plan made from the shapes alone (its row counts
    are made on the device: nothing is read on the host).
    Only the routed slots' weights are read, with the same gather and deterministic gated combine
    as the pipeline. A skipped pair (valid_NK False) owns no row: its range is empty, so no weight
    is read for it, and the kept pairs' rows come first; the rows past them are zeros the combine
    never reads."""
    N, K = slot_idx_NK.shape
    pair_R = torch.arange(N * K, device=x_ND.device)
    if valid_NK is None:  # no plan to check the ids: the twins' check (a device assert on a GPU)
        reference.check_slot_ids(slot_idx_NK, w_in_SDH.shape[0])
        rows_R, row_pair_R, dest_NK = torch.ones_like(pair_R), pair_R, pair_R.view(N, K)
    else:
        kept_R = valid_NK.reshape(-1)
        slot_idx_NK = torch.where(valid_NK, slot_idx_NK, 0)  # an empty range: any id in range will do
        rows_R = kept_R.long()
        row_R = torch.cumsum(rows_R, 0) - 1  # each kept pair's row
        dest_NK = torch.where(valid_NK, row_R.view(N, K), -1)
        row_pair_R = pair_R.new_full((N * K + 1,), -1).scatter(0, torch.where(kept_R, row_R, N * K), pair_R)[:N * K]
    plan = (slot_idx_NK.reshape(-1), rows_R, row_pair_R, dest_NK)
    a_RH = _first_layer(ops, x_ND, w_in_SDH, b_in_SH, plan, form)
    return _second_layer(ops, a_RH, w_out_SHD, gates_NK, plan, post), rows_R


def _takes_decode_op(x, slot_idx, gates, w_in, w_out, form: Form, b_in, b_out, out_of_range: str, path: str,
                     capacity_factor, n_valid) -> bool:
    """Whether the call is writing's: a handful of characters, no gradient, the CPU's one decode op
    (decode_experts) and nothing the general path would do besides it. Decided from a few
    attributes only: after the op has streamed megabytes of weights, every Python line and small
    op of the general path runs from a cold cache (_check_inputs took 50-80 us a call there, 10 on
    a warm one)."""
    if not (type(x) is torch.Tensor and type(slot_idx) is torch.Tensor and isinstance(gates, torch.Tensor)
            and isinstance(w_in, torch.Tensor) and isinstance(w_out, torch.Tensor)
            and (b_in is None or isinstance(b_in, torch.Tensor)) and (b_out is None or isinstance(b_out, torch.Tensor))):
        return False
    if form.fn is not None or out_of_range != "error" or path not in ("auto", "compiled"):
        return False
    if not (type(capacity_factor) in (int, float) and capacity_factor == 0):
        return False
    if x.dim() != 2 or slot_idx.dim() != 2 or w_in.dim() != 3 or not 1 <= slot_idx.shape[1] <= w_in.shape[0]:
        return False
    if not _use_decode(x.shape[0], 0, False):  # a training call leaves here, before the device and grad checks
        return False
    if n_valid is not None and not (type(n_valid) is int and 0 <= n_valid <= x.shape[0]):
        return False  # without a cap or statistics, padding rows change nothing but their own output
    if not gates.is_floating_point() or not _ops.supports(x.device):
        return False
    wants_grad = _wants_grad((x, gates, w_in, w_out, b_in, b_out))
    return _use_decode(x.shape[0], 0, wants_grad) and _fuses_decode(_ops.compiled(), x, form, None, None, wants_grad)


def _decode_op(x, slot_idx, gates, w_in, w_out, form: Form, b_in, b_out):
    """decode_experts without expert_mlp's Python checks in front: the op checks every argument
    itself. Where it refuses one, _check_inputs names the problem in expert_mlp's words, as it
    would have before the call; a problem only the op sees is raised as the op raised it."""
    try:
        with torch._C._AutoDispatchBelowAutograd():
            return _ops.compiled().decode_experts(x, slot_idx, gates.to(x.dtype), w_in, w_out, b_in, b_out,
                                                  *_form_args(form))
    except Exception as e:  # noqa: BLE001 (re-raised below unless the checks name it)
        refused = e
    try:
        _check_inputs(x, slot_idx, gates, w_in, w_out, form, b_in, b_out, "error")
        raise refused
    finally:
        del refused  # the frame holds the error, whose traceback holds the frame (and x and the weights)


def _add_out_bias(y_ND, b_out_SD, slot_idx_NK, gates_NK, kept_NK):
    """y + sum over the kept pairs of gate * b_out[slot]: the gates spread over the slots, [N, S],
    times b_out (no [N, k, d] gather)."""
    S = b_out_SD.shape[0]
    w_NK = gates_NK if kept_NK is None else torch.where(kept_NK, gates_NK, 0)
    ids_NK = slot_idx_NK if kept_NK is None else torch.where(kept_NK, slot_idx_NK, 0)
    mix_NS = w_NK.new_zeros(w_NK.shape[0], S).scatter_add(1, ids_NK, w_NK)
    return y_ND + mix_NS @ b_out_SD


def resolve_path(path: str, device: torch.device) -> str:
    if path not in PATHS:
        raise ValueError(f"expert_mlp: path must be one of {PATHS}, got {path!r}")
    if path == "auto":
        return "compiled" if _ops.supports(device) else "grouped"
    if path == "compiled" and not _ops.supports(device):
        from . import _backend

        st = _backend.state()
        why = st.reason if not st.loaded else f"the extension has no {device.type} kernels (built without them)"
        raise RuntimeError(f"expert_mlp: path='compiled' is not available: {why}; use path='grouped'")
    return path


def expert_mlp(x, slot_idx, gates, w_in, w_out, *, activation: str | Callable = "gelu", b_in=None, b_out=None,
               alpha: float = 1.702, limit: float = 7.0, post: Callable | None = None,
               out_of_range_slots: str = "error", path: str = "auto",
               capacity_factor: float = 0.0, return_stats: bool = False, bucketed: bool | None = None,
               n_valid: int | None = None):
    """Apply the routed experts: y[n] = sum_j gates[n, j] * (act(x[n] @ w_in[s] + b_in[s]) @ w_out[s]
    + b_out[s]), s = slot_idx[n, j].

    x [N, d]; slot_idx [N, k] int64 in [0, S); gates [N, k] (any floating dtype: computed in x's,
    its gradient in its own); w_in [S, d, h] ([S, d, 2h] for the gated forms: gate and up); w_out
    [S, h, d]; b_in [S, h or 2h] and b_out [S, d] optional; weights and biases in x's dtype, all on
    x's device, of any strides (an nn.Linear-style [S, out, in] weight is passed as its .mT view:
    nothing is copied). activation: one of ACTIVATIONS (alpha and limit are swiglu_oai's), or a
    callable [rows, h_in] -> [rows, h] applied between the two grouped GEMMs (no fused kernel; any
    differentiable torch function). post: a callable applied to each pair's expert output [rows,
    d], b_out included, before its gate (a post-expert norm).
    out_of_range_slots='skip': pairs whose slot is outside [0, S) (expert parallelism's ids of
    experts held elsewhere) add nothing and get no gradient; 'error' (the default) refuses them.
    capacity_factor c > 0 caps each slot at ceil(c * N * k / S) pairs, keeping the first in
    character order, then k order; dropped pairs contribute nothing, identically on every path.
    bucketed (grouped and compiled paths) pads each slot's rows to _bucket(load); None takes the
    path's default (grouped: True; compiled: False). n_valid: the rows
    from n_valid on are padding (the model pads a row's characters to _bucket sizes): they come
    last, so they never take a real pair's place under a cap, and they count in no statistic and
    not in the cap. Returns y [N, d], or (y, DispatchStats) with return_stats.
    """
    form = Form.of(activation, alpha, limit)
    if (post is None and not return_stats and not torch.compiler.is_compiling()
            and _takes_decode_op(x, slot_idx, gates, w_in, w_out, form, b_in, b_out, out_of_range_slots, path,
                                 capacity_factor, n_valid)):
        return _decode_op(x, slot_idx, gates, w_in, w_out, form, b_in, b_out)
    if post is not None and not callable(post):
        raise TypeError(f"expert_mlp: post must be a callable or None, got {type(post).__name__}")
    post_pair = None if post is None else (b_out, post)  # b_out goes in per pair, before post
    _check_inputs(x, slot_idx, gates, w_in, w_out, form, b_in, b_out, out_of_range_slots)
    N, K = slot_idx.shape
    S = w_in.shape[0]
    n_valid = N if n_valid is None else n_valid
    if not 0 <= n_valid <= N:
        raise ValueError(f"expert_mlp: n_valid must be in [0, N = {N}], got {n_valid}")
    gates = gates.to(x.dtype)  # autograd returns its gradient in the gates' own dtype
    skip = out_of_range_slots == "skip"
    valid = ((slot_idx >= 0) & (slot_idx < S)) if skip else None
    cap = capacity(capacity_factor, n_valid, K, S)
    path = resolve_path(path, x.device)
    rows_A = None  # the plan's rows per listed slot, for the statistics
    if path == "rectangle":  # the reference: quantized weights as the float weights they stand for
        w_in, w_out = (w.dequantize() if isinstance(w, QuantizedWeight) else w for w in (w_in, w_out))
        y, kept, executed = _rectangle(x, slot_idx, gates, w_in, w_out, cap, form, b_in, valid, post_pair)
    else:
        ops = _ops.compiled() if path == "compiled" else _ops.REFERENCE
        if bucketed is None:  # the compiled path's exact plan reads nothing on the host, GPUs included
            bucketed = path == "grouped"
        # The caller's functions may hold parameters of their own (a norm's weight).
        wants_grad = _wants_grad((x, gates, w_in, w_out, b_in, b_out)) or (
            torch.is_grad_enabled() and (form.fn is not None or post is not None))
        decode = _use_decode(N, cap, wants_grad, skip)
        if decode and _fuses_decode(ops, x, form, valid, post, wants_grad, w_in, w_out):
            with _below_autograd(False):
                y = _fused_decode(ops, x, slot_idx, gates, w_in, w_out, b_in, b_out, form)
            b_out = None  # added inside, per pair
            kept, executed = valid, N * K
        elif decode and (x.device.type != "cpu" or ops is _ops.REFERENCE):
            # Writing wants no gradient: the ops then run straight to their kernels, skipping the
            # Python autograd wrapper that registered ops pass through.
            with _below_autograd(wants_grad):
                y, rows_A = _decode(ops, x, slot_idx, gates, w_in, w_out, form, b_in, valid, post_pair)
            kept, executed = valid, rows_A.sum  # a row per kept pair: nothing padded
        else:
            y, kept, rows_A = _grouped(ops, x, slot_idx, gates, w_in, w_out, cap, bucketed, form, b_in, skip,
                                       post_pair)
            executed = rows_A.sum  # read only if the statistics are
    if b_out is not None and post is None:
        y = _add_out_bias(y, b_out, slot_idx, gates, kept)
    if not return_stats:
        return y
    groups = 1 if path == "rectangle" else (lambda: _groups(rows_A)) if rows_A is not None else 0
    return y, dispatch_stats(slot_idx[:n_valid], S, cap, executed, groups, None if valid is None else valid[:n_valid])


def _groups(rows_A) -> torch.Tensor:
    """The batched-matmul groups of a plan: its distinct nonzero row counts (a bucketed plan's
    groups are runs of equal counts, sorted), counted on the device."""
    r = rows_A.sort().values
    new = torch.ones_like(r, dtype=torch.bool)
    new[1:] = r[1:] != r[:-1]
    return (new & (r > 0)).sum()


def dispatch_stats(slot_idx_NK: torch.Tensor, S: int, cap: int, executed, groups,
                   valid_NK: torch.Tensor | None = None) -> DispatchStats:
    """The statistics of a call from its real characters' routing: a capped slot keeps its first
    `cap` pairs, so what it drops is what its count passes the cap by. valid_NK: the pairs whose
    slot is here (skipped ones count nowhere). Nothing is read from the device here: each field is
    read when it is first asked for."""
    ids_R = slot_idx_NK.reshape(-1)
    if valid_NK is not None:  # skipped pairs: a spare slot past the end
        ids_R = torch.where(valid_NK.reshape(-1), ids_R, S)
    count_S = torch.zeros(S + 1, dtype=torch.long, device=ids_R.device).index_add_(
        0, ids_R, torch.ones_like(ids_R))[:S]
    routed = count_S.sum()
    return DispatchStats(
        routed_pairs=routed,
        dropped_pairs=(count_S - cap).clamp(min=0).sum() if cap else 0,
        executed_rows=executed,
        groups=groups,
        max_load_ratio=count_S.max().double() * S / routed.clamp(min=1) if S else 0.0,
        top_k=slot_idx_NK.shape[1],
        capacity=cap,
        slot_load=count_S,
        chars=slot_idx_NK.shape[0],
    )
