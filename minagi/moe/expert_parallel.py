"""Expert parallelism, the dispatch half: the pool's experts sharded over the E ranks of an
expert-parallel group, each (character, k) pair sent to the rank that holds its expert and its
output sent back, as Megatron-core's all-to-all token dispatcher and torchtitan's expert
parallelism do. Routing stays global (every rank routes its characters over all experts); the
local half is minagi's own grouped dispatch (expert_mlp: the plan and grouped GEMM ops, compiled
where the extension is loaded).

    per rank: pairs sorted by the rank that owns their expert -> pair counts exchanged
    (all_to_all_single) -> rows exchanged (all_to_all_single_autograd of
    torch.distributed._functional_collectives) -> expert_mlp over the local experts, one pair per
    row, gate 1 -> outputs sent back the same way -> the gated combine per character.

The all_to_all's backward is the all_to_all back, so the input rows' and gates' gradients come
home, and each rank's expert weights receive the gradient of every rank's pairs that used them.

Legend: N characters, K top_k, R pairs (N * K), E ranks of the group, L local experts (the pool
/ E), D model width, H expert width, I pairs received.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .dispatch import expert_mlp


# Bytes this process has sent to other ranks through the forward all_to_alls of rows (the
# backward sends as many again); the trainer reads it into the history.
SENT = {"bytes": 0}


def _exchange(t: torch.Tensor, out_splits: list, in_splits: list, group) -> torch.Tensor:
    """all_to_all_single with autograd: rows t [sum(in_splits), ...] out, [sum(out_splits), ...] in."""
    from torch.distributed import _functional_collectives as fc

    if torch.is_grad_enabled():  # training's traffic, not evaluation's
        row_bytes = t[:1].numel() * t.element_size()
        SENT["bytes"] += (sum(in_splits) - in_splits[dist.get_rank(group)]) * row_bytes

    out = fc.all_to_all_single_autograd(t.contiguous(), out_splits, in_splits, group)
    return fc.wait_tensor(out) if isinstance(out, fc.AsyncCollectiveTensor) else out


def _counts(send_E: torch.Tensor, group) -> torch.Tensor:
    recv_E = torch.empty_like(send_E)
    dist.all_to_all_single(recv_E, send_E, group=group)
    return recv_E


def ep_expert_mlp(x_ND, slot_idx_NK, gates_NK, w_in_LDH, w_out_LHD, *, group, n_experts: int, path: str = "auto",
                  n_valid: int | None = None, activation: str = "gelu"):
    """y [N, D] = sum_k gates[n, k] * expert_{slot_idx[n, k]}(x[n]), with this rank holding experts
    [rank * L, (rank + 1) * L) of n_experts (w_in_LDH, w_out_LHD) and the group's other ranks the
    rest. Every rank of the group calls this with its own characters (possibly none). n_valid:
    rows from n_valid on are padding (zero output; they travel nowhere)."""
    N = x_ND.shape[0]
    if n_valid is not None and n_valid < N:
        y_VD = ep_expert_mlp(x_ND[:n_valid], slot_idx_NK[:n_valid], gates_NK[:n_valid], w_in_LDH, w_out_LHD,
                             group=group, n_experts=n_experts, path=path, activation=activation)
        return torch.cat([y_VD, y_VD.new_zeros(N - n_valid, y_VD.shape[1])])
    E, rank = dist.get_world_size(group), dist.get_rank(group)
    L = w_in_LDH.shape[0]
    if L * E != n_experts:
        raise ValueError(f"ep_expert_mlp: {L} local experts x {E} ranks != n_experts = {n_experts}")
    N, K = slot_idx_NK.shape
    D = x_ND.shape[1]
    flat_R = slot_idx_NK.reshape(-1)
    owner_R = torch.div(flat_R, L, rounding_mode="floor")
    order_R = torch.sort(owner_R, stable=True).indices  # the pairs grouped by the rank they go to
    send_E = torch.bincount(owner_R, minlength=E)
    recv_E = _counts(send_E, group)
    send, recv = send_E.tolist(), recv_E.tolist()
    # The local expert of every pair goes along (no gradient), then the rows (with one).
    local_R = (flat_R - owner_R * L).index_select(0, order_R)
    local_I = torch.empty(sum(recv), dtype=local_R.dtype, device=local_R.device)
    dist.all_to_all_single(local_I, local_R, recv, send, group=group)
    x_ID = _exchange(x_ND.index_select(0, torch.div(order_R, K, rounding_mode="floor")), recv, send, group)
    ones_I1 = torch.ones(local_I.shape[0], 1, dtype=x_ID.dtype, device=x_ID.device)
    y_ID = expert_mlp(x_ID, local_I.unsqueeze(1), ones_I1, w_in_LDH, w_out_LHD, activation=activation, path=path)
    y_RD = _exchange(y_ID, send, recv, group)  # back, in the sorted order of the pairs sent
    unsort_R = torch.empty_like(order_R)
    unsort_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)
    y_NKD = y_RD.index_select(0, unsort_R).view(N, K, D)
    return (y_NKD * gates_NK.unsqueeze(-1).to(y_NKD.dtype)).sum(1)


def groups(world: int, ep: int):
    """The process groups of expert parallelism within data parallelism: ranks [g * ep, (g + 1) *
    ep) share one pool (an expert-parallel group); ranks with the same place in their group hold
    the same experts (a data-parallel group, over which those experts' gradients are averaged).
    Every rank must call this (new_group is collective); returns (this rank's ep group, its dp
    group)."""
    if world % ep:
        raise ValueError(f"train.expert_parallel = {ep} must divide the number of ranks ({world})")
    rank = dist.get_rank()
    mine_ep = mine_dp = None
    for g in range(world // ep):
        ranks = list(range(g * ep, (g + 1) * ep))
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine_ep = pg
    for p in range(ep):
        ranks = list(range(p, world, ep))
        pg = dist.new_group(ranks)
        if rank in ranks:
            mine_dp = pg
    return mine_ep, mine_dp


SHARDED = ("pool.w_in", "pool.w_out")  # the expert weights: [n_pool / E, ...] on each rank


class ExpertParallel:
    """A training run's expert parallelism: its groups, and what the trainer does differently.
    The expert weights are left out of DDP; after backward each shard's gradient is summed over
    the ranks that hold the same shard (the data-parallel group) and divided by the ranks, which
    with DDP's mean of everything else is the gradient of the global batch's mean loss. The
    shards' checkpoints (DCP) are checkpoint.py's: save_shards, rest_state, local_state."""

    expert_names = SHARDED

    def __init__(self, world: int, ep: int):
        self.world, self.ep = world, ep
        self.ep_group, self.dp_group = groups(world, ep)
        self.rank = dist.get_rank(self.ep_group)
        self.steps = 0  # optimizer steps since the traffic was last read
        self.mesh = None  # for the checkpoint's DTensors, made at the first save or load

    def shard(self, model) -> None:
        """Keep this rank's experts (model.pool) and send every pair through the all_to_all."""
        model.pool.shard(self.rank, self.ep)
        model.mlp.ep_group = self.ep_group

    def take_sent(self) -> float:
        """Bytes of rows this rank sent to the others per training step since the last call,
        forward and backward (the backward's all_to_alls mirror the forward's)."""
        per_step = 2 * SENT["bytes"] / max(1, self.steps)
        SENT["bytes"], self.steps = 0, 0
        return per_step

    def expert_params(self, model) -> list:
        return [model.pool.w_in, model.pool.w_out]

    @torch.no_grad()
    def reduce_grads(self, model) -> None:
        """Once per optimizer step, after backward."""
        self.steps += 1
        for p in self.expert_params(model):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.dp_group)
            p.grad.div_(self.world)

    @torch.no_grad()
    def clip_grad_norm_(self, model, max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole model, each shard counted once: the same norm
        and scale on every rank, and one process's."""
        experts = {id(p) for p in self.expert_params(model)}
        params = [p for p in model.parameters() if p.grad is not None]
        # Squared norms summed on the device: one all_reduce, no host sync per tensor.
        square = lambda ps: torch.stack([p.grad.double().square().sum() for p in ps]).sum()  # noqa: E731
        sharded = square([p for p in params if id(p) in experts])
        dist.all_reduce(sharded, group=self.ep_group)
        total = (square([p for p in params if id(p) not in experts]) + sharded).sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in params], coef.float())
        return total.float()

    def device_mesh(self, device: torch.device):
        """The (data-parallel, expert-parallel) device mesh over this run's own groups: ranks
        [g * E, (g + 1) * E) are row g, as groups() made them (for the checkpoint's DTensors)."""
        if self.mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            layout = torch.arange(self.world).view(self.world // self.ep, self.ep)
            self.mesh = DeviceMesh.from_group([self.dp_group, self.ep_group], device.type, mesh=layout,
                                              mesh_dim_names=("dp", "ep"))
        return self.mesh

    def opt_indices(self, model, opt) -> list:
        """The optimizer state's keys (positions over its param groups) of the expert weights."""
        ids = {id(p) for p in self.expert_params(model)}
        flat = [p for g in opt.param_groups for p in g["params"]]
        return [i for i, p in enumerate(flat) if id(p) in ids]
