"""expert_mlp's paths against the loop oracle (the paths against each other: test_property.py);
bucket padding, the statistics, the input errors, PooledMLP, the bfloat16 error per device, the
decode path and skipped ids, and the fused CPU kernels' tiles against their unfused paths."""
import pytest
import torch

import minagi
from minagi import PooledMLP, expert_mlp
from minagi.bench.routings import sink_routing

from cases import make
from conftest import EXT, assert_close, requires_ext, tile_bytes
from oracle import expert_mlp_loop

PATHS = ["grouped", "compiled"] if EXT else ["grouped"]
ALL = ["rectangle", *PATHS]


def _run(path, slot_idx, leaves, cf=0.0, bucketed=None, seed=2):
    x, gates, w_in, w_out = (t.detach().clone().requires_grad_() for t in leaves)
    y, stats = expert_mlp(x, slot_idx, gates, w_in, w_out, path=path, capacity_factor=cf,
                          return_stats=True, bucketed=bucketed)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype).to(y.device)
    grads = torch.autograd.grad(y, [x, gates, w_in, w_out], gy, allow_unused=True) if y.numel() else [None] * 4
    return y, grads, stats


@pytest.mark.parametrize("name", ["one_char", "k1", "k_eq_S", "S1", "uniform", "sink"])
@pytest.mark.parametrize("cf", [0.0, 0.75])
def test_loop_oracle_agrees_with_every_path(name, cf):
    slot_idx, (x, gates, w_in, w_out) = make(name, torch.float64, requires_grad=False)
    want = expert_mlp_loop(x, slot_idx, gates, w_in, w_out, capacity_factor=cf)
    for path in ALL:
        got = expert_mlp(x, slot_idx, gates, w_in, w_out, path=path, capacity_factor=cf)
        assert_close(got, want, msg=f"{path} vs loop oracle")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["sink", "uniform", "one_char"])
def test_bucket_padding_changes_nothing(path, name):
    slot_idx, leaves = make(name)
    y_b, g_b, s_b = _run(path, slot_idx, leaves, bucketed=True)
    y_e, g_e, s_e = _run(path, slot_idx, leaves, bucketed=False)
    assert_close(y_b, y_e)
    for a, b in zip(g_b, g_e):
        assert_close(a, b, scale=4)
    assert s_e.executed_rows == s_e.routed_pairs <= s_b.executed_rows


def test_stats_at_the_sink():
    slot_idx = sink_routing(2081, 128, 8, 1960)
    x, w = torch.zeros(2081, 1), torch.zeros(128, 1, 1)
    gates = torch.zeros(2081, 8)
    _, rect = expert_mlp(x, slot_idx, gates, w, w, path="rectangle", return_stats=True)
    _, grp = expert_mlp(x, slot_idx, gates, w, w, path="grouped", return_stats=True)
    assert rect.routed_pairs == grp.routed_pairs == 2081 * 8
    assert rect.executed_rows == 128 * 1960 and rect.groups == 1
    assert abs(rect.max_load_ratio - 1960 / (2081 * 8 / 128)) < 1e-9
    assert grp.groups >= 2 and grp.executed_ratio <= 2.0   # the bucketed bound
    assert rect.executed_ratio > 15
    if EXT:
        _, cmp_ = expert_mlp(x, slot_idx, gates, w, w, path="compiled", return_stats=True)
        assert cmp_.executed_rows == cmp_.routed_pairs     # exact ranges on the CPU: no padding
    _, capped = expert_mlp(x, slot_idx, gates, w, w, path="grouped", capacity_factor=1.0, return_stats=True)
    assert capped.dropped_pairs == 1960 - 131               # the sink keeps ceil(16648 / 128) pairs
    assert set(capped.as_dict()) >= {"routed_pairs", "dropped_pairs", "executed_rows", "groups",
                                     "max_load_ratio", "executed_ratio"}


@pytest.mark.parametrize("path", ALL)
def test_empty_input(path):
    x = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(3, 4, 4, requires_grad=True)
    y, stats = expert_mlp(x, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), w, w, path=path,
                          return_stats=True)
    assert y.shape == (0, 4) and stats.routed_pairs == 0 and stats.executed_rows == 0


