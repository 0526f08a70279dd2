"""All environment reading lives here: one pydantic-settings ``Settings`` class.

Variables are prefixed ``VIT_SERVICE_`` (``VIT_SERVICE_HOME``, ``VIT_SERVICE_DATA_DIR``...), except
``MLFLOW_TRACKING_URI`` which keeps MLflow's own name.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VIT_SERVICE_", extra="ignore")

    # --- where things live -------------------------------------------------------------------
    home: Path = Field(Path(".vit-service"), description="runs, checkpoints, local databases")
    data_dir: Path = Field(Path("data"), description="datasets (or archives of them)")
    cache_dir: Path | None = Field(None, description="decoded-data cache; default ~/.cache")

    # --- MLflow ----------------------------------------------------------------------------------
    tracking_uri: str | None = Field(
        None,
        validation_alias=AliasChoices("MLFLOW_TRACKING_URI", "VIT_SERVICE_TRACKING_URI"),
        description="MLflow tracking URI; default: a SQLite database under home",
    )
    mlflow_ui_url: str | None = Field(None, description="public URL of the MLflow UI, for links")

    # --- API -------------------------------------------------------------------------------------
    api_key: SecretStr | None = Field(None, description="Bearer key for mutating routes")

    @property
    def resolved_tracking_uri(self) -> str:
        if self.tracking_uri:
            return self.tracking_uri
        return f"sqlite:///{(self.home / 'mlflow.db').resolve()}"

    @property
    def artifact_root(self) -> Path:
        """Where runs' artifacts go when the tracking URI is a local database."""
        return (self.home / "mlartifacts").resolve()


@lru_cache
def get_settings() -> Settings:
    return Settings()
