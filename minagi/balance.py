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
    row_loads: list  # per row, the routed load per card slot [S] (int64), for load-aware terms


class AdmissionBalance:
    """n_pool * sum_i f_i * P_i: f_i = 1 / n_slots if admitted, else 0; P_i = mean affinity."""

    name = "admission"

    def __call__(self, inp: BalanceInputs) -> torch.Tensor:
        P_P = inp.affinity_NP.float().mean(0)
        f_P = torch.zeros_like(P_P).index_fill_(0, inp.admitted_S.to(P_P.device), 1.0 / inp.n_slots)
        return inp.n_pool * (f_P * P_P).sum()


class NoBalance:
    name = "none"

    def __call__(self, inp: BalanceInputs) -> torch.Tensor:
        return inp.affinity_NP.new_zeros(()).float()


BALANCE_TERMS = {"admission": AdmissionBalance, "none": NoBalance}
