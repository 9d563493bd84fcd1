"""Every expert form (gelu, gelu_tanh, silu, relu2, swiglu, swiglu_interleaved, swiglu_oai) on every
path, with and without biases, with contiguous weights and with .mT views of [S, out, in] ones,
against a plain-Python float64 loop: outputs and the gradients of x, the gates, the weights and
the biases. Then the compiled ops' checks (opcheck, gradcheck, gradgradcheck), out-of-range slots,
gates in another dtype, the degenerate equivalences and the errors."""
import pytest
import torch
import torch.nn.functional as F

from minagi import expert_mlp
from minagi.moe.reference import ACTIVATIONS, GATED, activate

from cases import random_routing
from oracle import act_math, expert_mlp_loop
from conftest import EXT, assert_close, requires_ext

PATHS = ["rectangle", "grouped"] + (["compiled"] if EXT else [])
OAI = {"alpha": 1.702, "limit": 7.0}


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_the_twins_activation_is_the_forms_definition(act):
    # The loop oracle writes each form out from its definition (tests/oracle.py), so a wrong
    # formula in minagi's own activation (reference.activate, which the twins and the kernels'
    # tests follow) shows here, past the clamps and across the float range.
    h = torch.linspace(-12, 12, 2 * 481, dtype=torch.float64).reshape(1, -1)
    assert_close(activate(h, act, **OAI), act_math(h, act, **OAI))


def problem(act, dtype, bias, layout, N=19, S=5, K=2, D=6, H=4, seed=0):
    """Leaves (float64 masters) and the tensors passed: weights as given or as .mT of [S, out, in]."""
    g = torch.Generator().manual_seed(seed)
    h_in = 2 * H if act in GATED else H
    master = {
        "x": torch.randn(N, D, generator=g, dtype=torch.float64),
        "gates": torch.rand(N, K, generator=g, dtype=torch.float64),
        "w_in": torch.randn(S, D, h_in, generator=g, dtype=torch.float64) / D ** 0.5 * 2,
        "w_out": torch.randn(S, H, D, generator=g, dtype=torch.float64) / H ** 0.5,
    }
    if bias:
        master["b_in"] = torch.randn(S, h_in, generator=g, dtype=torch.float64)
        master["b_out"] = torch.randn(S, D, generator=g, dtype=torch.float64)
    idx = random_routing(N, S, K, 1.0, generator=g)
    leaves = {}
    for k, v in master.items():
        t = v.to(dtype)
        if layout == "mT" and k.startswith("w_"):
            t = t.mT.contiguous()  # stored [S, out, in], as nn.Linear keeps it
        leaves[k] = t.requires_grad_()
    return idx, master, leaves


def passed(leaves, layout):
    return {k: (v.mT if layout == "mT" and k.startswith("w_") else v) for k, v in leaves.items()}


def grads_of(y, leaves, gy, layout):
    names = list(leaves)
    grads = torch.autograd.grad(y, [leaves[k] for k in names], gy, allow_unused=True)
    return {k: (g.mT if layout == "mT" and k.startswith("w_") and g is not None else g) for k, g in zip(names, grads)}


def rel(a, b):
    return float((a.detach().double() - b.detach()).norm() / b.detach().norm().clamp(min=1e-30))


