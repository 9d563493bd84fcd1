"""What only a GPU can show: the caching allocator's reserved memory stays flat over many skewed
routings; the model trains there, with its pool on the device or in host memory; plans, routings
and gathers at scale and past the grid limits; a side stream; the decode kernel; and expert_mlp's
compiled path against the twin, forward and backward, with nothing read on the host (every form,
biases, .mT weights, decode sizes, capacity, skipped ids, the routing cases of tests/cases.py).
Every case skips visibly where no GPU (or no GPU build of minagi._C) is present; the
compiled-against-twin tests of the ops run on the GPU through the `device` fixture of test_ops and
test_dispatch."""
import contextlib
import random

import pytest
import torch

from minagi.lm import checkpoint

from minagi import expert_mlp
from minagi.lm.config import load
from minagi.lm.run import build
from minagi.lm.trainer import train
from minagi.moe.reference import ACTIVATIONS, GATED

from cases import CASES
from conftest import requires_gpu
from test_trainer import TINY, text_file  # noqa: F401  (a fixture)

pytestmark = requires_gpu


def _skewed_routing(N, S, K, rng):
    """K distinct slots per character; a random share of characters piles onto a few slots."""
    logits = torch.randn(N, S)
    hot = rng.sample(range(S), rng.randint(1, 4))
    share = rng.uniform(0.0, 0.98)
    boost = torch.rand(N) < share
    logits[boost.nonzero().squeeze(1)[:, None], torch.tensor(hot)[None]] += 10
    return logits.topk(K, dim=1).indices


