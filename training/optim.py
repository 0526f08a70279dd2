"""Optimisation pieces of the trainer: parameter groups, the learning-rate schedule, the
time-budget planner and the EMA of weights.

Schedule. :class:`LrSchedule` is a per-update schedule: linear warm-up over ``warmup_steps``,
then a decay (``cosine`` or ``linear``) to ``min_lr`` that reaches ``min_lr`` on the *last*
update. The decay is kept as a progress ``q`` in ``[0, 1]`` advanced incrementally,
``q += (1 - q) / (updates left)``: for a fixed number of steps this is exactly
``q = (k - w + 1) / (T - w)``, and when the budget planner changes ``T`` mid-run the learning
rate stays continuous and still lands on ``min_lr`` at the new last step.

Budget. :class:`BudgetPlanner` turns ``budget_minutes`` into a number of steps: it measures
the training throughput (steps per second, after a few warm-up steps that absorb
``torch.compile`` and allocator start-up) and re-plans every ``replan_every_s`` seconds so
that training ends at ``deadline - reserve`` (the reserve covers the final evaluation and
publishing, measured on the first evaluation), whatever else happens on the machine.
"""

from __future__ import annotations

import collections
import copy
import logging
import math
import time
from typing import Any, Literal

import torch
from torch import nn

from training.init import encoder_of
from training.lion import Lion

log = logging.getLogger(__name__)

EMBEDDING_PARAMS = ("patch_embed.", "stem.", "cls_token", "pos_embed", "tok_embed.",
                    "bigram_embed.", "bigram_proj.")

ScheduleShape = Literal["cosine", "linear"]


# ----------------------------------------------------------------------------- param groups


def layer_id(name: str, num_layers: int) -> int:
    """Depth of a parameter for layer-wise lr decay: embeddings 0, ``blocks.i`` i + 1, the rest
    (final norm, head; an MAE/MLM decoder) ``num_layers + 1``. An ``encoder.`` prefix (MAE,
    MLM) is ignored."""
    name = name.removeprefix("encoder.")
    if name.startswith(EMBEDDING_PARAMS):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return num_layers + 1


