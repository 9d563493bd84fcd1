"""What only a GPU can show: the caching allocator's reserved memory stays flat over many skewed
routings, and the model trains there, with its pool on the device or in host memory. Every case
skips visibly where no GPU (or no GPU build of minagi._C) is present; the compiled-against-twin
tests of the ops run on the GPU through the `device` fixture of test_ops and test_dispatch."""
import random

import pytest
import torch

from minagi import checkpoint, expert_mlp
from minagi.config import load
from minagi.trainer import build, train

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