def test_reserved_memory_stops_growing_after_warm_up():
    # 1,000 forward+backward calls at random sizes and skewed loads: every buffer whose size
    # depends on the routing is allocated at a _bucket size, so after warm-up the allocator has
    # cached every block it will be asked for.
    dev = torch.device("cuda")
    rng = random.Random(0)
    S, K, D, H = 64, 4, 128, 256
    w_in = (torch.randn(S, D, H, device=dev) / D ** 0.5).to(torch.bfloat16).requires_grad_()
    w_out = (torch.randn(S, H, D, device=dev) / H ** 0.5).to(torch.bfloat16).requires_grad_()
    reserved = []
    for i in range(1000):
        N = rng.randint(256, 2048)
        idx = _skewed_routing(N, S, K, rng).to(dev)
        x = torch.randn(N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        gates = torch.softmax(torch.randn(N, K, device=dev), 1).to(torch.bfloat16).requires_grad_()
        y = expert_mlp(x, idx, gates, w_in, w_out, path="compiled")
        y.float().square().mean().backward()
        w_in.grad = w_out.grad = None
        reserved.append(torch.cuda.memory_reserved(dev))
    warm = reserved[299]
    assert max(reserved[300:]) == warm, (
        f"reserved memory grew after 300 calls: {warm} -> {max(reserved[300:])} bytes")


@pytest.mark.parametrize("pool_device", ["", "cpu"])
def test_model_trains_on_the_gpu(tmp_path, text_file, pool_device):  # noqa: F811
    # With model.pool_device=cpu the pool stays in host memory and only the card goes to the GPU:
    # the pool's experts must still get their updates.
    cfg = load("cpu-tiny", [*TINY, "train.device=cuda", f"model.pool_device={pool_device}", "train.steps=4",
                            "train.checkpoint_every=4", f"data.path={text_file}"])
    train(cfg, tmp_path, progress=False)
    init, _, _ = build(cfg, torch.device("cuda"))
    assert init.pool.w_in.device.type == ("cpu" if pool_device else "cuda")
    trained = checkpoint.load(tmp_path)["model"]["pool.w_in"].cpu()
    assert torch.isfinite(trained).all()
    assert not torch.equal(trained, init.pool.w_in.detach().cpu()), "the pool's experts were not updated"


# ---- The review's findings (issue 15): plans and routings at scale, grid limits, streams, decode.

def _ops():
    from minagi.moe import ops

    return ops.compiled(), ops.REFERENCE


@pytest.mark.parametrize("S", [300, 1100, 2048])
@pytest.mark.parametrize("load", ["uniform", "sink"])
@pytest.mark.parametrize("cap,bucketed", [(0, True), (0, False), (7, True)])
def test_group_plan_at_scale_is_bit_exact_against_the_twin(S, load, cap, bucketed):
    compiled, ref = _ops()
    g = torch.Generator().manual_seed(S)
    N, K = 250_000, 4  # 10^6 pairs: thousands of chunks of 256
    if load == "uniform":
        idx = torch.rand(N, S, generator=g).topk(K, dim=1).indices
    else:  # every character takes slot 5, the rest spread
        idx = torch.rand(N, S, generator=g).topk(K, dim=1).indices
        idx[:, 0] = torch.where(idx[:, 1:].eq(5).any(1), idx[:, 0], torch.full_like(idx[:, 0], 5))
    got = compiled.group_plan(idx.cuda(), S, cap, bucketed)
    want = ref.group_plan(idx, S, cap, bucketed)
    for name, a, b in zip(("load", "slot_order", "slot_rows", "row_pair", "dest"), got, want):
        assert torch.equal(a.cpu(), b), name


def test_routing_past_grid_limits_with_ties_and_the_slot_limit():
    compiled, ref = _ops()
    logits = (torch.randn(70_000, 512) * 4).round()  # many ties across threads
    for a, b in zip(compiled.routing(logits.cuda(), 8), ref.routing(logits, 8)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-6)
    near = torch.randn(64, 2048, dtype=torch.float64)
    for a, b in zip(compiled.routing(near.cuda(), 4), ref.routing(near, 4)):
        torch.testing.assert_close(a.cpu(), b)
    with pytest.raises(RuntimeError, match="the GPU kernels take at most 2048 card slots"):
        compiled.routing(torch.randn(4, 2049, dtype=torch.float64, device="cuda"), 2)
    with pytest.raises(RuntimeError, match="the GPU kernels take at most 2048 card slots"):
        compiled.group_plan(torch.zeros(4, 1, dtype=torch.long, device="cuda"), 2049, 0, True)


def test_gather_scatter_and_gate_grad_past_grid_limits():
    compiled, ref = _ops()
    N, K, D = 70_000, 2, 256  # N*K > 65,535 and E*D > 65,535*256
    idx = torch.randint(0, 16, (N, K))
    _, _, _, row_pair, dest = ref.group_plan(idx, 16, 0, True)
    x, gates = torch.randn(N, D), torch.rand(N, K)
    buf = ref.bucketed_gather(x, row_pair, dest, gates)
    cu = lambda *t: [v.cuda() if isinstance(v, torch.Tensor) else v for v in t]  # noqa: E731
    torch.testing.assert_close(compiled.bucketed_gather(*cu(x, row_pair, dest, gates)).cpu(), buf)
    torch.testing.assert_close(compiled.weighted_scatter(*cu(buf, dest, row_pair, gates)).cpu(),
                               ref.weighted_scatter(buf, dest, row_pair, gates))
    torch.testing.assert_close(compiled.gate_grad(*cu(x, buf, dest, row_pair)).cpu(),
                               ref.gate_grad(x, buf, dest, row_pair), rtol=1e-4, atol=1e-3)


def test_a_side_stream_gives_the_default_streams_results_and_no_views():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    S, K, D, H, N = 16, 2, 64, 128, 3000

    def run():
        x = torch.randn(N, D, device=dev, generator=g, requires_grad=True)
        idx = torch.randint(0, S, (N, K), device=dev, generator=g)
        gates = torch.rand(N, K, device=dev, generator=g, requires_grad=True)
        w_in = torch.randn(S, D, H, device=dev, generator=g, requires_grad=True)
        w_out = torch.randn(S, H, D, device=dev, generator=g, requires_grad=True)
        y = expert_mlp(x, idx, gates, w_in, w_out, path="compiled")
        y.square().sum().backward()
        return [y.detach(), x.grad, gates.grad, w_in.grad, w_out.grad]

    base = run()
    g.manual_seed(0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = run()
    side.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(base, other))
    compiled, _ = _ops()
    idx = torch.randint(0, S, (N, K), device=dev)
    plan = compiled.group_plan(idx, S, 0, True)
    out = compiled.bucketed_gather(torch.randn(N, D, device=dev), plan[3], plan[4], None)
    assert out._base is None and plan[1]._base is None and plan[3]._base is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_decode_kernel_reads_weights_in_place_like_the_twin(dtype):
    compiled, ref = _ops()
    S, K, M = 12, 96, 200
    b = torch.randn(S, K, M, dtype=dtype)
    ids, rows = torch.tensor([7, 2, 11, 0]), torch.tensor([1, 4, 2, 3])  # at most 4 rows per slot
    a = torch.randn(int(rows.sum()), K, dtype=dtype)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # the in-place kernel ran, not gather + bmm
        got = compiled.grouped_mm(a.cuda(), b.cuda(), ids.cuda(), rows)
        torch.cuda.synchronize()
    assert any("small_rows_kernel" in e.name for e in prof.events()), sorted({e.name for e in prof.events()})
    want = ref.grouped_mm(a.double(), b.double(), ids, rows)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol * K ** 0.5)


