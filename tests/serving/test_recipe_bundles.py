"""Explain what users get: bundles trained by every shipped classifier recipe's own code path.

Each recipe trains for a few steps on small data in the real formats, exactly as shipped
(model preset and overrides, pooling, conv stem, patch dropout, flip TTA, bf16 step, compiled
step) except for the data size, the step count and the budget; its bundle is then served
through the API and asked for relevance and faithfulness in both inference precisions (fp32,
and bf16 as a CPU with native bf16 serves by default), and by a two-worker server.

The generic recipes train on sets uploaded to the service's data set store, made from the same
archives by ``examples/own_data.py``.

Not trained here: the pretraining recipes (they register encoders, which are not served for
predictions) and the fine-tuning ones' ``init.from`` step (their classifiers are their
parents' architectures, which are trained here with ``init.from`` unset).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from serving.app import create_app
from tests.serving.conftest import clean_settings
from tests.serving.procs import REPO, Server
from tests.training.conftest import QUIET, make_cifar_archive, make_imdb_archive, mlflow_client
from training.recipes import list_recipes, load_recipe

pytestmark = pytest.mark.slow

FEW = {"max_steps": 2}
SMALL = {"image": ["data.subset=120", "data.val_size=40", "batch_size=16",
                   "eval_batch_size=40"],
         "text": ["data.subset=120", "data.val_size=40", "batch_size=16",
                  "eval_batch_size=40", "data.vocab_size=300"]}


def _served_recipes() -> list[str]:
    """Every recipe that trains a classifier users serve (smoke recipes are the tests' own)."""
    out = []
    for name in list_recipes():
        r = load_recipe(name)
        if r.pretraining or name.endswith("-smoke"):
            continue
        out.append(name)
    return out


RECIPES = _served_recipes()


def _own_set(task: str, data: Path, home: Path) -> str:
    """A generic recipe's uploaded set, made by examples/own_data.py from the archives: three
    CIFAR-10 classes with a val/ split, or the reviews labelled by star band."""
    from examples.own_data import image_subset, star_table
    from vit_service.data.datasets import DatasetStore

    home.mkdir(parents=True, exist_ok=True)
    if task == "image":
        made = image_subset(data / "cifar10-jpeg-train.tar.gz", home / "own.zip",
                            ["airplane", "bird", "cat"], per_class=12, val_per_class=4)
    else:
        made = star_table(data / "aclImdb-train.tar.gz", home / "own.csv")
    info, _ = DatasetStore(home / "datasets").add(made, made.name)
    return info.id


def _train(recipe: str, data: Path, home: Path) -> Path:
    r = load_recipe(recipe)
    sets = [*SMALL[r.task], "budget_minutes=null", "attention_samples=0", "device=cpu"]
    if r.uploaded:
        sets.append(f"data.dataset={_own_set(r.task, data, home)}")
    if r.init.from_ is not None:
        sets.append("init.from=null")
    if r.task == "text" and r.data.max_len > 64:
        sets.append("data.max_len=64")
    if r.task == "text" and r.model.overrides.get("student_len", 0) > 32:
        sets.append("model.overrides.student_len=32")  # the crop, at the shorter length
    cmd = [sys.executable, "-m", "vit_service.cli", "train", recipe, "--data-dir", str(data),
           "--tracking-uri", f"sqlite:///{home / 'mlflow.db'}", "--run-name", recipe,
           "--max-steps", str(FEW["max_steps"]), "--no-register"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, **QUIET, "VIT_SERVICE_HOME": str(home),
           "VIT_SERVICE_CACHE_DIR": str(home / "cache")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    bundle = home / "runs" / recipe / "bundle"
    assert (bundle / "meta.json").is_file(), proc.stderr[-2000:]
    return bundle


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recipes")
    data = root / "data"
    data.mkdir()
    make_cifar_archive(data / "cifar10-jpeg-train.tar.gz", per_class=16)
    make_imdb_archive(data / "aclImdb-train.tar.gz", per_class=80)
    return {name: _train(name, data, root / "home") for name in RECIPES}


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def served(request, bundles: dict[str, Path], tmp_path_factory) -> Iterator[TestClient]:
    home = tmp_path_factory.mktemp("serve")
    # request_timeout_s: this checks answers, not speed; a CPU without native bf16 emulates
    # it (a bf16 explanation with faithfulness curves of the largest recipe took 28 s alone
    # on an AVX2-only CPU, past the 30 s default under a loaded CI)
    settings = clean_settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}",
                              reload_interval_s=0, max_wait_ms=2.0, request_timeout_s=300.0,
                              inference_precision=request.param,
                              models={name: str(b) for name, b in bundles.items()})
    with TestClient(create_app(settings)) as c:
        yield c


def _check_explained(res: dict) -> None:
    att = res["attention"]
    rel, roll = np.array(att["relevance"]), np.array(att["rollout"])
    assert rel.min() >= 0 and rel.sum() == pytest.approx(1.0, abs=1e-4)
    assert roll.min() >= 0 and roll.sum() == pytest.approx(1.0, abs=1e-4)
    assert rel.shape == roll.shape
    f = res["faithfulness"]
    head = {"ngram"} if att.get("ngram") is not None else set()  # text with an n-gram head
    assert set(f["maps"]) == {"rollout", "relevance", "random"} | head
    for curve in f["maps"].values():
        assert len(curve["deletion"]) == len(curve["insertion"]) == 11
        assert all(np.isfinite(curve["deletion"])) and all(np.isfinite(curve["insertion"]))