@pytest.mark.parametrize("path", ALL)
def test_non_contiguous_inputs(path):
    slot_idx, (x, gates, w_in, w_out) = make("sink", requires_grad=False)
    want = expert_mlp(x, slot_idx, gates, w_in, w_out, path="rectangle")
    x_t = x.t().contiguous().t()
    idx_t = slot_idx.t().contiguous().t()
    g_t = gates.t().contiguous().t()
    w_in_t = w_in.transpose(1, 2).contiguous().transpose(1, 2)
    w_out_t = w_out.transpose(1, 2).contiguous().transpose(1, 2)
    assert not x_t.is_contiguous() and not w_in_t.is_contiguous()
    assert_close(expert_mlp(x_t, idx_t, g_t, w_in_t, w_out_t, path=path), want)


def _bad(n=5, **overrides):
    args = {"x": torch.randn(n, 4), "slot_idx": torch.zeros(n, 2, dtype=torch.long), "gates": torch.ones(n, 2),
            "w_in": torch.randn(3, 4, 6), "w_out": torch.randn(3, 6, 4)}
    args.update(overrides)
    return args


@pytest.mark.parametrize("overrides,match", [
    (lambda n: {"x": torch.randn(n)}, "x must be \\[N, d\\]"),
    (lambda n: {"x": torch.ones(n, 4, dtype=torch.long)}, "x must be a floating-point"),
    (lambda n: {"slot_idx": torch.zeros(n, 2, dtype=torch.int32)}, "slot_idx must be int64"),
    (lambda n: {"slot_idx": torch.zeros(n - 1, 2, dtype=torch.long)}, "slot_idx must be \\[N, k\\]"),
    (lambda n: {"slot_idx": torch.full((n, 2), 3)}, "slot_idx holds 3, outside \\[0, S = 3\\)"),
    (lambda n: {"slot_idx": torch.full((n, 2), -1)}, "slot_idx holds -1"),
    (lambda n: {"slot_idx": torch.zeros(n, 4, dtype=torch.long), "gates": torch.ones(n, 4)},
     "top_k .* must be in \\[1, S = 3\\]"),
    (lambda n: {"gates": torch.ones(n, 3)}, "gates must have slot_idx's shape"),
    (lambda n: {"gates": torch.ones(n, 2, dtype=torch.long)}, "gates must be a floating-point tensor, got torch.int64"),
    (lambda n: {"gates": torch.ones(n, 2, dtype=torch.float64)}, None),  # any floating dtype: computed in x's
    (lambda n: {"w_in": torch.randn(3, 5, 6)}, "w_in.shape\\[1\\] \\(5\\) must equal x.shape\\[1\\] \\(4\\)"),
    (lambda n: {"w_out": torch.randn(3, 6, 5)}, "w_out must be \\[S, h, d\\]"),
    (lambda n: {"w_in": torch.randn(4, 6)}, "w_in must be \\[S, d, h\\]"),
    (lambda n: {"w_in": torch.randn(3, 4, 6, dtype=torch.float64)}, "w_in is torch.float64 but x is torch.float32"),
    (lambda n: {"activation": "gelu2"}, "activation must be one of"),
])
@pytest.mark.parametrize("n", [5, 2])  # 2: writing's characters, the CPU's one decode op (its own checks first)
def test_bad_input_names_the_argument(overrides, match, n):
    if match is None:
        assert expert_mlp(**_bad(n, **overrides(n))).shape == (n, 4)
        return
    with pytest.raises(ValueError, match=match) as caught:
        expert_mlp(**_bad(n, **overrides(n)))
    assert caught.value.__context__ is None  # expert_mlp's words alone, not the op's error beneath them


def test_bad_options():
    with pytest.raises(ValueError, match="path must be one of"):
        expert_mlp(**_bad(), path="fast")
    with pytest.raises(ValueError, match="capacity_factor must be a finite number >= 0"):
        expert_mlp(**_bad(), capacity_factor=-1)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        expert_mlp(**_bad(x=[[1.0]]))


