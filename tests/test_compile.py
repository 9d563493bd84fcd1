"""expert_mlp under torch.compile (issue 49): one graph with no break for every form, biases,
.mT weights, skipped ids, capacity and decode sizes; forward and backward equal to eager; and no
recompile as the number of tokens changes. The compiled ops' fake kernels and autograd make the
graph; the pure-torch twins' grouped GEMM reads its plan on the host, so these tests need the
extension."""
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.fx.experimental._config

from minagi import expert_mlp
from conftest import assert_close, requires_ext

pytestmark = requires_ext

S, D, H, K = 6, 8, 12, 2


def _weights(gated: bool, transposed: bool, bias: bool, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    H_in = 2 * H if gated else H
    if transposed:  # nn.Linear's [S, out, in], passed as the .mT view
        w_in = torch.randn(S, H_in, D, generator=g, dtype=dtype).mT
        w_out = torch.randn(S, D, H, generator=g, dtype=dtype).mT
    else:
        w_in, w_out = torch.randn(S, D, H_in, generator=g, dtype=dtype), torch.randn(S, H, D, generator=g, dtype=dtype)
    b_in = torch.randn(S, H_in, generator=g, dtype=dtype) if bias else None
    b_out = torch.randn(S, D, generator=g, dtype=dtype) if bias else None
    return [t.requires_grad_() if t is not None else None for t in (w_in, w_out, b_in, b_out)]


def _tokens(N: int, skip: bool = False, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed + N)
    x = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    slot_idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(N)])
    if skip:  # ids of experts held elsewhere
        slot_idx[::3, 0] = S + 1
    gates = torch.softmax(torch.randn(N, K, generator=g, dtype=dtype), 1).requires_grad_()
    return x, slot_idx, gates


FORMS = [  # activation, bias, .mT weights, out_of_range_slots, capacity_factor
    ("gelu", False, False, "error", 0.0),
    ("swiglu", True, True, "error", 0.0),
    ("swiglu_oai", True, False, "skip", 0.0),
    ("silu", False, True, "error", 1.0),
    ("relu2", True, False, "skip", 0.5),
]


def _call(activation, skip, cf):
    def fn(x, slot_idx, gates, w_in, w_out, b_in, b_out):
        return expert_mlp(x, slot_idx, gates, w_in, w_out, activation=activation, b_in=b_in, b_out=b_out,
                          out_of_range_slots=skip, capacity_factor=cf)
    return fn


def _grads(y, leaves, seed=3):
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    return torch.autograd.grad(y, [t for t in leaves if t is not None], gy)


@pytest.mark.parametrize("activation,bias,transposed,skip,cf", FORMS)
@pytest.mark.parametrize("N", [3, 40])
def test_compiles_whole_and_equals_eager(activation, bias, transposed, skip, cf, N):
    torch._dynamo.reset()
    fn = _call(activation, skip, cf)
    weights = _weights(activation.startswith("swiglu"), transposed, bias)
    x, slot_idx, gates = _tokens(N, skip == "skip")
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    y = compiled(x, slot_idx, gates, *weights)  # fullgraph: a graph break raises
    want = fn(x, slot_idx, gates, *weights)
    assert_close(y, want)
    leaves = [x, gates, *weights]
    for a, b in zip(_grads(y, leaves), _grads(want, leaves)):
        assert_close(a, b, scale=4)


@pytest.mark.parametrize("grad", [False, True])
def test_no_recompile_as_the_tokens_change(grad):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    fn = _call("swiglu", "error", 0.0)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    weights = _weights(True, True, True)
    # Sizes 0 and 1 are specialised by default; size-oblivious, one graph takes N = 1 too.
    with torch.fx.experimental._config.patch(backed_size_oblivious=True), torch.set_grad_enabled(grad):
        for N in (1, 2, 3, 4, 5, 17, 512, 4096):
            x, slot_idx, gates = _tokens(N)
            y = compiled(x, slot_idx, gates, *weights)
            if N == 1:
                first = counter.frame_count
            if N in (1, 4, 17):
                assert_close(y, fn(x, slot_idx, gates, *weights))
    assert counter.frame_count == first, f"{counter.frame_count - first} recompiles after N = 1"


def test_inductor_forward_and_backward_equal_eager():
    torch._dynamo.reset()
    fn = _call("swiglu", "error", 0.0)
    weights = _weights(True, True, True)
    x, slot_idx, gates = _tokens(33)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    y, want = compiled(x, slot_idx, gates, *weights), fn(x, slot_idx, gates, *weights)
    assert_close(y, want)
    leaves = [x, gates, *weights]
    for a, b in zip(_grads(y, leaves), _grads(want, leaves)):
        assert_close(a, b, scale=4)


def test_a_bad_id_is_found_by_the_op_under_compile():
    torch._dynamo.reset()
    fn = _call("gelu", "error", 0.0)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    weights = _weights(False, False, False)
    x, slot_idx, gates = _tokens(9)
    slot_idx[4, 1] = S
    with pytest.raises(ValueError, match=f"slot_idx holds {S}, outside \\[0, S = {S}\\) at token 4, position 1"):
        compiled(x, slot_idx, gates, *weights)
