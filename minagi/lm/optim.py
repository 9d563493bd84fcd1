"""AdamW that leaves off-card experts alone.

For the pool's tensors (param groups with pool=True) only the experts admitted to the card this
step are updated: their moments, their weight decay, their step count (bias correction is per
expert). An expert that sat out the step is bit-for-bit untouched, as if the step had not
happened for it. When the whole pool is on the card this is plain AdamW.
"""
from __future__ import annotations

import torch

# torch's fused AdamW kernel: one pass over each tensor instead of about ten (the unfused update
# is a visible part of a small model's CPU step).
_FUSED_DEVICES = ("cpu", "cuda")


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

    @staticmethod
    def _foreach_update(params, grads, ms, vs, step, lr, b1, b2, eps, wd):
        """AdamW over a list of whole tensors sharing one step count, in a few fused kernels."""
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_lerp_(ms, grads, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
        c1, c2 = 1 - b1 ** step, 1 - b2 ** step
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, c2 ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, ms, denom, value=-lr / c1)

    @staticmethod
    def _fused_update(params, grads, ms, vs, step, lr, b1, b2, eps, wd):
        """_foreach_update in torch's fused kernel (the same update, one pass per tensor), where
        it runs: whole tensors on one device type that has it, gradients of the params' dtype."""
        dev = params[0].device
        if (dev.type not in _FUSED_DEVICES or not hasattr(torch, "_fused_adamw_")
                or any(p.device != dev or g.dtype != p.dtype or g.is_sparse for p, g in zip(params, grads))):
            return False
        # The kernel reads the step count, already advanced (as torch.optim.AdamW passes it).
        steps = [torch.tensor(float(step), dtype=torch.float32, device=dev) for _ in params]
        torch._fused_adamw_(params, grads, ms, vs, [], steps, lr=lr, beta1=b1, beta2=b2, weight_decay=wd,
                            eps=eps, amsgrad=False, maximize=False)
        return True

    def _whole_update(self, params, step, lr, b1, b2, eps, wd):
        grads = [p.grad for p in params]
        ms = [self.state[p]["exp_avg"] for p in params]
        vs = [self.state[p]["exp_avg_sq"] for p in params]
        if not self._fused_update(params, grads, ms, vs, step, lr, b1, b2, eps, wd):
            self._foreach_update(params, grads, ms, vs, step, lr, b1, b2, eps, wd)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            hyper = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])
            live = [p for p in group["params"] if p.grad is not None]
            for p in live:
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                    st["step"] = torch.zeros(p.shape[0] if group["pool"] else (), dtype=torch.float64, device=p.device)
            if group["pool"]:
                self._pool_step(live, *hyper)
            elif live:
                for p in live:
                    self.state[p]["step"] += 1
                self._whole_update(live, float(self.state[live[0]]["step"]), *hyper)
        return loss

    def _pool_step(self, params, lr, b1, b2, eps, wd):
        """Per expert (row): only the admitted rows move, each with its own step count."""
        admitted = self.pool_module.last_admitted
        for p in params:
            st = self.state[p]
            whole = admitted is None or admitted.numel() == p.shape[0]
            r = slice(None) if whole else admitted.to(p.device)
            st["step"][r] += 1
            # The whole pool on the card, every expert at one step count (the usual case when
            # n_slots == n_pool; checked on the host only, where it costs no sync): plain AdamW.
            if whole and p.device.type == "cpu" and bool((st["step"] == st["step"][0]).all()):
                self._whole_update([p], float(st["step"][0]), lr, b1, b2, eps, wd)
                continue
            step = st["step"][r].view(-1, *([1] * (p.dim() - 1))).to(p.dtype)
            if whole:
                self._update(p, p.grad, st["exp_avg"], st["exp_avg_sq"], step, lr, b1, b2, eps, wd)
                continue
            sub_p, m, v = p[r], st["exp_avg"][r], st["exp_avg_sq"][r]
            self._update(sub_p, p.grad[r], m, v, step, lr, b1, b2, eps, wd)
            p[r], st["exp_avg"][r], st["exp_avg_sq"][r] = sub_p, m, v
