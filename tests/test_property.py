"""expert_mlp's paths against each other: the grouped path and (where the extension is loaded) the
compiled one against the rectangle, outputs, the gradients of every input and the dispatch
statistics; the compiled path's inference calls too (no gradient, and a gradient for w_out alone,
whose first layer is still the inference op). A hypothesis property test over random N, S, K, d, h,
skewed loads, capacities, every form, biases and .mT weights in float64, with the routing cases of
tests/cases.py (N = 0, N = 1, k = 1, k = S, S = 1, uniform and sink loads) as explicit examples in
float32 and float64, uncapped and capped."""
from typing import NamedTuple

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minagi import expert_mlp
from minagi.moe.reference import ACTIVATIONS, GATED

from cases import CASES, make, random_routing
from conftest import EXT, assert_close

PATHS = ["grouped", "compiled"] if EXT else ["grouped"]


class Problem(NamedTuple):
    N: int
    S: int
    K: int
    D: int
    H: int
    skew: float
    cf: float
    seed: int
    act: str = "gelu"
    bias: bool = False
    mT: bool = False
    case: str = ""  # a routing case of tests/cases.py: its N, S, K, slot ids and tensors (d = 8, h = 12)
    dtype: torch.dtype = torch.float64


@st.composite
def problems(draw):
    S = draw(st.integers(1, 12))
    K = draw(st.integers(1, S))
    N = draw(st.integers(0, 60))
    D, H = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    skew = draw(st.sampled_from([0.0, 0.5, 2.0, 8.0]))
    cf = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7]))
    seed = draw(st.integers(0, 2 ** 16))
    act = draw(st.sampled_from(ACTIVATIONS))
    return Problem(N, S, K, D, H, skew, cf, seed, act, draw(st.booleans()), draw(st.booleans()))


def tensors(p: Problem):
    """slot_idx and the inputs, {x, gates, w_in, w_out[, b_in, b_out]}."""
    if p.case:
        torch.manual_seed(p.seed)
        slot_idx, (x, gates, w_in, w_out) = make(p.case, p.dtype, requires_grad=False)
        return slot_idx, {"x": x, "gates": gates, "w_in": w_in, "w_out": w_out}
    g = torch.Generator().manual_seed(p.seed)
    slot_idx = random_routing(p.N, p.S, p.K, p.skew, generator=g)
    h_in = 2 * p.H if p.act in GATED else p.H
    t = {"x": torch.randn(p.N, p.D, generator=g, dtype=p.dtype), "gates": torch.rand(p.N, p.K, generator=g, dtype=p.dtype),
         "w_in": torch.randn(p.S, p.D, h_in, generator=g, dtype=p.dtype),
         "w_out": torch.randn(p.S, p.H, p.D, generator=g, dtype=p.dtype)}
    if p.bias:
        t["b_in"] = torch.randn(p.S, h_in, generator=g, dtype=p.dtype)
        t["b_out"] = torch.randn(p.S, p.D, generator=g, dtype=p.dtype)
    return slot_idx, t


def call(p: Problem, slot_idx, leaves, path, **kw):
    # .mT: a strided view of weights stored [S, out, in], as nn.Linear keeps them.
    w = {k: (t.mT.contiguous().mT if p.mT and k.startswith("w_") else t) for k, t in leaves.items()}
    return expert_mlp(w["x"], slot_idx, w["gates"], w["w_in"], w["w_out"], activation=p.act, b_in=w.get("b_in"),
                      b_out=w.get("b_out"), path=path, capacity_factor=p.cf, **kw)


def with_the_routing_cases(test):
    for name in sorted(CASES):
        N, S, K, _ = CASES[name]
        for cf in (0.0, 0.5, 1.0):
            for dtype in (torch.float32, torch.float64):
                test = example(Problem(N, S, K, 8, 12, 0.0, cf, 0, case=name, dtype=dtype))(test)
    return test


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
@with_the_routing_cases
def test_paths_match_the_rectangle(problem):
    p = problem
    slot_idx, inputs = tensors(p)
    results = {}
    for path in ["rectangle", *PATHS]:
        leaves = {k: t.clone().requires_grad_() for k, t in inputs.items()}
        y, stats = call(p, slot_idx, leaves, path, return_stats=True)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(p.seed + 1), dtype=y.dtype)
        grads = torch.autograd.grad(y, list(leaves.values()), gy, allow_unused=True) if y.numel() else [None] * 6
        results[path] = (y, dict(zip(leaves, grads)), stats)
    y_r, g_r, s_r = results["rectangle"]
    for path in PATHS:
        y, grads, stats = results[path]
        assert stats.dropped_pairs == s_r.dropped_pairs and stats.routed_pairs == s_r.routed_pairs == slot_idx.numel()
        assert_close(y, y_r, msg=path)
        for k in g_r:
            assert_close(grads[k], g_r[k], scale=4, msg=f"{path} grad of {k}")
    if "compiled" not in PATHS:
        return
    # Inference: without a gradient the compiled path's first layer gathers each slot's rows into a
    # tile (gather_mm_act on the CPU); with a gradient for w_out alone it still does, and the
    # second layer's backward gives w_out's.
    with torch.no_grad():
        assert_close(call(p, slot_idx, inputs, "compiled"), y_r, msg="compiled without a gradient")
    leaves = {**inputs, "w_out": inputs["w_out"].clone().requires_grad_()}
    y = call(p, slot_idx, leaves, "compiled")
    assert_close(y.detach(), y_r, msg="compiled with a gradient for w_out alone")
    if y.numel():
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(p.seed + 1), dtype=y.dtype)
        (g_out,) = torch.autograd.grad(y, leaves["w_out"], gy)
        assert_close(g_out, g_r["w_out"], scale=4, msg="w_out's gradient with the first layer in tiles")
