"""The pure-torch twin of every compiled op, with the same signature and the same results.

These are the oracle the compiled kernels are tested against and the fallback wherever the
extension is not built. Autograd runs through them natively. The grouped GEMM here is the seed's
grouped dispatch: weights gathered from the card once per call, split into each group's view,
one batched matmul per group.

Legend: N characters, K top_k, S card slots, A active slots (load > 0), E buffer rows (padding
included), D/I/O feature widths.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

_NEG_INF = float("-inf")

# The expert forms (csrc/activation.h holds the compiled ones, in this order): plain activations
# of h [.., H], and gated ones of h [.., 2H] = gate and up (halves, or alternating columns).
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu2", "swiglu", "swiglu_interleaved", "swiglu_oai")
GATED = ("swiglu", "swiglu_interleaved", "swiglu_oai")


def activate(h, activation: str, alpha: float = 1.702, limit: float = 7.0):
    """The form's activation of h: [.., H] for the plain forms, [.., 2H] -> [.., H] for the gated."""
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "silu":
        return F.silu(h)
    if activation == "relu2":
        return F.relu(h).square()
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if activation == "swiglu_interleaved":
        return F.silu(h[..., 0::2]) * h[..., 1::2]
    if activation == "swiglu_oai":  # GPT-OSS: clamped, (up + 1) * gate * sigmoid(alpha * gate)
        gate, up = h[..., 0::2].clamp(max=limit), h[..., 1::2].clamp(min=-limit, max=limit)
        return (up + 1) * gate * torch.sigmoid(alpha * gate)
    raise ValueError(f"unknown activation {activation!r}; the forms are {', '.join(ACTIVATIONS)}")


def _row_slots(slot_ids_A: torch.Tensor, slot_rows_A: torch.Tensor, n_rows: int, past: int) -> torch.Tensor:
    """The slot of each of a plan buffer's n_rows rows, [n_rows]; the rows past the listed ranges
    (an exact plan's dropped pairs) get the id `past`. Sized n_rows whatever the ranges hold, so it
    traces with static shapes."""
    rows_A = slot_rows_A.to(slot_ids_A.device)
    ids = torch.cat([slot_ids_A, slot_ids_A.new_full((1,), past)])
    counts = torch.cat([rows_A, (n_rows - rows_A.sum()).reshape(1)])
    return torch.repeat_interleave(ids, counts, output_size=n_rows)


def per_row(table_SW: torch.Tensor, slot_ids_A: torch.Tensor, slot_rows_A: torch.Tensor, n_rows: int) -> torch.Tensor:
    """table[slot of each row] for the n_rows rows of a plan's buffer, zeros past the ranges. On a
    GPU through embedding, whose table gradient (slot_sums) is deterministic; index_select's
    (index_add, atomics) is not."""
    S = table_SW.shape[0]
    slots = _row_slots(slot_ids_A, slot_rows_A, n_rows, S)
    if table_SW.device.type == "cpu":
        return F.pad(table_SW, (0, 0, 0, 1)).index_select(0, slots)
    return F.embedding(slots, F.pad(table_SW, (0, 0, 0, 1)))


def slot_sums(rows_EW: torch.Tensor, slot_ids_A, slot_rows_A, n_slots: int) -> torch.Tensor:
    """Per slot, the sum of its rows of rows_EW, [n_slots, W] (zeros for slots with none; rows past
    the listed ranges count nowhere). Bit-reproducible on every device: on a GPU through
    embedding's backward (sorted rows, a fixed order), not index_add's atomics."""
    E, W = rows_EW.shape
    slots_E = _row_slots(slot_ids_A, slot_rows_A, E, n_slots)  # past the ranges: a spare slot
    if rows_EW.device.type == "cpu":
        return rows_EW.new_zeros(n_slots + 1, W).index_add(0, slots_E, rows_EW)[:n_slots]
    return torch.ops.aten.embedding_dense_backward(rows_EW, slots_E, n_slots + 1, -1, False)[:n_slots]


def _pow2_at_least(n):
    """The power of two at least n, for 1 <= n <= 128: n - 1's bits smeared right, plus one (n - 1
    has at most 7 bits: shifts of 1, 2 and 4 cover them). The same integer ops on an int and on a
    tensor."""
    m = n - 1
    m = m | (m >> 1)
    m = m | (m >> 2)
    return (m | (m >> 4)) + 1


