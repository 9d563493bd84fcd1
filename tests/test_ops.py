"""Each compiled op against its pure-torch twin, forward and backward; opcheck; gradcheck."""
from pathlib import Path

import pytest
import torch

from minagi.moe import ops, reference
from minagi.bench.routings import sink_routing

from cases import CASES, make
from conftest import assert_close, requires_ext, tile_bytes

pytestmark = requires_ext
REF = ops.REFERENCE
DTYPES = [torch.float32, torch.float64]


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    if isinstance(out, (tuple, list)):
        out = [o for o in out if o.is_floating_point()]
    else:
        out = [out]
    gouts = [torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device) for o in out]
    live = [t for t in inputs if t is not None and t.requires_grad]
    got = torch.autograd.grad(out, live, gouts, allow_unused=True)
    it = iter(got)
    return [next(it) if (t is not None and t.requires_grad) else None for t in inputs]


def _leaf(t, device=None):
    return t.detach().to(device or t.device).clone().requires_grad_(t.is_floating_point())


def _cpu(t):
    return None if t is None else t.cpu()


def _compare(fn_c, fn_r, inputs, dtype, msg, device=torch.device("cpu")):
    """Forward outputs and input gradients of the compiled op on `device` against the twin's on
    the CPU (the oracle)."""
    ic = [_leaf(t, device) if isinstance(t, torch.Tensor) else t for t in inputs]
    ir = [_leaf(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    oc, orf = fn_c(*ic), fn_r(*ir)
    for a, b in zip(oc if isinstance(oc, tuple) else (oc,), orf if isinstance(orf, tuple) else (orf,)):
        if a.is_floating_point():
            assert_close(a.cpu(), b, dtype, msg=f"{msg} forward")
        else:
            assert torch.equal(a.cpu(), b), f"{msg} forward (indices)"
    tc = [t for t in ic if isinstance(t, torch.Tensor)]
    tr = [t for t in ir if isinstance(t, torch.Tensor)]
    if not any(t.requires_grad for t in tc):
        return
    out_c = [o for o in (oc if isinstance(oc, tuple) else (oc,)) if o.is_floating_point()]
    if not out_c or sum(o.numel() for o in out_c) == 0:
        return
    for i, (gc, gr) in enumerate(zip(_grads(oc, tc), _grads(orf, tr))):
        if tc[i].requires_grad:
            assert_close(_cpu(gc), gr, dtype, scale=4, msg=f"{msg} grad of input {i}")


def _plan(slot_idx, S, cap=0, bucketed=True):
    return REF.group_plan(slot_idx, S, cap, bucketed)


# ---------------------------------------------------------------- routing

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,S,K", [(1, 8, 3), (0, 8, 2), (40, 6, 1), (10, 4, 4), (15, 1, 1), (300, 128, 8)])
def test_routing_matches_twin(compiled, device, dtype, N, S, K):
    # Rounded logits make ties; both must send a tie to the lower slot.
    logits = (torch.randn(N, S) * 2).round().to(dtype)
    _compare(compiled.routing, REF.routing, [logits, K], dtype, "routing", device)
    idx, _, load = compiled.routing(logits.to(device), K)
    assert torch.equal(load.cpu(), torch.bincount(idx.reshape(-1).cpu(), minlength=S))


def test_routing_ties_go_to_lower_slot(compiled, device):
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]], device=device)
    for impl in (compiled, REF):
        idx, gates, _ = impl.routing(logits, 2)
        assert idx.tolist() == [[1, 2]]
        assert_close(gates.cpu(), torch.tensor([[0.5, 0.5]]))