def test_compiled_path_without_extension_is_an_error(monkeypatch):
    from minagi.moe import ops
    monkeypatch.setattr(ops, "supports", lambda device: False)
    with pytest.raises(RuntimeError, match="path='compiled' is not available"):
        expert_mlp(**_bad(), path="compiled")
    assert minagi.moe.dispatch.resolve_path("auto", torch.device("cpu")) == "grouped"


def test_auto_takes_the_compiled_ops_where_the_device_has_them(monkeypatch):
    from minagi.moe import ops
    monkeypatch.setattr(ops, "supports", lambda device: device.type == "cpu")
    assert minagi.moe.dispatch.resolve_path("auto", torch.device("cpu")) == "compiled"
    assert minagi.moe.dispatch.resolve_path("auto", torch.device("meta")) == "grouped"
    assert minagi.moe.dispatch.resolve_path("rectangle", torch.device("cpu")) == "rectangle"
    with pytest.raises(ValueError, match="path must be one of"):
        minagi.moe.dispatch.resolve_path("fast", torch.device("cpu"))


def test_nan_router_does_not_crash_dispatch():
    m = PooledMLP(8, 16, 6, 2)
    x = torch.randn(10, 8)
    x[3] = float("nan")
    y = m(x)
    assert y.shape == x.shape and y[3].isnan().all() and not y[[0, 1, 2, 4]].isnan().any()


# ---------------------------------------------------------------- PooledMLP

def test_pooled_mlp_switch_to_rectangle(monkeypatch):
    m = PooledMLP(8, 16, 6, 2).double()
    x = torch.randn(4, 7, 8, dtype=torch.float64)
    y_grouped, s_grouped = m(x, return_stats=True)
    monkeypatch.setattr(PooledMLP, "grouped_dispatch", False)
    y_rect, s_rect = m(x, return_stats=True)
    assert y_rect.shape == x.shape and s_rect.groups == 1 and s_grouped.groups >= 1
    assert s_rect.executed_rows % 6 == 0  # every one of the 6 slots padded to one length
    assert_close(y_grouped, y_rect)


def test_pooled_mlp_takes_a_card_from_outside():
    m = PooledMLP(8, 16, 4, 2).double()
    other = PooledMLP(8, 16, 4, 2).double()
    x = torch.randn(9, 8, dtype=torch.float64)
    assert_close(m(x, card=other.card()), other(x))
    router, w_in, w_out = (t.detach().clone().requires_grad_() for t in other.card())
    m(x, card=(router, w_in, w_out)).sum().backward()
    assert router.grad is not None and w_in.grad is not None and m.w_in.grad is None


def test_pooled_mlp_router_gets_gradients():
    m = PooledMLP(8, 16, 6, 2)
    m(torch.randn(12, 8)).square().sum().backward()
    assert m.router.grad.abs().sum() > 0 and m.w_in.grad.abs().sum() > 0


def test_pooled_mlp_rejects_bad_top_k():
    with pytest.raises(ValueError, match="top_k must be in \\[1, n_slots = 4\\]"):
        PooledMLP(8, 16, 4, 5)


# ---------------------------------------------------------------- on every device

def _rel_err(got, want):
    return float((got.detach().double().cpu() - want.detach()).norm() / want.detach().norm())


@requires_ext
@pytest.mark.parametrize("name", ["sink", "uniform"])
def test_bfloat16_error_within_twice_the_pure_torch_error(device, name):
    # Against a float64 reference, the compiled path in bfloat16 may lose at most twice what the
    # pure-torch path loses in bfloat16: forward and the gradients.
    slot_idx, leaves = make(name, torch.float64, D=64, H=128)
    y64, g64, _ = _run("grouped", slot_idx, leaves)
    low = [t.detach().to(device, torch.bfloat16) for t in leaves]
    idx = slot_idx.to(device)
    y_c, g_c, _ = _run("compiled", idx, low)
    y_t, g_t, _ = _run("grouped", idx, low)
    assert _rel_err(y_c, y64) <= 2 * _rel_err(y_t, y64), "forward"
    for what, c, t, want in zip(("x", "gates", "w_in", "w_out"), g_c, g_t, g64):
        assert _rel_err(c, want) <= 2 * _rel_err(t, want), f"grad of {what}"


