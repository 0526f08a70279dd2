"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): the update is
the *sign* of an interpolation between the momentum and the gradient, so every coordinate
moves by exactly ``lr``; weight decay is decoupled as in AdamW. It keeps one state tensor per
parameter (AdamW two). Its lr is typically 3-10x smaller than AdamW's and its weight decay
3-10x larger, so that ``lr * weight_decay`` stays about the same.

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * wd) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    """Lion over parameter groups (each may set its own ``lr`` and ``weight_decay``), with
    ``torch._foreach`` kernels per group: a handful of launches per step, not one per tensor."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        if not lr > 0:  # written so that nan fails too
            raise ValueError(f"Lion: lr must be positive, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be two values in [0, 1), got {betas}")
        if not weight_decay >= 0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> torch.Tensor | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moms = []
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                moms.append(state["exp_avg"])
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            if wd:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            update = torch._foreach_mul(moms, beta1)
            torch._foreach_add_(update, grads, alpha=1.0 - beta1)
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-lr)
            torch._foreach_lerp_(moms, grads, 1.0 - beta2)  # m += (1 - beta2) (g - m)
        return loss
