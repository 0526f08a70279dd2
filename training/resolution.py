"""Progressive resizing: the first part of an image run trains on smaller images.

``augment.resolution_schedule: [[until, size], ...]`` splits the run into stages: the steps
before ``round(until * total_steps)`` see ``size``-px images (the augmented batch, box-filtered
down), the rest the full ``data.image_size``. A ViT with patch ``p`` then has a
``(size / p)^2`` patch grid, so a step costs roughly its share of tokens (32 -> 16 px: 64 -> 16
patches, ~3.5x cheaper on this CPU); positions come from
:meth:`vit_service.models.vit.ViT.pos_embed_for`. Evaluation and serving always see full size.
This is the FFCV / AutoProg (Li et al. 2022) idea for a fixed budget: more updates early, when
coarse features are what is learnt, at full resolution for the end.

Stages only move forward: a budget re-plan that lengthens the run never sends a step back to
a lower resolution. The budget planner gets each stage's relative step cost
(:attr:`ResolutionSchedule.stages`) to size a run whose step time changes mid-way.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def vit_tokens(size: int, patch_size: int, patch_dropout: float = 0.0) -> int:
    """Tokens one training image puts through the blocks at ``size`` px: CLS + kept patches."""
    n = (size // patch_size) ** 2
    return 1 + (max(1, round((1 - patch_dropout) * n)) if patch_dropout > 0 else n)


class ResolutionSchedule:
    """Which image size each step trains at (see the module docstring)."""

    def __init__(self, schedule: list[tuple[float, int]], full_size: int, patch_size: int,
                 patch_dropout: float = 0.0) -> None:
        self.ends = [float(u) for u, _ in schedule] + [1.0]
        self.sizes = [int(s) for _, s in schedule] + [full_size]
        full = vit_tokens(full_size, patch_size, patch_dropout)
        # relative step cost ~ tokens per image (the blocks' GEMMs dominate a step)
        self.costs = [vit_tokens(s, patch_size, patch_dropout) / full for s in self.sizes]
        self.stage = 0

    @property
    def stages(self) -> list[tuple[float, float]]:
        """``(end fraction, relative step cost)`` per stage, for the budget planner."""
        return list(zip(self.ends, self.costs, strict=True))

    @property
    def size(self) -> int:
        return self.sizes[self.stage]

    def advance(self, step: int, total_steps: int) -> bool:
        """Move to the stage of update ``step`` (0-based) of ``total_steps``; True if it
        changed."""
        before = self.stage
        while (self.stage < len(self.ends) - 1
               and step >= round(self.ends[self.stage] * total_steps)):
            self.stage += 1
        if self.stage != before:
            log.info("resolution: %d px from step %d (of %d)", self.size, step, total_steps)
        return self.stage != before
