"""The compiled ops (torch.ops.minagi.*) with their fake kernels and autograd, and one table per
implementation so callers can pick compiled or reference with the same call signatures.

Backward formulas use the ops themselves: gather and scatter are each the other's backward,
gate_grad gives both their gate gradients, and grouped_mm's input gradient is grouped_mm with the
transposed weights. So double backward works wherever the forward does.
"""
from __future__ import annotations

import functools
import threading
import types

import torch

from . import _backend, reference

_REGISTERED = False


# The sizes C++ defines (csrc/sizes.h, csrc/common.h), as the pure-torch twins take them where the
# extension is not loaded; tests/test_ops.py checks each equals the built extension's.
FALLBACK_CONSTANTS = {"small_rows": 4, "gpu_max_slots": 2048}


def constant(name: str) -> int:
    """A size defined in C++ (torch.ops.minagi.constant), read from the extension where it is
    loaded, else FALLBACK_CONSTANTS'."""
    return int(torch.ops.minagi.constant(name)) if _backend.loaded() else FALLBACK_CONSTANTS[name]


# The most card slots the GPU kernels take (csrc/common.h kMaxGpuSlots, which the kernels check:
# the routing and plan kernels keep per-slot arrays in one block's shared memory). The CPU
# kernels and the pure-torch twins have no limit.
GPU_MAX_SLOTS = constant("gpu_max_slots")


