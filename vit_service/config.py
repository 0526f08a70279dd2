"""All environment reading lives here: one pydantic-settings ``Settings`` class.

Variables are prefixed ``VIT_SERVICE_`` (``VIT_SERVICE_HOME``, ``VIT_SERVICE_DATA_DIR``...), except
``MLFLOW_TRACKING_URI`` which keeps MLflow's own name.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MIN_API_KEY_LENGTH = 16  # a key short enough to guess is no key
DEFAULT_PRINCIPAL = "default"  # who VIT_SERVICE_API_KEY authenticates
PRINCIPAL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")  # whole name: fullmatch


class Settings(BaseSettings):
    # hide_input_in_errors: an error about one bad entry of VIT_SERVICE_API_KEYS must not
    # print the others (start-up errors go to logs). validate_by_name: a field with an alias
    # (tracking_uri reads MLFLOW_TRACKING_URI) still takes its value by name in code,
    # `Settings(tracking_uri=...)`; without it the keyword was silently dropped and the
    # environment's URI, which mlflow.set_tracking_uri exports, was used instead
    model_config = SettingsConfigDict(env_prefix="VIT_SERVICE_", extra="ignore",
                                      hide_input_in_errors=True, validate_by_name=True,
                                      validate_by_alias=True)

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
    api_key: SecretStr | None = Field(
        None, description=f"Bearer key for mutating routes (at least {MIN_API_KEY_LENGTH} "
        "characters; empty counts as unset)")
    # VIT_SERVICE_API_KEYS='{"alice": "<key>", "bob": "<key>"}'
    api_keys: Annotated[dict[str, SecretStr], NoDecode] = Field(
        default_factory=dict, description="named Bearer keys, JSON name -> key: each name is a "
        "principal (a job's owner, per-key caps); VIT_SERVICE_API_KEY is the principal "
        f"'{DEFAULT_PRINCIPAL}'. Each at least {MIN_API_KEY_LENGTH} characters, all distinct")

    # --- serving (REST API; owned by serving/) ----------------------------------------------------
    # VIT_SERVICE_MODELS='{"cifar10-vit": "models:/cifar10-vit@champion", "x": "/path/to/bundle"}'
    models: dict[str, str] = Field(
        default_factory=lambda: {
            "cifar10-vit": "models:/cifar10-vit@champion",
            "imdb-sentiment": "models:/imdb-sentiment@champion",
        },
        description="served name -> source: models:/name@alias, models:/name/version, "
        "runs:/<run_id>/model, or a local bundle folder",
    )
    default_image_model: str = Field("cifar10-vit", description="model used by /v1/predict/image")
    default_text_model: str = Field("imdb-sentiment", description="model used by /v1/predict/text")
    host: str = Field("127.0.0.1", description="`vit-service serve` bind address")
    port: int = Field(8000, ge=0, le=65535, description="`vit-service serve` port")
    discover_models: int = Field(
        20, ge=0, description="also serve up to N registered models whose @champion alias is "
        "set (found at start-up and at every reload poll); 0: only `models`")
    reload_interval_s: float = Field(
        30.0, ge=0, description="poll the registry for moved aliases this often; 0 = never"
    )
    max_batch_size: int = Field(32, ge=1, description="most inputs in one forward pass")
    max_wait_ms: float = Field(
        2.0, ge=0, description="how long a batch waits for more requests after the first"
    )
    adaptive_wait: bool = Field(
        True, description="wait max_wait_ms only while requests arrive at least that often "
        "(serving/batching.py); false: every batch waits the whole window")
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1, description="request body limit")
    max_dataset_bytes: int = Field(
        512 * 1024 * 1024, ge=1, description="body limit of a data set upload (POST /v1/datasets)")
    max_image_pixels: int = Field(
        12_000_000, ge=1, description="width*height limit per image (decompression bombs; a "
        "4000x3000 photo passes): an image is decoded in its own mode, at most 4 bytes a pixel, "
        "then reduced towards the model's size before it becomes RGB")
    max_request_pixels: int = Field(
        48_000_000, ge=1, description="width*height summed over the images of one request, "
        "checked from their headers before anything is decoded")
    max_items_per_request: int = Field(64, ge=1, description="images or texts per request")
    max_explain_items: int = Field(
        16, ge=1, description="images or texts per request with attention=relevance or "
        "faithfulness=true (each costs a backward pass or ~55 extra forwards)")
    max_text_chars: int = Field(100_000, ge=1, description="characters per text")
    max_queued_items: int = Field(
        512, ge=1, description="inputs admitted for plain predictions (and attention maps) and "
        "not yet answered, per API process; beyond it requests get 503 with Retry-After")
    max_queued_explain_items: int = Field(
        32, ge=1, description="the same for relevance / faithfulness inputs, a lane of their own "
        "(each costs a backward pass or ~55 forwards), so a queue of explanations never holds "
        "plain predictions back by more than one small explain batch")
    max_queue_wait_s: float = Field(
        1.0, gt=0, description="a request whose estimated wait in its lane (inputs ahead x the "
        "measured seconds per input) is longer gets 503 with Retry-After at once: what is served "
        "is served within about this much queueing")
    explain_batch_size: int = Field(
        4, ge=1, description="most inputs in one relevance / faithfulness batch: how long a plain "
        "prediction may wait behind one")
    request_timeout_s: float = Field(
        30.0, gt=0, description="a prediction not answered by then gets 503 (its work is dropped "
        "if it has not started)")
    ready_requires_all: bool = Field(
        True, description="/readyz: every configured model loaded (else: at least one)"
    )
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads")
    inference_precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="precision of the served forward (vit_service/precision.py): bf16 "
        "autocast on the explicit attention path, ~1.9x fp32 on a CPU with native bf16; auto = "
        "bf16 exactly there, fp32 elsewhere. Relevance, faithfulness and the MLflow pyfunc follow")
    trace_forwards: bool = Field(
        True, description="serve TorchScript traces of the model's forwards, checked against "
        "the eager model at load (serving/compiled.py); false: always eager")
    workers: int | None = Field(
        None, ge=1, le=64, description="`vit-service serve` processes; default: one per core, "
        "at most 4 (serving/workers.py: one leader, one model version per home)"
    )
    supervisor_pid: int | None = Field(
        None, description="set by `serve --workers N` for its workers: they exit if it dies"
    )
    leader_check_s: float = Field(
        2.0, gt=0, description="how often a process that does not lead tries to take the "
        "leadership, and how often the leader checks the connection holding its PostgreSQL "
        "advisory lock (serving/workers.py)")

    # --- training jobs over the API (owned by serving/jobs) -----------------------------------
    jobs_db_url: str | None = Field(
        None, description="SQLAlchemy URL of the jobs database; default: SQLite under home"
    )
    jobs_concurrency: int | None = Field(
        None, ge=1, description="jobs running at once; default 1 per GPU, 1 on CPU"
    )
    jobs_cancel_grace_s: float = Field(
        30.0, ge=0, description="after SIGTERM, wait this long for a checkpoint before SIGKILL"
    )
    jobs_max_procs: int = Field(8, ge=1, description="most processes (torchrun) one job may ask")
    jobs_host_id: str | None = Field(
        None, description="this API host's name in the job store (default: hostname and boot "
        "id); two hosts sharing one database must differ")
    jobs_lease_s: float = Field(
        30.0, gt=0, description="a running job whose host has not renewed its lease for this "
        "long is settled by another host (renewed every third of it)")
    jobs_max_threads: int = Field(64, ge=1, description="most torch threads a job may ask")
    jobs_max_epochs: int = Field(1000, ge=1, description="most epochs a job may ask")
    jobs_max_batch_size: int = Field(4096, ge=1, description="most examples per batch a job "
                                     "may ask")
    jobs_max_budget_minutes: float = Field(24 * 60, gt=0, description="longest budget a job "
                                           "may ask")
    jobs_max_params: int = Field(
        500_000_000, ge=1, description="largest model (parameters) a job may build, counted "
        "before it is queued")
    jobs_max_queued: int = Field(64, ge=1, description="queued jobs in all; beyond it a new "
                                 "job gets 429")
    jobs_max_queued_per_key: int | None = Field(
        None, ge=1, description="queued jobs per API key (principal); beyond it that key's "
        "new job gets 429; unset: only jobs_max_queued")
    jobs_max_running: int | None = Field(
        None, ge=1, description="running jobs in all, on top of the executor's concurrency; "
        "queued jobs wait (never refused); unset: the concurrency alone")
    jobs_max_running_per_key: int | None = Field(
        None, ge=1, description="running jobs per API key: the scheduler skips a queued job "
        "whose key is at it and starts the next one; unset: no per-key limit")
    jobs_admit_by_resources: bool = Field(
        True, description="start a job only when the CPUs and GPUs its recipe asks are free "
        "(local machine or Ray cluster); false: by slots alone, the executor queues the rest")
    jobs_cpus: float | None = Field(
        None, gt=0, description="CPUs local jobs may hold in all; default: this process's "
        "CPUs (os.sched_getaffinity)")
    jobs_gpus: int | None = Field(
        None, ge=0, description="GPUs local jobs may hold in all; default: "
        "torch.cuda.device_count()")
    jobs_poll_s: float = Field(0.5, gt=0, description="how often the job scheduler looks around")
    jobs_executor: Literal["local", "ray"] = Field(
        "local", description="where jobs run: processes on this machine, or a Ray cluster"
    )

    # --- jobs on a Ray cluster (VIT_SERVICE_JOBS_EXECUTOR=ray; docs/jobs.md) -----------------
    ray_address: str = Field(
        "http://127.0.0.1:8265", description="the Ray head's dashboard / Job Submission address"
    )
    ray_timeout_s: float = Field(10.0, gt=0, description="timeout of each call to the Ray head")
    ray_home: str | None = Field(
        None, description="VIT_SERVICE_HOME as the cluster's nodes see it: a folder every node "
        "mounts (runs and checkpoints live there, so a job resumes on any node); default: home"
    )
    ray_data_dir: str | None = Field(
        None, description="the datasets folder as the nodes see it; default: data_dir"
    )
    ray_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI for jobs on the cluster (an MLflow server the "
        "nodes reach); default: the service's own tracking URI"
    )
    ray_python: str = Field(
        "auto", description="the interpreter on the nodes that has vit-service installed: a "
        "path or a command on the nodes' PATH (the trainer image's `python`); auto: this "
        "process's own interpreter for a head on this machine (a loopback address), else "
        "`python`")
    ray_cpus_per_proc: float = Field(
        1.0, ge=0, description="CPUs Ray reserves per training process of a job"
    )
    ray_auto_gpus: bool = Field(
        False, description="reserve a GPU per process for recipes with device: auto (true on a "
        "GPU cluster; device: cuda recipes always do)"
    )
    ray_submit_grace_s: float = Field(
        30.0, gt=0, description="a job claimed this long ago that Ray does not know yet was "
        "never submitted (its API process died in between): it is queued again"
    )
    ray_storage_path: str | None = Field(
        None, description="Ray Train's storage for jobs with nprocs > 1 (their checkpoints): "
        "a folder every node mounts, or an s3:// / gs:// URI; default: <ray_home>/ray-train"
    )
    ray_max_failures: int = Field(
        2, ge=0, description="restarts of a multi-worker job from its last checkpoint after a "
        "worker or its node died, before the job fails"
    )
    ray_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="how a multi-worker job's workers are placed on the nodes (Ray "
        "placement-group strategy): PACK fills a node first, STRICT_SPREAD one per node"
    )

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_key(cls, v: Any) -> Any:
        """An empty key (compose's ``${VIT_SERVICE_API_KEY:-}``) is no key, with a warning; a
        short one is refused at start-up rather than guarded by."""
        raw = v.get_secret_value() if isinstance(v, SecretStr) else v
        if raw is None:
            return None
        if not str(raw).strip():
            logging.getLogger(__name__).warning(
                "VIT_SERVICE_API_KEY is empty: treated as unset (mutating routes are refused)")
            return None
        if len(str(raw).strip()) < MIN_API_KEY_LENGTH:
            raise ValueError(f"the API key must be at least {MIN_API_KEY_LENGTH} characters "
                             "(e.g. python -c 'import secrets; print(secrets.token_urlsafe())')")
        return str(raw).strip()

    @field_validator("api_keys", mode="before")
    @classmethod
    def _api_keys(cls, v: Any) -> Any:
        """Named keys: each name a principal, each key long enough and used once (a key
        shared by two names could not say who sent a request). Empty (compose's
        ``${VIT_SERVICE_API_KEYS:-}``) is none."""
        if v is None or (isinstance(v, str) and not v.strip()):
            return {}
        if isinstance(v, str):
            v = json.loads(v)
        if not isinstance(v, dict):
            raise ValueError("VIT_SERVICE_API_KEYS must be a JSON object: {name: key}")
        out: dict[str, str] = {}
        for name, key in v.items():
            raw = str(key.get_secret_value() if isinstance(key, SecretStr) else key).strip()
            if not PRINCIPAL_NAME.fullmatch(str(name)):
                raise ValueError(f"API key name {name!r}: 1-64 of A-Z a-z 0-9 _ . @ -, "
                                 "starting with a letter or digit")
            if len(raw) < MIN_API_KEY_LENGTH:
                raise ValueError(f"the API key of {name!r} must be at least "
                                 f"{MIN_API_KEY_LENGTH} characters")
            if raw in out.values():
                raise ValueError(f"the API key of {name!r} is another name's too: each "
                                 "key must be its own")
            out[str(name)] = raw
        return out

    @model_validator(mode="after")
    def _one_key_one_principal(self) -> Settings:
        """``default`` is VIT_SERVICE_API_KEY's name; no named key may repeat it."""
        if self.api_key is None:
            return self
        if DEFAULT_PRINCIPAL in self.api_keys:
            raise ValueError(f"VIT_SERVICE_API_KEYS names {DEFAULT_PRINCIPAL!r}, which is "
                             "VIT_SERVICE_API_KEY's principal: rename it or drop one")
        key = self.api_key.get_secret_value()
        if any(k.get_secret_value() == key for k in self.api_keys.values()):
            raise ValueError("VIT_SERVICE_API_KEY is also in VIT_SERVICE_API_KEYS: each key "
                             "must be its own")
        return self

    @property
    def principals(self) -> dict[str, str]:
        """Principal name -> its key, every configured one (``default``: VIT_SERVICE_API_KEY).
        Plain strings also accepted: tests build settings with ``model_construct``."""
        def secret(v: SecretStr | str) -> str:
            return v.get_secret_value() if isinstance(v, SecretStr) else str(v)

        out = {name: secret(key) for name, key in (self.api_keys or {}).items()}
        if self.api_key is not None:
            out[DEFAULT_PRINCIPAL] = secret(self.api_key)
        return out

    @property
    def resolved_jobs_db_url(self) -> str:
        if self.jobs_db_url:
            return self.jobs_db_url
        return f"sqlite:///{(self.home / 'jobs.db').resolve()}"

    @property
    def resolved_ray_python(self) -> str:
        """``ray_python`` with ``auto`` resolved: a head on loopback runs its jobs on this
        machine, where this very environment has vit-service (a head started from the
        project's venv without activating it would otherwise run the PATH's bare ``python``)."""
        if self.ray_python != "auto":
            return self.ray_python
        host = urlsplit(self.ray_address).hostname or ""
        return sys.executable if host in ("127.0.0.1", "localhost", "::1") else "python"

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