def bucket(n):
    """_bucket(n): powers of two up to 128, then multiples of 128 (0 for n <= 0), the rule of
    csrc/sizes.h's bucket(), which tests/test_ops.py holds this to. n: an int, or an integer
    tensor (elementwise)."""
    if isinstance(n, torch.Tensor):
        return torch.where(n <= 0, 0, torch.where(n <= 128, _pow2_at_least(n), (n + 127) // 128 * 128))
    if n <= 0:
        return 0
    return _pow2_at_least(n) if n <= 128 else (n + 127) // 128 * 128


def _graph_zero(*tensors):
    """An exact 0 that carries the inputs' autograd graph, for results built from nothing."""
    return sum(t.reshape(-1)[:0].sum() for t in tensors)


def routing(logits_NS: torch.Tensor, top_k: int):
    """Top-k slots per character (ties to the lower slot, NaN ranked as -inf), the softmax over
    the k chosen logits, and the load per slot."""
    S = logits_NS.shape[1]
    key_NS = torch.where(torch.isnan(logits_NS), _NEG_INF, logits_NS)
    # A stable descending sort keeps equal logits in slot order: ties go to the lower slot.
    slot_idx_NK = torch.sort(key_NS, dim=1, descending=True, stable=True).indices[:, :top_k].contiguous()
    gates_NK = torch.softmax(logits_NS.gather(1, slot_idx_NK), dim=1)
    load_S = torch.bincount(slot_idx_NK.reshape(-1), minlength=S)
    return slot_idx_NK, gates_NK, load_S


def routing_backward(grad_gates_NK, gates_NK, slot_idx_NK, n_slots: int):
    dot_N1 = (grad_gates_NK * gates_NK).sum(1, keepdim=True)
    grad_NK = gates_NK * (grad_gates_NK - dot_N1)
    out_NS = grad_NK.new_zeros(gates_NK.shape[0], n_slots)
    return out_NS.scatter_add_(1, slot_idx_NK, grad_NK)


def slot_ranks(flat_R: torch.Tensor, n_slots: int):
    """Each pair's position among its slot's pairs (character order, then k order), and the
    pairs per slot. Capacity keeps the pairs of rank < cap."""
    count_S = torch.bincount(flat_R, minlength=n_slots)
    by_slot_R = torch.sort(flat_R, stable=True).indices
    first_S = torch.cumsum(count_S, 0) - count_S
    rank_R = torch.empty_like(flat_R)
    rank_R[by_slot_R] = torch.arange(flat_R.numel(), device=flat_R.device) - first_S[flat_R[by_slot_R]]
    return rank_R, count_S


# csrc/common.h kSkipHint, the compiled ops' words
SKIP_HINT = (" (ids of experts held elsewhere, as expert parallelism passes them: out_of_range_slots='skip' drops "
             "those pairs)")


def check_slot_ids(slot_idx_NK: torch.Tensor, n_slots: int) -> None:
    """Every id in [0, n_slots), in expert_mlp's words (the compiled plan's check): raised at once
    on the CPU in eager mode, a device assert elsewhere (nothing synchronises)."""
    if slot_idx_NK.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = ((slot_idx_NK < 0) | (slot_idx_NK >= n_slots)).nonzero()
        if bad.numel():
            n, j = bad[0].tolist()
            raise ValueError(f"expert_mlp: slot_idx holds {int(slot_idx_NK[n, j])}, outside [0, S = {n_slots}) at "
                             f"token {n}, position {j}{SKIP_HINT}")
        return
    torch._assert_async(((slot_idx_NK >= 0) & (slot_idx_NK < n_slots)).all(),
                        f"expert_mlp: slot_idx holds an id outside [0, S = {n_slots}){SKIP_HINT}")


def group_plan(slot_idx_NK: torch.Tensor, n_slots: int, capacity: int, bucketed: bool, skip_invalid: bool = False):
    """The dispatch plan; see the schema in csrc/ops.cpp."""
    N, K = slot_idx_NK.shape
    R = N * K
    dev = slot_idx_NK.device
    flat_R = slot_idx_NK.reshape(-1)
    if not skip_invalid:
        check_slot_ids(slot_idx_NK, n_slots)
    valid_R = (flat_R >= 0) & (flat_R < n_slots)
    if skip_invalid:  # out-of-range ids: a slot of their own past the end, dropped below
        flat_R = torch.where(valid_R, flat_R, n_slots)
    rank_R, count_S = slot_ranks(flat_R, n_slots + 1 if skip_invalid else n_slots)
    count_S = count_S[:n_slots]
    load_S = count_S.clamp(max=capacity) if capacity > 0 else count_S
    kept_R = rank_R < torch.cat([load_S, load_S.new_zeros(1)])[flat_R] if skip_invalid else rank_R < load_S[flat_R]
    if not bucketed:  # every slot in id order: every size depends on the input's shape only
        start_S = torch.cumsum(load_S, 0) - load_S
        dest_R = torch.where(kept_R, start_S[flat_R.clamp(max=n_slots - 1)] + rank_R, -1)
        row_pair_R = torch.full((R + 1,), -1, dtype=torch.long, device=dev)  # the last one takes the dropped
        row_pair_R = row_pair_R.scatter(0, torch.where(kept_R, dest_R, R), torch.arange(R, device=dev))[:R]
        order_S = torch.arange(n_slots, device=dev)
        return load_S, order_S, load_S, row_pair_R, dest_R.view(N, K)  # slot_rows on the input's device

    active_A = torch.nonzero(load_S > 0).reshape(-1)
    slot_order_A = active_A[torch.sort(load_S[active_A], stable=True).indices]
    slot_rows_A = bucket(load_S[slot_order_A])
    start_A = torch.cumsum(slot_rows_A, 0) - slot_rows_A
    start_S = torch.full((n_slots + 1,), -1, dtype=torch.long, device=dev)
    start_S[slot_order_A] = start_A

    dest_R = torch.where(kept_R, start_S[flat_R] + rank_R, -1)
    # Like the compiled op, slot_rows lives on the host: the grouped GEMM sizes its matmuls from
    # it, and this is the bucketed plan's one device-to-host copy.
    slot_rows_A = slot_rows_A.cpu()
    E = int(slot_rows_A.sum())
    row_pair_E = torch.full((E,), -1, dtype=torch.long, device=dev)
    row_pair_E[dest_R[kept_R]] = torch.nonzero(kept_R).reshape(-1)
    return load_S, slot_order_A, slot_rows_A, row_pair_E, dest_R.view(N, K)


def bucketed_gather(x_ND, row_pair_E, dest_NK, gates_NK=None):
    K = dest_NK.shape[1]
    valid_E1 = (row_pair_E >= 0).unsqueeze(1)
    pair_E = row_pair_E.clamp(min=0)
    out_ED = x_ND.index_select(0, pair_E // K)
    if gates_NK is not None:
        out_ED = out_ED * gates_NK.reshape(-1).index_select(0, pair_E).unsqueeze(1)
    return torch.where(valid_E1, out_ED, 0.0)


def weighted_scatter(rows_ED, dest_NK, row_pair_E, gates_NK=None):
    N, K = dest_NK.shape
    D = rows_ED.shape[1]
    if rows_ED.shape[0] == 0:  # every pair dropped: nothing to index
        return rows_ED.new_zeros(N, D) + _graph_zero(rows_ED)
    valid_NK1 = (dest_NK >= 0).unsqueeze(-1)
    picked_NKD = rows_ED.index_select(0, dest_NK.clamp(min=0).reshape(-1)).view(N, K, D)
    if gates_NK is not None:
        picked_NKD = picked_NKD * gates_NK.unsqueeze(-1)
    return torch.where(valid_NK1, picked_NKD, 0.0).sum(1)


def gate_grad(a_ND, rows_ED, dest_NK, row_pair_E):
    N, K = dest_NK.shape
    D = a_ND.shape[1]
    if rows_ED.shape[0] == 0:
        return a_ND.new_zeros(N, K) + _graph_zero(a_ND, rows_ED)
    picked_NKD = rows_ED.index_select(0, dest_NK.clamp(min=0).reshape(-1)).view(N, K, D)
    dot_NK = (picked_NKD * a_ND.unsqueeze(1)).sum(-1)
    return torch.where(dest_NK >= 0, dot_NK, 0.0)


def groups(slot_rows_A: torch.Tensor) -> list[tuple[int, int]]:
    """The groups of a plan as (slots, rows per slot): runs of equal slot_rows. One host copy."""
    runs: list[tuple[int, int]] = []
    for rows in slot_rows_A.tolist():
        if runs and runs[-1][1] == rows:
            runs[-1] = (runs[-1][0] + 1, rows)
        else:
            runs.append((1, rows))
    return runs


def grouped_mm(a_EI, b_SIO, slot_ids_A, slot_rows_A):
    """Per group, one bmm of the group's [slots, rows, I] buffer with its view of the weights."""
    w_AIO = b_SIO.index_select(0, slot_ids_A)  # one gather per call, split into views below
    outs, row, slot = [], 0, 0
    for n_slots, rows in groups(slot_rows_A):
        a_GCI = a_EI[row:row + n_slots * rows].view(n_slots, rows, a_EI.shape[1])
        outs.append(torch.bmm(a_GCI, w_AIO[slot:slot + n_slots]).reshape(n_slots * rows, b_SIO.shape[2]))
        row += n_slots * rows
        slot += n_slots
    if row > a_EI.shape[0]:
        raise ValueError(f"minagi.grouped_mm: slot_rows sums to {row} rows but a has only {a_EI.shape[0]}")
    # Rows past the ranges (an exact plan's dropped pairs) own no slot: zeros.
    outs.append(a_EI.new_zeros(a_EI.shape[0] - row, b_SIO.shape[2]) + _graph_zero(a_EI, b_SIO))
    return torch.cat(outs)


def dequantize(q_SOX, scale, bits: int, group_size: int, dtype: torch.dtype, n_in: int | None = None) -> torch.Tensor:
    """The float weight [S, out, in] that quantized storage stands for (minagi/moe/quant.py's format):
    bits 8: q [S, out, in'] int8; bits 4: q [S, out, in' / 2] uint8, each 32 inputs' block in 16
    bytes, byte j holding input j in its low nibble and input j + 16 in its high one, each nibble the
    value + 8. scale [S, out] (group_size 0: one per output channel) or [S, out, in' / group_size].
    in' is what q stores: n_in (default: all of it), and with groups the padding past it to the end
    of the last group (zeros), left out. Computed in float32 (float64 for float64), where q * scale
    is exact, then cast to dtype."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if bits == 8:
        v_SOI = q_SOX.to(work)
    elif bits == 4:
        S, O, X = q_SOX.shape
        b = q_SOX.view(S, O, X // 16, 16).to(torch.int16)  # one 32-input block per 16 bytes
        v_SOI = (torch.stack([b & 15, b >> 4], dim=3) - 8).reshape(S, O, 2 * X).to(work)
    else:
        raise ValueError(f"minagi.dequantize: bits must be 8 or 4, got {bits}")
    s = scale.to(work)
    if group_size == 0:
        w_SOI = v_SOI * s.unsqueeze(-1)
    else:
        S, O, I = v_SOI.shape
        w_SOI = (v_SOI.view(S, O, I // group_size, group_size) * s.unsqueeze(-1)).view(S, O, I)
    return (w_SOI if n_in is None else w_SOI[..., :n_in]).to(dtype)


def qgrouped_mm(a_EI, q_SOX, scale, slot_ids_A, slot_rows_A, bits: int, group_size: int, *, ops=None):
    """grouped_mm with quantized weights: each listed slot's weights dequantized (in a's dtype),
    then the float grouped GEMM. The oracle of the compiled kernel, and its stand-in on devices
    without one (ops: whose grouped_mm to use, as gather_mm_act's)."""
    ops = ops or _twins()
    w_AOI = dequantize(q_SOX.index_select(0, slot_ids_A), scale.index_select(0, slot_ids_A), bits, group_size,
                       a_EI.dtype, a_EI.shape[1])
    ids_A = torch.arange(slot_ids_A.shape[0], device=slot_ids_A.device)
    return ops.grouped_mm(a_EI, w_AOI.mT, ids_A, slot_rows_A)


def grouped_mm_wgrad(a_EI, grad_EO, slot_ids_A, slot_rows_A, n_slots: int):
    outs, row = [], 0
    for n_group, rows in groups(slot_rows_A):
        a_GCI = a_EI[row:row + n_group * rows].view(n_group, rows, a_EI.shape[1])
        g_GCO = grad_EO[row:row + n_group * rows].view(n_group, rows, grad_EO.shape[1])
        outs.append(torch.bmm(a_GCI.transpose(1, 2), g_GCO))
        row += n_group * rows
    out_SIO = a_EI.new_zeros(n_slots, a_EI.shape[1], grad_EO.shape[1]) + _graph_zero(a_EI, grad_EO)
    if outs:
        out_SIO = out_SIO.index_add(0, slot_ids_A, torch.cat(outs))
    return out_SIO


def grouped_mm_act(a_EK, b_SKM, bias_SM, slot_ids_A, slot_rows_A, activation: str, alpha: float, limit: float):
    """h = grouped_mm(a, b) + bias[slot of each row], and the form's activation of h."""
    h_EM = grouped_mm(a_EK, b_SKM, slot_ids_A, slot_rows_A)
    if bias_SM is not None:
        h_EM = h_EM + per_row(bias_SM, slot_ids_A, slot_rows_A, h_EM.shape[0])
    return h_EM, activate(h_EM, activation, alpha, limit)


def gather_mm_act(x_ND, b_SKM, bias_SM, slot_ids_A, slot_rows_A, row_pair_E, dest_NK, activation: str,
                  alpha: float, limit: float, *, ops=None):
    """The activation of grouped_mm_act on the plan's gathered rows of x (inference's first layer).
    ops: whose gather and grouped_mm_act to compose (the twins by default; the compiled op's
    backward passes the compiled ops, whose own autograd then traces)."""
    ops = ops or _twins()
    buf_EK = ops.bucketed_gather(x_ND, row_pair_E, dest_NK, None)
    return ops.grouped_mm_act(buf_EK, b_SKM, bias_SM, slot_ids_A, slot_rows_A, activation, alpha, limit)[1]


def grouped_mm_scatter(a_EI, b_SID, gates_NK, slot_ids_A, slot_rows_A, row_pair_E, dest_NK):
    """An expert's second layer and the gated combine: weighted_scatter(grouped_mm(a, b), ...)."""
    return weighted_scatter(grouped_mm(a_EI, b_SID, slot_ids_A, slot_rows_A), dest_NK, row_pair_E, gates_NK)


def decode_experts(x_ND, slot_idx_NK, gates_NK, w_in_SDM, w_out_SHD, b_in_SM, b_out_SD, activation: str,
                   alpha: float, limit: float, *, ops=None):
    """Writing's experts in one call: sum_j gates[n, j] * (act(x[n] @ w_in[s] + b_in[s]) @ w_out[s] +
    b_out[s]), s = slot_idx[n, j], composed from the exact plan's pipeline. ops: as gather_mm_act's."""
    ops = ops or _twins()
    _, order_S, rows_S, row_pair_R, dest_NK = ops.group_plan(slot_idx_NK, w_in_SDM.shape[0], 0, False)
    buf_RD = ops.bucketed_gather(x_ND, row_pair_R, dest_NK, None)
    a_RH = ops.grouped_mm_act(buf_RD, w_in_SDM, b_in_SM, order_S, rows_S, activation, alpha, limit)[1]
    out_RD = ops.grouped_mm(a_RH, w_out_SHD, order_S, rows_S)
    if b_out_SD is not None:
        out_RD = out_RD + per_row(b_out_SD, order_S, rows_S, out_RD.shape[0])
    return ops.weighted_scatter(out_RD, dest_NK, row_pair_R, gates_NK)


def qdecode_experts(x_ND, slot_idx_NK, gates_NK, q_in, scale_in, bits_in: int, group_in: int, q_out, scale_out,
                    bits_out: int, group_out: int, b_in_SM, b_out_SD, activation: str, alpha: float, limit: float, *,
                    ops=None):
    """decode_experts with quantized weights (qgrouped_mm's q and scale for each layer), composed
    from the exact plan's pipeline with qgrouped_mm for both GEMMs. ops: as gather_mm_act's."""
    ops = ops or _twins()
    _, order_S, rows_S, row_pair_R, dest_NK = ops.group_plan(slot_idx_NK, q_in.shape[0], 0, False)
    buf_RD = ops.bucketed_gather(x_ND, row_pair_R, dest_NK, None)
    h_RM = ops.qgrouped_mm(buf_RD, q_in, scale_in, order_S, rows_S, bits_in, group_in)
    if b_in_SM is not None:
        h_RM = h_RM + per_row(b_in_SM, order_S, rows_S, h_RM.shape[0])
    out_RD = ops.qgrouped_mm(activate(h_RM, activation, alpha, limit), q_out, scale_out, order_S, rows_S, bits_out,
                             group_out)
    if b_out_SD is not None:
        out_RD = out_RD + per_row(b_out_SD, order_S, rows_S, out_RD.shape[0])
    return ops.weighted_scatter(out_RD, dest_NK, row_pair_R, gates_NK)


def expert_act_backward(grad_EW, h_EM, slot_ids_A, slot_rows_A, activation: str, alpha: float, limit: float,
                        n_slots: int, bias_grad: bool):
    """h's gradient through the activation, and per slot the column sums of it (the bias's)."""
    with torch.enable_grad():
        h = h_EM if h_EM.requires_grad else h_EM.detach().requires_grad_()
        (grad_h_EM,) = torch.autograd.grad(activate(h, activation, alpha, limit), h, grad_EW, create_graph=True)
    if not bias_grad:
        return grad_h_EM, h_EM.new_zeros(0)
    return grad_h_EM, slot_sums(grad_h_EM, slot_ids_A, slot_rows_A, n_slots)


def scatter_mm_backward(grad_y_ND, a_EI, b_SID, gates_NK, slot_ids_A, slot_rows_A, row_pair_E, dest_NK,
                        b_grad: int, *, ops=None):
    """The gradients of y = weighted_scatter(grouped_mm(a, b, slot_ids, slot_rows), dest, row_pair,
    gates) with respect to a, b and the gates, given y's: (grad_a [E, I], grad_b, grad_gates [N, k]).
    grad_b is [S, I, D] for b_grad 1, the same transposed ([S, D, I], contiguous) for 2, [0] for 0. The gates'
    gradient is <a_r, grad_y b^T> per pair's row r, which equals <grad_y, a_r b>. ops: as gather_mm_act's."""
    ops = ops or _twins()
    N, K = dest_NK.shape
    valid_E = row_pair_E >= 0
    dy_ED = ops.bucketed_gather(grad_y_ND, row_pair_E, dest_NK, None)  # each row's character's gradient
    g_EI = ops.grouped_mm(dy_ED, b_SID.transpose(1, 2), slot_ids_A, slot_rows_A)
    gate_E = torch.where(valid_E, gates_NK.reshape(-1).index_select(0, row_pair_E.clamp(min=0)), 0.0)
    grad_a_EI = g_EI * gate_E.unsqueeze(1)
    if a_EI.shape[0]:
        dot_NK = (g_EI * a_EI).sum(1).index_select(0, dest_NK.clamp(min=0).reshape(-1)).view(N, K)
        grad_gates_NK = torch.where(dest_NK >= 0, dot_NK, 0.0)
    else:  # every pair dropped
        grad_gates_NK = gates_NK.new_zeros(N, K) + _graph_zero(grad_y_ND, a_EI, b_SID, gates_NK)
    if not b_grad:
        return grad_a_EI, a_EI.new_zeros(0), grad_gates_NK
    grad_b_SID = ops.grouped_mm_wgrad(a_EI, dy_ED * gate_E.unsqueeze(1), slot_ids_A, slot_rows_A, b_SID.shape[0])
    return grad_a_EI, grad_b_SID.transpose(1, 2).contiguous() if b_grad == 2 else grad_b_SID, grad_gates_NK


def _twins():
    """This module as the ops of the composed twins (their default)."""
    return sys.modules[__name__]