def _fake_registrations(lib: str = "minagi") -> None:
    @torch.library.register_fake(f"{lib}::routing")
    def _(logits, top_k):
        N, S = logits.shape
        return (logits.new_empty(N, top_k, dtype=torch.long), logits.new_empty(N, top_k),
                logits.new_empty(S, dtype=torch.long))

    @torch.library.register_fake(f"{lib}::routing_backward")
    def _(grad_gates, gates, slot_idx, n_slots):
        return gates.new_empty(gates.shape[0], n_slots)

    @torch.library.register_fake(f"{lib}::group_plan")
    def _(slot_idx, n_slots, capacity, bucketed, skip_invalid=False):
        if bucketed:  # the active slots and their bucketed rows: sizes that depend on the data
            ctx = torch.library.get_ctx()
            A, E = ctx.new_dynamic_size(), ctx.new_dynamic_size()
        else:  # every slot, and a row per pair: sizes from the input's shape only
            A, E = n_slots, slot_idx.shape[0] * slot_idx.shape[1]
        new = slot_idx.new_empty
        # A bucketed plan's slot_rows is on the host (its sizes, copied once); an exact plan's stays
        # on the input's device.
        return new(n_slots), new(A), new(A, device="cpu") if bucketed else new(A), new(E), new(slot_idx.shape)

    @torch.library.register_fake(f"{lib}::bucketed_gather")
    def _(x, row_pair, dest, gates):
        return x.new_empty(row_pair.shape[0], x.shape[1])

    @torch.library.register_fake(f"{lib}::weighted_scatter")
    def _(rows, dest, row_pair, gates):
        return rows.new_empty(dest.shape[0], rows.shape[1])

    @torch.library.register_fake(f"{lib}::gate_grad")
    def _(a, rows, dest, row_pair):
        return a.new_empty(dest.shape)

    @torch.library.register_fake(f"{lib}::grouped_mm")
    def _(a, b, slot_ids, slot_rows):
        return a.new_empty(a.shape[0], b.shape[2])

    @torch.library.register_fake(f"{lib}::grouped_mm_wgrad")
    def _(a, grad, slot_ids, slot_rows, n_slots):
        return a.new_empty(n_slots, a.shape[1], grad.shape[1])

    @torch.library.register_fake(f"{lib}::grouped_mm_act")
    def _(a, b, bias, slot_ids, slot_rows, activation, alpha, limit):
        M = b.shape[2]
        return a.new_empty(a.shape[0], M), a.new_empty(a.shape[0], M // 2 if activation in reference.GATED else M)

    @torch.library.register_fake(f"{lib}::expert_act_backward")
    def _(grad, h, slot_ids, slot_rows, activation, alpha, limit, n_slots, bias_grad):
        return h.new_empty(h.shape), h.new_empty((n_slots, h.shape[1]) if bias_grad else (0,))


def _fused_fake_registrations(names: tuple[str, ...], lib: str = "minagi") -> None:
    if "scatter_mm_backward" in names:
        @torch.library.register_fake(f"{lib}::scatter_mm_backward")
        def _(grad_y, a, b, gates, slot_ids, slot_rows, row_pair, dest, b_grad):
            if b_grad not in (0, 1, 2):
                raise RuntimeError(f"minagi.scatter_mm_backward: b_grad must be 0 (no gradient), 1 (b's shape "
                                   f"[S, I, D]) or 2 (transposed, [S, D, I]), got {b_grad}")
            S, I, D = b.shape
            return a.new_empty(a.shape), a.new_empty(((0,), (S, I, D), (S, D, I))[b_grad]), gates.new_empty(gates.shape)

    if "grouped_mm_scatter" in names:
        @torch.library.register_fake(f"{lib}::grouped_mm_scatter")
        def _(a, b, gates, slot_ids, slot_rows, row_pair, dest):
            return a.new_empty(dest.shape[0], b.shape[2])

    if "gather_mm_act" in names:
        @torch.library.register_fake(f"{lib}::gather_mm_act")
        def _(x, b, bias, slot_ids, slot_rows, row_pair, dest, activation, alpha, limit):
            M = b.shape[2]
            return x.new_empty(row_pair.shape[0], M // 2 if activation in reference.GATED else M)

    if "decode_experts" in names:
        @torch.library.register_fake(f"{lib}::decode_experts")
        def _(x, slot_idx, gates, w_in, w_out, b_in, b_out, activation, alpha, limit):
            return x.new_empty(x.shape[0], w_out.shape[2])

    if "qgrouped_mm" in names:
        @torch.library.register_fake(f"{lib}::qgrouped_mm")
        def _(a, q, scale, slot_ids, slot_rows, bits, group_size):
            return a.new_empty(a.shape[0], q.shape[1])

    if "qdecode_experts" in names:
        @torch.library.register_fake(f"{lib}::qdecode_experts")
        def _(x, slot_idx, gates, q_in, scale_in, bits_in, group_in, q_out, scale_out, bits_out, group_out, b_in,
              b_out, activation, alpha, limit):
            return x.new_empty(x.shape[0], q_out.shape[1])


def stored_transposed(b_SIO: torch.Tensor) -> bool:
    """Whether b is the .mT view of a contiguous [S, out, in] weight (nn.Linear's layout)."""
    return not b_SIO.is_contiguous() and b_SIO.mT.is_contiguous()


def _wgrad(ops, a_EI, grad_EO, b_SIO, slot_ids, slot_rows, n_slots: int):
    """b's gradient in b's own layout. A weight stored [S, out, in] (nn.Linear's) comes in as its
    .mT view: the transposed problem's gradient, [S, out, in], viewed back, gives its parameter a
    contiguous gradient that autograd takes as is, where [S, in, out] would be copied to the
    parameter's layout (one more weight-sized buffer and pass per call)."""
    if stored_transposed(b_SIO):
        return ops.grouped_mm_wgrad(grad_EO, a_EI, slot_ids, slot_rows, n_slots).mT
    return ops.grouped_mm_wgrad(a_EI, grad_EO, slot_ids, slot_rows, n_slots)


def _through_twin(twin, inputs, rest, grad_outs) -> tuple:
    """The gradients of a backward op's outputs with respect to its tensor inputs, given the
    outputs' gradients: through the autograd of `twin`, a differentiable composition of the same
    maths (the pure-torch twin, or the ops it fuses; only double backward and checks come here). None for each input where no output has a gradient."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in inputs]
        outs = twin(*leaves, *rest)
        pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.numel()]
        if not pairs:
            return (None,) * len(leaves)
        return torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs], allow_unused=True)


def _autograd_registrations(lib: str = "minagi") -> None:
    ops = getattr(torch.ops, lib)

    def routing_setup(ctx, inputs, output):
        logits, _ = inputs
        slot_idx, gates, _ = output
        ctx.n_slots = logits.shape[1]
        ctx.save_for_backward(slot_idx, gates)

    def routing_bwd(ctx, grad_idx, grad_gates, grad_load):
        slot_idx, gates = ctx.saved_tensors
        if grad_gates is None:
            return None, None
        return ops.routing_backward(grad_gates, gates, slot_idx, ctx.n_slots), None

    torch.library.register_autograd(f"{lib}::routing", routing_bwd, setup_context=routing_setup)

    def maps_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)  # gather/scatter's optional gates may be None
        ctx.has_gates = inputs[3] is not None

    def gather_bwd(ctx, grad):
        x, row_pair, dest, gates = ctx.saved_tensors
        grad_x = ops.weighted_scatter(grad, dest, row_pair, gates) if ctx.needs_input_grad[0] else None
        grad_g = (ops.gate_grad(x, grad, dest, row_pair)
                  if ctx.has_gates and ctx.needs_input_grad[3] else None)
        return grad_x, None, None, grad_g

    torch.library.register_autograd(f"{lib}::bucketed_gather", gather_bwd, setup_context=maps_setup)

    def scatter_bwd(ctx, grad):
        rows, dest, row_pair, gates = ctx.saved_tensors
        grad_rows = ops.bucketed_gather(grad, row_pair, dest, gates) if ctx.needs_input_grad[0] else None
        grad_g = (ops.gate_grad(grad, rows, dest, row_pair)
                  if ctx.has_gates and ctx.needs_input_grad[3] else None)
        return grad_rows, None, None, grad_g

    torch.library.register_autograd(f"{lib}::weighted_scatter", scatter_bwd, setup_context=maps_setup)

    def gate_grad_bwd(ctx, grad):
        a, rows, dest, row_pair = ctx.saved_tensors
        grad_a = ops.weighted_scatter(rows, dest, row_pair, grad) if ctx.needs_input_grad[0] else None
        grad_rows = ops.bucketed_gather(a, row_pair, dest, grad) if ctx.needs_input_grad[1] else None
        return grad_a, grad_rows, None, None

    torch.library.register_autograd(f"{lib}::gate_grad", gate_grad_bwd, setup_context=maps_setup)

    def mm_setup(ctx, inputs, output):
        a, b, slot_ids, slot_rows = inputs
        ctx.n_slots = b.shape[0]
        ctx.save_for_backward(a, b, slot_ids, slot_rows)

    def mm_bwd(ctx, grad):
        a, b, slot_ids, slot_rows = ctx.saved_tensors
        grad_a = ops.grouped_mm(grad, b.transpose(1, 2), slot_ids, slot_rows) if ctx.needs_input_grad[0] else None
        grad_b = _wgrad(ops, a, grad, b, slot_ids, slot_rows, ctx.n_slots) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None, None

    torch.library.register_autograd(f"{lib}::grouped_mm", mm_bwd, setup_context=mm_setup)

    def wgrad_setup(ctx, inputs, output):
        a, grad, slot_ids, slot_rows, _ = inputs
        ctx.save_for_backward(a, grad, slot_ids, slot_rows)

    def wgrad_bwd(ctx, gout):
        a, grad, slot_ids, slot_rows = ctx.saved_tensors
        grad_a = (ops.grouped_mm(grad, gout.transpose(1, 2), slot_ids, slot_rows)
                  if ctx.needs_input_grad[0] else None)
        grad_g = ops.grouped_mm(a, gout, slot_ids, slot_rows) if ctx.needs_input_grad[1] else None
        return grad_a, grad_g, None, None, None

    torch.library.register_autograd(f"{lib}::grouped_mm_wgrad", wgrad_bwd, setup_context=wgrad_setup)

    def act_setup(ctx, inputs, output):
        a, b, bias, slot_ids, slot_rows, activation, alpha, limit = inputs
        ctx.form, ctx.n_slots, ctx.has_bias = (activation, alpha, limit), b.shape[0], bias is not None
        ctx.set_materialize_grads(False)  # h's gradient is None when h is unused: no [E, 2h] zeros to add
        ctx.save_for_backward(a, b, slot_ids, slot_rows, output[0])

    def act_bwd(ctx, grad_h, grad_out):
        a, b, slot_ids, slot_rows, h = ctx.saved_tensors
        want_bias = ctx.has_bias and ctx.needs_input_grad[2]
        if grad_out is None:
            gh, gb = torch.zeros_like(h), None
        elif torch.is_grad_enabled():  # a double backward: the differentiable twin, through h
            gh, gb = reference.expert_act_backward(grad_out, h, slot_ids, slot_rows, *ctx.form, ctx.n_slots, want_bias)
        else:
            gh, gb = ops.expert_act_backward(grad_out, h, slot_ids, slot_rows, *ctx.form, ctx.n_slots, want_bias)
        if grad_h is not None:  # h itself was used: its gradient joins the activation's
            gh = gh + grad_h
            if want_bias:
                extra = reference.slot_sums(grad_h, slot_ids, slot_rows, ctx.n_slots)
                gb = extra if gb is None else gb + extra
        grad_a = ops.grouped_mm(gh, b.transpose(1, 2), slot_ids, slot_rows) if ctx.needs_input_grad[0] else None
        grad_b = _wgrad(ops, a, gh, b, slot_ids, slot_rows, ctx.n_slots) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, gb if want_bias else None, None, None, None, None, None

    torch.library.register_autograd(f"{lib}::grouped_mm_act", act_bwd, setup_context=act_setup)

    def act_backward_setup(ctx, inputs, output):
        grad, h, slot_ids, slot_rows, activation, alpha, limit, n_slots, bias_grad = inputs
        ctx.args = (activation, alpha, limit, n_slots, bias_grad)
        ctx.save_for_backward(grad, h, slot_ids, slot_rows)

    def act_backward_bwd(ctx, g_gh, g_gb):
        # Second derivatives of the forms, through the twin's autograd (only double backward and
        # checks come here).
        grad, h, slot_ids, slot_rows = ctx.saved_tensors
        grads = _through_twin(reference.expert_act_backward, (grad, h), (slot_ids, slot_rows, *ctx.args), (g_gh, g_gb))
        return *grads, None, None, None, None, None, None, None

    torch.library.register_autograd(f"{lib}::expert_act_backward", act_backward_bwd, setup_context=act_backward_setup)


def _fused_autograd_registrations(names: tuple[str, ...], lib: str = "minagi") -> None:
    if "scatter_mm_backward" in names:
        _scatter_mm_backward_autograd(lib)
    if "grouped_mm_scatter" in names:
        _grouped_mm_scatter_autograd(lib)
    if "gather_mm_act" in names:
        _gather_mm_act_autograd(lib)
    if "decode_experts" in names:
        _decode_experts_autograd(lib)
    if "qgrouped_mm" in names:
        _qgrouped_mm_autograd(lib)
    if "qdecode_experts" in names:
        _qdecode_experts_autograd(lib)


def _grouped_mm_scatter_autograd(lib: str) -> None:
    ops = getattr(torch.ops, lib)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def bwd(ctx, grad_y):
        a, b, gates, *plan = ctx.saved_tensors
        need = ctx.needs_input_grad
        layout = 0 if not need[1] else 2 if stored_transposed(b) else 1  # b's gradient, in b's layout
        # A double backward composes the ops whose own autograd goes on (gather, grouped GEMMs).
        fn = (functools.partial(reference.scatter_mm_backward, ops=ops) if torch.is_grad_enabled()
              else ops.scatter_mm_backward)
        grad_a, grad_b, grad_g = fn(grad_y.contiguous(), a, b, gates, *plan, layout)
        grad_b = (grad_b.mT if layout == 2 else grad_b) if need[1] else None
        return grad_a if need[0] else None, grad_b, grad_g if need[2] else None, None, None, None, None

    torch.library.register_autograd(f"{lib}::grouped_mm_scatter", bwd, setup_context=setup)


def _gather_mm_act_autograd(lib: str) -> None:
    # An inference op: dispatch never calls it where a gradient is wanted. Its gradients, for
    # whoever does, come through the ops it fuses (gather, grouped_mm_act) and their autograd.
    ops = getattr(torch.ops, lib)

    def setup(ctx, inputs, output):
        x, b, bias, slot_ids, slot_rows, row_pair, dest, *form = inputs
        ctx.form, ctx.has_bias = form, bias is not None
        ctx.save_for_backward(x, b, bias, slot_ids, slot_rows, row_pair, dest)

    def bwd(ctx, g_out):
        x, b, bias, *plan = ctx.saved_tensors
        create = torch.is_grad_enabled()  # a double backward: the graph goes on through these gradients
        with torch.enable_grad():
            leaves = [t if t.requires_grad else t.detach().requires_grad_() for t in (x, b, bias) if t is not None]
            out = reference.gather_mm_act(*leaves, *([None] if bias is None else []), *plan, *ctx.form, ops=ops)
            grads = torch.autograd.grad(out, leaves, g_out, create_graph=create, allow_unused=True)
        return grads[0], grads[1], grads[2] if ctx.has_bias else None, None, None, None, None, None, None, None

    torch.library.register_autograd(f"{lib}::gather_mm_act", bwd, setup_context=setup)


def _decode_experts_autograd(lib: str) -> None:
    # Writing's op: dispatch never calls it where a gradient is wanted. Its gradients, for whoever
    # does, come through the ops it fuses, one row per pair, and their autograd.
    ops = getattr(torch.ops, lib)

    def setup(ctx, inputs, output):
        *tensors, activation, alpha, limit = inputs
        ctx.form = (activation, alpha, limit)
        ctx.present = [t is not None for t in tensors]
        ctx.save_for_backward(*[t for t in tensors if t is not None])

    def bwd(ctx, g_y):
        saved = iter(ctx.saved_tensors)
        tensors = [next(saved) if p else None for p in ctx.present]
        create = torch.is_grad_enabled()  # a double backward: the graph goes on through these gradients
        with torch.enable_grad():
            leaves = [t if t is None or not t.is_floating_point() or t.requires_grad
                      else t.detach().requires_grad_() for t in tensors]
            y = reference.decode_experts(*leaves, *ctx.form, ops=ops)
            wanted = [t for t in leaves if t is not None and t.is_floating_point()]
            grads = iter(torch.autograd.grad(y, wanted, g_y, create_graph=create, allow_unused=True))
        return (*(next(grads) if t is not None and t.is_floating_point() else None for t in leaves), None, None, None)

    torch.library.register_autograd(f"{lib}::decode_experts", bwd, setup_context=setup)


NO_WEIGHT_GRAD = ("quantized weights take no gradient (their values are integers; expert_mlp gives gradients to x and "
                  "the gates only): pass a scale that does not require grad, or train the float weights")


def _qgrouped_mm_autograd(lib: str) -> None:
    # a's gradient only: grad @ W^T per slot, W dequantized (the twin's maths) and multiplied by the
    # device's grouped_mm, which reads nothing on the host.
    ops = getattr(torch.ops, lib)

    def setup(ctx, inputs, output):
        a, q, scale, slot_ids, slot_rows, bits, group_size = inputs
        ctx.form = (bits, group_size)
        ctx.n_in = a.shape[1]  # q may store padding past a's inputs
        ctx.save_for_backward(q, scale, slot_ids, slot_rows)

    def bwd(ctx, grad):
        if ctx.needs_input_grad[2]:
            raise RuntimeError(f"minagi.qgrouped_mm: {NO_WEIGHT_GRAD}")
        q, scale, slot_ids, slot_rows = ctx.saved_tensors
        grad_a = None
        if ctx.needs_input_grad[0]:
            w_AOI = reference.dequantize(q.index_select(0, slot_ids), scale.index_select(0, slot_ids), *ctx.form,
                                         grad.dtype, ctx.n_in)
            ids_A = torch.arange(slot_ids.shape[0], device=slot_ids.device)
            grad_a = ops.grouped_mm(grad, w_AOI, ids_A, slot_rows)
        return grad_a, None, None, None, None, None, None

    torch.library.register_autograd(f"{lib}::qgrouped_mm", bwd, setup_context=setup)


def _qdecode_experts_autograd(lib: str) -> None:
    # Writing's op with quantized weights: dispatch never calls it where a gradient is wanted. x's,
    # the gates' and the biases' gradients, for whoever asks, come through its twin's ops and their
    # autograd; the scales take none (NO_WEIGHT_GRAD).
    ops = getattr(torch.ops, lib)
    differentiable = (0, 2, 11, 12)  # x, gates, b_in, b_out
    scales = (4, 8)

    def setup(ctx, inputs, output):
        ctx.args = [None if isinstance(t, torch.Tensor) else t for t in inputs]  # tensors: saved below
        ctx.present = [isinstance(t, torch.Tensor) for t in inputs]
        ctx.save_for_backward(*[t for t in inputs if isinstance(t, torch.Tensor)])

    def bwd(ctx, g_y):
        if any(ctx.needs_input_grad[i] for i in scales):
            raise RuntimeError(f"minagi.qdecode_experts: {NO_WEIGHT_GRAD}")
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if p else a for p, a in zip(ctx.present, ctx.args)]
        create = torch.is_grad_enabled()  # a double backward: the graph goes on through these gradients
        with torch.enable_grad():
            wanted = [i for i in differentiable if args[i] is not None]
            for i in wanted:
                args[i] = args[i] if args[i].requires_grad else args[i].detach().requires_grad_()
            y = reference.qdecode_experts(*args, ops=ops)
            grads = torch.autograd.grad(y, [args[i] for i in wanted], g_y, create_graph=create, allow_unused=True)
        out = [None] * len(args)
        for i, g in zip(wanted, grads):
            out[i] = g
        return tuple(out)

    torch.library.register_autograd(f"{lib}::qdecode_experts", bwd, setup_context=setup)


def _scatter_mm_backward_autograd(lib: str) -> None:
    ops = getattr(torch.ops, lib)

    def scatter_mm_backward_setup(ctx, inputs, output):
        *tensors, b_grad = inputs
        ctx.b_grad = b_grad
        ctx.save_for_backward(*tensors)

    def scatter_mm_backward_bwd(ctx, g_a, g_b, g_gates):
        # Its second derivatives, through the ops it fuses and their autograd (only double
        # backward and checks come here).
        grad_y, a, b, gates, *plan = ctx.saved_tensors
        composed = functools.partial(reference.scatter_mm_backward, ops=ops)
        grads = _through_twin(composed, (grad_y, a, b, gates), (*plan, ctx.b_grad),
                              (g_a, g_b, g_gates))
        return *grads, None, None, None, None, None

    torch.library.register_autograd(f"{lib}::scatter_mm_backward", scatter_mm_backward_bwd,
                                    setup_context=scatter_mm_backward_setup)


_REGISTERING = threading.Lock()


def _register() -> None:
    """The fake kernels and autograd of the compiled ops, once (at import, where the extension
    loads; two threads asking at once register them once)."""
    global _REGISTERED
    if _REGISTERED:
        return
    with _REGISTERING:
        if _REGISTERED:
            return
        _fake_registrations()
        _autograd_registrations()
        names = _fused_names()  # a build from before a fused op lacks it
        _fused_fake_registrations(names)
        _fused_autograd_registrations(names)
        _REGISTERED = True


def _fused_names() -> tuple[str, ...]:
    """The fused ops this build of the extension has."""
    return tuple(name for name in _backend.FUSED_OP_NAMES if hasattr(torch.ops.minagi, name))


_COMPILED: tuple | None = None  # (the backend state it was made under, the table)


def compiled() -> types.SimpleNamespace:
    """The compiled ops, registered with fake kernels and autograd. Raises if not loaded."""
    global _COMPILED
    st = _backend.state()
    if _COMPILED is not None and _COMPILED[0] is st:  # decoding asks on every row
        return _COMPILED[1]
    if not st.loaded:
        raise RuntimeError(f"minagi's compiled ops are not available: {st.reason}")
    _register()
    names = _backend.OP_NAMES + _fused_names()
    table = types.SimpleNamespace(**{name: getattr(torch.ops.minagi, name) for name in names})
    _COMPILED = (st, table)
    return table


REFERENCE = types.SimpleNamespace(**{name: getattr(reference, name)
                                     for name in _backend.OP_NAMES + _backend.FUSED_OP_NAMES})


_SUPPORTS: dict[str, bool] = {}


def supports(device: torch.device) -> bool:
    """Whether every compiled op has a kernel for this device (asked once per device type: the
    registrations do not change, and decoding asks on every row)."""
    return _supports_type(device.type)


@torch.compiler.assume_constant_result  # the registrations do not change while a graph runs
def _supports_type(device_type: str) -> bool:
    if device_type not in _SUPPORTS:
        _SUPPORTS[device_type] = all(_backend.has_kernel(name, device_type) for name in _backend.OP_NAMES)
    return _SUPPORTS[device_type]


_FUSED: dict[tuple[str, str], bool] = {}


def has_fused(name: str, device: torch.device) -> bool:
    """Whether the fused op `name` (_backend.FUSED_OP_NAMES) has a compiled kernel for this device."""
    return _has_fused_type(name, device.type)


@torch.compiler.assume_constant_result
def _has_fused_type(name: str, device_type: str) -> bool:
    key = (name, device_type)
    if key not in _FUSED:
        _FUSED[key] = _backend.loaded() and name in _fused_names() and _backend.has_kernel(name, device_type)
    return _FUSED[key]


def best(device: torch.device) -> types.SimpleNamespace:
    """Compiled ops where they run on this device, else the pure-torch twins."""
    return compiled() if supports(device) else REFERENCE


if _backend.state().loaded:  # torch.compile traces the ops through these: none may be made then
    compiled()
