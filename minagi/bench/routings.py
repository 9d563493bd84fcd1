"""Routings for benchmarks and tests: uniform, and the seed's sink shape.

Legend: N characters, K top_k, S card slots.
"""
from __future__ import annotations

import torch


def _cyclic_rows(n_rows: int, width: int, slots: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Rows of `width` distinct slots taken in turn from `slots`, so loads stay within one of each other."""
    pos = offset + torch.arange(n_rows * width).view(n_rows, width)
    return slots[pos % slots.numel()]


def uniform_routing(N: int, S: int, K: int) -> torch.Tensor:
    """Every slot gets N * K / S pairs (within one); each character K distinct slots."""
    return _cyclic_rows(N, K, torch.arange(S))


def sink_routing(N: int, S: int, K: int, sink_chars: int) -> torch.Tensor:
    """The seed's sink: slot 0 is chosen by the first `sink_chars` characters (1,960 of 2,081 at
    a typical row), the other pairs spread evenly over slots 1..S-1."""
    if not 0 <= sink_chars <= N:
        raise ValueError(f"sink_chars must be in [0, N = {N}], got {sink_chars}")
    if S < K + 1 and sink_chars < N:
        raise ValueError(f"a sink routing needs S > K (got S = {S}, K = {K})")
    rest = torch.arange(1, S)
    sink_part = torch.cat([torch.zeros(sink_chars, 1, dtype=torch.long),
                           _cyclic_rows(sink_chars, K - 1, rest)], dim=1)
    other_part = _cyclic_rows(N - sink_chars, K, rest, offset=sink_chars * (K - 1))
    return torch.cat([sink_part, other_part]).contiguous()


def random_gates(N: int, K: int, dtype=torch.float32, generator=None) -> torch.Tensor:
    return torch.softmax(torch.randn(N, K, generator=generator), dim=1).to(dtype)
