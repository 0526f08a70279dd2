"""Settings: values given in code win over the environment, aliases included."""

from __future__ import annotations

from pathlib import Path

import pytest

from vit_service.config import Settings


def test_tracking_uri_given_by_name_wins_over_the_environment(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """tracking_uri reads MLFLOW_TRACKING_URI, which mlflow.set_tracking_uri exports to the
    process: a URI passed by name must still be the one used (it was once silently dropped
    for the environment's, and a test's servers migrated one database while their jobs
    opened another)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/mlflow.db")
    mine = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert Settings(home=tmp_path, tracking_uri=mine).resolved_tracking_uri == mine
    # the environment still sets it when the code does not
    assert Settings(home=tmp_path).resolved_tracking_uri == "sqlite:////elsewhere/mlflow.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.setenv("VIT_SERVICE_TRACKING_URI", mine)
    assert Settings(home=tmp_path).resolved_tracking_uri == mine


def test_every_field_is_settable_by_name(tmp_path: Path) -> None:
    """No field drops a keyword: each one given by name comes back as given."""
    s = Settings(home=tmp_path, tracking_uri="sqlite:////x/mlflow.db", port=8123)
    assert (s.home, s.tracking_uri, s.port) == (tmp_path, "sqlite:////x/mlflow.db", 8123)
