"""The balance term (the auxiliary loss), a separate, swappable piece.

The seed charges experts by admission share: Switch-style n * sum_i f_i * P_i over the pool, with
f_i the share of card slots expert i was admitted to and P_i its mean admission affinity. With
nearly the whole pool on the card, f is near uniform, so this term cannot see sink experts (the
routing load); a load-aware term plugs in here with the same signature.

Legend: N characters, P pool experts, S card slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BalanceInputs:
    affinity_NP: torch.Tensor  # softmax over the pool of each character's admission affinity
    admitted_S: torch.Tensor  # pool indices on the card, int64
    n_pool: int
    n_slots: int
    row_loads: list  # per row, a pool.RowRoute (router logits, real load per slot, real rows), for load-aware terms
    # Data parallelism (minagi.lm.distributed.Sum): sums across the ranks, whose characters make one
    # batch; None in one process. Each rank's term is then scaled so that DDP's mean of the ranks'
    # gradients is the gradient of the term over the whole batch.
    sync: object = None
    n_rows: int = 0  # the model's max_rows: ranks may run different numbers of rows

    def global_count(self, n: int) -> float:
        """The batch's characters over every rank (n in one process)."""
        if self.sync is None:
            return float(n)
        return float(self.sync(torch.tensor([float(n)], device=self.affinity_NP.device, dtype=torch.float64)))


class AdmissionBalance:
    """n_pool * sum_i f_i * P_i: f_i = 1 / n_slots if admitted, else 0; P_i = mean affinity."""

    name = "admission"

    def __call__(self, inp: BalanceInputs) -> torch.Tensor:
        if inp.sync is None:
            P_P = inp.affinity_NP.float().mean(0)
        else:  # this rank's share of the whole batch's mean, times the ranks (DDP averages)
            P_P = inp.affinity_NP.float().sum(0) * (inp.sync.world / inp.global_count(inp.affinity_NP.shape[0]))
        f_P = torch.zeros_like(P_P).index_fill_(0, inp.admitted_S.to(P_P.device), 1.0 / inp.n_slots)
        return inp.n_pool * (f_P * P_P).sum()


class LoadBalance:
    """Switch-style on the routing itself, per row, averaged over rows: n_slots * sum_s f_s * P_s,
    f_s the share of the row's routed pairs that went to slot s (the load: no gradient) and P_s
    the mean softmax probability of slot s over the row's characters (the router's gradient).
    1.0 at a uniform load; a sink slot that nearly every character picks pushes it up, and its
    gradient lowers the sink's probability. This one sees what admission cannot."""

    name = "load"
    needs_routes = True

    def __call__(self, inp: BalanceInputs) -> torch.Tensor:
        if inp.sync is not None:
            return self._across_ranks(inp)
        terms = []
        for logits_NS, load_S, n_valid in inp.row_loads:
            if n_valid == 0:
                continue
            # The softmax over every row, then the real ones: the padded sizes stay the only ones.
            P_S = torch.softmax(logits_NS.float(), dim=-1)[:n_valid].mean(0)
            f_S = load_S.float() / load_S.sum().clamp(min=1)
            terms.append(logits_NS.shape[1] * (f_S * P_S).sum())
        if not terms:
            return inp.affinity_NP.new_zeros(()).float()
        return torch.stack(terms).mean()

    def _across_ranks(self, inp: BalanceInputs) -> torch.Tensor:
        """The term over the whole batch: every row's load and character count summed across the
        ranks (one all_reduce, [rows, S + 1]; a row a rank did not run counts zero there), the
        probabilities this rank's share of the batch's mean, times the ranks."""
        S = inp.n_slots
        stats = torch.zeros(inp.n_rows, S + 1, dtype=torch.float64, device=inp.affinity_NP.device)
        for r, (_, load_S, n_valid) in enumerate(inp.row_loads):
            stats[r, :S] = load_S.to(stats)
            stats[r, S] = n_valid
        inp.sync(stats)
        counts = stats[:, S].tolist()
        terms = []
        for r, n_global in enumerate(counts):
            if not n_global:
                continue
            f_S = (stats[r, :S] / stats[r, :S].sum().clamp(min=1)).float()
            if r < len(inp.row_loads) and inp.row_loads[r].n_valid:
                logits_NS, _, n_valid = inp.row_loads[r]
                P_S = torch.softmax(logits_NS.float(), dim=-1)[:n_valid].sum(0) * (inp.sync.world / n_global)
                terms.append(S * (f_S.to(P_S.device) * P_S).sum())
            else:  # no character of this rank reached the row: no gradient from here
                terms.append(inp.affinity_NP.new_zeros(()).float())
        if not terms:
            return inp.affinity_NP.new_zeros(()).float()
        return torch.stack(terms).mean()


class BiasBalance:
    """Auxiliary-loss-free balancing, in the manner of DeepSeek-V3: each pool expert has a bias
    (the pool's route_bias buffer) added to its router logit for the top-k choice only; the
    gates come from the unbiased logits, and no loss term is added. After each optimizer step
    the bias of every expert that was on the card moves by bias_rate toward an even load:
    + rate where the expert's load (its routed pairs over the step's rows) was below the card's
    mean, - rate where above."""

    name = "bias"
    needs_routes = True
    adds_bias = True

    def __init__(self):
        self.pending_P = None  # routed pairs per pool expert since the last update
        self.seen_P = None  # pool experts that were on the card

    def __call__(self, inp: BalanceInputs) -> torch.Tensor:
        if inp.row_loads:
            admitted = inp.admitted_S.to(inp.row_loads[0].load_S.device)
            if self.pending_P is None:
                self.pending_P = admitted.new_zeros(inp.n_pool)
                self.seen_P = admitted.new_zeros(inp.n_pool, dtype=torch.bool)
            for route in inp.row_loads:
                self.pending_P.index_add_(0, admitted, route.load_S)
            self.seen_P[admitted] = True
        return inp.affinity_NP.new_zeros(()).float()

    @torch.no_grad()
    def update(self, bias_P: torch.Tensor, rate: float, apply: bool = True, sync=None) -> None:
        """Move bias_P (in place) from the loads since the last update, then forget them; a
        skipped step (apply=False) only forgets them. sync: the loads are summed across the
        ranks first, so every rank moves its biases alike."""
        pending, seen, self.pending_P, self.seen_P = self.pending_P, self.seen_P, None, None
        if sync is not None:  # every rank takes part, with or without loads of its own
            n = bias_P.numel()
            both = torch.zeros(2 * n, dtype=torch.float64, device=bias_P.device)
            if pending is not None:
                both[:n], both[n:] = pending.to(both), seen.to(both)
            sync(both)
            pending, seen = both[:n], both[n:] > 0
            if not bool(seen.any()):
                pending = None
        if not apply or pending is None:
            return
        idx = seen.nonzero().squeeze(1)
        load = pending.index_select(0, idx).float()
        bias_P.index_add_(0, idx.to(bias_P.device), (rate * torch.sign(load.mean() - load)).to(bias_P))


class NoBalance:
    name = "none"

    def __call__(self, inp: BalanceInputs) -> torch.Tensor:
        return inp.affinity_NP.new_zeros(()).float()


BALANCE_TERMS = {"admission": AdmissionBalance, "load": LoadBalance, "bias": BiasBalance, "none": NoBalance}
