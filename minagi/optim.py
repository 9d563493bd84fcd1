"""AdamW that leaves off-card experts alone.

For the pool's tensors (param groups with pool=True) only the experts admitted to the card this
step are updated: their moments, their weight decay, their step count (bias correction is per
expert). An expert that sat out the step is bit-for-bit untouched, as if the step had not
happened for it. When the whole pool is on the card this is plain AdamW.
"""
from __future__ import annotations

import torch


class PoolAdamW(torch.optim.Optimizer):
    def __init__(self, param_groups, pool_module, lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "pool": False}
        super().__init__(param_groups, defaults)
        self.pool_module = pool_module  # its last_admitted says which rows were on the card

    @staticmethod
    def _update(p, g, m, v, step, lr, b1, b2, eps, wd):
        """One AdamW update of p (rows or whole tensor) in place; step broadcasts over rows."""
        if wd:
            p.mul_(1 - lr * wd)
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        c1 = 1 - b1 ** step
        c2 = 1 - b2 ** step
        p.sub_(lr * (m / c1) / ((v / c2).sqrt() + eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            rows = None
            if group["pool"] and self.pool_module.last_admitted is not None:
                rows = self.pool_module.last_admitted
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                    st["step"] = torch.zeros(p.shape[0] if group["pool"] else (), dtype=torch.float64, device=p.device)
                if rows is None or rows.numel() == p.shape[0]:
                    st["step"] += 1
                    step = st["step"].view(-1, *([1] * (p.dim() - 1))).to(p.dtype) if group["pool"] else float(st["step"])
                    self._update(p, p.grad, st["exp_avg"], st["exp_avg_sq"], step, lr, b1, b2, eps, wd)
                    continue
                r = rows.to(p.device)
                st["step"][r] += 1
                step = st["step"][r].view(-1, *([1] * (p.dim() - 1))).to(p.dtype)
                sub_p, m, v = p[r], st["exp_avg"][r], st["exp_avg_sq"][r]
                self._update(sub_p, p.grad[r], m, v, step, lr, b1, b2, eps, wd)
                p[r], st["exp_avg"][r], st["exp_avg_sq"][r] = sub_p, m, v
        return loss
