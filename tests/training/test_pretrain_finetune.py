"""Pretraining then fine-tuning, on generated data in the real formats.

MAE pretraining through the real CLI (registered as ``cifar10-mae``), then fine-tuning from each
source: the run (``runs:/<id>`` and a bare id), the registered model (``@latest``, ``/1``), the
checkpoint file and the bundle folder. In every case the fine-tune model's encoder at step 0
equals the pretrained encoder exactly and its head is new (the new class count, the same fresh
initialisation a from-scratch run gets). Also: MLM pretraining (train + unsup, never test) then
fine-tuning with the pretraining tokenizer, supervised transfer between two ImageFolders with
different classes, timm weights offline, layer-wise lr decay, the frozen-encoder linear probe,
lineage on the fine-tuning MLflow run, and the recipe checks.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.training.conftest import QUIET, mlflow_client, progress_events, run_artifacts
from training.checkpoint import load_checkpoint
from training.init import InitError, Lineage
from training.optim import CosineWarmup, layer_id, param_groups
from training.recipes import RecipeError, load_recipe
from training.run import prepare_run, train
from vit_service.config import Settings
from vit_service.models import build_model, create_model
from vit_service.models.mae import MAE, MAEConfig

FINETUNE = "cifar10-vit-finetune-smoke"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_starts_from(model: torch.nn.Module, source: dict[str, torch.Tensor],
                        scratch: torch.nn.Module, num_classes: int) -> None:
    """Every encoder tensor equals the source's; the head is the scratch run's fresh one."""
    sd, fresh = model.state_dict(), scratch.state_dict()
    encoder_keys = [k for k in sd if not k.startswith("head.")]
    assert set(source) == set(encoder_keys)  # the source is exactly the encoder, no head
    for k in encoder_keys:
        torch.testing.assert_close(sd[k], source[k], rtol=0, atol=0, msg=k)
    assert model.head.weight.shape[0] == num_classes
    torch.testing.assert_close(sd["head.weight"], fresh["head.weight"], rtol=0, atol=0)
    torch.testing.assert_close(sd["head.bias"], fresh["head.bias"], rtol=0, atol=0)
    # and the encoder really is not the random one a scratch run starts from
    assert not torch.equal(sd["blocks.0.attn.qkv.weight"], fresh["blocks.0.attn.qkv.weight"])


@pytest.fixture(scope="module")
def mae_run(tmp_path_factory: pytest.TempPathFactory, data_dir: Path, run_cli,
            mlflow_db) -> dict[str, Any]:
    """``vit-service train cifar10-mae-smoke`` through the real CLI, once for this module."""
    home = tmp_path_factory.mktemp("pretrain-home")
    cache = data_dir.parent / "cache"
    env = {"VIT_SERVICE_HOME": str(home), "VIT_SERVICE_CACHE_DIR": str(cache), **QUIET}
    uri = mlflow_db(home)
    proc = run_cli(["train", "cifar10-mae-smoke", "--data-dir", str(data_dir), "--tracking-uri",
                    uri, "--run-name", "mae"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    end = progress_events(proc.stdout)[-1]
    run_dir = home / "runs" / "mae"
    return {"uri": uri, "home": home, "data_dir": data_dir, "end": end,
            "run_id": end["mlflow_run_id"], "run_dir": run_dir,
            "settings": Settings(home=home, cache_dir=cache),
            "encoder": _weights(run_dir / "bundle" / "weights.pt")}


def _prepare(m: dict[str, Any], recipe: str, overrides: dict[str, Any], **kw: Any) -> Any:
    return prepare_run(load_recipe(recipe, overrides), data_dir=m["data_dir"],
                       tracking_uri=m["uri"], settings=m["settings"], mlflow_enabled=False,
                       **kw)


# ----------------------------------------------------------------------------- MAE


def test_mae_pretraining_logs_an_encoder_bundle_and_reconstructions(mae_run: dict) -> None:
    end = mae_run["end"]
    assert end["status"] == "finished" and end["val_acc"] is None
    assert 0 < end["val_loss"] < 2 and end["registered_version"] == "1"
    client = mlflow_client(mae_run["uri"])
    run = client.get_run(mae_run["run_id"])
    assert run.data.tags["vit_service.objective"] == "mae"
    assert "val/loss" in run.data.metrics and "val/acc" not in run.data.metrics
    assert "train/acc" not in run.data.metrics
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [12, 24]
    assert "reconstructions/mae_reconstructions.png" in run_artifacts(client, run.info.run_id)
    png = mae_run["run_dir"] / "artifacts" / "mae_reconstructions.png"
    assert Image.open(png).size[0] > 200
    # registered without a champion; @latest resolves
    mv = client.get_model_version_by_alias("cifar10-mae", "latest")
    assert str(mv.version) == "1" and mv.run_id == mae_run["run_id"]
    assert not client.get_registered_model("cifar10-mae").aliases
    # the bundle is the headless encoder, its config and the pretraining settings
    meta = json.loads((mae_run["run_dir"] / "bundle" / "meta.json").read_text())
    assert meta["class_names"] == [] and meta["model_config"]["num_classes"] == 0
    assert meta["extra"]["objective"] == "mae" and meta["extra"]["pretrain"]["mask_ratio"] == 0.75
    assert not any(k.startswith(("head.", "decoder")) for k in mae_run["encoder"])
    # the checkpoint keeps the whole MAE (decoder too) for resuming
    ck = load_checkpoint(mae_run["run_dir"] / "checkpoints" / "last.pt")
    assert ck["objective"] == "mae" and any(k.startswith("decoder_") for k in ck["model"])


@pytest.mark.parametrize("kind", ["runs_uri", "run_id", "model_latest", "model_version",
                                  "checkpoint", "bundle"])
def test_finetune_starts_from_the_pretrained_encoder_with_a_new_head(mae_run: dict,
                                                                     kind: str) -> None:
    rid, run_dir = mae_run["run_id"], mae_run["run_dir"]
    spec = {"runs_uri": f"runs:/{rid}", "run_id": rid,
            "model_latest": "models:/cifar10-mae@latest", "model_version": "models:/cifar10-mae/1",
            "checkpoint": str(run_dir / "checkpoints" / "last.pt"),
            "bundle": str(run_dir / "bundle")}[kind]
    run = _prepare(mae_run, FINETUNE, {"init.from": spec})
    scratch = _prepare(mae_run, FINETUNE, {"init.from": None})
    _assert_starts_from(run.model, mae_run["encoder"], scratch.model, 10)
    expected = {"runs_uri": "run", "run_id": "run", "model_latest": "model",
                "model_version": "model", "checkpoint": "checkpoint", "bundle": "bundle"}[kind]
    assert run.lineage.init == expected and run.lineage.parent_run_id == rid
    assert run.lineage.parent_recipe == "cifar10-mae-smoke"
    assert run.lineage.parent_objective == "mae"
    if kind.startswith("model"):
        assert run.lineage.parent_model == "cifar10-mae/1"
    assert scratch.lineage == Lineage()


def test_finetune_run_records_lineage_in_mlflow_and_the_bundle(mae_run: dict) -> None:
    rid = mae_run["run_id"]
    res = train(load_recipe(FINETUNE, {"init.from": f"runs:/{rid}"}),
                data_dir=mae_run["data_dir"], tracking_uri=mae_run["uri"],
                settings=mae_run["settings"], run_name="ft-lineage")
    assert res.status == "finished" and res.val_acc is not None and res.val_acc > 0.3
    client = mlflow_client(mae_run["uri"])
    tags = client.get_run(res.mlflow_run_id).data.tags
    assert tags["vit_service.init_source"] == f"runs:/{rid}"
    assert tags["vit_service.init_kind"] == "run" and tags["lineage.init"] == "run"
    assert tags["vit_service.parent_run_id"] == rid == tags["lineage.parent_run_id"]
    assert tags["vit_service.parent_recipe"] == "cifar10-mae-smoke"
    assert tags["vit_service.parent_objective"] == "mae"
    params = client.get_run(res.mlflow_run_id).data.params
    assert params["recipe.init.from"] == f"runs:/{rid}"
    arts = run_artifacts(client, res.mlflow_run_id)
    assert {"lineage/init.json", "lineage/parent_recipe.yaml"} <= arts
    meta = json.loads((res.run_dir / "bundle" / "meta.json").read_text())
    assert meta["extra"]["lineage"]["parent_run_id"] == rid
    assert meta["class_names"][0] == "airplane"
    ck = load_checkpoint(res.checkpoint)
    assert ck["lineage"]["source"] == f"runs:/{rid}"


def test_frozen_encoder_linear_probe_trains_only_the_head(mae_run: dict) -> None:
    ckpt = str(mae_run["run_dir"] / "checkpoints" / "last.pt")
    run = _prepare(mae_run, FINETUNE, {"init.from": ckpt, "freeze_encoder": True,
                                       "max_steps": 4}, run_name="probe")
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable == {"head.weight", "head.bias"}
    in_optim = {id(p) for g in run.parts.optimizer.param_groups for p in g["params"]}
    assert in_optim == {id(run.model.head.weight), id(run.model.head.bias)}
    names = {id(p): n for n, p in run.model.named_parameters()}
    for g in run.parts.optimizer.param_groups:  # weight decay on the head weight only
        in_group = {names[id(p)] for p in g["params"]}
        assert g["weight_decay"] == (0.05 if in_group == {"head.weight"} else 0.0)
    res = run.run()
    assert res.status == "stopped" and res.step == 4
    after = run.model.state_dict()
    for k, v in before.items():
        if k.startswith("head."):
            assert not torch.equal(after[k], v), k
        else:
            torch.testing.assert_close(after[k], v, rtol=0, atol=0, msg=k)
    torch.testing.assert_close(after["blocks.1.mlp.fc2.weight"],
                               mae_run["encoder"]["blocks.1.mlp.fc2.weight"], rtol=0, atol=0)


def test_an_encoder_that_does_not_fit_is_a_clear_error(mae_run: dict, tmp_path: Path) -> None:
    with pytest.raises(InitError, match="does not fit.*depth=2.*depth=3"):
        _prepare(mae_run, FINETUNE, {"init.from": str(mae_run["run_dir"] / "bundle"),
                                     "model.overrides.depth": 3})
    with pytest.raises(InitError, match="no such file"):
        _prepare(mae_run, FINETUNE, {"init.from": str(tmp_path / "nope.pt")})
    with pytest.raises(InitError, match="not a model bundle"):
        _prepare(mae_run, FINETUNE, {"init.from": str(tmp_path)})
    with pytest.raises(InitError, match="cifar10-nothing"):
        _prepare(mae_run, FINETUNE, {"init.from": "models:/cifar10-nothing@latest"})


# ----------------------------------------------------------------------------- MLM


def test_mlm_pretrain_on_train_and_unsup_then_finetune_with_its_tokenizer(
    env: dict, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import training.tasks.text as tasks  # where the text task reads IMDb

    splits: list[str] = []
    real = tasks.load_imdb

    def spy(data: Any, split: str = "train", **kw: Any) -> Any:
        splits.append(split)
        return real(data, split, **kw)

    monkeypatch.setattr(tasks, "load_imdb", spy)
    settings = Settings()
    pre = prepare_run(load_recipe("imdb-mlm-smoke"), data_dir=data_dir, settings=settings,
                      run_name="mlm")
    assert splits == ["train", "unsup"]  # never test
    assert pre.task.n_train == 200 + 1 and pre.task.n_val == 40  # train part + 1 unsup review
    res = pre.run()
    assert res.status == "finished" and res.val_acc is None and res.registered_version == "1"
    assert 0 < res.val_loss < 10
    bundle = res.run_dir / "bundle"
    encoder = _weights(bundle / "weights.pt")
    assert json.loads((bundle / "meta.json").read_text())["extra"]["objective"] == "mlm"
    assert not any(k.startswith(("head.", "transform.")) for k in encoder)

    splits.clear()
    ft = prepare_run(load_recipe("imdb-transformer-finetune-smoke"), data_dir=data_dir,
                     settings=settings, run_name="mlm-ft")
    assert splits == ["train"]
    assert ft.task.tokenizer.to_str() == (bundle / "tokenizer.json").read_text()
    # a scratch run trains its own tokenizer (another vocabulary size), so the fresh head to
    # compare with is the one the same architecture gets from the recipe seed
    torch.manual_seed(0)
    fresh = build_model(dataclasses.replace(ft.model.config))
    _assert_starts_from(ft.model, encoder, fresh, 2)
    assert ft.lineage.parent_model == "imdb-mlm/1" and ft.lineage.parent_objective == "mlm"
    out = ft.run()
    assert out.status == "finished" and out.val_acc is not None
    tags = mlflow_client(env["MLFLOW_TRACKING_URI"]).get_run(out.mlflow_run_id).data.tags
    assert tags["vit_service.parent_run_id"] == res.mlflow_run_id
    assert tags["vit_service.init_source"] == "models:/imdb-mlm@latest"
    # the fine-tuned checkpoint carries the tokenizer (resume, and fine-tuning from it)
    assert load_checkpoint(out.checkpoint)["tokenizer"] == ft.task.tokenizer.to_str()


# ----------------------------------------------------------------------------- transfer


def _image_folder(root: Path, classes: list[str], per_class: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    for k, cls in enumerate(classes):
        (root / cls).mkdir(parents=True)
        colour = rng.integers(0, 256, 3)
        for i in range(per_class):
            img = np.clip(colour + rng.normal(0, 20, (32, 32, 3)), 0, 255).astype(np.uint8)
            img[:, k * 4 : k * 4 + 4] = 255
            Image.fromarray(img).save(root / cls / f"{i}.png")
    return root


def test_supervised_transfer_between_image_folders_replaces_the_head(
    env: dict, tmp_path: Path
) -> None:
    a = _image_folder(tmp_path / "a", ["cat", "dog", "fox"], 16, seed=1)
    b = _image_folder(tmp_path / "b", ["oak", "elm", "ash", "fir", "yew"], 12, seed=2)
    common = {"data.dataset": "imagefolder", "data.subset": None, "register_as": None,
              "data.val_size": 10, "epochs": 2}
    src = train(load_recipe("cifar10-smoke", {**common, "data.path": str(a)}),
                settings=Settings(), run_name="folder-a", mlflow_enabled=False)
    assert src.status == "finished"
    src_bundle = src.run_dir / "bundle"
    src_weights = _weights(src_bundle / "weights.pt")
    assert src_weights["head.weight"].shape == (3, 32)
    over = {**common, "data.path": str(b), "optim.layer_decay": 0.7}
    ft = prepare_run(load_recipe("cifar10-smoke", {**over, "init.from": str(src_bundle)}),
                     settings=Settings(), run_name="folder-b", mlflow_enabled=False)
    scratch = prepare_run(load_recipe("cifar10-smoke", over), settings=Settings(),
                          mlflow_enabled=False)
    encoder = {k: v for k, v in src_weights.items() if not k.startswith("head.")}
    _assert_starts_from(ft.model, encoder, scratch.model, 5)
    assert ft.task.class_names == ["ash", "elm", "fir", "oak", "yew"]
    res = ft.run()
    assert res.status == "finished" and res.val_acc is not None
    # the ImageFolder run evaluates on its own validation split
    from training.evaluate import evaluate_bundle

    ev = evaluate_bundle(str(res.run_dir / "bundle"), "val", None)
    assert ev.n == 10 and ev.acc == pytest.approx(res.val_acc)


# ----------------------------------------------------------------------------- timm


def test_timm_weights_offline_are_loaded_resampled_and_given_a_new_head(
    env: dict, data_dir: Path, tmp_path: Path
) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    path = tmp_path / "vit_tiny.pth"
    torch.save(ref.state_dict(), path)
    sd = ref.state_dict()
    run = prepare_run(load_recipe("cifar10-smoke", {"init.timm": "vit_tiny_patch16_224",
                                                    "init.timm_file": str(path),
                                                    "max_steps": 1}),
                      data_dir=data_dir, settings=Settings(), mlflow_enabled=False)
    m = run.model
    assert (m.config.embed_dim, m.config.depth, m.config.patch_size) == (192, 12, 8)
    for k in ("blocks.3.attn.qkv.weight", "blocks.11.mlp.fc2.bias", "norm.weight", "cls_token"):
        torch.testing.assert_close(m.state_dict()[k], sd[k], rtol=0, atol=0)
    assert m.pos_embed.shape == (1, 1 + 4 * 4, 192)  # 14x14 grid resampled to 32/8 = 4x4
    torch.testing.assert_close(m.pos_embed[:, 0], sd["pos_embed"][:, 0])
    assert m.patch_embed.proj.weight.shape == (192, 3, 8, 8)  # kernel 16 -> 8
    assert m.head.out_features == 10
    assert run.lineage.init == "timm" and run.lineage.source == "timm:vit_tiny_patch16_224"
    assert run.run().step == 1


# ----------------------------------------------------------------------------- LLRD


def test_layer_wise_lr_decay_groups_and_their_lrs() -> None:
    model = create_model("vit_test")  # depth 2: embeddings 0, blocks 1-2, head/norm 3
    groups = param_groups(model, 0.05, layer_decay=0.5)
    opt = torch.optim.AdamW(groups, lr=1.0)
    CosineWarmup(opt, 2.0, 100, 1).apply()  # step 0 ends a 1-step warm-up: base lr 2.0
    names = {id(p): n for n, p in model.named_parameters()}
    lr_of = {names[id(p)]: g["lr"] for g in opt.param_groups for p in g["params"]}
    assert set(lr_of) == set(names.values())
    expected = {"cls_token": 0.25, "pos_embed": 0.25, "patch_embed.proj.weight": 0.25,
                "blocks.0.attn.qkv.weight": 0.5, "blocks.0.norm1.bias": 0.5,
                "blocks.1.mlp.fc1.weight": 1.0, "norm.weight": 2.0, "head.weight": 2.0,
                "head.bias": 2.0}
    for n, lr in expected.items():
        assert lr_of[n] == pytest.approx(lr), n
    for g in opt.param_groups:  # weight decay still only on matrices
        assert g["weight_decay"] == (0.05 if g["name"].endswith("_decay") and "no_" not in
                                     g["name"] else 0.0)
    # MAE / MLM: the encoder. prefix is ignored, the decoder is on top
    assert layer_id("encoder.blocks.1.attn.qkv.weight", 2) == 2
    assert layer_id("encoder.tok_embed.weight", 2) == 0
    assert layer_id("decoder_blocks.0.mlp.fc1.weight", 2) == 3
    mae = MAE(MAEConfig(encoder=create_model("vit_test", num_classes=0).config,
                        decoder_dim=32, decoder_heads=2))
    assert len(param_groups(mae, 0.05, layer_decay=0.9)) == 8  # 4 depths x (decay, no decay)
    # off: the two classic groups
    assert [g["weight_decay"] for g in param_groups(model, 0.05)] == [0.05, 0.0]


# ----------------------------------------------------------------------------- recipes


@pytest.mark.parametrize(("overrides", "message"), [
    ({"init.from": "s3://bucket/x.pt"}, "only runs:/, models:/"),
    ({"init.from": "models:/cifar10-mae"}, "models:/<name>@<alias>"),
    ({"init.from": "runs:/" + "a" * 32, "init.timm": "vit_tiny_patch16_224"}, "not both"),
    ({"init.from": "runs:/abc"}, "32-hex run id"),
    ({"init.from": "runs:/" + "a" * 32 + "/../../x"}, "32-hex run id"),  # out of the run
    ({"init.timm_file": "/x.pth"}, "needs init.timm"),
    ({"data.dataset": "imagefolder"}, "data.path is required"),
    ({"data.include_unsup": True}, "include_unsup is for dataset imdb"),
    ({"objective": "mlm"}, "objective mlm needs"),
    ({"objective": "mae"}, "has no labels"),
    ({"mae.mask_ratio": 0.5}, "only for objective mae"),
    ({"optim.layer_decay": 1.5}, "optim.layer_decay"),
])
def test_recipe_checks_name_the_problem(overrides: dict, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe("cifar10-smoke", overrides)


def test_pretraining_recipes_and_their_rules() -> None:
    r = load_recipe("cifar10-mae-pretrain")
    assert r.objective == "mae" and r.pretraining and r.mae is not None
    assert r.mae.mask_ratio == 0.75 and r.register_as == "cifar10-mae"
    assert r.to_dict()["init"] == {"from": None, "timm": None, "timm_file": None,
                                   "whiten_patches": False, "mimetic": False}
    ft = load_recipe("cifar10-vit-finetune")
    assert ft.init.from_ == "models:/cifar10-mae@latest" and ft.optim.layer_decay == 0.75
    assert (ft.data.val_size, ft.data.split_seed) == (r.data.val_size, r.data.split_seed)
    mlm = load_recipe("imdb-mlm-pretrain")
    assert mlm.data.include_unsup and mlm.register_as == "imdb-mlm" and mlm.mlm is not None
    assert load_recipe("imdb-transformer-finetune").init.from_ == "models:/imdb-mlm@latest"
    # objective mae without a mae: table gets the defaults; dumps round-trip
    r2 = load_recipe("cifar10-mae-smoke", {"mae": None})
    assert r2.mae is not None and r2.mae.mask_ratio == 0.75
    assert load_recipe("cifar10-mae-smoke", {"init.from": "abc"}).to_dict()["init"]["from"] == "abc"
    with pytest.raises(RecipeError, match="freeze_encoder is for objective classify"):
        load_recipe("cifar10-mae-smoke", {"freeze_encoder": True})
    with pytest.raises(RecipeError, match="register_as must be 'imdb-mlm'"):
        load_recipe("imdb-mlm-smoke", {"register_as": "imdb-sentiment"})
    with pytest.raises(RecipeError, match="leaves no visible"):
        load_recipe("cifar10-mae-smoke", {"mae.mask_ratio": 0.999})