@contextlib.contextmanager
def _sync_is_an_error():
    """CUDA's sync debug mode at "error": any device-to-host read or synchronising copy raises."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


# (activation, gated, biases, weights stored [S, out, in] and passed as .mT, N, capacity_factor,
# out_of_range_slots): the fused forms, a caller's activation, decode sizes, capacity and skip;
# each in float32 and bfloat16.
SYNC_FREE_CALLS = [
    ("gelu", False, False, False, 300, 0.0, "error"),
    ("swiglu", True, True, True, 300, 0.0, "error"),
    ("swiglu_oai", True, True, False, 257, 1.25, "error"),
    ("relu2", False, True, True, 1, 0.0, "error"),
    ("swiglu", True, False, True, 3, 0.0, "error"),
    ("gelu", False, True, False, 64, 0.0, "skip"),
    (torch.nn.functional.silu, False, True, True, 100, 0.0, "error"),
]
# In float32: every form with biases, .mT weights and skipped ids, at the decode size (3) and past
# it (300); and N naming a routing case of tests/cases.py instead (its N, S, K and slot ids): a
# sink, uniform loads, one character, k = S, uncapped and capped.
SYNC_FREE_FLOAT32_CALLS = [
    *[(act, act in GATED, True, True, N, 0.0, "skip") for act in ACTIVATIONS for N in (3, 300)],
    *[("gelu", False, False, False, case, cf, "error") for case in ("sink", "uniform", "one_char", "k_eq_S")
      for cf in (0.0, 0.5)],
]


def _call_id(call, dtype):
    return "-".join(str(getattr(v, "__name__", v)) for v in call) + ("-bf16" if dtype == torch.bfloat16 else "-fp32")


SYNC_FREE = [pytest.param(c, d, id=_call_id(c, d)) for c in SYNC_FREE_CALLS for d in (torch.float32, torch.bfloat16)] + \
    [pytest.param(c, torch.float32, id=_call_id(c, torch.float32)) for c in SYNC_FREE_FLOAT32_CALLS]


def _expert_args(act, gated, biases, transposed, N, dtype, skip):
    dev, S, K, D, H = torch.device("cuda"), 8, 2, 64, 96
    g = torch.Generator().manual_seed(N if isinstance(N, int) else 0)
    H_in = 2 * H if gated else H

    def weight(s, i, o):  # [s, i, o], stored [s, o, i] where transposed
        w = torch.randn(s, o, i, generator=g).mT if transposed else torch.randn(s, i, o, generator=g)
        return (w / i ** 0.5).to(dev, dtype).requires_grad_()

    if isinstance(N, str):  # a routing case
        N, S, K, build = CASES[N]
        idx = build(N, S, K).to(dev)
    else:
        idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(N)]).to(dev)
    if skip:
        idx[::5, 0] = S + 3  # held elsewhere
    x = torch.randn(N, D, generator=g).to(dev, dtype).requires_grad_()
    gates = torch.rand(N, K, generator=g).softmax(1).to(dev, dtype).requires_grad_()
    w_in, w_out = weight(S, D, H_in), weight(S, H, D)
    b_in = (torch.randn(S, H_in, generator=g) * 0.1).to(dev, dtype).requires_grad_() if biases else None
    b_out = (torch.randn(S, D, generator=g) * 0.1).to(dev, dtype).requires_grad_() if biases else None
    return x, idx, gates, w_in, w_out, b_in, b_out


@pytest.mark.parametrize("call,dtype", SYNC_FREE)
def test_expert_mlp_never_synchronises_on_the_gpu_and_matches_the_twin(call, dtype):
    # The compiled path on the GPU reads nothing on the host: the exact plan's sizes come from the
    # shapes, the grouped GEMMs sum the ranges on the device and read the weights in place.
    act, gated, biases, transposed, N, cap, oor = call
    args = _expert_args(act, gated, biases, transposed, N, dtype, oor == "skip")
    x, idx, gates, w_in, w_out, b_in, b_out = args
    leaves = [t for t in (x, gates, w_in, w_out, b_in, b_out) if t is not None]
    kw = dict(activation=act, b_in=b_in, b_out=b_out, capacity_factor=cap, out_of_range_slots=oor)
    grad_y = torch.randn(x.shape, device=x.device, dtype=dtype)
    torch.cuda.synchronize()
    with _sync_is_an_error():  # the statistics too: read only when asked for, below
        y, stats = expert_mlp(x, idx, gates, w_in, w_out, path="compiled", return_stats=True, **kw)
        got = torch.autograd.grad(y, leaves, grad_y)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    twin = [t.detach().float().requires_grad_() for t in leaves]
    tw = dict(zip([n for n, t in zip(("x", "gates", "w_in", "w_out", "b_in", "b_out"),
                                     (x, gates, w_in, w_out, b_in, b_out)) if t is not None], twin))
    y_twin, stats_twin = expert_mlp(tw["x"], idx, tw["gates"], tw["w_in"], tw["w_out"], path="grouped",
                                    return_stats=True, **{**kw, "b_in": tw.get("b_in"), "b_out": tw.get("b_out")})
    assert (stats.routed_pairs, stats.dropped_pairs) == (stats_twin.routed_pairs, stats_twin.dropped_pairs)
    torch.testing.assert_close(y.float(), y_twin, **tol)
    want = torch.autograd.grad(y_twin, twin, grad_y.float())
    for name, a, b in zip(tw, got, want):
        torch.testing.assert_close(a.float(), b, **tol, msg=lambda m, name=name: f"{name}'s gradient: {m}")


def test_b_in_gradient_is_bitwise_deterministic_on_the_gpu():
    args = _expert_args("swiglu", True, True, True, 513, torch.float32, False)
    x, idx, gates, w_in, w_out, b_in, b_out = args

    def grad_b_in():
        y = expert_mlp(x, idx, gates, w_in, w_out, activation="swiglu", b_in=b_in, b_out=b_out, path="compiled")
        return torch.autograd.grad(y.square().sum(), b_in)[0]

    first = grad_b_in()
    for _ in range(5):
        assert torch.equal(grad_b_in(), first)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_transformers_moe_experts_never_synchronise_on_the_gpu(name, dtype):
    # The tiny model's own code (masks, loss) may synchronise: sync debug mode is "error" while
    # its experts run, forward and backward (module hooks), and the results match eager's.
    pytest.importorskip("transformers")
    import minagi.hf
    from minagi.bench.hf import experts_of, tiny_model, token_ids

    minagi.hf.register()
    model = tiny_model(name, dtype).cuda()
    ids = token_ids().cuda()
    modes = []

    def enter(*_):
        modes.append(torch.cuda.get_sync_debug_mode())
        torch.cuda.set_sync_debug_mode("error")

    def leave(*_):
        torch.cuda.set_sync_debug_mode(modes.pop() if modes else 0)

    def run(impl):
        model.set_experts_implementation(impl)
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        torch.cuda.synchronize()
        return out.logits.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}

    want_logits, want_grads = run("eager")
    hooks = []
    for experts in experts_of(model):
        hooks += [experts.register_forward_pre_hook(enter), experts.register_forward_hook(leave),
                  experts.register_full_backward_pre_hook(enter), experts.register_full_backward_hook(leave)]
    try:
        logits, grads = run("minagi")
    finally:
        for h in hooks:
            h.remove()
        torch.cuda.set_sync_debug_mode(0)
    tol = dict(rtol=5e-2, atol=5e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, **tol)
    assert grads.keys() == want_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
