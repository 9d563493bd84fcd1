"""PooledMLP: the card's experts as one module. Routes with the routing op, dispatches with
expert_mlp. The pool and admission (which pool experts sit on the card) live around it in the
model; a card can be fed from outside through forward(card=...).

Legend: N characters, K top_k, S card slots, D model width, H expert width.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from ..moe import ops as _ops
from ..moe.dispatch import dispatch_stats, expert_mlp
from ..moe.expert_parallel import ep_expert_mlp
from ..moe.reference import ACTIVATIONS, GATED


class Card(NamedTuple):
    """The experts on the compute device for one step, one tensor per weight."""
    router_SD: torch.Tensor
    w_in_SDH: torch.Tensor
    w_out_SHD: torch.Tensor


class RowRoute(NamedTuple):
    """One call's routing, for a load-aware balance term: the router logits of every row passed
    (padding included), the real characters' load per slot, and how many rows are real."""
    logits_NS: torch.Tensor
    load_S: torch.Tensor  # int64
    n_valid: int


def init_experts(n: int, d_model: int, d_hidden: int, *, device=None, dtype=None, generator=None, gated=False):
    """Fresh (router [n, d], w_in [n, d, h] ([n, d, 2h] for a gated form), w_out [n, h, d])."""
    kw = {"device": device, "dtype": dtype}
    router = torch.empty(n, d_model, **kw).normal_(std=1.0 / math.sqrt(d_model), generator=generator)
    width = 2 * d_hidden if gated else d_hidden
    w_in = torch.empty(n, d_model, width, **kw).normal_(std=1.0 / math.sqrt(d_model), generator=generator)
    w_out = torch.empty(n, d_hidden, d_model, **kw).normal_(std=1.0 / math.sqrt(d_hidden), generator=generator)
    return router, w_in, w_out


