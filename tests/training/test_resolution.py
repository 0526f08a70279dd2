"""Progressive resizing (training/resolution.py), the task's downsampling and the recipe checks."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from training.distributed import DistInfo
from training.recipes import RecipeError, load_recipe
from training.resolution import ResolutionSchedule, vit_tokens
from training.tasks import build_task


def test_tokens_count_cls_and_the_kept_patches() -> None:
    assert vit_tokens(32, 4) == 65 and vit_tokens(16, 4) == 17
    assert vit_tokens(32, 4, 0.5) == 33 and vit_tokens(16, 4, 0.5) == 9


def test_stages_follow_the_fractions_and_never_go_back() -> None:
    res = ResolutionSchedule([(0.25, 16), (0.5, 24)], full_size=32, patch_size=4,
                             patch_dropout=0.5)
    assert res.stages == [(0.25, 9 / 33), (0.5, 19 / 33), (1.0, 1.0)]
    sizes = []
    for step in range(100):
        res.advance(step, 100)
        sizes.append(res.size)
    assert sizes == [16] * 25 + [24] * 25 + [32] * 50
    res.advance(10, 1000)  # a re-plan that lengthens the run: still full size
    assert res.size == 32 and res.stage == 2


def test_a_resumed_schedule_finds_its_stage_from_the_step() -> None:
    res = ResolutionSchedule([(0.5, 16)], full_size=32, patch_size=4)
    assert res.advance(70, 100) and res.size == 32


def test_the_image_task_box_filters_the_augmented_batch(data_dir: Path) -> None:
    recipe = load_recipe("cifar10-smoke", {"device": "cpu", "augment.cutmix_prob": 0,
                                           "augment.mixup_alpha": 0})  # crop + flip only
    cpu = DistInfo(device=torch.device("cpu"))
    task = build_task(recipe, cpu, data_dir, data_dir.parent / "cache")
    torch.manual_seed(0)
    full = task.train_batch(0, 0)
    torch.manual_seed(0)
    small = task.train_batch(0, 0, size=16)
    (x,), (xs,) = full.inputs, small.inputs
    assert xs.shape == (x.shape[0], 3, 16, 16)
    torch.testing.assert_close(xs, F.avg_pool2d(x, 2))  # the same crops and flips, 2x2 means
    assert torch.equal(small.labels, full.labels)


@pytest.mark.parametrize("schedule, message", [
    ([[0.6, 16], [0.5, 24]], "increase"),
    ([[1.0, 16]], "increase"),
    ([[0.5, 18]], "multiple of the patch size"),
    ([[0.5, 32]], "below data.image_size"),
])
def test_bad_schedules_are_refused(schedule, message) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe("cifar10-vit-cpu", {"augment.resolution_schedule": str(schedule)})


def test_text_recipes_refuse_a_resolution_schedule() -> None:
    with pytest.raises(RecipeError, match="image classification"):
        load_recipe("imdb-smoke", {"augment.resolution_schedule": "[[0.5, 16]]"})
