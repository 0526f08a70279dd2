"""Fixtures: tiny data sets in the real formats, an isolated home/cache/MLflow per session."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from vit_service.data import CIFAR10_CLASSES

REPO = Path(__file__).resolve().parents[2]
CLASSES = list(CIFAR10_CLASSES)
POS_WORDS = "great wonderful superb moving brilliant loved delightful masterpiece".split()
NEG_WORDS = "awful boring terrible dull waste hated clumsy disaster".split()
FILLER = "the film movie plot actor scene story was and a it this of to".split()


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def make_cifar_archive(path: Path, per_class: int = 50, seed: int = 0) -> Path:
    """``cifar10-jpeg/train/<class>/<i>.jpg``: each class a distinct colour + noise, so a tiny
    model can learn it in a few steps."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 256, size=(len(CLASSES), 3))
    with tarfile.open(path, "w:gz") as tf:
        for k, cls in enumerate(CLASSES):
            for i in range(per_class):
                noise = rng.normal(0, 25, size=(32, 32, 3))
                img = np.clip(colours[k] + noise, 0, 255).astype(np.uint8)
                img[k * 3 : k * 3 + 3, :, :] = 255  # a class-specific bright stripe
                buf = io.BytesIO()
                Image.fromarray(img).save(buf, format="JPEG", quality=90)
                _add(tf, f"cifar10-jpeg/train/{cls}/{i:04d}.jpg", buf.getvalue())
    return path


def make_imdb_archive(path: Path, per_class: int = 120, seed: int = 0) -> Path:
    """``aclImdb/train/{pos,neg,unsup}/<id>_<rating>.txt`` with sentiment words."""
    rng = np.random.default_rng(seed)
    with tarfile.open(path, "w:gz") as tf:
        for label, words in (("pos", POS_WORDS), ("neg", NEG_WORDS)):
            for i in range(per_class):
                n = int(rng.integers(10, 80))
                toks = list(rng.choice(FILLER, size=n)) + list(rng.choice(words, size=3))
                rng.shuffle(toks)
                rating = int(rng.integers(7, 11)) if label == "pos" else int(rng.integers(1, 5))
                text = " ".join(toks) + ".<br /><br />" + " ".join(rng.choice(FILLER, 5))
                _add(tf, f"aclImdb/train/{label}/{i}_{rating}.txt", text.encode())
        _add(tf, "aclImdb/train/unsup/0_0.txt", b"unlabelled review text")
        _add(tf, "aclImdb/imdb.vocab", "\n".join(POS_WORDS + NEG_WORDS + FILLER).encode())
    return path


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("data")
    make_cifar_archive(d / "cifar10-jpeg-train.tar.gz")
    make_imdb_archive(d / "aclImdb-train.tar.gz")
    return d


QUIET = {"LOG_LEVEL": "WARNING", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
         "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}


def progress_events(stdout: str) -> list[dict]:
    """The JSON-lines progress events a non-TTY ``vit-service train`` printed."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def mlflow_client(uri: str) -> Any:
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(uri)
    return MlflowClient(uri)


def run_artifacts(client: Any, run_id: str, path: str = "") -> set[str]:
    """Every artifact path of a run, recursively."""
    out = set()
    for f in client.list_artifacts(run_id, path):
        out.add(f.path)
        if f.is_dir:
            out |= run_artifacts(client, run_id, f.path)
    return out


@pytest.fixture(scope="session")
def mlflow_db(tmp_path_factory: pytest.TempPathFactory):
    """``mlflow_db(folder) -> sqlite URI``: a fresh tracking database, copied from one
    migrated once per session (creating MLflow's schema takes seconds)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    template = tmp_path_factory.mktemp("mlflow-template") / "template.db"
    SqlAlchemyStore(f"sqlite:///{template}", str(template.parent / "artifacts"))

    def make(folder: Path) -> str:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, folder / "mlflow.db")
        return f"sqlite:///{folder / 'mlflow.db'}"

    return make


@pytest.fixture
def env(tmp_path: Path, data_dir: Path, mlflow_db, monkeypatch: pytest.MonkeyPatch
        ) -> Iterator[dict[str, str]]:
    """A private home, cache and SQLite MLflow for one test (also set in os.environ)."""
    home = tmp_path / "home"
    values = {
        "VIT_SERVICE_HOME": str(home),
        "VIT_SERVICE_CACHE_DIR": str(data_dir.parent / "cache"),  # shared: decode once
        "VIT_SERVICE_DATA_DIR": str(data_dir),
        "MLFLOW_TRACKING_URI": mlflow_db(home),
        **QUIET,
    }
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    from vit_service.config import get_settings

    get_settings.cache_clear()
    yield values
    get_settings.cache_clear()


@pytest.fixture(scope="session")
def run_cli():
    """``run_cli(args, env)``: ``python -m vit_service.cli ARGS`` in a subprocess, stdout
    captured (so not a TTY: progress comes as JSON lines)."""

    def run(args: list[str], env: dict[str, str], timeout: float = 300
            ) -> subprocess.CompletedProcess[str]:
        full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        return subprocess.run([sys.executable, "-m", "vit_service.cli", *args], cwd=REPO,
                              env={**full_env, **env}, capture_output=True, text=True,
                              timeout=timeout)

    return run