# ---------------------------------------------------------------- the decode path

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("N", [1, 3])
def test_decode_path_skips_the_plan(monkeypatch, path, N):
    # A handful of characters goes straight to its routed slots' ranges: no plan is built.
    slot_idx, (x, gates, w_in, w_out) = make("uniform", torch.float64, requires_grad=False)
    slot_idx, x, gates = slot_idx[:N], x[:N], gates[:N]
    want = expert_mlp(x, slot_idx, gates, w_in, w_out, path="rectangle")

    def no_plan(*args, **kwargs):
        raise AssertionError("the decode path built a plan")

    monkeypatch.setattr(minagi.moe.dispatch, "_grouped", no_plan)
    with torch.no_grad():
        got, stats = expert_mlp(x, slot_idx, gates, w_in, w_out, path=path, return_stats=True)
    assert_close(got, want)
    assert stats.executed_rows == N * slot_idx.shape[1] and stats.dropped_pairs == 0


@pytest.mark.parametrize("path", PATHS)
def test_unfused_decode_is_a_one_row_range_per_pair(path):
    # Without the decode op (a GPU, the twins, or a gradient there), each (token, k) pair is its
    # own one-row range: a plan from the shapes alone, nothing read from the ids on the host.
    slot_idx = torch.tensor([[0, 1], [1, 0], [2, 1], [1, 3]])
    x, w_in, w_out = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, 12, dtype=torch.float64), \
        torch.randn(4, 12, 8, dtype=torch.float64)
    gates = torch.softmax(torch.randn(4, 2, dtype=torch.float64), 1)
    ops = minagi.moe.ops.compiled() if path == "compiled" else minagi.moe.ops.REFERENCE
    with torch.no_grad():
        form = minagi.moe.dispatch.Form.of("gelu", 1.702, 7.0)
        y, rows = minagi.moe.dispatch._decode(ops, x, slot_idx, gates, w_in, w_out, form, None, None, None)
    assert rows.tolist() == [1] * 8
    assert_close(y, expert_mlp(x, slot_idx, gates, w_in, w_out, path="rectangle"))


