"""Shared routing cases: (name, N, S, K, slot_idx builder)."""
import torch

from minagi.bench.routings import sink_routing, uniform_routing


def random_routing(N, S, K, skew=0.0, generator=None):
    """K distinct slots per character; skew > 0 makes low slots more popular."""
    logits = torch.randn(N, S, generator=generator) - skew * torch.arange(S, dtype=torch.float32)
    return torch.topk(logits, K, dim=1).indices


CASES = {
    # name: (N, S, K, builder)
    "one_char": (1, 8, 3, lambda N, S, K: random_routing(N, S, K)),
    "empty": (0, 8, 2, lambda N, S, K: torch.empty(0, K, dtype=torch.long)),
    "k1": (20, 6, 1, lambda N, S, K: random_routing(N, S, K)),
    "k_eq_S": (10, 4, 4, lambda N, S, K: random_routing(N, S, K)),
    "S1": (15, 1, 1, lambda N, S, K: torch.zeros(N, 1, dtype=torch.long)),
    "uniform": (64, 16, 4, uniform_routing),
    # the seed's sink shape: one slot chosen by ~94% of characters
    "sink": (300, 16, 4, lambda N, S, K: sink_routing(N, S, K, 282)),
}


def make(name, dtype=torch.float64, D=8, H=12, requires_grad=True):
    N, S, K, build = CASES[name]
    slot_idx = build(N, S, K)
    x = torch.randn(N, D, dtype=dtype)
    gates = torch.softmax(torch.randn(N, K), 1).to(dtype)
    w_in = (torch.randn(S, D, H) / D ** 0.5).to(dtype)
    w_out = (torch.randn(S, H, D) / H ** 0.5).to(dtype)
    leaves = [t.requires_grad_(requires_grad) for t in (x, gates, w_in, w_out)]
    return slot_idx, leaves