def param_groups(model: nn.Module, weight_decay: float,
                 layer_decay: float | None = None) -> list[dict[str, Any]]:
    """AdamW groups of the trainable parameters: decayed (weight matrices) and not decayed
    (norms, biases, and the names in ``model.no_weight_decay()`` such as ``cls_token``,
    ``pos_embed``). Without ``layer_decay``: those two groups. With it: one pair per depth
    (:func:`layer_id`), each with ``lr_scale = layer_decay ** (L + 1 - depth)`` (the scheduler
    multiplies its lr by it) and a ``name`` like ``layer3_decay``. Frozen parameters
    (``requires_grad=False``) are left out."""
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    blocks = getattr(encoder_of(model), "blocks", None)
    num_layers = len(blocks) if blocks is not None else 0
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_wd = p.ndim <= 1 or name.endswith(".bias") or name in skip
        lid = layer_id(name, num_layers) if layer_decay is not None else 0
        key = (lid, no_wd)
        if key not in groups:
            groups[key] = {"params": [], "weight_decay": 0.0 if no_wd else weight_decay}
            if layer_decay is not None:
                groups[key]["lr_scale"] = layer_decay ** (num_layers + 1 - lid)
                groups[key]["name"] = f"layer{lid}_{'no_decay' if no_wd else 'decay'}"
        groups[key]["params"].append(p)
    if layer_decay is None:
        return [groups.get((0, False), {"params": [], "weight_decay": weight_decay}),
                groups.get((0, True), {"params": [], "weight_decay": 0.0})]
    return [groups[k] for k in sorted(groups)]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float], eps: float, layer_decay: float | None,
                    fused: bool, algorithm: Literal["adamw", "lion"] = "adamw",
                    ) -> torch.optim.Optimizer:
    """AdamW (or :class:`~training.lion.Lion`, ``algorithm="lion"``; ``eps`` and ``fused``
    unused) over :func:`param_groups`; ``fused`` asks for the fused AdamW kernel and falls back
    to the default (foreach) implementation where this build or device has none. The trainer
    asks for it on every device: on the CPU too it is one kernel over all the parameters,
    several times faster than foreach (docs/benchmarks.md ledger)."""
    groups = param_groups(model, weight_decay, layer_decay)
    if algorithm == "lion":
        return Lion(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    if fused:
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        except (RuntimeError, ValueError) as e:  # no fused kernel for these tensors
            log.warning("fused AdamW unavailable (%s): using the default implementation", e)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


# ----------------------------------------------------------------------------- schedule


def decay_factor(q: float, shape: ScheduleShape) -> float:
    """Fraction of ``(base - min)`` left at decay progress ``q`` in ``[0, 1]``."""
    q = min(1.0, max(0.0, q))
    if shape == "linear":
        return 1.0 - q
    return 0.5 * (1.0 + math.cos(math.pi * q))


def lr_at(step: int, base_lr: float, total_steps: int, warmup_steps: int,
          min_lr: float = 0.0, shape: ScheduleShape = "cosine") -> float:
    """Learning rate of update ``step`` (0-based) for a fixed ``total_steps``: linear warm-up
    (``base_lr * (step + 1) / warmup``), then the decay, which gives ``min_lr`` to the last
    update (``total_steps - 1``) and after it."""
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    q = (step - warmup_steps + 1) / max(1, total_steps - warmup_steps)
    return min_lr + (base_lr - min_lr) * decay_factor(q, shape)


class LrSchedule:
    """Per-update schedule: sets every group's lr to the schedule's value times the group's
    ``lr_scale`` (layer-wise decay; 1 when absent). ``apply()`` before an update,
    ``step()`` after it. ``set_total_steps`` re-plans the end (budget mode) without a jump in
    the learning rate. ``state_dict`` is plain numbers (checkpoint-safe)."""

    def __init__(self, optimizer: torch.optim.Optimizer, base_lr: float, total_steps: int,
                 warmup_steps: int, min_lr: float = 0.0, shape: ScheduleShape = "cosine"
                 ) -> None:
        self.optimizer, self.base_lr, self.min_lr, self.shape = optimizer, base_lr, min_lr, shape
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        self.step_num = 0
        self.q = 0.0  # decay progress reached by the last applied update
        self._applied: int | None = None  # step whose q is already folded in
        self.last_lr = base_lr

    def set_total_steps(self, total_steps: int) -> None:
        """A new end; never before the updates already done (equal to them: stop now)."""
        self.total_steps = max(total_steps, self.step_num)

    def _lr(self) -> float:
        k = self.step_num
        if k < self.warmup_steps:
            return self.base_lr * (k + 1) / self.warmup_steps
        if self._applied != k:
            left = max(1, self.total_steps - k)  # updates left, this one included
            self.q += (1.0 - self.q) / left
            self._applied = k
        return self.min_lr + (self.base_lr - self.min_lr) * decay_factor(self.q, self.shape)

    def apply(self) -> float:
        lr = self.last_lr = self._lr()
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        return lr

    def step(self) -> None:
        self.step_num += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_num, "q": self.q, "applied": self._applied,
                "base_lr": self.base_lr, "min_lr": self.min_lr, "shape": self.shape,
                "total_steps": self.total_steps, "warmup_steps": self.warmup_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_num = int(state["step"])
        if "q" in state:
            self.q, self._applied = float(state["q"]), state.get("applied")
            self.total_steps = int(state.get("total_steps", self.total_steps))
        else:  # a checkpoint from before the incremental form: the closed form
            w, t = self.warmup_steps, self.total_steps
            self.q = max(0.0, min(1.0, (self.step_num - w) / max(1, t - w)))
            self._applied = self.step_num - 1


CosineWarmup = LrSchedule  # the former name (cosine is the default shape)


# ----------------------------------------------------------------------------- budget


class BudgetPlanner:
    """Sizes a run to a wall-clock budget (see the module docstring).

    ``deadline`` is ``time.monotonic()`` seconds. ``reserve_s`` is kept free at the end for the
    last evaluation and publishing (:meth:`keep_for_end` sizes it from measured costs);
    ``eval_s`` is the cost of one intermediate evaluation.

    The rate is measured over the last ``window_s`` seconds of training (evaluations paused
    out), so it follows the machine's load; plans come every ``replan_every_s`` seconds, and
    more often as the deadline nears (every tenth of the time left, at least every second), so
    that a late change of speed still moves the end to the deadline."""

    def __init__(self, budget_s: float, start: float, reserve_s: float,
                 warmup_steps: int = 5, replan_every_s: float = 20.0, window_s: float = 30.0,
                 clock: Any = time.monotonic,
                 stages: list[tuple[float, float]] | None = None) -> None:
        self.budget_s, self.start, self.reserve_s = budget_s, start, reserve_s
        # (end fraction of the run, relative step cost) per stage: progressive resizing makes
        # the early steps cheaper; one stage of cost 1 = every step costs the same
        self.stages = stages or [(1.0, 1.0)]
        self._stage = 0
        self.deadline = start + budget_s
        self.warmup_steps, self.replan_every_s, self.clock = warmup_steps, replan_every_s, clock
        self.window_s = window_s
        self.eval_s = 0.0
        self._marks: collections.deque[tuple[float, int]] = collections.deque()
        # the first update measured (None: ``warmup_steps`` after the next call's). The run's
        # start, a resume and a new stage all stall (compiling for a shape, warming caches and
        # allocations); measured, they would shrink the plan enough to skip a short stage
        self._measure_from: int | None = None
        self._last_plan = -math.inf
        self.rate: float | None = None  # training steps per second (excluding evaluations)
        self.planned_steps: int | None = None
        self.first_plan: dict[str, float] | None = None
        self._paused = 0.0  # seconds paused so far: training time = clock - paused
        self._pause_t: float | None = None
        self.final_eval_s = 0.0
        self.publish_s = 0.0

    def keep_for_end(self, final_eval_s: float, publish_s: float,
                     margin: float = 0.01) -> float:
        """Size the reserve from what the end of the run was measured to cost: its last
        validation pass(es) and its publishing, plus ``margin`` of the budget for the noise
        of the throughput estimate. Returns the new ``reserve_s``."""
        self.final_eval_s, self.publish_s = final_eval_s, publish_s
        self.reserve_s = final_eval_s + publish_s + margin * self.budget_s
        return self.reserve_s

    def underrun_reason(self, wall_s: float, status: str, end_s: float | None,
                        tolerance: float = 0.03) -> str | None:
        """Why a run that ended more than ``tolerance`` of its budget early did so, in words
        (None when it did not): what stopped it, or that its end (``end_s``: last
        validation and publishing) cost less than the plan kept for it."""
        early = self.budget_s - wall_s
        if early <= tolerance * self.budget_s:
            return None
        if status != "finished":
            return f"the run was {status} {early:.1f}s before its budget"
        kept = self.final_eval_s + self.publish_s
        if end_s is not None and kept - end_s > tolerance * self.budget_s:
            return (f"the last validation and publishing took {end_s:.1f}s of the {kept:.1f}s "
                    "measured for them before training")
        return (f"ended {early:.1f}s early: the last throughput measured ({self.rate or 0:.2f} "
                "steps/s) was lower than the rate of the final steps")

    # evaluations and checkpoints are not training time: pause the rate clock around them
    def pause(self) -> None:
        self._pause_t = self.clock()

    def resume(self) -> None:
        if self._pause_t is not None:
            self._paused += self.clock() - self._pause_t
            self._pause_t = None

    def time_left(self) -> float:
        return self.deadline - self.reserve_s - self.clock()

    def observe(self, step: int, steps_per_eval: int | None = None,
                stage: int = 0) -> int | None:
        """Call after each update with the number of updates done. Returns a new planned
        total when it (re)plans, else None (``step`` itself: stop now). Measuring starts at
        update ``warmup_steps`` (or ``warmup_steps`` after a resume); the first plan comes
        after 3 measured updates. With ``steps_per_eval`` (an evaluation every so many
        updates, ``eval_s`` each) the plan leaves room for the evaluations it implies.
        ``stage``: the index in ``stages`` the run is in; a new stage is measured afresh,
        from its ``warmup_steps``-th update on (the plan made before it holds until then)."""
        now = self.clock()
        stage = min(stage, len(self.stages) - 1)
        if stage != self._stage:
            self._stage, self._last_plan = stage, -math.inf
            self._marks.clear()
            self._measure_from = None
        if self._measure_from is None:  # ``step`` is the first update of this warm-up
            self._measure_from = step - 1 + self.warmup_steps
        if not self._marks:
            if step >= self._measure_from:
                self._marks.append((now - self._paused, step))
            return None
        t_train = now - self._paused
        self._marks.append((t_train, step))
        while len(self._marks) > 5 and t_train - self._marks[1][0] >= self.window_s:
            self._marks.popleft()
        t0, s0 = self._marks[0]
        if step - s0 < 3:
            return None
        left = self.time_left()
        every = min(self.replan_every_s, max(1.0, left / 10))
        if self.planned_steps is not None and now - self._last_plan < every:
            return None
        self.rate = (step - s0) / max(1e-6, t_train - t0)
        extra = self.eval_s / steps_per_eval if steps_per_eval else 0.0
        self.planned_steps = self._fit(step, left, 1.0 / self.rate, extra)
        self._last_plan = now
        if self.first_plan is None:
            self.first_plan = {"steps": float(self.planned_steps), "steps_per_s": self.rate}
        return self.planned_steps

    def _fit(self, step: int, left: float, per_step: float, extra: float) -> int:
        """The largest total ``n`` whose remaining updates fit in ``left`` seconds, with
        ``per_step`` measured in the current stage and each stage's cost relative to it."""
        unit = per_step / self.stages[self._stage][1]  # seconds per unit of step cost

        def seconds(n: int) -> float:  # updates step .. n-1, stage by stage
            t, lo = 0.0, step
            for j in range(self._stage, len(self.stages)):
                end, cost = self.stages[j]
                hi = n if j == len(self.stages) - 1 else max(lo, min(n, round(end * n)))
                t += (hi - lo) * (unit * cost + extra)
                lo = hi
            return t

        cheapest = unit * min(c for _, c in self.stages[self._stage:]) + extra
        lo, hi = step, step + max(0, int(left / cheapest)) + 1  # seconds(hi) > left
        while hi - lo > 1:  # bisection: seconds() grows with n
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if seconds(mid) <= left else (lo, mid)
        return lo

    def state_dict(self) -> dict[str, Any]:
        return {"budget_s": self.budget_s, "used_s": self.clock() - self.start,
                "planned_steps": self.planned_steps, "eval_s": self.eval_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """On resume the time already spent counts against the budget."""
        used = float(state.get("used_s", 0.0))
        self.start = self.clock() - used
        self.deadline = self.start + self.budget_s
        self.eval_s = float(state.get("eval_s", 0.0))
        self.planned_steps = state.get("planned_steps")
        self._marks.clear()
        self._measure_from = None


# ----------------------------------------------------------------------------- EMA


class ModelEma:
    """Exponential moving average of a model's weights (float params and buffers).

    The decay warms up as ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates, so the average
    is useful early in short runs too."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        ema_f, cur_f = [], []
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values(),
                        strict=True):
            if e.is_floating_point():
                ema_f.append(e)
                cur_f.append(m.detach())
            else:
                e.copy_(m)
        torch._foreach_lerp_(ema_f, cur_f, 1.0 - d)

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