@requires_ext
def test_decode_goes_through_one_op_where_it_can(monkeypatch):
    # On the CPU's compiled path a handful of characters without a gradient are one call
    # (decode_experts, b_out inside it); with the caller's own activation, a post, skipped ids or a
    # gradient, the unfused decode. Both agree with the rectangle.
    if not minagi.moe.ops.has_fused("decode_experts", torch.device("cpu")):
        pytest.skip("this build has no decode_experts kernel")
    fused, checked = [], []
    real, real_check = minagi.moe.dispatch._fuses_decode, minagi.moe.dispatch._check_inputs
    monkeypatch.setattr(minagi.moe.dispatch, "_fuses_decode", lambda *a: fused.append(real(*a)) or fused[-1])
    # The op checks its own arguments: the one-op calls skip expert_mlp's Python checks.
    monkeypatch.setattr(minagi.moe.dispatch, "_check_inputs", lambda *a: checked.append(1) or real_check(*a))
    g = torch.Generator().manual_seed(4)
    slot_idx = torch.tensor([[0, 1], [1, 3], [2, 1]])
    x, gates = torch.randn(3, 8, generator=g, dtype=torch.float64), torch.rand(3, 2, generator=g, dtype=torch.float64)
    w_in, w_out = torch.randn(4, 8, 12, generator=g, dtype=torch.float64), torch.randn(4, 12, 8, generator=g,
                                                                                      dtype=torch.float64)
    b_out = torch.randn(4, 8, generator=g, dtype=torch.float64)
    cases = {"plain": {}, "own activation": {"activation": torch.tanh}, "post": {"post": lambda o: torch.nn.functional.normalize(o, dim=-1)}}
    for what, kw in cases.items():
        want = expert_mlp(x, slot_idx, gates, w_in, w_out, b_out=b_out, path="rectangle", **kw)
        with torch.no_grad():
            got = expert_mlp(x, slot_idx, gates, w_in, w_out, b_out=b_out, path="compiled", **kw)
        assert_close(got, want, msg=what)
        assert fused.pop() == (what == "plain"), what
        assert len(checked) == (1 if what == "plain" else 2), what  # the rectangle's call, and the general path's
        checked.clear()
    with torch.no_grad():  # the model's call: n_valid given (a padded last row changes only its own output)
        got = expert_mlp(x, slot_idx, gates, w_in, w_out, b_out=b_out, path="compiled", n_valid=2)
    assert fused.pop() is True and not checked
    assert_close(got, expert_mlp(x, slot_idx, gates, w_in, w_out, b_out=b_out, path="rectangle", n_valid=2))
    skipped = torch.tensor([[0, 9], [1, 3], [2, 1]])
    with torch.no_grad():
        got = expert_mlp(x, skipped, gates, w_in, w_out, b_out=b_out, path="compiled", out_of_range_slots="skip")
    assert_close(got, expert_mlp(x, skipped, gates, w_in, w_out, b_out=b_out, path="rectangle",
                                 out_of_range_slots="skip"))
    assert fused.pop() is False
    y = expert_mlp(x[:1], slot_idx[:1], gates[:1], w_in.requires_grad_(), w_out, b_out=b_out, path="compiled")
    assert fused.pop() is False and y.requires_grad
    assert_close(y, expert_mlp(x[:1], slot_idx[:1], gates[:1], w_in, w_out, b_out=b_out, path="rectangle"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("slot_idx", [
    [[0, 5, -1, 1], [7, 0, 2, 9], [0, 6, 3, 8], [1, 0, -4, 2]],
    [[3, -1], [2, 9]],
    [[1, 8], [2, 1]],
], ids=["four_chars", "two_chars", "two_chars_one_slot_twice"])
def test_decode_skips_out_of_range_slots(path, slot_idx):
    # Expert parallelism's ids of experts held elsewhere (negative or past S), at the decode sizes
    # without a gradient: dropped pairs on every path, adding nothing. Where no kept pair names
    # slot 0, its weights are NaN and inf: a skipped pair reads nothing into its token (no
    # inf * 0), and the unfused decode (the twins) gives it no row, so no weight is read for it.
    S, slot_idx = 4, torch.tensor(slot_idx)
    N, K = slot_idx.shape
    x, w_in, w_out = torch.randn(N, 8, dtype=torch.float64), torch.randn(S, 8, 12, dtype=torch.float64), \
        torch.randn(S, 12, 8, dtype=torch.float64)
    gates = torch.softmax(torch.randn(N, K, dtype=torch.float64), 1)
    kept = (slot_idx >= 0) & (slot_idx < S)
    if not slot_idx[kept].eq(0).any():
        w_in[0], w_out[0] = float("nan"), float("inf")
    want = expert_mlp(x, slot_idx, gates, w_in, w_out, path="rectangle", out_of_range_slots="skip")
    with torch.no_grad():
        got, stats = expert_mlp(x, slot_idx, gates, w_in, w_out, path=path, out_of_range_slots="skip",
                                return_stats=True)
    assert torch.isfinite(got).all()
    assert_close(got, want)
    if path == "grouped":  # the unfused decode: a row per kept pair
        assert stats.executed_rows == stats.routed_pairs == int(kept.sum())


@pytest.mark.parametrize("path", PATHS)
def test_decode_path_gives_way_where_it_would_be_wrong(monkeypatch, path):
    # Capacity can drop pairs of several characters, and a weight gradient needs each slot once:
    # those calls take the planned path, and still agree with the rectangle.
    calls = []
    real = minagi.moe.dispatch._grouped
    monkeypatch.setattr(minagi.moe.dispatch, "_grouped", lambda *a: calls.append(1) or real(*a))
    slot_idx = torch.tensor([[0, 1], [0, 2], [0, 1]])
    x, w_in, w_out = torch.randn(3, 8, dtype=torch.float64), torch.randn(4, 8, 12, dtype=torch.float64), \
        torch.randn(4, 12, 8, dtype=torch.float64)
    leaves = [x, torch.softmax(torch.randn(3, 2, dtype=torch.float64), 1), w_in, w_out]
    y_r, g_r, _ = _run("rectangle", slot_idx, leaves, cf=0.5)
    y_p, g_p, stats = _run(path, slot_idx, leaves, cf=0.5)
    assert calls and stats.dropped_pairs == 3  # slot 0 keeps 1 of 3, slot 1 keeps 1 of 2
    assert_close(y_p, y_r)
    for a, b in zip(g_p, g_r):
        assert_close(a, b, scale=4)


@requires_ext
def test_tile_bytes_reads_sets_and_names_a_bad_name():
    before = torch.ops.minagi.tile_bytes("gather")
    with tile_bytes("gather", 123):
        assert torch.ops.minagi.tile_bytes("gather") == 123
    assert torch.ops.minagi.tile_bytes("gather") == before > 0 and torch.ops.minagi.tile_bytes("fused") > 0
    with pytest.raises(ValueError, match="name must be 'gather' or 'fused', got 'nope'"):
        torch.ops.minagi.tile_bytes("nope")


@requires_ext
@pytest.mark.parametrize("name", ["uniform", "sink", "k1", "S1"])
@pytest.mark.parametrize("cf,bucketed", [(0.0, None), (0.5, None), (0.0, True)])
def test_fused_second_layer_backward_equals_its_unfused_path(name, cf, bucketed):
    # The second layer is one op (grouped_mm_scatter) whose backward keeps each slot's rows in a
    # thread's tile where they fit and no slot passes a thread's share (S1: one slot holds every
    # row), else takes whole-buffer GEMMs: the same gradients either way.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the choice weighs the busiest slot against a thread's share of the rows
    try:
        slot_idx, leaves = make(name, torch.float64)
        y_f, g_f, _ = _run("compiled", slot_idx, leaves, cf, bucketed)
        with tile_bytes("fused", 0):
            y_u, g_u, _ = _run("compiled", slot_idx, leaves, cf, bucketed)
    finally:
        torch.set_num_threads(threads)
    assert y_f.grad_fn.name() == y_u.grad_fn.name() == "GeneratedBackwardFor_minagi_grouped_mm_scatter_defaultBackward"
    assert_close(y_f, y_u)
    for what, a, b in zip(("x", "gates", "w_in", "w_out"), g_f, g_u):
        assert_close(a, b, torch.float64, scale=4, msg=f"grad of {what}")


def _stored_transposed_run(slot_idx, leaves):
    """expert_mlp with weights stored [S, out, in] and passed as .mT: y's grad_fn, the stored
    w_out's gradient, and second derivatives (of |dL/dx|^2) for every input."""
    x, gates, w_in, w_out = (t.detach().clone() for t in leaves)
    xs, g = x.requires_grad_(), gates.requires_grad_()
    wi, wo = w_in.mT.contiguous().requires_grad_(), w_out.mT.contiguous().requires_grad_()
    y = expert_mlp(xs, slot_idx, g, wi.mT, wo.mT, path="compiled")
    (g_wo,) = torch.autograd.grad(y.pow(2).sum(), wo, retain_graph=True)
    (gx,) = torch.autograd.grad(y.pow(2).sum(), xs, create_graph=True)
    return y.grad_fn.name(), g_wo, torch.autograd.grad(gx.pow(2).sum(), [xs, g, wi, wo])


@requires_ext
def test_fused_second_layer_backward_keeps_the_weights_layout_and_its_second_derivatives():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        slot_idx, leaves = make("uniform", torch.float64)
        _, g_wo_f, second_f = _stored_transposed_run(slot_idx, leaves)
        with tile_bytes("fused", 0):
            _, g_wo_u, second_u = _stored_transposed_run(slot_idx, leaves)
    finally:
        torch.set_num_threads(threads)
    assert g_wo_f.is_contiguous() and g_wo_u.is_contiguous()  # the stored layout's gradient, with no copy to make
    assert_close(g_wo_f, g_wo_u, torch.float64, scale=4)
    for what, a, b in zip(("x", "gates", "w_in", "w_out"), second_f, second_u):
        assert_close(a, b, torch.float64, scale=4, msg=f"second derivative of {what}")