def _image(seed: int = 0) -> bytes:
    import io

    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipes_model_explains_in_both_precisions(recipe: str, served: TestClient) -> None:
    card = next(m for m in served.get("/v1/models").json()["models"] if m["name"] == recipe)
    assert card["loaded"] and card["relevance"] is True, card
    if card["task"] == "image":
        r = served.post("/v1/predict/image", content=_image(), params={
            "model": recipe, "attention": "relevance", "faithfulness": "true"},
            headers={"content-type": "image/jpeg"})
    else:
        r = served.post("/v1/predict/text", json={
            "model": recipe, "text": "a moving film, but far too long and slow",
            "attention": "relevance", "faithfulness": True})
    assert r.status_code == 200, r.text
    [res] = r.json()["results"]
    _check_explained(res)


def test_two_workers_explain_a_conv_stem_model(bundles: dict[str, Path], tmp_path: Path) -> None:
    """The default served path (bf16 where the CPU has it, traced forwards) in a real
    ``serve --workers 2``: every answer a 200 with relevance, whichever worker took it."""
    name = "cifar10-vit-convstem-cpu"
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIT_SERVICE_", "MLFLOW_", "PROMETHEUS_"))}
    env.update({"VIT_SERVICE_HOME": str(home), "VIT_SERVICE_API_KEY": "k" * 20,
                "VIT_SERVICE_MODELS": json.dumps({name: str(bundles[name])}),
                "VIT_SERVICE_DEFAULT_IMAGE_MODEL": name, "LOG_LEVEL": "WARNING"})
    server = Server(env, home, args=("--workers", "2"))
    server.start()
    try:
        import httpx

        for i in range(8):
            h = httpx.post(f"{server.url}/v1/predict/image", content=_image(i),
                           params={"attention": "relevance", "faithfulness": "true"},
                           headers={"content-type": "image/jpeg"}, timeout=60)
            assert h.status_code == 200, h.text
            _check_explained(h.json()["results"][0])
    finally:
        server.stop()


def test_a_shipped_ngram_head_is_fitted_saved_and_in_the_served_logits(
        bundles: dict[str, Path], served: TestClient) -> None:
    """``imdb-selftrain-cpu``'s n-gram head: fitted by the run (non-zero weights in the bundle)
    and part of what the server answers (its probabilities are the eval-mode model's, head
    included, not the Transformer's alone)."""
    import torch

    from training.evaluate import bundle_val_rows
    from vit_service.bundle import load_bundle
    from vit_service.data import load_imdb

    with_head = {n: b for n, b in bundles.items() if load_recipe(n).model.overrides.get(
        "ngram_head_buckets")}
    assert with_head, "no shipped recipe has an n-gram head"
    text = "a moving film, but far too long and slow"
    for name, path in with_head.items():
        b = load_bundle(path)
        assert b.model.ngram_head is not None and b.model.ngram_head.weight.any()
        enc = b.tokenizer.encode_batch([text], b.meta.preprocess["max_len"],
                                       b.meta.preprocess["truncation"])
        with torch.no_grad():
            logits = b.model(enc.input_ids, enc.attention_mask)
            alone = 2 * logits - b.model.ngram_head(enc.input_ids, enc.attention_mask)
        r = served.post("/v1/predict/text", json={"model": name, "text": text})
        assert r.status_code == 200, r.text
        got = {p["index"]: p["probability"] for p in r.json()["results"][0]["predictions"]}
        want = torch.softmax(logits, 1)[0].numpy()
        assert len(got) == len(want)
        np.testing.assert_allclose([got[i] for i in range(len(want))], want, atol=2e-2)
        assert not np.allclose(torch.softmax(alone, 1)[0].numpy(),
                               torch.softmax(logits, 1)[0].numpy(), atol=1e-3)

        # the explanation shows the head's share of the logit token by token, exactly
        r = served.post("/v1/predict/text", json={"model": name, "text": text, "target": 0,
                                                   "attention": "relevance"})
        assert r.status_code == 200, r.text
        att = r.json()["results"][0]["attention"]
        assert att["target"]["index"] == 0
        shares = np.array(att["ngram"])
        assert len(shares) == len(r.json()["results"][0]["tokens"]) and (shares != 0).any()
        with torch.no_grad():
            c = b.model.ngram_contributions(enc.input_ids, enc.attention_mask)[0, :, 0]  # (T,)
            half = b.model.ngram_head(enc.input_ids, enc.attention_mask)[0, 0] / 2
        np.testing.assert_allclose(shares, c[1:].numpy(), atol=1e-5)
        assert shares.sum() + float(c[0]) + float(b.model.ngram_head.bias[0]) / 2 == \
            pytest.approx(float(half), abs=1e-4)

        # the head's own validation accuracy, logged by the run, is the saved head's on the
        # run's validation split
        home = path.parents[2]
        client = mlflow_client(f"sqlite:///{home / 'mlflow.db'}")
        [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                   f"tags.mlflow.runName = '{name}'")
        ds = load_imdb(home.parent / "data", "train", cache_dir=home / "cache")
        labels = np.asarray(ds.labels)
        rows = bundle_val_rows(b.meta, labels)
        enc = b.tokenizer.encode_batch([ds.texts[i] for i in rows],
                                       b.meta.preprocess["max_len"],
                                       b.meta.preprocess["truncation"])
        with torch.no_grad():
            pred = b.model.ngram_head(enc.input_ids, enc.attention_mask).argmax(1).numpy()
        assert float(run.data.params["model.ngram_head_val_acc"]) == pytest.approx(
            float((pred == labels[rows]).mean()), abs=1e-6)