def test_routing_nan_logits_are_safe(compiled, device):
    nan = float("nan")
    logits = torch.tensor([[nan, 0.5, nan, 2.0], [nan, nan, nan, nan], [1.0, 2.0, 3.0, 4.0]], device=device)
    for impl in (compiled, REF):
        idx, gates, load = impl.routing(logits, 2)
        assert idx.tolist()[0] == [3, 1]          # NaN ranks below every number
        assert idx.tolist()[1] == [0, 1]          # an all-NaN row: the lowest slots, valid indices
        assert gates[1].isnan().all()             # and NaN gates, so the loss shows it
        assert not gates[0].isnan().any() and not gates[2].isnan().any()
        assert int(load.sum()) == 6
    assert torch.equal(compiled.routing(logits, 2)[0].cpu(), REF.routing(logits.cpu(), 2)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_routing_backward_matches_twin(compiled, device, dtype):
    gates = torch.softmax(torch.randn(30, 4, dtype=dtype), 1)
    grad = torch.randn(30, 4, dtype=dtype)
    idx = torch.randn(30, 9).topk(4, dim=1).indices
    got = compiled.routing_backward(grad.to(device), gates.to(device), idx.to(device), 9)
    assert_close(got.cpu(), REF.routing_backward(grad, gates, idx, 9), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_routing_half_precision(compiled, device, dtype):
    logits = torch.randn(50, 16).to(dtype)
    ic, gc, _ = compiled.routing(logits.to(device), 4)
    ir, gr, _ = REF.routing(logits, 4)
    assert torch.equal(ic.cpu(), ir)
    assert_close(gc.cpu(), gr, dtype)


# ---------------------------------------------------------------- group_plan

@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cap", [0, 1, 5])
@pytest.mark.parametrize("bucketed", [True, False])
def test_group_plan_matches_twin(compiled, device, name, cap, bucketed):
    N, S, K, build = CASES[name]
    slot_idx = build(N, S, K)
    got = compiled.group_plan(slot_idx.to(device), S, cap, bucketed)
    want = REF.group_plan(slot_idx, S, cap, bucketed)
    for field, a, b in zip(("load", "slot_order", "slot_rows", "row_pair", "dest"), got, want):
        assert torch.equal(a.cpu(), b), f"{name}: {field} differs"
    assert got[2].device.type == "cpu"  # slot_rows: the grouped GEMM's sizes, on the host
    for field, t in zip(("load", "slot_order", "row_pair", "dest"), (got[0], got[1], got[3], got[4])):
        assert t.device.type == device.type, f"{field} left the device"


def test_sink_plan_splits_into_groups(compiled, device):
    slot_idx = CASES["sink"][3](*CASES["sink"][:3]).to(device)
    load, order, rows, row_pair, dest = compiled.group_plan(slot_idx, 16, 0, True)
    assert len(reference.groups(rows)) >= 2
    assert int(order[-1]) == 0 and int(load[0]) == 282  # the sink, busiest, last
    assert int(rows[-1]) == reference.bucket(282) == 384


def test_one_character_is_one_group(compiled, device):
    slot_idx = torch.tensor([[5, 1, 7]], device=device)
    load, order, rows, row_pair, dest = compiled.group_plan(slot_idx, 8, 0, True)
    assert reference.groups(rows) == [(3, 1)]
    assert sorted(order.tolist()) == [1, 5, 7]


@pytest.mark.parametrize("n,b", [(0, 0), (1, 1), (2, 2), (3, 4), (100, 128), (128, 128), (129, 256),
                                 (256, 256), (257, 384), (1960, 2048)])
def test_bucket(n, b):
    assert reference.bucket(n) == b
    assert int(reference.bucket(torch.tensor([n]))) == b


def test_bucket_is_the_compiled_ops_bucket(compiled):
    # csrc/sizes.h's bucket(), reached through the CPU group_plan: a bucketed plan's slot_rows are
    # bucket(load). Slot s of a call has load n0 + s, for every n up to 5,000, a call per chunk of
    # about a million pairs; a slot with no pairs (n = 0) is left out of the plan, its 0 rows.
    n, n_max = 0, 5000
    while n <= n_max:
        loads = []
        while n <= n_max and sum(loads) + n <= 1 << 20:
            loads.append(n)
            n += 1
        load_S = torch.tensor(loads)
        slot_idx = torch.repeat_interleave(torch.arange(len(loads)), load_S).view(-1, 1)
        load, order, rows, _, _ = compiled.group_plan(slot_idx, len(loads), 0, True)
        assert torch.equal(load, load_S)
        want = reference.bucket(load_S)
        assert torch.equal(rows, want[order]), f"loads {loads[0]}..{loads[-1]}"
        assert rows.tolist() == [reference.bucket(int(x)) for x in load[order]]
        assert int((want == 0).sum()) == len(loads) - len(order)  # only a load of 0 buckets to 0


# ---------------------------------------------------------------- gather / scatter / gate_grad

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cap", [0, 2])
@pytest.mark.parametrize("with_gates", [False, True])
def test_gather_scatter_match_twin(compiled, device, dtype, name, cap, with_gates):
    slot_idx, (x, gates, _, _) = make(name, dtype)
    N, S, K, _ = CASES[name]
    _, _, _, row_pair, dest = _plan(slot_idx, S, cap)
    g = gates if with_gates else None
    _compare(compiled.bucketed_gather, REF.bucketed_gather, [x, row_pair, dest, g], dtype, "gather", device)
    rows = torch.randn(row_pair.shape[0], x.shape[1], dtype=dtype)
    _compare(compiled.weighted_scatter, REF.weighted_scatter, [rows, dest, row_pair, g], dtype, "scatter", device)
    _compare(compiled.gate_grad, REF.gate_grad, [x, rows, dest, row_pair], dtype, "gate_grad", device)


def test_gather_and_scatter_are_each_others_backward(compiled):
    slot_idx, (x, gates, _, _) = make("sink")
    _, _, _, row_pair, dest = _plan(slot_idx, 16)
    rows = torch.randn(row_pair.shape[0], x.shape[1], dtype=torch.float64)
    # <gather(x), rows> == <x, scatter(rows)>: adjoint maps.
    lhs = (compiled.bucketed_gather(x, row_pair, dest, gates) * rows).sum()
    rhs = (x * compiled.weighted_scatter(rows, dest, row_pair, gates)).sum()
    assert_close(lhs, rhs)


def test_gather_zero_pads(compiled, device):
    slot_idx = torch.tensor([[0], [0], [1]])
    x = torch.arange(6.0).view(3, 2)
    _, _, rows, row_pair, dest = _plan(slot_idx, 2)
    out = compiled.bucketed_gather(x.to(device), row_pair.to(device), dest.to(device), None)
    assert rows.tolist() == [1, 2] and out.tolist() == [[4, 5], [0, 1], [2, 3]]


# ---------------------------------------------------------------- grouped GEMM

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("bucketed", [True, False])
def test_grouped_mm_matches_twin(compiled, device, dtype, name, bucketed):
    slot_idx, (_, _, w_in, _) = make(name, dtype)
    N, S, K, _ = CASES[name]
    _, order, rows, row_pair, _ = _plan(slot_idx, S, 0, bucketed)
    a = torch.randn(row_pair.shape[0], w_in.shape[1], dtype=dtype)
    # slot_rows stays on the host, as group_plan returns it for every device
    call = lambda a, b, o, r: compiled.grouped_mm(a, b, o, rows)  # noqa: E731
    _compare(call, REF.grouped_mm, [a, w_in, order, rows], dtype, "grouped_mm", device)
    g = torch.randn(row_pair.shape[0], 5, dtype=dtype)
    call = lambda a, g, o, r, S: compiled.grouped_mm_wgrad(a, g, o, rows, S)  # noqa: E731
    _compare(call, REF.grouped_mm_wgrad, [a, g, order, rows, S], dtype, "wgrad", device)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_grouped_mm_few_rows(compiled, device, rows, dtype):
    # Writing puts one row in each of its top_k slots; the CPU streams such small ranges through
    # its own loop instead of the BLAS. Widths that are not multiples of its unrolling or block.
    ids = torch.tensor([3, 0, 3, 1])
    slot_rows = torch.full((4,), rows)
    a = torch.randn(4 * rows, 1030, dtype=torch.float64)
    b = torch.randn(5, 1030, 1027, dtype=torch.float64) / 32
    got = compiled.grouped_mm(a.to(device, dtype), b.to(device, dtype), ids.to(device), slot_rows)
    assert_close(got.cpu(), REF.grouped_mm(a, b, ids, slot_rows), dtype, scale=4)


def test_grouped_mm_transposed_weights(compiled, device):
    slot_idx = sink_routing(200, 8, 2, 190)
    _, order, rows, row_pair, _ = _plan(slot_idx, 8, 0, False)
    a = torch.randn(row_pair.shape[0], 6, dtype=torch.float64)
    b_t = torch.randn(8, 7, 6, dtype=torch.float64).transpose(1, 2)  # a strided view
    got = compiled.grouped_mm(a.to(device), b_t.to(device), order.to(device), rows)
    assert_close(got.cpu(), REF.grouped_mm(a, b_t, order, rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_grouped_mm_weights_with_no_unit_stride(compiled, device, dtype):
    # A view with no unit stride cannot go to the BLAS as it is: the CPU takes ATen's mm there.
    slot_idx = sink_routing(300, 8, 2, 190)
    _, order, rows, row_pair, _ = _plan(slot_idx, 8, 0, False)
    a = torch.randn(row_pair.shape[0], 24, dtype=torch.float64)
    b = torch.randn(8, 48, 40, dtype=torch.float64) / 4
    b_view = b.to(device, dtype)[:, ::2, ::2]
    assert 1 not in b_view.stride()[1:]
    got = compiled.grouped_mm(a.to(device, dtype), b_view, order.to(device), rows)
    assert_close(got.cpu(), REF.grouped_mm(a, b[:, ::2, ::2], order, rows), dtype, scale=4)


OWN_KERNEL_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("K,N", [(1, 1), (3, 17), (33, 40), (64, 64), (130, 95)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", OWN_KERNEL_DTYPES)
def test_grouped_mm_slot_shapes(compiled, K, N, transposed, dtype):
    # In float32 and bfloat16 a slot of more than a few rows goes through the CPU's own AVX-512
    # kernels (csrc/cpu/f32_gemm.h, bf16_gemm.h) where the CPU has them (ATen's mm elsewhere):
    # 8-row tiles and every remainder (5 to 19 rows, 40), odd K (in bfloat16 a pair with a zero),
    # N past their 32-column blocks, and weights in either layout (.mT of [S, N, K] is how
    # nn.Linear-style experts come in).
    rows = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 19, 40])
    ids = torch.randperm(len(rows))
    a = torch.randn(int(rows.sum()), K).to(dtype)
    b = (torch.randn(len(rows), N, K).mT if transposed else torch.randn(len(rows), K, N)) / K ** 0.5
    b = b.to(dtype)
    got = compiled.grouped_mm(a, b, ids, rows)
    want = REF.grouped_mm(a.double(), b.double(), ids, rows)  # exact from the same values
    assert_close(got, want, dtype)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_slots_of_many_rows(compiled, transposed, dtype):
    # On CPUs without AVX-512 a bfloat16 or float16 slot of more than a few rows is multiplied in
    # float32 (csrc/cpu/slot_gemm.h widened_mm): at K = 4,096 its rows go in 64-row chunks (100
    # rows: two) and its columns in 16-column tiles (40: a short last one). Elsewhere ATen's mm.
    K, M = 4096, 40
    rows = torch.tensor([5, 100, 0, 70])
    ids = torch.tensor([2, 0, 3, 1])
    a = torch.randn(int(rows.sum()), K).to(dtype)
    b = ((torch.randn(4, M, K).mT if transposed else torch.randn(4, K, M)) / K ** 0.5).to(dtype)
    got = compiled.grouped_mm(a, b, ids, rows)
    assert_close(got, REF.grouped_mm(a.double(), b.double(), ids, rows), dtype)


@pytest.mark.parametrize("K,M", [(1, 1), (3, 17), (33, 40), (130, 95), (64, 1026), (257, 1027), (40, 2085)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", OWN_KERNEL_DTYPES)
@pytest.mark.parametrize("copies", [1, 3])
def test_few_rows_kernels(compiled, K, M, transposed, dtype, copies):
    # Writing's products: ranges of 1 to 4 rows (and an empty one), through csrc/cpu/small_rows.h
    # where the CPU has AVX-512 (the portable loops elsewhere), in both weight layouts, with every
    # remainder of their 16/32-value steps and of the 2,048-column chunk. On one thread each range
    # is one part; on 3, small_ranges_by_columns shares them out: 5 ranges have their columns cut
    # (the bias added to each part's columns), 15 are a part each; then the activation runs once
    # over all rows.
    rows = torch.tensor([1, 2, 0, 3, 4, 1] * copies)
    ids = torch.tensor([3, 0, 5, 3, 1, 2] * copies)
    a = torch.randn(int(rows.sum()), K).to(dtype)
    b = (torch.randn(6, M, K).mT if transposed else torch.randn(6, K, M)) / K ** 0.5
    b, bias = b.to(dtype), torch.randn(6, M).to(dtype)
    want = REF.grouped_mm(a.double(), b.double(), ids, rows)
    want_h, want_act = REF.grouped_mm_act(a.double(), b.double(), bias.double(), ids, rows, "relu2", 1.0, 0.0)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert_close(compiled.grouped_mm(a, b, ids, rows), want, dtype, msg=f"{n} threads")
            h, act = compiled.grouped_mm_act(a, b, bias, ids, rows, "relu2", 1.0, 0.0)
            assert_close(h, want_h, dtype, msg=f"h, {n} threads")
            assert_close(act, want_act, dtype, scale=4, msg=f"relu2, {n} threads")
            if M % 2 == 0:  # a gated form's halves meet only after every part's columns are done
                got = compiled.grouped_mm_act(a, b, None, ids, rows, "swiglu", 1.0, 0.0)[1]
                gated = REF.grouped_mm_act(a.double(), b.double(), None, ids, rows, "swiglu", 1.0, 0.0)[1]
                assert_close(got, gated, dtype, scale=4, msg=f"swiglu, {n} threads")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_decode_experts_matches_twin(compiled, activation, transposed, dtype):
    # Writing's one op (CPU only): 1 to 4 characters whose pairs share slots (one range a slot, read
    # once), with and without both biases, against its twin (every pair its own row).
    if not ops.has_fused("decode_experts", torch.device("cpu")):
        pytest.skip("this build has no decode_experts kernel")
    S, D, H = 6, 40, 24
    M = 2 * H if activation in reference.GATED else H
    g = torch.Generator().manual_seed(5)
    w_in = (torch.randn(S, M, D, generator=g).mT if transposed else torch.randn(S, D, M, generator=g)) / D ** 0.5
    w_out = (torch.randn(S, D, H, generator=g).mT if transposed else torch.randn(S, H, D, generator=g)) / H ** 0.5
    b_in, b_out = torch.randn(S, M, generator=g) / 4, torch.randn(S, D, generator=g) / 4
    idx = torch.tensor([[3, 0, 5], [0, 3, 1], [2, 3, 0], [5, 4, 3]])
    for N, K in ((1, 3), (2, 1), (4, 3)):
        x, gates = torch.randn(N, D, generator=g), torch.rand(N, K, generator=g)
        for biases in ((None, None), (b_in, b_out)):
            args = [t if t is None else t.to(dtype) for t in (x, idx[:N, :K], gates, w_in, w_out, *biases)]
            args[1] = idx[:N, :K]
            got = compiled.decode_experts(*args, activation, 1.702, 7.0)
            wide = [t.double() if t is not None and t.is_floating_point() else t for t in args]
            want = REF.decode_experts(*wide, activation, 1.702, 7.0)
            assert_close(got, want, dtype, scale=4, msg=f"N={N} K={K} biases={biases[0] is not None}")


def test_decode_experts_gradients_through_the_twin(compiled):
    # Dispatch never asks decode_experts for a gradient; whoever does gets the twin's.
    if not ops.has_fused("decode_experts", torch.device("cpu")):
        pytest.skip("this build has no decode_experts kernel")
    g = torch.Generator().manual_seed(1)
    x, gates = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.rand(2, 2, generator=g, dtype=torch.float64)
    w_in, w_out = torch.randn(3, 5, 8, generator=g, dtype=torch.float64), torch.randn(3, 4, 5, generator=g,
                                                                                     dtype=torch.float64)
    b_out = torch.randn(3, 5, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 2], [2, 1]])
    leaves = [t.requires_grad_() for t in (x, gates, w_in, w_out, b_out)]
    fn = lambda x, g_, wi, wo, bo: compiled.decode_experts(x, idx, g_, wi, wo, None, bo, "swiglu", 1.702, 7.0)  # noqa: E731
    assert torch.autograd.gradcheck(fn, leaves)
    (grad_x,) = torch.autograd.grad(fn(*leaves).sum(), leaves[0])
    assert not grad_x.requires_grad  # a first backward builds no graph for a second


def test_decode_experts_names_bad_arguments(compiled):
    if not ops.has_fused("decode_experts", torch.device("cpu")):
        pytest.skip("this build has no decode_experts kernel")
    x, idx, gates = torch.randn(2, 8), torch.tensor([[0, 1], [1, 2]]), torch.rand(2, 2)
    w_in, w_out = torch.randn(3, 8, 12), torch.randn(3, 12, 8)
    call = torch.ops.minagi.decode_experts
    with pytest.raises(RuntimeError, match=r"w_out must be \[S, H, D\] = \[3, 6, 8\]"):
        call(x, idx, gates, w_in, w_out, None, None, "swiglu", 1.702, 7.0)
    with pytest.raises(RuntimeError, match="gates .* must have the dtype of x"):
        call(x, idx, gates.double(), w_in, w_out, None, None, "gelu", 1.702, 7.0)
    with pytest.raises(RuntimeError, match="b_out must be \\[3, 8\\]"):
        call(x, idx, gates, w_in, w_out, None, torch.randn(3, 9), "gelu", 1.702, 7.0)
    with pytest.raises(ValueError, match="slot_idx holds 3, outside \\[0, S = 3\\) at token 0, position 1"):
        call(x, torch.tensor([[0, 3], [1, 2]]), gates, w_in, w_out, None, None, "gelu", 1.702, 7.0)


@pytest.mark.parametrize("M", [1, 17, 40, 95])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", OWN_KERNEL_DTYPES)
def test_bias_starts_the_sums(compiled, M, transposed, dtype):
    # The own kernels start each row's sums from its slot's bias (grouped_mm_act's h, and
    # gather_mm_act's tiles): every column of a 32-column block and past it, every row remainder.
    rows = torch.tensor([5, 6, 7, 8, 9, 13, 17, 40])
    ids = torch.randperm(len(rows))
    a = torch.randn(int(rows.sum()), 24).to(dtype)
    b = (torch.randn(len(rows), M, 24).mT if transposed else torch.randn(len(rows), 24, M)) / 24 ** 0.5
    b, bias = b.to(dtype), torch.randn(len(rows), M).to(dtype)
    h, out = compiled.grouped_mm_act(a, b, bias, ids, rows, "relu2", 1.0, 0.0)
    want_h, want = REF.grouped_mm_act(a.double(), b.double(), bias.double(), ids, rows, "relu2", 1.0, 0.0)
    assert_close(h, want_h, dtype, msg="h")
    assert_close(out, want, dtype, scale=4, msg="relu2")
    # gather_mm_act: the same bias on the gathered rows of a plan
    slot_idx = sink_routing(60, len(rows), 2, 50)
    _, order, srows, row_pair, dest = _plan(slot_idx, len(rows), 0, False)
    x = torch.randn(60, 24).to(dtype)
    args = (x, b, bias, order, srows, row_pair, dest, "relu2", 1.0, 0.0)
    want = REF.gather_mm_act(x.double(), b.double(), bias.double(), *args[3:])
    assert_close(compiled.gather_mm_act(*args), want, dtype, scale=4, msg="gather_mm_act")


@pytest.mark.parametrize("K,M", [(1, 1), (3, 17), (33, 40), (64, 64), (130, 95)])
@pytest.mark.parametrize("dtype", OWN_KERNEL_DTYPES)
def test_weight_gradients_slot_shapes(compiled, K, M, dtype):
    # The weight gradients' GEMMs (x^T y over a slot's rows) take the same kernels: an odd number
    # of rows (in bfloat16 a pair with a zero), widths past their 32-column blocks, an empty slot.
    rows = torch.tensor([1, 2, 5, 8, 9, 16, 33, 0, 40])
    ids = torch.randperm(len(rows))
    a = torch.randn(int(rows.sum()), K).to(dtype)
    g = torch.randn(int(rows.sum()), M).to(dtype)
    want = REF.grouped_mm_wgrad(a.double(), g.double(), ids, rows, len(rows) + 1)
    threads = torch.get_num_threads()
    try:
        for n in (1, 8):  # 8: the busiest slots' columns split across parts (grad's rows wider than a part)
            torch.set_num_threads(n)
            got = compiled.grouped_mm_wgrad(a, g, ids, rows, len(rows) + 1)
            assert_close(got, want, dtype, scale=2, msg=f"{n} threads")
    finally:
        torch.set_num_threads(threads)
    # scatter_mm_backward: a slot's rows of grad_y (times their gates) against a's, both layouts
    slot_idx = sink_routing(60, 8, 2, 50)
    _, order, srows, row_pair, dest = _plan(slot_idx, 8, 0, False)
    a2 = torch.randn(row_pair.shape[0], K).to(dtype)
    b2 = (torch.randn(8, K, M) / K ** 0.5).to(dtype)
    gy, gates = torch.randn(60, M).to(dtype), torch.rand(60, 2).to(dtype)
    for layout in (1, 2):
        got = compiled.scatter_mm_backward(gy, a2, b2, gates, order, srows, row_pair, dest, layout)
        want = REF.scatter_mm_backward(gy.double(), a2.double(), b2.double(), gates.double(), order, srows, row_pair,
                                       dest, layout)
        for x, y, what in zip(got, want, ("grad_a", "grad_b", "grad_gates")):
            assert_close(x, y, dtype, scale=2, msg=f"layout {layout} {what}")


@pytest.mark.parametrize("dtype", OWN_KERNEL_DTYPES)
def test_weight_gradients_past_the_cache(compiled, dtype):
    # A weight gradient of 16 MiB or more is written with non-temporal stores where its rows are
    # whole aligned 64-byte lines (the own kernels' stream_rows), with ordinary stores elsewhere:
    # both kinds of rows, in grouped_mm_wgrad and scatter_mm_backward, an empty slot among them.
    S, K = 64, 256
    # 520: rows that are not whole lines take the ordinary stores; 528: whole lines, but in float32
    # a last column block 16 wide (a whole block's streamed stores would pass the row's end)
    for M in (512, 520, 528):
        rows = torch.tensor([5 + i % 8 for i in range(S - 1)] + [0])
        ids = torch.randperm(S)
        a = torch.randn(int(rows.sum()), K).to(dtype)
        g = torch.randn(int(rows.sum()), M).to(dtype)
        got = compiled.grouped_mm_wgrad(a, g, ids, rows, S)
        assert got.nbytes >= 16 << 20
        assert_close(got, REF.grouped_mm_wgrad(a.double(), g.double(), ids, rows, S), dtype, scale=2, msg=f"M {M}")
    slot_idx = sink_routing(200, S, 2, 50)
    _, order, srows, row_pair, dest = _plan(slot_idx, S, 0, False)
    a2 = torch.randn(row_pair.shape[0], K).to(dtype)
    b2 = (torch.randn(S, K, 512) / K ** 0.5).to(dtype)
    gy, gates = torch.randn(200, 512).to(dtype), torch.rand(200, 2).to(dtype)
    got = compiled.scatter_mm_backward(gy, a2, b2, gates, order, srows, row_pair, dest, 1)
    want = REF.scatter_mm_backward(gy.double(), a2.double(), b2.double(), gates.double(), order, srows, row_pair,
                                   dest, 1)
    assert got[1].nbytes >= 16 << 20
    for x, y, what in zip(got[:2], want[:2], ("grad_a", "grad_b")):  # grad_gates: the slot-shape test
        assert_close(x, y, dtype, scale=2, msg=what)
    # a busy slot's columns split across 3 threads: parts 688 columns wide (16-aligned), so a
    # part's last column block is 16 wide and its neighbour's columns are another thread's
    rows = torch.tensor([300, 5, 7, 9])
    a, g = torch.randn(int(rows.sum()), 2 * K).to(dtype), torch.randn(int(rows.sum()), 2048).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        got = compiled.grouped_mm_wgrad(a, g, torch.arange(4), rows, 8)
    finally:
        torch.set_num_threads(threads)
    assert got.nbytes >= 16 << 20
    assert_close(got, REF.grouped_mm_wgrad(a.double(), g.double(), torch.arange(4), rows, 8), dtype, scale=2,
                 msg="split columns")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_mm_half_precision(compiled, device, dtype):
    slot_idx, (_, _, w_in, _) = make("sink", dtype, requires_grad=False)
    _, order, rows, row_pair, _ = _plan(slot_idx, 16)
    a = torch.randn(row_pair.shape[0], w_in.shape[1]).to(dtype)
    got = compiled.grouped_mm(a.to(device), w_in.to(device), order.to(device), rows)
    assert_close(got.cpu(), REF.grouped_mm(a, w_in, order, rows), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_scatter_half_precision(compiled, device, dtype):
    slot_idx, (x, gates, _, _) = make("sink", dtype, requires_grad=False)
    _, _, _, row_pair, dest = _plan(slot_idx, 16)
    x, gates, row_pair, dest = (t.to(device) for t in (x, gates, row_pair, dest))
    buf = compiled.bucketed_gather(x, row_pair, dest, gates)
    assert_close(buf.cpu(), REF.bucketed_gather(x.cpu(), row_pair.cpu(), dest.cpu(), gates.cpu()), dtype)
    y = compiled.weighted_scatter(buf, dest, row_pair, gates)
    assert_close(y.cpu(), REF.weighted_scatter(buf.cpu(), dest.cpu(), row_pair.cpu(), gates.cpu()), dtype)


def test_ops_are_deterministic(compiled, device):
    # The combine has no atomics: the same inputs give the same bits, in deterministic mode too.
    slot_idx, (x, gates, w_in, w_out) = make("sink", torch.float32, D=64, H=96, requires_grad=False)
    x, gates, w_in, w_out, slot_idx = (t.to(device) for t in (x, gates, w_in, w_out, slot_idx))

    def run():
        plan = compiled.group_plan(slot_idx, 16, 0, True)
        _, order, rows, row_pair, dest = plan
        h = compiled.grouped_mm(compiled.bucketed_gather(x, row_pair, dest, None), w_in, order, rows)
        y = compiled.weighted_scatter(compiled.grouped_mm(h, w_out, order, rows), dest, row_pair, gates)
        return y, compiled.gate_grad(x, h[:, :64], dest, row_pair), compiled.grouped_mm_wgrad(h, h, order, rows, 16)

    first = run()
    prior = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(3):
            for a, b in zip(first, run()):
                assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(prior)


def test_grouped_mm_splits_a_lone_slot_across_threads(compiled):
    # One slot owning every row: the CPU kernel cuts it into parts; the result must not change.
    a = torch.randn(1000, 32, dtype=torch.float64)
    b = torch.randn(1, 32, 48, dtype=torch.float64)
    ids, rows = torch.tensor([0]), torch.tensor([1000])
    assert_close(compiled.grouped_mm(a, b, ids, rows), a @ b[0])
    g = torch.randn(1000, 48, dtype=torch.float64)
    assert_close(compiled.grouped_mm_wgrad(a, g, ids, rows, 3)[0], a.t() @ g)
    assert compiled.grouped_mm_wgrad(a, g, ids, rows, 3)[1:].abs().sum() == 0


# ---------------------------------------------------------------- the fused second-layer backward

def _smb_problem(name, dtype, cap=0, bucketed=False, layout=1):
    """scatter_mm_backward's operands on a case's plan: b [S, I, D] contiguous (layout 1) or the .mT
    view of a contiguous [S, D, I] (layout 2)."""
    slot_idx, (x, gates, _, _) = make(name, dtype)
    N, S, K, _ = CASES[name]
    _, order, rows, row_pair, dest = _plan(slot_idx, S, cap, bucketed)
    I, D = 5, x.shape[1]
    a = torch.randn(row_pair.shape[0], I, dtype=dtype)
    b = torch.randn(S, I, D, dtype=dtype) if layout == 1 else torch.randn(S, D, I, dtype=dtype).mT
    return torch.randn(N, D, dtype=dtype), a, b, gates.detach(), order, rows, row_pair, dest


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cap,bucketed", [(0, False), (2, False), (0, True)])
@pytest.mark.parametrize("layout", [0, 1, 2])
def test_scatter_mm_backward_matches_twin_and_the_unfused_ops(compiled, dtype, name, cap, bucketed, layout):
    args = _smb_problem(name, dtype, cap, bucketed, 2 if layout == 2 else 1)
    grad_y, a, b, gates, order, rows, row_pair, dest = args
    got = compiled.scatter_mm_backward(*args, layout)
    want = REF.scatter_mm_backward(*args, layout)
    for what, g, w in zip(("a", "b", "gates"), got, want):
        assert g.shape == w.shape, what
        assert_close(g, w, dtype, scale=4, msg=f"scatter_mm_backward grad of {what}")
    if layout == 2:  # the gradient of a weight stored [S, D, I], in that layout
        assert got[1].is_contiguous()
    # The same three gradients from the unfused ops, through autograd.
    a_, b_, g_ = (t.clone().requires_grad_() for t in (a, b, gates))
    y = compiled.weighted_scatter(compiled.grouped_mm(a_, b_, order, rows), dest, row_pair, g_)
    ref_a, ref_b, ref_g = torch.autograd.grad(y, [a_, b_, g_], grad_y) if y.numel() else (None,) * 3
    assert_close(got[0], ref_a, dtype, scale=4, msg="grad of a vs the unfused ops")
    assert_close(got[2], ref_g, dtype, scale=4, msg="grad of gates vs the unfused ops")
    if layout:
        assert_close(got[1].mT if layout == 2 else got[1], ref_b, dtype, scale=4, msg="grad of b vs the unfused ops")
    else:
        assert got[1].numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scatter_mm_backward_half_precision(compiled, dtype):
    args = [t.to(dtype) if t.is_floating_point() else t for t in _smb_problem("sink", torch.float64)]
    for g, w in zip(compiled.scatter_mm_backward(*args, 1), REF.scatter_mm_backward(*args, 1)):
        assert_close(g, w, dtype, scale=4)


def test_scatter_mm_backward_bad_inputs_name_the_argument(compiled):
    grad_y, a, b, gates, order, rows, row_pair, dest = _smb_problem("uniform", torch.float64)
    with pytest.raises(RuntimeError, match="scatter_mm_backward: b_grad must be 0"):
        compiled.scatter_mm_backward(grad_y, a, b, gates, order, rows, row_pair, dest, 3)
    with pytest.raises(RuntimeError, match=r"scatter_mm_backward: grad_y.shape\[1\] must equal b.shape\[2\]"):
        compiled.scatter_mm_backward(grad_y[:, :3], a, b, gates, order, rows, row_pair, dest, 1)
    with pytest.raises(RuntimeError, match="scatter_mm_backward: gates .* must have the dtype of a"):
        compiled.scatter_mm_backward(grad_y, a, b, gates.float(), order, rows, row_pair, dest, 1)
    with pytest.raises(RuntimeError, match="scatter_mm_backward: row_pair holds"):
        compiled.scatter_mm_backward(grad_y, a, b, gates, order, rows, row_pair.clamp(max=0) + 10 ** 6, dest, 1)


# ---------------------------------------------------------------- inference's first layer in tiles

def _gma_problem(name, dtype, cap=0, bucketed=False, activation="gelu", bias=False, transposed=False, M=12):
    """gather_mm_act's operands on a case's plan: w [S, D, M] contiguous or the .mT view of [S, M, D]."""
    slot_idx, (x, _, _, _) = make(name, dtype, requires_grad=False)
    N, S, K, _ = CASES[name]
    _, order, rows, row_pair, dest = _plan(slot_idx, S, cap, bucketed)
    D = x.shape[1]
    w = torch.randn(S, M, D, dtype=dtype).mT if transposed else torch.randn(S, D, M, dtype=dtype)
    b = torch.randn(S, M, dtype=dtype) if bias else None
    return (x, w / D ** 0.5, b, order, rows, row_pair, dest, activation, 1.702, 7.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cap,bucketed", [(0, False), (2, False), (0, True)])
@pytest.mark.parametrize("activation,bias,transposed", [("gelu", False, False), ("swiglu", True, False),
                                                        ("swiglu_oai", True, True), ("relu2", False, True)])
def test_gather_mm_act_matches_twin_and_the_unfused_ops(compiled, dtype, name, cap, bucketed, activation, bias,
                                                         transposed):
    args = _gma_problem(name, dtype, cap, bucketed, activation, bias, transposed)
    x, w, b, order, rows, row_pair, dest, *form = args
    got = compiled.gather_mm_act(*args)
    assert_close(got, REF.gather_mm_act(*args), dtype, scale=4)
    unfused = compiled.grouped_mm_act(compiled.bucketed_gather(x, row_pair, dest, None), w, b, order, rows, *form)[1]
    assert_close(got, unfused, dtype, scale=4, msg="against grouped_mm_act on bucketed_gather's rows")
    with tile_bytes("gather", 0):  # no slot's rows fit a tile: the op's own whole-buffer branch
        assert_close(compiled.gather_mm_act(*args), unfused, dtype, scale=4, msg="past the tile")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_mm_act_half_precision(compiled, dtype):
    args = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            for t in _gma_problem("sink", torch.float64, activation="swiglu", bias=True)]
    assert_close(compiled.gather_mm_act(*args), REF.gather_mm_act(*args), dtype, scale=4)


def test_gather_mm_act_takes_a_slot_too_wide_for_a_tile_whole():
    # A slot's rows of x and h past a tile (16 rows of 174,760 bytes): its rows gathered whole and
    # multiplied by one GEMM, as grouped_mm_act does.
    if not ops.has_fused("gather_mm_act", torch.device("cpu")):
        pytest.skip("no compiled gather_mm_act in this build")
    args = _gma_problem("uniform", torch.float32, M=43_682)
    assert set(args[4].tolist()) == {16}
    assert_close(ops.compiled().gather_mm_act(*args), REF.gather_mm_act(*args), torch.float32, scale=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_mm_act_weights_with_no_unit_stride(compiled, dtype):
    x, w, b, *rest = _gma_problem("sink", torch.float64, activation="swiglu", bias=True)
    w_full = torch.randn(w.shape[0], 2 * w.shape[1], 2 * w.shape[2], dtype=torch.float64) / 4
    w_view = w_full.to(dtype)[:, ::2, ::2]
    assert 1 not in w_view.stride()[1:]
    got = compiled.gather_mm_act(x.to(dtype), w_view, b.to(dtype), *rest)
    assert_close(got, REF.gather_mm_act(x, w_full[:, ::2, ::2], b, *rest), dtype, scale=4)


def test_gather_mm_act_bad_inputs_name_the_argument(compiled):
    x, w, b, order, rows, row_pair, dest, *form = _gma_problem("uniform", torch.float64, activation="swiglu",
                                                               bias=True)
    with pytest.raises(RuntimeError, match="gather_mm_act: b .* must have the dtype of x"):
        compiled.gather_mm_act(x, w.float(), b, order, rows, row_pair, dest, *form)
    with pytest.raises(RuntimeError, match=r"gather_mm_act: b.shape\[1\] must equal x.shape\[1\]"):
        compiled.gather_mm_act(x[:, :3], w, b, order, rows, row_pair, dest, *form)
    with pytest.raises(RuntimeError, match=r"gather_mm_act: dest.shape\[0\] must equal x.shape\[0\]"):
        compiled.gather_mm_act(x[:5], w, b, order, rows, row_pair, dest, *form)
    with pytest.raises(RuntimeError, match="gather_mm_act: bias must be"):
        compiled.gather_mm_act(x, w, b[:, :4], order, rows, row_pair, dest, *form)
    with pytest.raises(RuntimeError, match="gather_mm_act: row_pair holds"):
        compiled.gather_mm_act(x, w, b, order, rows, row_pair.clamp(max=0) + 10 ** 6, dest, *form)
    with pytest.raises(RuntimeError, match="gather_mm_act: slot_rows sums to .* rows but row_pair has"):
        compiled.gather_mm_act(x, w, b, order, rows, row_pair[:-1], dest, *form)
    with pytest.raises(RuntimeError, match="gather_mm_act: the gated form 'swiglu' needs an even width"):
        compiled.gather_mm_act(x, w[:, :, :11], b[:, :11], order, rows, row_pair, dest, *form)


# ---------------------------------------------------------------- opcheck and gradcheck

def _opcheck_samples(device):
    slot_idx, (x, gates, w_in, w_out) = make("sink", torch.float64)
    S = w_in.shape[0]
    _, order, rows, row_pair, dest = _plan(slot_idx, S)
    buf = torch.randn(row_pair.shape[0], x.shape[1], dtype=torch.float64, requires_grad=True)
    a = torch.randn(row_pair.shape[0], w_in.shape[1], dtype=torch.float64, requires_grad=True)
    g = torch.randn(row_pair.shape[0], w_in.shape[2], dtype=torch.float64, requires_grad=True)
    logits = torch.randn(40, S, dtype=torch.float64, requires_grad=True)
    samples = {
        "routing": (logits, 4),
        "routing_backward": (torch.randn(40, 4, dtype=torch.float64), torch.rand(40, 4, dtype=torch.float64),
                             torch.randn(40, S).topk(4, 1).indices, S),
        "group_plan": (slot_idx, S, 0, True),
        "group_plan/exact": (slot_idx, S, 2, False, False),
        "bucketed_gather": (x, row_pair, dest, gates),
        "weighted_scatter": (buf, dest, row_pair, gates),
        "gate_grad": (x, buf, dest, row_pair),
        "grouped_mm": (a, w_in, order, rows),
        "grouped_mm_wgrad": (a, g, order, rows, S),
        "scatter_mm_backward": (torch.randn(x.shape[0], w_in.shape[2], dtype=torch.float64, requires_grad=True), a,
                                w_in, gates, order, rows, row_pair, dest, 1),
        "grouped_mm_scatter": (a, torch.randn(S, w_in.shape[1], x.shape[1], dtype=torch.float64, requires_grad=True),
                               gates, order, rows, row_pair, dest),
        "gather_mm_act": (x, w_in, torch.randn(S, w_in.shape[2], dtype=torch.float64, requires_grad=True), order,
                          rows, row_pair, dest, "swiglu", 1.702, 7.0),
        "decode_experts": (x[:3], slot_idx[:3], gates[:3], w_in, w_out,
                           torch.randn(S, w_in.shape[2], dtype=torch.float64, requires_grad=True), None, "gelu",
                           1.702, 7.0),
    }

    def move(t):  # slot_rows (the last tensor of the GEMMs) stays on the host, as the plan gives it
        if not isinstance(t, torch.Tensor) or t is rows:
            return t
        return t.detach().to(device).requires_grad_(t.requires_grad)

    return {op: tuple(move(t) for t in args) for op, args in samples.items()}


@pytest.mark.parametrize("op", ["routing", "routing_backward", "group_plan", "group_plan/exact", "bucketed_gather",
                                "weighted_scatter", "gate_grad", "grouped_mm", "grouped_mm_wgrad",
                                "scatter_mm_backward", "grouped_mm_scatter", "gather_mm_act", "decode_experts"])
def test_opcheck(compiled, device, op):
    name = op.split("/")[0]
    if name in ops._backend.FUSED_OP_NAMES and not ops.has_fused(name, device):
        pytest.skip(f"{name} has no {device.type} kernel (a fused op with a CPU kernel only)")
    args = _opcheck_samples(device)[op]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if op == "routing":
        # opcheck's AOT harness sums every output into a tensor of the first output's dtype in
        # place, and routing's first is int64: it fails before the op is looked at. The same
        # check, by hand, on the differentiable output (the gates).
        from torch.testing._internal.optests import aot_autograd_check

        utils = utils[:3]
        aot_autograd_check(lambda logits, k: torch.ops.minagi.routing(logits, k)[1], args, {}, dynamic=True,
                           check_gradients=True)
    torch.library.opcheck(getattr(torch.ops.minagi, name), args, test_utils=utils)


def test_opcheck_without_gates(compiled, device):
    slot_idx, (x, _, _, _) = make("uniform", torch.float64)
    _, _, _, row_pair, dest = _plan(slot_idx, 16)
    torch.library.opcheck(torch.ops.minagi.bucketed_gather, (x.to(device), row_pair.to(device), dest.to(device), None))


def test_gradcheck(compiled, device):
    slot_idx, (x, gates, w_in, w_out) = make("sink", torch.float64, D=3, H=4)
    slot_idx, x, gates = slot_idx[:24], _leaf(x[:24], device), _leaf(gates[:24], device)
    w_in = _leaf(w_in, device)
    S = w_in.shape[0]
    _, order, rows, row_pair, dest = _plan(slot_idx, S)
    order, row_pair, dest = order.to(device), row_pair.to(device), dest.to(device)
    buf = torch.randn(row_pair.shape[0], 3, dtype=torch.float64, device=device, requires_grad=True)
    check = torch.autograd.gradcheck
    assert check(lambda x, g: compiled.bucketed_gather(x, row_pair, dest, g), (x, gates))
    assert check(lambda r, g: compiled.weighted_scatter(r, dest, row_pair, g), (buf, gates))
    assert check(lambda a, r: compiled.gate_grad(a, r, dest, row_pair), (x, buf))
    assert check(lambda a, b: compiled.grouped_mm(a, b, order, rows), (buf, w_in))
    g = torch.randn(row_pair.shape[0], 4, dtype=torch.float64, device=device, requires_grad=True)
    assert check(lambda a, g: compiled.grouped_mm_wgrad(a, g, order, rows, S), (buf, g))
    logits = torch.randn(6, 5, dtype=torch.float64, device=device, requires_grad=True)
    assert check(lambda l: compiled.routing(l, 3)[1], (logits,))
    # double backward through gather/scatter (their backwards are each other)
    assert torch.autograd.gradgradcheck(lambda x, g: compiled.bucketed_gather(x, row_pair, dest, g), (x, gates))
    if device.type == "cpu":  # the fused backward and, through its twin, its own backward
        gy = torch.randn(24, 3, dtype=torch.float64, requires_grad=True)
        w_out = torch.randn(S, 4, 3, dtype=torch.float64, requires_grad=True)
        a4 = torch.randn(row_pair.shape[0], 4, dtype=torch.float64, requires_grad=True)
        f = lambda gy, a, b, g: compiled.scatter_mm_backward(gy, a, b, g, order, rows, row_pair, dest, 1)  # noqa: E731
        assert check(f, (gy, a4, w_out, gates))
        # inference's tiled first layer: its gradients and second derivatives, through its twin
        b_in = torch.randn(S, 4, dtype=torch.float64, requires_grad=True)
        f = lambda x, w, b: compiled.gather_mm_act(x, w, b, order, rows, row_pair, dest, "swiglu", 1.702, 7.0)  # noqa: E731
        assert check(f, (x, w_in, b_in))
        assert torch.autograd.gradgradcheck(f, (x, w_in, b_in))


# ---------------------------------------------------------------- bad input

def test_bad_inputs_name_the_argument(compiled):
    idx = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="top_k must be in"):
        compiled.routing(torch.randn(3, 4), 5)
    with pytest.raises(RuntimeError, match="logits must be 2-D"):
        compiled.routing(torch.randn(3), 1)
    with pytest.raises(RuntimeError, match="logits must be float32"):
        compiled.routing(torch.ones(3, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="slot_idx holds 9, outside \\[0, S = 4\\)"):
        compiled.group_plan(torch.tensor([[0, 9]]), 4, 0, True)
    with pytest.raises(RuntimeError, match="slot_idx must be int64"):
        compiled.group_plan(idx.int(), 4, 0, True)
    with pytest.raises(RuntimeError, match="capacity must be >= 0"):
        compiled.group_plan(idx, 4, -1, True)
    _, order, rows, row_pair, dest = compiled.group_plan(idx, 4, 0, False)
    with pytest.raises(RuntimeError, match="dest.shape\\[0\\] must equal x.shape\\[0\\]"):
        compiled.bucketed_gather(torch.randn(2, 3), row_pair, dest, None)
    with pytest.raises(RuntimeError, match="gates .* must have the dtype"):
        compiled.weighted_scatter(torch.randn(2, 3), dest, row_pair, torch.ones(1, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="slot_rows sums to 2 rows but the input has only 1 rows"):
        compiled.grouped_mm(torch.randn(1, 4), torch.randn(4, 4, 5), order, rows)
    with pytest.raises(RuntimeError, match="b .* must have the dtype of a"):
        compiled.grouped_mm(torch.randn(2, 4), torch.randn(4, 4, 5, dtype=torch.float64), order, rows)
    with pytest.raises(RuntimeError, match="lists slot 0 twice"):
        compiled.grouped_mm_wgrad(torch.randn(2, 4), torch.randn(2, 5), torch.tensor([0, 0]), torch.tensor([1, 1]), 4)


@requires_ext
def test_wgrad_slot_ids_unique_and_in_range_as_the_gpu_kernel_checks_them():
    compiled = ops.compiled()
    rows = torch.tensor([1, 1])
    with pytest.raises(RuntimeError, match="slot_ids lists slot 2 twice; each slot may own one row range"):
        compiled.grouped_mm_wgrad(torch.randn(2, 4), torch.randn(2, 5), torch.tensor([2, 2]), rows, 4)
    with pytest.raises(RuntimeError, match="slot_ids holds 4 at position 1, outside \\[0, n_slots=4\\)"):
        compiled.grouped_mm_wgrad(torch.randn(2, 4), torch.randn(2, 5), torch.tensor([0, 4]), rows, 4)


def test_one_gpu_slot_limit_in_the_kernels_and_before_a_run():
    from minagi.lm import run as run_
    from minagi.lm.config import ConfigError

    with pytest.raises(ConfigError, match="model.n_slots = 2049: the GPU kernels take at most 2048 card slots"):
        run_.check_card_fits(2049, torch.device("cuda"), gpu_kernels=True)
    run_.check_card_fits(2048, torch.device("cuda"), gpu_kernels=True)
    run_.check_card_fits(5000, torch.device("cpu"), gpu_kernels=True)  # the CPU kernels have no limit
    run_.check_card_fits(5000, torch.device("cuda"), gpu_kernels=False)  # no GPU kernels: the twins route


@pytest.mark.slow
@requires_ext
def test_debug_checks_range_check_indices_on_the_host_first():
    import subprocess
    import sys

    code = ("import torch, minagi; from minagi.moe import ops; c = ops.compiled()\n"
            "dest = torch.tensor([[0, 1], [2, 7]]); row_pair = torch.tensor([0, 1, 2, -1])\n"
            "c.weighted_scatter(torch.randn(4, 3), dest, row_pair, None)\n")
    for switch, says in (("1", "dest holds 7 at flat position 3, outside [-1, 4) (found by MINAGI_DEBUG_CHECKS=1"),
                         ("0", "dest holds 7 at flat position 3, outside [-1, 4)")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**__import__("os").environ, "MINAGI_DEBUG_CHECKS": switch})
        assert r.returncode != 0 and says in r.stderr, r.stderr[-1500:]
        assert ("MINAGI_DEBUG_CHECKS" in r.stderr) == (switch == "1")


@pytest.mark.slow
@requires_ext
@pytest.mark.parametrize("level", ["portable", "avx2"])
def test_cpu_loops_where_avx512_is_switched_off(level):
    # A CPU without AVX-512 takes the AVX2 few-row kernels, half-precision products widened to
    # float32, and (without AVX2) the portable loops and ATen, where this one may run AVX-512
    # kernels (GEMMs, few-row products, SwiGLU rows); MINAGI_CPU_ISA makes this machine take them
    # too, and the kernels' shape tests run again that way.
    import os
    import subprocess
    import sys

    if level == "avx2" and torch.ops.minagi.cpu_isa() != "avx512":
        pytest.skip(f"this CPU runs at {torch.ops.minagi.cpu_isa()}: the default run took these paths")
    here = Path(__file__).parent
    tests = [f"{here / 'test_ops.py'}::{name}" for name in
             ("test_grouped_mm_slot_shapes", "test_few_rows_kernels", "test_half_precision_slots_of_many_rows",
              "test_weight_gradients_slot_shapes",
              "test_scatter_mm_backward_matches_twin_and_the_unfused_ops", "test_decode_experts_matches_twin")]
    tests += [f"{here / 'test_forms.py'}::{name}" for name in
              ("test_swiglu_kernels_across_the_float_range_and_at_the_clamps",
               "test_swiglu_kernels_at_infinities_as_the_twin")]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], capture_output=True,
                       text=True, env={**os.environ, "MINAGI_CPU_ISA": level, "MINAGI_REQUIRE_EXT": "1"})
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-1500:]


@pytest.mark.parametrize("activation", ["gelu", "swiglu_oai", "relu2"])
def test_bucketed_activation_equals_the_form_in_a_bucketed_allocation_that_is_no_view(activation):
    from minagi.moe.dispatch import BucketedAct, Form

    form = Form(activation)
    width = 14 if activation == "swiglu_oai" else 7
    h = (torch.randn(300, width, dtype=torch.float64) * 4).requires_grad_()
    y = BucketedAct.apply(h, form)
    assert y._base is None and y.untyped_storage().nbytes() == 384 * 7 * 8  # _bucket(300) = 384 rows
    torch.testing.assert_close(y, form.act(h))
    g = torch.randn(300, 7, dtype=torch.float64)
    (gh,) = torch.autograd.grad(y, h, g, create_graph=True)
    (want,) = torch.autograd.grad(form.act(h), h, g, create_graph=True)
    torch.testing.assert_close(gh, want)
    small = (torch.randn(5, width // 7 * 3, dtype=torch.float64) + 0.3).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: BucketedAct.apply(t, form), (small,))
    assert torch.autograd.gradgradcheck(lambda t: BucketedAct.apply(t, form), (small,))
    with torch.no_grad():
        out, _ = BucketedAct.backward(type("Ctx", (), {"saved_tensors": (h.detach(),), "form": form})(), g)
    assert out._base is None and out.untyped_storage().nbytes() == 384 * width * 8


def test_python_reads_the_sizes_cpp_defines():
    from minagi.moe import dispatch

    # The twins' values (used where the extension is not loaded) are the built extension's.
    for name, fallback in ops.FALLBACK_CONSTANTS.items():
        assert int(torch.ops.minagi.constant(name)) == fallback, name
    assert (dispatch.DECODE_MAX_CHARS, ops.GPU_MAX_SLOTS) == (ops.constant("small_rows"), ops.constant("gpu_max_slots"))
    with pytest.raises(ValueError, match="the names are"):
        torch.ops.minagi.constant("nope")
