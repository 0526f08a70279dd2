"""Model bundles are replaced whole: a reader sees the old or the new one, never a mix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vit_service.bundle import BundleMeta, load_bundle, save_bundle
from vit_service.models import config_to_dict, create_model


def _meta(model) -> BundleMeta:
    return BundleMeta(task="image", model_config=config_to_dict(model.config),
                      class_names=[str(i) for i in range(10)],
                      preprocess={"image_size": 32, "mean": [0.5] * 3, "std": [0.5] * 3})


def test_rewriting_a_bundle_replaces_it_whole_and_leaves_nothing_behind(tmp_path: Path) -> None:
    a, b = create_model("vit_test"), create_model("vit_test")
    with torch.no_grad():
        for p in b.parameters():
            p.add_(1.0)
    path = save_bundle(tmp_path / "bundle", a, _meta(a))
    save_bundle(path, b, _meta(b))
    loaded = load_bundle(path).model
    for x, y in zip(loaded.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # no temp or old folder


def test_a_failed_write_keeps_the_old_bundle(tmp_path: Path) -> None:
    a = create_model("vit_test")
    path = save_bundle(tmp_path / "bundle", a, _meta(a))
    text = BundleMeta(task="text", model_config={}, class_names=["a"], preprocess={})
    with pytest.raises(ValueError):
        save_bundle(path, a, text)  # a text bundle without its tokenizer
    assert load_bundle(path).meta.task == "image"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]
