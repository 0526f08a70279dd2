"""The champion alias moves only for a better score on the same validation split, under a
lock (vit_service.tracking.promote_champion), on a real SQLite registry."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from vit_service import tracking
from vit_service.tracking import CHAMPION, SPLIT_PARAM, promote_champion

NAME = "promo-vit"


@pytest.fixture
def client(tmp_path: Path) -> MlflowClient:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("promotion")
    c = MlflowClient(uri, uri)
    c.create_registered_model(NAME)
    return c


def _version(client: MlflowClient, val_acc: float, split: str) -> str:
    with mlflow.start_run() as run:
        mlflow.log_metric("val_acc", val_acc)
        mlflow.log_param(SPLIT_PARAM, split)
    return str(client.create_model_version(NAME, "file:///nowhere", run.info.run_id).version)


def _champion(client: MlflowClient) -> str:
    return str(client.get_model_version_by_alias(NAME, CHAMPION).version)


def test_a_perfect_score_on_another_split_does_not_win(client, tmp_path: Path) -> None:
    v1 = _version(client, 0.80, "split-a")
    assert promote_champion(NAME, v1, client=client, lock_dir=tmp_path)
    gamed = _version(client, 1.00, "split-tiny")  # data.val_size: 1
    assert not promote_champion(NAME, gamed, client=client, lock_dir=tmp_path)
    assert _champion(client) == v1
    better = _version(client, 0.85, "split-a")
    assert promote_champion(NAME, better, client=client, lock_dir=tmp_path)
    worse = _version(client, 0.84, "split-a")
    assert not promote_champion(NAME, worse, client=client, lock_dir=tmp_path)
    assert _champion(client) == better


def test_the_check_and_move_wait_for_the_lock(client, tmp_path: Path) -> None:
    """A promotion in progress elsewhere (the lock held by another process) is waited for."""
    v1 = _version(client, 0.8, "s")
    lock = tmp_path / f"champion-{NAME}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.0)",
         str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    t0 = time.monotonic()
    assert promote_champion(NAME, v1, client=client, lock_dir=tmp_path)
    assert time.monotonic() - t0 >= 0.5  # it waited for the holder, not raced it
    holder.wait(10)
    assert tracking.CHAMPION == "champion" and _champion(client) == v1