@pytest.mark.parametrize("layout", ["contiguous", "mT"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_every_form_on_every_path_matches_the_loop(act, path, dtype, bias, layout):
    idx, master, leaves = problem(act, dtype, bias, layout)
    ref_leaves = {k: v.clone().requires_grad_() for k, v in master.items()}
    want = expert_mlp_loop(ref_leaves["x"], idx, ref_leaves["gates"], ref_leaves["w_in"], ref_leaves["w_out"], act,
                           ref_leaves.get("b_in"), ref_leaves.get("b_out"))
    gy = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want_g = grads_of(want, ref_leaves, gy, "contiguous")
    p = passed(leaves, layout)
    y = expert_mlp(p["x"], idx, p["gates"], p["w_in"], p["w_out"], activation=act, b_in=p.get("b_in"),
                   b_out=p.get("b_out"), path=path)
    got_g = grads_of(y, leaves, gy.to(dtype), layout)
    if dtype == torch.bfloat16:  # against float64: the error of bfloat16 storage, about 2^-8 per value
        assert rel(y, want) < 3e-2, "output"
        for k in want_g:
            assert rel(got_g[k], want_g[k]) < 5e-2, f"grad of {k}"
        return
    assert_close(y, want.to(dtype), msg="output")
    for k in want_g:
        assert_close(got_g[k], want_g[k].to(dtype), scale=4, msg=f"grad of {k}")


@requires_ext
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_mT_views_equal_contiguous_copies_on_the_compiled_path(act):
    # Within float32 rounding: the decode rows (4 characters) and the grouped GEMMs (60) each sum in
    # another order for a transposed operand (small_rows.h's column dots run in 16 lanes; the
    # BLAS's kernels differ by layout).
    for N in (4, 60):
        idx, _, leaves = problem(act, torch.float32, True, "mT", N=N)
        views = passed(leaves, "mT")
        copies = {k: v.detach().contiguous() for k, v in views.items()}
        with torch.no_grad():
            a = expert_mlp(views["x"], idx, views["gates"], views["w_in"], views["w_out"], activation=act,
                           b_in=views["b_in"], b_out=views["b_out"], path="compiled")
            b = expert_mlp(copies["x"], idx, copies["gates"], copies["w_in"], copies["w_out"], activation=act,
                           b_in=copies["b_in"], b_out=copies["b_out"], path="compiled")
        assert_close(a, b, msg=f"{N} characters on .mT views")


@pytest.mark.parametrize("path", PATHS)
def test_one_slot_top1_swiglu_is_a_dense_swiglu_mlp(path):
    g = torch.Generator().manual_seed(3)
    N, D, H = 9, 5, 7
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    wg, wu, wd = (torch.randn(a, b, generator=g, dtype=torch.float64) for a, b in ((D, H), (D, H), (H, D)))
    dense = (F.silu(x @ wg) * (x @ wu)) @ wd
    y = expert_mlp(x, torch.zeros(N, 1, dtype=torch.long), torch.ones(N, 1, dtype=torch.float64),
                   torch.cat([wg, wu], 1)[None], wd[None], activation="swiglu", path=path)
    torch.testing.assert_close(y, dense)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("N", [3, 40])
def test_out_of_range_slots_add_nothing_and_get_no_gradient_when_skipped(path, N):
    idx, master, leaves = problem("swiglu", torch.float64, True, "contiguous", N=N, K=3)
    idx[0, 1], idx[1, 0], idx[2, 2] = 5, -1, 99  # S = 5: experts held elsewhere
    p = passed(leaves, "contiguous")
    y, stats = expert_mlp(p["x"], idx, p["gates"], p["w_in"], p["w_out"], activation="swiglu", b_in=p["b_in"],
                          b_out=p["b_out"], out_of_range_slots="skip", path=path, return_stats=True)
    assert stats.routed_pairs == N * 3 - 3 and stats.n_chars == N and 0 < stats.sink_share <= 1
    ref = {k: v.clone().requires_grad_() for k, v in master.items()}
    want = expert_mlp_loop(ref["x"], idx, ref["gates"], ref["w_in"], ref["w_out"], "swiglu", ref["b_in"], ref["b_out"],
                           skip=True)
    assert_close(y, want)
    gy = torch.randn(want.shape, dtype=torch.float64)
    got, exp = grads_of(y, leaves, gy, "contiguous"), grads_of(want, ref, gy, "contiguous")
    for k in exp:
        assert_close(got[k], exp[k], scale=4, msg=k)
    assert got["gates"][0, 1] == 0 and got["gates"][1, 0] == 0 and got["gates"][2, 2] == 0
    with pytest.raises(ValueError, match="slot_idx holds (5|99), outside \\[0, S = 5\\).*out_of_range_slots='skip'"):
        expert_mlp(p["x"], idx.clamp(min=0), p["gates"], p["w_in"], p["w_out"], activation="swiglu", path=path)


@pytest.mark.parametrize("path", PATHS)
def test_float32_gates_with_bfloat16_x_come_back_in_float32(path):
    idx, _, leaves = problem("swiglu", torch.bfloat16, False, "contiguous")
    gates = leaves["gates"].detach().float().requires_grad_()
    y = expert_mlp(leaves["x"], idx, gates, leaves["w_in"], leaves["w_out"], activation="swiglu", path=path)
    assert y.dtype == torch.bfloat16
    (g,) = torch.autograd.grad(y.float().sum(), gates)
    assert g.dtype == torch.float32 and g.abs().sum() > 0


@pytest.mark.slow
@requires_ext
def test_compiled_forms_pass_opcheck_gradcheck_and_gradgradcheck(compiled):
    from minagi.moe import reference

    g = torch.Generator().manual_seed(5)
    idx = random_routing(7, 3, 2, generator=g)
    _, order, rows, row_pair, dest = reference.group_plan(idx, 3, 0, False)
    buf = reference.bucketed_gather(torch.randn(7, 3, generator=g, dtype=torch.float64), row_pair, dest)
    for act in ACTIVATIONS:
        width = 4 if act in GATED else 2
        b = (torch.randn(3, 3, width, generator=g, dtype=torch.float64)).requires_grad_()
        bias = torch.randn(3, width, generator=g, dtype=torch.float64).requires_grad_()
        a = buf.clone().requires_grad_()
        args = (a, b, bias, order, rows, act, 1.702, 0.9)  # a small limit, so the clamp bites
        torch.library.opcheck(torch.ops.minagi.grouped_mm_act, args)
        f = lambda a, b, bias: compiled.grouped_mm_act(a, b, bias, order, rows, act, 1.702, 0.9)[1]  # noqa: E731
        assert torch.autograd.gradcheck(f, (a, b, bias))
        assert torch.autograd.gradgradcheck(f, (a, b, bias))
        h = torch.randn(buf.shape[0], width, generator=g, dtype=torch.float64).requires_grad_()
        gr = torch.randn(buf.shape[0], width // 2 if act in GATED else width, generator=g, dtype=torch.float64)
        torch.library.opcheck(torch.ops.minagi.expert_act_backward,
                              (gr.requires_grad_(), h, order, rows, act, 1.702, 0.9, 3, True))
        got = compiled.expert_act_backward(gr, h, order, rows, act, 1.702, 0.9, 3, True)
        want = reference.expert_act_backward(gr, h, order, rows, act, 1.702, 0.9, 3, True)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
    plan = torch.ops.minagi.group_plan(torch.tensor([[0, 7], [-1, 1]]), 3, 0, False, True)
    want = reference.group_plan(torch.tensor([[0, 7], [-1, 1]]), 3, 0, False, True)
    for x, y in zip(plan, want):
        assert torch.equal(x, y)
    torch.library.opcheck(torch.ops.minagi.group_plan, (torch.tensor([[0, 7], [-1, 1]]), 3, 0, True, True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("path", PATHS)
def test_bad_forms_and_biases_are_named(path):
    idx, _, leaves = problem("gelu", torch.float32, False, "contiguous")
    x, gates, w_in, w_out = (leaves[k].detach() for k in ("x", "gates", "w_in", "w_out"))
    S, D, H = w_in.shape

    def call(**kw):
        args = {"x": x, "slot_idx": idx, "gates": gates, "w_in": w_in, "w_out": w_out, **kw}
        return expert_mlp(args.pop("x"), args.pop("slot_idx"), args.pop("gates"), args.pop("w_in"), args.pop("w_out"),
                          path=path, **args)

    with pytest.raises(ValueError, match="activation must be one of gelu, gelu_tanh, silu, relu2, swiglu, "
                                         "swiglu_interleaved, swiglu_oai or a callable, got 'geglu'"):
        call(activation="geglu")
    with pytest.raises(ValueError, match=r"gated form 'swiglu' needs w_in \[S, d, 2h\].*width is 4, w_out's h is 4"):
        call(activation="swiglu")
    with pytest.raises(ValueError, match=r"b_in must be \[S, h\] = \(5, 4\), got \(5, 3\)"):
        call(b_in=torch.zeros(S, 3))
    with pytest.raises(ValueError, match=r"b_out must be \[S, d\] = \(5, 6\), got \(6,\)"):
        call(b_out=torch.zeros(D))
    with pytest.raises(ValueError, match="b_in is torch.float64 but x is torch.float32"):
        call(b_in=torch.zeros(S, H, dtype=torch.float64))
    with pytest.raises(ValueError, match="w_out is torch.float64 but x is torch.float32"):
        call(w_out=w_out.double())
    with pytest.raises(ValueError, match="b_out is on meta but x is on cpu"):
        call(b_out=torch.zeros(S, D, device="meta"))
    with pytest.raises(ValueError, match="out_of_range_slots must be 'error' or 'skip'"):
        call(out_of_range_slots="ignore")


@requires_ext
def test_compiled_op_errors_name_the_argument(compiled):
    a, b = torch.randn(4, 3), torch.randn(2, 3, 5)
    ids, rows = torch.tensor([0, 1]), torch.tensor([2, 2])
    with pytest.raises(RuntimeError, match="unknown activation 'tanh'; the forms are gelu, gelu_tanh"):
        compiled.grouped_mm_act(a, b, None, ids, rows, "tanh", 1.0, 1.0)
    with pytest.raises(RuntimeError, match="gated form 'swiglu' needs an even width"):
        compiled.grouped_mm_act(a, b, None, ids, rows, "swiglu", 1.0, 1.0)
    with pytest.raises(RuntimeError, match=r"bias must be \[S, M\] = \[2, 5\]"):
        compiled.grouped_mm_act(a, b, torch.zeros(5), ids, rows, "gelu", 1.0, 1.0)


@pytest.mark.parametrize("layout", ["contiguous", "mT"])
@pytest.mark.parametrize("path", PATHS)
def test_callable_activation_and_post_match_the_loop(path, layout):
    # A model's own gate (a clamped GELU-gated unit no kernel fuses) and a post-expert norm with a
    # weight of its own: the general path, forward and every gradient, against the loop.
    idx, master, leaves = problem("swiglu", torch.float64, True, layout)
    H = master["w_out"].shape[1]
    norm = torch.nn.RMSNorm(master["x"].shape[1], dtype=torch.float64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)

    def gate(h):
        return F.gelu(h[..., :H].clamp(max=2.0)) * h[..., H:]

    def loop(x, gates, w_in, w_out, b_in, b_out):
        return expert_mlp_loop(x, idx[:x.shape[0]], gates, w_in, w_out, gate, b_in, b_out, post=norm)

    v = passed(leaves, layout)
    y = expert_mlp(v["x"], idx, v["gates"], v["w_in"], v["w_out"], activation=gate, b_in=v["b_in"],
                   b_out=v["b_out"], post=norm, path=path)
    ref = loop(*(master[k] for k in ("x", "gates", "w_in", "w_out", "b_in", "b_out")))
    assert rel(y, ref) < 1e-12
    gy = torch.randn_like(y)
    got = grads_of(y, leaves, gy, layout)
    master_leaves = {k: t.clone().requires_grad_() for k, t in master.items()}
    ref = loop(*(master_leaves[k] for k in ("x", "gates", "w_in", "w_out", "b_in", "b_out")))
    want = dict(zip(master_leaves, torch.autograd.grad(ref, list(master_leaves.values()), gy)))
    for k in master_leaves:
        assert rel(got[k], want[k]) < 1e-12, k
    with torch.no_grad():  # a handful of characters: the decode path
        y4 = expert_mlp(v["x"][:4], idx[:4], v["gates"][:4], v["w_in"], v["w_out"], activation=gate, b_in=v["b_in"],
                        b_out=v["b_out"], post=norm, path=path)
        assert rel(y4, loop(*(master[k][:4] if k in ("x", "gates") else master[k]
                              for k in ("x", "gates", "w_in", "w_out", "b_in", "b_out")))) < 1e-12


@pytest.mark.parametrize("path", PATHS)
def test_post_norm_weight_gets_the_loops_gradient(path):
    idx, master, leaves = problem("gelu", torch.float64, False, "contiguous")
    norm = torch.nn.LayerNorm(master["x"].shape[1], dtype=torch.float64)
    y = expert_mlp(leaves["x"], idx, leaves["gates"], leaves["w_in"], leaves["w_out"], post=norm, path=path)
    (g_w, g_b) = torch.autograd.grad((y * y).sum(), [norm.weight, norm.bias])
    ref = expert_mlp_loop(master["x"], idx, master["gates"], master["w_in"], master["w_out"], post=norm)
    r_w, r_b = torch.autograd.grad((ref ** 2).sum(), [norm.weight, norm.bias])
    assert rel(g_w, r_w) < 1e-12 and rel(g_b, r_b) < 1e-12


@pytest.mark.parametrize("path", PATHS)
def test_callable_and_post_shape_errors_are_named(path):
    idx, _, leaves = problem("gelu", torch.float32, False, "contiguous")
    x, gates, w_in, w_out = (leaves[k].detach() for k in ("x", "gates", "w_in", "w_out"))
    with pytest.raises(ValueError, match=r"the activation .* must map h"):
        expert_mlp(x, idx, gates, w_in, w_out, activation=lambda h: h.sum(0), path=path)
    with pytest.raises(ValueError, match=r"post .* must keep the shape"):
        expert_mlp(x, idx, gates, w_in, w_out, post=lambda o: o[:, :2], path=path)
    with pytest.raises(TypeError, match="post must be a callable"):
        expert_mlp(x, idx, gates, w_in, w_out, post="rmsnorm", path=path)


@requires_ext
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_mT_weight_gradients_come_back_in_the_parameters_layout(act):
    # A weight stored [S, out, in] and passed as .mT gets its gradient in the view's own strides,
    # so the parameter's is contiguous without the layout copy autograd would otherwise make.
    idx, _, leaves = problem(act, torch.float32, False, "mT", N=40)
    v = passed(leaves, "mT")
    y = expert_mlp(v["x"], idx, v["gates"], v["w_in"], v["w_out"], activation=act, path="compiled")
    g_in, g_out = torch.autograd.grad(y.sum(), [v["w_in"], v["w_out"]])
    for k, g in (("w_in", g_in), ("w_out", g_out)):
        assert g.stride() == v[k].stride() and g.mT.is_contiguous(), k


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("act", ["gelu", "swiglu_oai"])
def test_second_derivatives_through_expert_mlp_reach_every_input(path, act):
    # A double backward through the whole call (not only the raw op): the gradient of |dL/dx|^2
    # with respect to every input, biases included, against the loop's.
    idx, master, leaves = problem(act, torch.float64, True, "contiguous", N=7)
    names = ("x", "gates", "w_in", "w_out", "b_in", "b_out")

    def second(fn_out, ins):
        (gx,) = torch.autograd.grad(fn_out(*ins).pow(2).sum(), ins[0], create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), ins, allow_unused=True)

    got = second(lambda x, g, wi, wo, bi, bo: expert_mlp(x, idx, g, wi, wo, activation=act, b_in=bi, b_out=bo,
                                                         path=path), [leaves[k] for k in names])
    ref_in = [master[k].clone().requires_grad_() for k in names]
    want = second(lambda x, g, wi, wo, bi, bo: expert_mlp_loop(x, idx, g, wi, wo, act, bi, bo), ref_in)
    for k, a, b in zip(names, got, want):
        if b is None:
            assert a is None or not a.abs().max(), k
            continue
        assert rel(a, b) < 1e-10, k


@requires_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [8, 25, 50, 500])
@pytest.mark.parametrize("act", ["swiglu_oai", "swiglu_interleaved", "swiglu"])
def test_swiglu_kernels_across_the_float_range_and_at_the_clamps(dtype, width, act):
    # The CPU's own loops for the SwiGLU forms (GPT-OSS's clamped one, plain SwiGLU interleaved and
    # in halves) take the sigmoid from their own exp (a polynomial, vectorised by GCC or written
    # for AVX-512): against the twin from -300 to 300, exactly at +-limit, past exp's range, and
    # NaN (a row of its own: a NaN input spreads over its row through the GEMM). Widths: under one
    # AVX-512 vector (8), vectors and a tail (50; 25: a tail of 9, past half of the interleaved
    # layout's second vector), and in bfloat16 past a 256-output chunk (500). bfloat16 is the
    # float32 arithmetic rounded to nearest even, bit for bit.
    from minagi.moe import ops
    from minagi.moe.reference import expert_act_backward

    compiled, alpha, limit = ops.compiled(), 1.702, 7.0
    gate = torch.cat([torch.linspace(-300, 300, 994), torch.tensor([limit, -limit, 0.0, 60.0, -60.0, -100.0])])
    up = torch.cat([torch.linspace(40, -40, 994), torch.tensor([limit, -limit, 1.0, -limit - 1, limit + 1, 2.0])])
    if act == "swiglu":  # gate and up as h's halves
        h = torch.cat([gate.reshape(-1, width), up.reshape(-1, width)], 1)
    else:  # interleaved, GPT-OSS's layout
        h = torch.stack([gate, up], 1).reshape(-1, 2 * width)
    h = torch.cat([h, torch.full((1, 2 * width), float("nan"))]).to(dtype)
    one = (torch.tensor([0]), torch.tensor([h.shape[0]]))
    eye = torch.eye(2 * width, dtype=dtype)[None]
    got = compiled.grouped_mm_act(h, eye, None, *one, act, alpha, limit)[1]
    want = activate(h.double(), act, alpha, limit)
    assert got[-1].isnan().all()
    assert_close(got[:-1], want[:-1], dtype)
    grad = torch.randn(h.shape[0], width).to(dtype)
    g_got, _ = compiled.expert_act_backward(grad, h, *one, act, alpha, limit, 1, False)
    g_want, _ = expert_act_backward(grad.double(), h.double(), *one, act, alpha, limit, 1, False)
    assert g_got[-1].isnan().all()
    assert_close(g_got[:-1], g_want[:-1], dtype)
    if dtype == torch.bfloat16:  # torch's own rounding keeps a NaN's sign and payload: the NaN row is left out
        f32 = compiled.grouped_mm_act(h.float(), eye.float(), None, *one, act, alpha, limit)[1]
        assert torch.equal(got[:-1].view(torch.int16), f32[:-1].to(dtype).view(torch.int16))
        assert (got[-1].view(torch.int16) == 0x7FC0).all()  # NaN as c10::BFloat16 rounds it
        g32, _ = compiled.expert_act_backward(grad.float(), h.float(), *one, act, alpha, limit, 1, False)
        assert torch.equal(g_got[:-1].view(torch.int16), g32[:-1].to(dtype).view(torch.int16))


@requires_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["swiglu_interleaved", "swiglu"])
def test_swiglu_kernels_at_infinities_as_the_twin(dtype, act):
    # silu(-inf) is -inf / inf = NaN in the twin (torch's silu); the kernels' clamped exp would give
    # -inf there unless they say otherwise. Gates and ups of +-inf, both passes, both layouts.
    from minagi.moe import ops
    from minagi.moe.reference import expert_act_backward

    compiled, inf = ops.compiled(), float("inf")
    gate = torch.tensor([-inf, inf, 1.0, -1.0, 0.0, -inf, inf, 2.0] * 3)
    up = torch.tensor([2.0, 3.0, inf, -inf, inf, -inf, -inf, 0.5] * 3)
    W = gate.numel()
    h = torch.cat([gate, up])[None] if act == "swiglu" else torch.stack([gate, up], 1).reshape(1, 2 * W)
    one = (torch.tensor([0]), torch.tensor([1]))
    # Forward through the fused first layer: rows times 10 * identity, so that +-3e38 overflows to
    # +-inf in the GEMM without a NaN (an infinite input would meet the identity's zeros).
    x = torch.where(h.isinf(), h.sign() * 3e38, h / 10).to(dtype)
    h_got, got = compiled.grouped_mm_act(x, 10 * torch.eye(2 * W, dtype=dtype)[None], None, *one, act, 1.0, 7.0)
    assert torch.equal(h_got.isinf(), h.isinf())
    grad = torch.ones(1, W, dtype=dtype)
    g_got, _ = compiled.expert_act_backward(grad, h.to(dtype), *one, act, 1.0, 7.0, 1, False)
    g_want, _ = expert_act_backward(grad.double(), h.double(), *one, act, 1.0, 7.0, 1, False)
    for a, b in ((got, activate(h_got.double(), act)), (g_got, g_want)):
        assert torch.equal(a.isnan(), b.isnan()) and a.isnan().any()
        assert torch.equal(a.isinf(), b.isinf()) and torch.equal(a[a.isinf()].sign(), b[b.isinf()].sign().to(dtype))
        finite = b.isfinite()
        assert_close(a[finite], b[finite], dtype)
