"""A temporary MLflow registry (SQLite in tmp) with tiny models, and app/client factories.

Registered once per session:

* ``cifar10-vit`` v1 (``@champion``): ``vit_test`` (32x32, 4x4 patch grid, 2 layers, 2 heads);
* ``reload-vit`` v1 (``@champion``) and v2 (different weights), for alias-move tests;
* ``imdb-sentiment`` v1 (``@champion``): ``text_test`` with a tiny WordPiece tokenizer,
  ``max_len`` 16 so truncation is easy to trigger.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image
from pydantic import SecretStr

from serving.app import create_app
from vit_service import tracking
from vit_service.bundle import CIFAR10_MEAN, CIFAR10_STD, BundleMeta, save_bundle
from vit_service.config import Settings
from vit_service.data import CIFAR10_CLASSES
from vit_service.data.tokenizer import TextTokenizer
from vit_service.models import config_to_dict, create_model

CIFAR_CLASSES = list(CIFAR10_CLASSES)
TEXT_MAX_LEN = 16
CORPUS = [
    "a moving beautifully shot film with a great cast",
    "the plot was dull and the acting was terrible",
    "i loved every minute of this wonderful movie",
    "boring slow and far too long i fell asleep",
    "an instant classic the director at her best",
    "worst film of the year do not watch it",
] * 5


def clean_settings(**values: Any) -> Settings:
    """Settings from defaults + ``values`` only: the developer's environment (VIT_SERVICE_*,
    MLFLOW_TRACKING_URI) never leaks into tests."""
    if "api_key" in values and isinstance(values["api_key"], str):
        values["api_key"] = SecretStr(values["api_key"])
    return Settings.model_construct(**values)


@dataclass
class Registry:
    home: Path
    uri: str
    experiment_id: str
    local_bundle: Path  # a bundle folder served straight from disk
    vit_v2_bundle: Path  # the weights of reload-vit v2

    def settings(self, models: dict[str, str] | None = None, **overrides: Any) -> Settings:
        # discover_models 0: the tests share one registry, whose champions come and go with
        # the tests that register them (discovery has its own test on its own registry)
        base: dict[str, Any] = {"home": self.home, "tracking_uri": self.uri,
                                "reload_interval_s": 0, "max_wait_ms": 2.0,
                                "discover_models": 0}
        base.update(overrides)
        if models is not None:
            base["models"] = models
        return clean_settings(**base)

    def register_copy(self, name: str, champion: bool, tmp_path: Path) -> None:
        """A copy of the local bundle registered as ``name``, its classes ``<name>-<i>``
        (a user's own model), with the ``champion`` alias if asked."""
        from vit_service.bundle import load_bundle

        b = load_bundle(self.local_bundle)
        b.meta.class_names = [f"{name}-{i}" for i in range(len(b.meta.class_names))]
        bundle = save_bundle(tmp_path / name, b.model, b.meta)
        tracking.configure(settings=self.settings())
        mlflow.set_experiment(experiment_id=self.experiment_id)
        with mlflow.start_run():
            version = tracking.log_bundle(bundle, "image", name)
        if champion:
            mlflow.MlflowClient().set_registered_model_alias(name, tracking.CHAMPION, version)


def _perturbed(model: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """Random weights large enough for peaked predictions and non-uniform attention."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def _image_bundle(path: Path, seed: int) -> Path:
    model = _perturbed(create_model("vit_test"), seed)
    meta = BundleMeta(task="image", model_config=config_to_dict(model.config),
                      class_names=CIFAR_CLASSES,
                      preprocess={"image_size": 32, "mean": list(CIFAR10_MEAN),
                                  "std": list(CIFAR10_STD)},
                      extra={"seed": seed})
    return save_bundle(path, model, meta)


# the evaluation report the trainer logs (training/reporting.py), for the model card
CIFAR_REPORT = {
    "accuracy": 0.5, "loss": 1.2,
    "confusion": [[5 if i == j else (1 if j == (i + 1) % 10 else 0) for j in range(10)]
                  for i in range(10)],
    "per_class": [{"class": c, "support": 6, "precision": 5 / 6, "recall": 5 / 6,
                   "f1": 5 / 6} for c in CIFAR10_CLASSES],
}


def _register(bundle: Path, task: str, name: str, val_acc: float,
              report: dict | None = None) -> str:
    with mlflow.start_run():
        mlflow.log_metric("val_acc", val_acc)
        if report is not None:
            mlflow.log_dict(report, "per_class.json")
        version = tracking.log_bundle(bundle, task, name)
    assert version is not None
    return version


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Registry:
    root = tmp_path_factory.mktemp("registry")
    home = root / "home"
    uri = f"sqlite:///{home / 'mlflow.db'}"
    settings = clean_settings(home=home, tracking_uri=uri)
    tracking.configure(settings=settings)
    exp = tracking.ensure_experiment("serving-tests", settings=settings)
    mlflow.set_experiment(experiment_id=exp)
    client = mlflow.MlflowClient()

    _register(_image_bundle(root / "cifar", seed=1), "image", "cifar10-vit", 0.5, CIFAR_REPORT)
    client.set_registered_model_alias("cifar10-vit", tracking.CHAMPION, "1")

    _register(_image_bundle(root / "reload-v1", seed=2), "image", "reload-vit", 0.5)
    v2 = _image_bundle(root / "reload-v2", seed=3)
    _register(v2, "image", "reload-vit", 0.6)
    client.set_registered_model_alias("reload-vit", tracking.CHAMPION, "1")

    tok = TextTokenizer.train(CORPUS, vocab_size=120, min_frequency=1)
    text_model = _perturbed(create_model("text_test", vocab_size=tok.vocab_size,
                                         max_len=TEXT_MAX_LEN), seed=4)
    meta = BundleMeta(task="text", model_config=config_to_dict(text_model.config),
                      class_names=["negative", "positive"], preprocess={"max_len": TEXT_MAX_LEN})
    text_bundle = save_bundle(root / "text", text_model, meta, tokenizer=tok)
    _register(text_bundle, "text", "imdb-sentiment", 0.7)
    client.set_registered_model_alias("imdb-sentiment", tracking.CHAMPION, "1")

    local = _image_bundle(root / "local", seed=5)
    return Registry(home=home, uri=uri, experiment_id=exp, local_bundle=local, vit_v2_bundle=v2)


@pytest.fixture
def make_client(registry: Registry) -> Iterator[Callable[..., TestClient]]:
    """``make_client(models=None, **settings)`` -> a started TestClient (closed afterwards)."""
    clients: list[TestClient] = []

    def make(models: dict[str, str] | None = None, **overrides: Any) -> TestClient:
        client = TestClient(create_app(registry.settings(models, **overrides)))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture(scope="module")
def client(registry: Registry) -> Iterator[TestClient]:
    """The default app: cifar10-vit + imdb-sentiment + a local bundle, API key
    ``secret-key-for-tests``."""
    models = {"cifar10-vit": "models:/cifar10-vit@champion",
              "imdb-sentiment": "models:/imdb-sentiment@champion",
              "local-vit": str(registry.local_bundle)}
    settings = registry.settings(models, api_key="secret-key-for-tests",
                                 mlflow_ui_url="http://mlflow.example:5000")
    with TestClient(create_app(settings)) as c:
        yield c


# --- inputs (fixtures, since test modules cannot import conftest under importlib mode) ------


@pytest.fixture(scope="session")
def image_bytes() -> Callable[..., bytes]:
    return _image_bytes


@pytest.fixture(scope="session")
def png_header() -> Callable[[int, int], bytes]:
    return _png_header


def _image_bytes(size: tuple[int, int] = (40, 30), fmt: str = "PNG", mode: str = "RGB",
                seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if channels == 1 else arr)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _png_header(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` (a decompression-bomb shape): the
    IHDR, one IDAT of compressed zero rows, IEND."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * (1 + 3 * min(width, 4096)) * 4)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