class PooledMLP(nn.Module):
    # The seed's switch: False sends every instance through the rectangle dispatch.
    grouped_dispatch: bool = True

    def __init__(self, d_model: int, d_hidden: int, n_slots: int, top_k: int, *,
                 capacity_factor: float = 0.0, path: str = "auto", own_card: bool = True,
                 gates: str = "chosen", activation: str = "gelu", device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= n_slots:
            raise ValueError(f"PooledMLP: top_k must be in [1, n_slots = {n_slots}], got {top_k}")
        self.d_model, self.d_hidden, self.n_slots = d_model, d_hidden, n_slots
        if gates not in ("chosen", "all"):
            raise ValueError(f"PooledMLP: gates must be 'chosen' or 'all', got {gates!r}")
        self.top_k, self.capacity_factor, self.path, self.gates = top_k, capacity_factor, path, gates
        if activation not in ACTIVATIONS:
            raise ValueError(f"PooledMLP: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        self.last_stats = None
        # Benchmarks set this to impose a routing shape: fn(x_ND, n_slots, top_k) -> (slot_idx, gates).
        self.force_routing = None
        # A list while a load-aware balance term wants them: a RowRoute per call, in order.
        self.route_log = None
        # Expert parallelism (minagi.moe.expert_parallel): the process group over which the card's
        # experts are sharded; the card's weights are then this rank's shard, the router all of it.
        self.ep_group = None
        if own_card:  # else every forward is handed its card (the model's pool admits one)
            self.router, self.w_in, self.w_out = (nn.Parameter(t) for t in init_experts(
                n_slots, d_model, d_hidden, device=device, dtype=dtype, gated=activation in GATED))

    def card(self) -> Card:
        if not hasattr(self, "w_in"):
            raise RuntimeError("this PooledMLP has no card of its own (own_card=False): pass card=...")
        return Card(self.router, self.w_in, self.w_out)

    def route(self, x_ND: torch.Tensor, router_SD: torch.Tensor, n_valid: int, route_bias_S=None):
        """(slot_idx [N, K], gates [N, K] in x's dtype). Rows from n_valid on are zero padding:
        their logits all tie, so they would all pick the same top_k slots; they are spread over
        the slots instead (their gates, 1 / K, are the same for any pick)."""
        if self.force_routing is not None:
            slot_idx_NK, gates_NK = self.force_routing(x_ND, router_SD.shape[0], self.top_k)
            return slot_idx_NK, gates_NK
        N, S = x_ND.shape[0], router_SD.shape[0]
        logits_NS = x_ND @ router_SD.t()
        ops = _ops.best(x_ND.device)
        if route_bias_S is None:
            slot_idx_NK, gates_NK, load_S = ops.routing(logits_NS, self.top_k)
        else:  # the bias picks the slots; the gates are the unbiased logits' softmax over them
            with torch.no_grad():
                slot_idx_NK, _, load_S = ops.routing(logits_NS.float() + route_bias_S.float(), self.top_k)
        if n_valid < N:
            spread = torch.arange((N - n_valid) * self.top_k, device=x_ND.device).view(-1, self.top_k) % S
            slot_idx_NK = torch.cat([slot_idx_NK[:n_valid], spread])
            if self.route_log is not None:  # the real characters' load
                load_S = torch.bincount(slot_idx_NK[:n_valid].reshape(-1), minlength=S)
        if self.gates == "all":  # each chosen slot's share of the whole card's softmax
            wide = torch.promote_types(logits_NS.dtype, torch.float32)  # bfloat16 logits: float32 softmax
            gates_NK = torch.softmax(logits_NS, dim=-1, dtype=wide).gather(1, slot_idx_NK)
        elif route_bias_S is not None:
            gates_NK = torch.softmax(logits_NS.gather(1, slot_idx_NK).float(), dim=-1)
        if self.route_log is not None:
            self.route_log.append(RowRoute(logits_NS, load_S, n_valid))
        # Under autocast the logits (so the gates) may come out in another dtype than x.
        return slot_idx_NK, gates_NK.to(x_ND.dtype)

    def forward(self, x: torch.Tensor, card: Card | None = None, return_stats: bool = False,
                n_valid: int | None = None, route_bias: torch.Tensor | None = None):
        """x [..., D] -> [..., D]. card: the slots' weights to use instead of this module's own.
        n_valid: x's rows from n_valid on (flattened) are padding, zero rows whose output nobody
        reads; they count in no load, statistic or capacity. route_bias [S]: added to the router
        logits for the choice of slots only (bias balancing)."""
        router_SD, w_in_SDH, w_out_SHD = card if card is not None else self.card()
        x_ND = x.reshape(-1, x.shape[-1])
        n_valid = x_ND.shape[0] if n_valid is None else n_valid
        # Under autocast the activations may be bfloat16 while the card is float32: one dtype.
        router_SD, w_in_SDH, w_out_SHD = (t.to(x_ND.dtype) for t in (router_SD, w_in_SDH, w_out_SHD))
        slot_idx_NK, gates_NK = self.route(x_ND, router_SD, n_valid, route_bias)
        path = self.path if type(self).grouped_dispatch else "rectangle"
        if self.ep_group is not None:
            y_ND = ep_expert_mlp(x_ND, slot_idx_NK, gates_NK, w_in_SDH, w_out_SHD, group=self.ep_group,
                                 n_experts=router_SD.shape[0], path=path, n_valid=n_valid, activation=self.activation)
            K = slot_idx_NK.shape[1]
            stats = (dispatch_stats(slot_idx_NK[:n_valid], router_SD.shape[0], 0, n_valid * K, 0)
                     if return_stats else None)
        else:
            result = expert_mlp(x_ND, slot_idx_NK, gates_NK, w_in_SDH, w_out_SHD, activation=self.activation, path=path,
                                capacity_factor=self.capacity_factor, return_stats=return_stats, n_valid=n_valid)
            y_ND, stats = result if return_stats else (result, None)
        self.last_stats = stats  # None unless asked for: the statistics cost host syncs
        y = y_ND.view(x.shape)
        return (y, stats) if return_stats else y

    def extra_repr(self) -> str:
        S, D, H = self.n_slots, self.d_model, self.d_hidden
        return (f"n_slots={S}, d_model={D}, d_hidden={H}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, path={self.path!r}, gates={self.gates!r}, "
                f"activation={self.activation!r}")
