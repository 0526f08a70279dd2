"""The generic recipes on uploaded data sets, in process: the classes, the split and the
vocabulary come from the set; a timm ViT checkpoint saved locally fine-tunes on it with its
position embeddings resampled and a new head; the run records the set as its MLflow input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from examples.own_data import image_subset, star_table
from tests.training.conftest import make_cifar_archive, make_imdb_archive, mlflow_client
from training.progress import Progress
from training.recipes import load_recipe
from training.run import prepare_run, train
from vit_service.config import Settings
from vit_service.data.datasets import DatasetStore

PETS = ["airplane", "bird", "cat"]
SMALL = {"device": "cpu", "compile": False, "budget_minutes": None, "epochs": 1,
         "batch_size": 8, "eval_batch_size": 32, "attention_samples": 0}


@pytest.fixture
def settings(env: dict[str, str]) -> Settings:
    """The test's private home (data sets under it), cache and MLflow (``env``)."""
    return Settings()


def _image_set(settings: Settings, tmp_path: Path) -> str:
    archive = make_cifar_archive(tmp_path / "cifar.tar.gz", per_class=16)
    made = image_subset(archive, tmp_path / "pets.zip", PETS, per_class=12, val_per_class=4)
    return DatasetStore(Path(settings.home) / "datasets").add(made, "pets.zip")[0].id


def test_an_uploaded_image_set_fine_tunes_timm_weights(settings: Settings, tmp_path: Path
                                                       ) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    weights = tmp_path / "vit_tiny.pth"
    torch.save(ref.state_dict(), weights)
    dataset = _image_set(settings, tmp_path)
    recipe = load_recipe("image-classifier-cpu", {
        **SMALL, "data.dataset": dataset, "register_as": "pets", "max_steps": 2,
        "init.timm": "vit_tiny_patch16_224", "init.timm_file": str(weights),
        "init.whiten_patches": False})  # whitening is for training from scratch
    run = prepare_run(recipe, settings=settings, mlflow_enabled=False)
    m = run.model
    assert m.head.out_features == 3 and run.task.class_names == PETS
    assert (run.task.n_train, run.task.n_val) == (36, 12)  # the set's own val/ split
    assert m.pos_embed.shape == (1, 1 + 8 * 8, 192)  # 14x14 grid resampled to the 8x8 one
    torch.testing.assert_close(m.state_dict()["blocks.5.attn.qkv.weight"],
                               ref.state_dict()["blocks.5.attn.qkv.weight"], rtol=0, atol=0)
    assert run.lineage.init == "timm" and run.run().step == 2


def test_an_uploaded_text_set_trains_with_its_own_classes_and_vocabulary(
        settings: Settings, tmp_path: Path, env: dict[str, str]) -> None:
    archive = make_imdb_archive(tmp_path / "imdb.tar.gz", per_class=60)
    table = star_table(archive, tmp_path / "stars.csv")
    info, _ = DatasetStore(Path(settings.home) / "datasets").add(table, "stars.csv")
    recipe = load_recipe("text-classifier-cpu", {
        **SMALL, "data.dataset": info.id, "register_as": "stars", "data.vocab_size": 200,
        "data.max_len": 64})
    res = train(recipe, settings=settings, run_name="stars",
                progress=Progress(json_lines=True, stream=io.StringIO()))
    assert res.status == "finished" and 0 <= res.val_acc <= 1
    client = mlflow_client(env["MLFLOW_TRACKING_URI"])
    [version] = client.search_model_versions("name='stars'")
    run = client.get_run(version.run_id)
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.digest == info.sha256[:32]
    assert run.data.params["data.n_val"] == "12"  # val_fraction 0.1 of 120 rows
    meta = json.loads((res.run_dir / "bundle" / "meta.json").read_text())
    assert meta["class_names"] == ["1-2", "3-4", "7-8", "9-10"]


def test_a_generic_recipe_without_its_data_set_says_so(settings: Settings) -> None:
    from vit_service.data import DataNotFoundError

    with pytest.raises(DataNotFoundError, match="data.dataset=<id>"):
        prepare_run(load_recipe("image-classifier-cpu", SMALL), settings=settings,
                    mlflow_enabled=False)
    with pytest.raises(DataNotFoundError, match="unknown data set"):
        prepare_run(load_recipe("text-classifier-cpu", {**SMALL,
                                                        "data.dataset": "0123456789abcdef"}),
                    settings=settings, mlflow_enabled=False)
