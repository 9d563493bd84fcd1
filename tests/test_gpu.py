"""What only a GPU can show: the caching allocator's reserved memory stays flat over many skewed
routings, and the model trains there, with its pool on the device or in host memory. Every case
skips visibly where no GPU (or no GPU build of minagi._C) is present; the compiled-against-twin
tests of the ops run on the GPU through the `device` fixture of test_ops and test_dispatch."""
import random

import pytest
import torch

from minagi import checkpoint, expert_mlp
from minagi.config import load
from minagi.run import build
from minagi.trainer import train

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
    from minagi import ops

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


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu2", "swiglu", "swiglu_interleaved", "swiglu_oai"])
@pytest.mark.parametrize("N", [3, 300])
def test_every_expert_form_on_the_gpu_matches_the_cpu(act, N):
    # Biases, .mT weights and skipped out-of-range ids, forward and backward, on the GPU's
    # compiled path (the decode kernel at N = 3) against the pure-torch path on the CPU in float64.
    g = torch.Generator().manual_seed(N)
    S, K, D, H = 6, 2, 16, 12
    h_in = 2 * H if "swiglu" in act else H
    idx = torch.rand(N, S, generator=g).topk(K, dim=1).indices
    idx[0, 1] = S  # an expert held elsewhere
    cpu = {"x": torch.randn(N, D, generator=g, dtype=torch.float64),
           "gates": torch.rand(N, K, generator=g, dtype=torch.float64),
           "w_in": torch.randn(S, h_in, D, generator=g, dtype=torch.float64) / 4,  # [S, out, in]
           "w_out": torch.randn(S, D, H, generator=g, dtype=torch.float64) / 4,
           "b_in": torch.randn(S, h_in, generator=g, dtype=torch.float64),
           "b_out": torch.randn(S, D, generator=g, dtype=torch.float64)}
    gy = torch.randn(N, D, generator=g, dtype=torch.float64)

    def run(leaves, idx, path):
        y = expert_mlp(leaves["x"], idx, leaves["gates"], leaves["w_in"].mT, leaves["w_out"].mT, activation=act,
                       b_in=leaves["b_in"], b_out=leaves["b_out"], out_of_range_slots="skip", path=path)
        grads = torch.autograd.grad(y, list(leaves.values()), gy.to(y), allow_unused=True)
        return y, dict(zip(leaves, grads))

    want, want_g = run({k: v.clone().requires_grad_() for k, v in cpu.items()}, idx, "grouped")
    got, got_g = run({k: v.float().cuda().requires_grad_() for k, v in cpu.items()}, idx.cuda(), "compiled")
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-4)
    for k in want_g:
        torch.testing.assert_close(got_g[k].cpu().double(), want_g[k], rtol=1e-4, atol=1e-4, msg=k)
