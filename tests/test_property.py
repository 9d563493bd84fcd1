"""Property test: random N, S, K, d, h and skewed loads, compiled against the twins."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minagi import expert_mlp
from minagi.moe.reference import ACTIVATIONS, GATED

from cases import random_routing
from conftest import assert_close, requires_ext


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
    bias = draw(st.booleans())
    mT = draw(st.booleans())
    return N, S, K, D, H, skew, cf, seed, act, bias, mT


@requires_ext
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_compiled_matches_reference(problem):
    N, S, K, D, H, skew, cf, seed, act, bias, mT = problem
    g = torch.Generator().manual_seed(seed)
    slot_idx = random_routing(N, S, K, skew, generator=g)
    h_in = 2 * H if act in GATED else H
    x, gates = torch.randn(N, D, generator=g, dtype=torch.float64), torch.rand(N, K, generator=g, dtype=torch.float64)
    w_in, w_out = torch.randn(S, D, h_in, generator=g, dtype=torch.float64), torch.randn(S, H, D, generator=g, dtype=torch.float64)
    b_in, b_out = torch.randn(S, h_in, generator=g, dtype=torch.float64), torch.randn(S, D, generator=g, dtype=torch.float64)
    results = {}
    for path in ("rectangle", "grouped", "compiled"):
        leaves = [t.clone().requires_grad_() for t in ((x, gates, w_in, w_out, b_in, b_out) if bias else (x, gates, w_in, w_out))]
        w = [t.mT.contiguous().mT if mT else t for t in leaves[2:4]]  # a strided view of [S, out, in]
        biases = {"b_in": leaves[4], "b_out": leaves[5]} if bias else {}
        y, stats = expert_mlp(leaves[0], slot_idx, leaves[1], *w, activation=act, **biases, path=path,
                              capacity_factor=cf, return_stats=True)
        grads = torch.autograd.grad(y.sum(), leaves, allow_unused=True) if N else [None] * len(leaves)
        results[path] = (y, grads, stats.dropped_pairs)
    y_r, g_r, d_r = results["rectangle"]
    for path in ("grouped", "compiled"):
        y, grads, dropped = results[path]
        assert dropped == d_r
        assert_close(y, y_r, msg=path)
        for a, b in zip(grads, g_r):
            assert_close(a, b, scale=4, msg=f"{path} grad")
